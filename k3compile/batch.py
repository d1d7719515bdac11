"""Per-step inputs of the rank-local model and the caches it updates in place.

A step processes T new tokens of N sequences, packed token-major. Prefill packs several
sequences of any length; decode has exactly one new token per sequence (T = N).
Positions never enter the math (K3 has no positional encoding: KDA is recurrent and
MLA is NoPE); they only decide where a token's MLA latent is cached.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from k3compile.config import K3Config
from k3compile.mla_cache_fp8 import FP8_CACHE_DTYPES, fp8_row_width, is_fp8_dtype
from k3compile.sharding import ParallelPlan
from k3compile.targets import Target


@dataclass
class Batch:
    """Metadata of one forward step (tensors on the model's device)."""

    cu_seqlens: Tensor  # [N+1] int32: offsets of each sequence's new tokens
    seq_lens: Tensor  # [N] int32: context length of each sequence after this step
    state_slots: Tensor  # [N] int64: KDA conv/recurrent state slot of each sequence
    block_table: Tensor  # [N, M] int32: MLA cache blocks of each sequence
    slot_mapping: Tensor  # [T] int64: flat MLA cache slot of each new token
    logit_indices: Tensor  # [n_out] int64: the tokens whose logits the step returns
    decode: bool = False  # one new token per sequence: the decode graph


@dataclass
class KDALayerCache:
    """Short-conv states (last K-1 pre-conv inputs of q, k, v) and the fp32 delta-rule state."""

    conv_q: Tensor  # [S, C_local, K-1]
    conv_k: Tensor
    conv_v: Tensor
    state: Tensor  # [S, H_local, D, D] fp32, layout [key dim, value dim]


@dataclass
class MLALayerCache:
    #: [num_blocks, block_size, W] in the model dtype, W = kv_lora_rank + qk_rope_head_dim;
    #: or FP8 [num_blocks, block_size, W + 16], values and scales (k3compile/mla_cache_fp8.py)
    kv: Tensor


LayerCache = KDALayerCache | MLALayerCache


@dataclass(frozen=True)
class CacheShape:
    """How many sequences (KDA state slots) and MLA tokens (blocks x block size) fit."""

    num_slots: int
    num_blocks: int
    block_size: int = 16

    def __post_init__(self) -> None:
        for name in ("num_slots", "num_blocks", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"CacheShape.{name} must be >= 1, got {getattr(self, name)}")

    @classmethod
    def serving(cls, sequences: int, local_length: int, block_size: int) -> CacheShape:
        """The runtime's caches for ``sequences`` sequences of up to ``local_length`` tokens
        on this rank, plus the reserved state slot and MLA block it keeps for itself."""
        blocks = -(-local_length // block_size)
        return cls(num_slots=sequences + 1, num_blocks=sequences * blocks + 1, block_size=block_size)


#: ``--kv-cache-dtype``: "auto" the model dtype, "bf16", "fp8" the target's FP8 format
KV_CACHE_DTYPE_CHOICES = ("auto", "bf16", "fp8")


def resolve_kv_cache_dtype(choice: str, dtype: torch.dtype, target: Target) -> torch.dtype:
    """The MLA cache dtype of ``--kv-cache-dtype choice`` for a model in ``dtype`` on ``target``."""
    if choice == "auto":
        return dtype
    if choice == "bf16":
        if dtype != torch.bfloat16:
            raise ValueError(f"--kv-cache-dtype bf16 needs the bfloat16 model dtype, not {dtype}; use auto or fp8")
        return torch.bfloat16
    if choice == "fp8":
        return FP8_CACHE_DTYPES[target.fp8_cache_dtype]
    raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPE_CHOICES)}, got {choice!r}")


def check_kv_cache_dtype(choice: str | None, compiled: torch.dtype, dtype: torch.dtype, target: Target) -> None:
    """A runtime's ``--kv-cache-dtype choice`` (None: whatever was compiled) against the
    MLA cache dtype an artifact was compiled for (model ``dtype``, ``target``): the
    programs' cache inputs have that dtype, so another is a ValueError saying what to do."""
    if choice is None:
        return
    wanted = resolve_kv_cache_dtype(choice, dtype, target)
    if wanted != compiled:
        have, want = str(compiled).removeprefix("torch."), str(wanted).removeprefix("torch.")
        raise ValueError(
            f"--kv-cache-dtype {choice} asks for a {want} MLA cache, but the artifact was compiled for a {have} "
            f"cache: recompile with 'k3compile optimize ... --kv-cache-dtype {choice}', or leave the option out"
        )


def allocate_caches(
    cfg: K3Config,
    plan: ParallelPlan,
    shape: CacheShape,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    kv_cache_dtype: torch.dtype | None = None,
) -> list[LayerCache]:
    """Zeroed caches for every layer on this rank (KDA heads are split across TP ranks):
    KDA conv states in ``dtype``, fp32 recurrent states, MLA latent caches in
    ``kv_cache_dtype`` (default ``dtype``; an FP8 format gives the FP8 layout)."""
    kv_dtype = dtype if kv_cache_dtype is None else kv_cache_dtype
    kv_width = fp8_row_width(cfg.mla_cache_width) if is_fp8_dtype(kv_dtype) else cfg.mla_cache_width
    lin = cfg.linear_attn
    heads = lin.num_heads // plan.tp
    channels = heads * lin.head_dim
    caches: list[LayerCache] = []
    for kind in cfg.layer_kinds:
        if kind == "kda":
            conv = lambda: torch.zeros(  # noqa: E731
                shape.num_slots, channels, lin.short_conv_kernel_size - 1, dtype=dtype, device=device
            )
            state = torch.zeros(shape.num_slots, heads, lin.head_dim, lin.head_dim, dtype=torch.float32, device=device)
            caches.append(KDALayerCache(conv(), conv(), conv(), state))
        else:
            kv = torch.zeros(shape.num_blocks, shape.block_size, kv_width, dtype=kv_dtype, device=device)
            caches.append(MLALayerCache(kv))
    return caches


def flatten_caches(caches: Sequence[LayerCache]) -> list[Tensor]:
    """Cache tensors in the programs' input order (KDA: conv_q, conv_k, conv_v, state;
    MLA: kv), layer by layer."""
    out: list[Tensor] = []
    for c in caches:
        out.extend((c.conv_q, c.conv_k, c.conv_v, c.state) if isinstance(c, KDALayerCache) else (c.kv,))
    return out


def unflatten_caches(cfg: K3Config, flat: Sequence[Tensor]) -> list[LayerCache]:
    """The per-layer caches of ``cfg`` from :func:`flatten_caches`' order."""
    caches: list[LayerCache] = []
    i = 0
    for kind in cfg.layer_kinds:
        if kind == "kda":
            caches.append(KDALayerCache(*flat[i : i + 4]))
            i += 4
        else:
            caches.append(MLALayerCache(flat[i]))
            i += 1
    if i != len(flat):
        raise ValueError(f"expected {i} cache tensors for {cfg.num_hidden_layers} layers, got {len(flat)}")
    return caches


def zero_state_slot(caches: Sequence[LayerCache], slot: int) -> None:
    """A new sequence starts from zero KDA conv and recurrent states."""
    for cache in caches:
        if isinstance(cache, KDALayerCache):
            for t in (cache.conv_q, cache.conv_k, cache.conv_v, cache.state):
                t[slot].zero_()
