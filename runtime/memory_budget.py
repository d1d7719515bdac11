"""Whether a runtime's weights and caches fit its device, decided before anything is
allocated: a ``max_context`` of 10^9 tokens, or a config with a vocabulary of 10^12, is
refused with the bytes it would need instead of an allocation that fails (or swaps) after
minutes of loading."""

from __future__ import annotations

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

from k3compile.batch import CacheShape, allocate_caches, flatten_caches
from k3compile.config import K3Config
from k3compile.device_memory import GiB, available_bytes
from k3compile.runtime.weight_layout import padding_bytes
from k3compile.sequences import RequestError
from k3compile.sharding import ParallelPlan


def weight_bytes(program: ExportedProgram) -> int:
    """Bytes of one rank's parameters (the program's state dict holds their local shapes),
    with the padding rows of the grouped ones (``weight_layout``)."""
    params = [s.target for s in program.graph_signature.input_specs if s.kind == InputKind.PARAMETER]
    return (sum(program.state_dict[name].numel() * program.state_dict[name].element_size() for name in params)
            + padding_bytes(program))


def cache_bytes(cfg: K3Config, plan: ParallelPlan, shape: CacheShape, dtype: torch.dtype,
                kv_cache_dtype: torch.dtype) -> int:
    """Bytes of the caches ``allocate_caches`` would allocate (laid out on the meta device)."""
    caches = flatten_caches(allocate_caches(cfg, plan, shape, dtype, "meta", kv_cache_dtype))
    return sum(t.numel() * t.element_size() for t in caches)


def check_fits(device: torch.device, weights: int, caches: int, what: str) -> None:
    """A RequestError naming ``what`` (the options that sized the caches) unless weights
    and caches fit the device's free memory."""
    free = available_bytes(device)
    if free is not None and weights + caches > free:
        raise RequestError(f"{what} need {caches / GiB:.1f} GiB of caches and {weights / GiB:.1f} GiB of weights; "
                           f"{device} has {free / GiB:.1f} GiB free")
