"""Token sampling: greedy, temperature, top-k and top-p (nucleus), seeded."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch
from torch import Tensor

from k3compile.sequences import is_whole_number


@dataclass(frozen=True)
class SamplingParams:
    """``temperature == 0`` is greedy. ``top_k == 0`` and ``top_p == 1`` disable those filters."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        t = self.temperature
        if not _real(t) or not (t == 0 or MIN_TEMPERATURE <= t < math.inf):
            raise ValueError(f"temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE}, got {t!r}")
        if not is_whole_number(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be a whole number >= 0, got {self.top_k!r}")
        if not _real(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not is_whole_number(self.seed) or not 0 <= self.seed < 2**64):
            raise ValueError(f"seed must be a whole number in [0, 2**64), got {self.seed!r}")


#: the smallest temperature above 0: logits / temperature stay finite in fp32 (|logits| < 3e30)
MIN_TEMPERATURE = 1e-8


def _real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def sample(logits: Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> Tensor:
    """One token per row of ``logits`` [N, V] (fp32)."""
    if params.temperature == 0:
        return logits.argmax(-1)
    scores = logits.float() / params.temperature
    if params.top_k:
        kth = torch.topk(scores, min(params.top_k, scores.shape[-1]), dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1:
        sorted_scores, order = torch.sort(scores, descending=True, dim=-1)
        probs = torch.softmax(sorted_scores, dim=-1)
        # Drop a token when the mass before it already reaches top_p (the first always stays).
        drop = probs.cumsum(-1) - probs >= params.top_p
        sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
        scores = torch.full_like(scores, float("-inf")).scatter(-1, order, sorted_scores)
    probs = torch.softmax(scores, dim=-1)
    return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(logits.device)


def sampling_tensor(params: SamplingParams, device: torch.device) -> Tensor:
    """``params`` as the [3] float tensor :func:`sample_on_device` reads: temperature,
    top_k, top_p."""
    return torch.tensor([params.temperature, params.top_k, params.top_p], dtype=torch.float32, device=device)


def sample_on_device(logits: Tensor, params: Tensor) -> Tensor:
    """One token per row of ``logits`` [N, V], on their device and without a host sync,
    so that a CUDA graph can hold it: ``params`` [3] = (temperature, top_k, top_p) as
    :func:`sampling_tensor` makes them; temperature 0 is greedy. The same filters as
    :func:`sample` (top-k, then top-p over what top-k kept), then the Gumbel-max trick:
    the argmax of the kept scores plus Gumbel noise is a draw from their softmax. The
    noise comes from the device's default generator (CUDA graphs replay it with a fresh
    offset each time; ``torch.cuda.manual_seed`` reseeds it)."""
    temperature, top_k, top_p = params[0], params[1], params[2]
    greedy = logits.argmax(-1)
    scores = logits.float() / torch.where(temperature > 0, temperature, 1.0)
    sorted_scores, order = scores.sort(-1, descending=True)
    rank = torch.arange(scores.shape[-1], device=scores.device)
    keep = (rank < top_k) | (top_k == 0)
    probs = torch.softmax(sorted_scores.masked_fill(~keep, float("-inf")), dim=-1)
    keep = keep & (probs.cumsum(-1) - probs < top_p)  # the first always stays
    uniform = torch.rand_like(sorted_scores).clamp_(1e-20, 1 - 1e-7)
    noisy = (sorted_scores - torch.log(-torch.log(uniform))).masked_fill(~keep, float("-inf"))
    sampled = order.gather(-1, noisy.argmax(-1, keepdim=True)).squeeze(-1)
    return torch.where(temperature > 0, sampled, greedy)
