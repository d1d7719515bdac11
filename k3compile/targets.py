"""Compilation targets: the hardware a compiled artifact is meant for.

A target names its device kind and the facts passes consult (memory, compute units,
on-chip memory per unit) and its default pass pipeline. Kernel capability tables (which
attention kernels exist and which shapes they accept) are derived from the kernels'
own declarations in ``k3compile.runtime``, not written here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

DeviceKind = Literal["cuda", "hip", "cpu"]


@dataclass(frozen=True)
class Target:
    name: str
    device: DeviceKind
    arch: str  # "sm_90", "gfx950", "gfx942", "cpu"
    compute_units: int
    local_memory_bytes: int  # shared memory per SM / LDS per CU
    hbm_bytes: int
    default_passes: tuple[str, ...]
    #: tokens per MLA cache block when the user gives none: on h200 64, so that the
    #: split-KV kernel's 32-row KV tiles lie inside one block and load by tensor
    #: descriptors (TMA; 1.5x the pointer gathers at batch 16, BENCHMARKS.md); 64 is
    #: also the block FlashMLA-style kernels require. Elsewhere 16 (pointer gathers take
    #: any block size; smaller blocks waste less of each sequence's last block).
    mla_block_size: int = 16


# The mission's passes join these lists as they land (one file each in passes/).
_COMMON_PASSES: tuple[str, ...] = ("remove_noops", "mxfp4_experts", "dedup_replicated_linear", "sink_copies")
#: GPU targets also fuse single-token KDA into one kernel and pad attention heads to what
#: their fast MLA decode kernel accepts.
_GPU_PASSES: tuple[str, ...] = (*_COMMON_PASSES, "fuse_kda_decode", "pad_attention_heads")

TARGETS: dict[str, Target] = {
    "h200": Target("h200", "cuda", "sm_90", 132, 228 * 1024, 141 * 10**9, _GPU_PASSES, mla_block_size=64),
    "mi355x": Target("mi355x", "hip", "gfx950", 256, 160 * 1024, 288 * 10**9, _GPU_PASSES),
    "mi300x": Target("mi300x", "hip", "gfx942", 304, 64 * 1024, 192 * 10**9, _GPU_PASSES),
    "cpu": Target("cpu", "cpu", "cpu", 1, 0, 0, _COMMON_PASSES),
}


def get_target(name: str) -> Target:
    if name not in TARGETS:
        raise ValueError(f"unknown target {name!r}; choose one of {', '.join(TARGETS)}")
    return TARGETS[name]
