"""Compilation targets: the hardware a compiled artifact is meant for.

A target names its device kind and the facts passes consult (memory, compute units,
on-chip memory per unit). Its default pass pipeline follows from the passes' own
declarations (``GraphPass.default_on``: the device kinds a pass runs on by default), and
kernel capability tables (which attention kernels exist and which shapes they accept)
from the kernels' own declarations in ``k3compile.runtime``; neither is written here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

DeviceKind = Literal["cuda", "hip", "cpu"]
DEVICE_KINDS: tuple[DeviceKind, ...] = get_args(DeviceKind)
GPU_DEVICES: frozenset[DeviceKind] = frozenset({"cuda", "hip"})


@dataclass(frozen=True)
class Target:
    name: str
    device: DeviceKind
    arch: str  # "sm_90", "gfx950", "gfx942", "cpu"
    compute_units: int
    local_memory_bytes: int  # shared memory per SM / LDS per CU
    hbm_bytes: int
    #: tokens per MLA cache block when the user gives none: on h200 64, so that the
    #: split-KV kernel's 32-row KV tiles lie inside one block and load by tensor
    #: descriptors (TMA; 1.5x the pointer gathers at batch 16, BENCHMARKS.md); 64 is
    #: also the block FlashMLA-style kernels require. Elsewhere 16 (pointer gathers take
    #: any block size; smaller blocks waste less of each sequence's last block).
    mla_block_size: int = 16
    #: the FP8 format of ``--kv-cache-dtype fp8`` (k3compile/mla_cache_fp8.py): OCP E4M3,
    #: which gfx950 and sm_90 convert in hardware; gfx942 converts the fnuz variant
    fp8_cache_dtype: str = "float8_e4m3fn"
    #: how the runtime lowers the optimized programs when the user does not say (one of
    #: LOWERINGS): "inductor" (torch.compile at load: pointwise work, norms and AttnRes
    #: mixes fused around the k3 kernels) on GPU targets; "eager" on the CPU, where the
    #: compile costs more than tests and tiny models gain
    lowering: str = "inductor"


#: how an artifact's programs run (``CompileOptions.lowering``, recorded in the artifact):
#: "inductor" compiles each phase's program with torch.compile when the runtime loads it,
#: "eager" runs it op by op
LOWERINGS = ("inductor", "eager")

TARGETS: dict[str, Target] = {
    "h200": Target("h200", "cuda", "sm_90", 132, 228 * 1024, 141 * 10**9, mla_block_size=64),
    "mi355x": Target("mi355x", "hip", "gfx950", 256, 160 * 1024, 288 * 10**9),
    "mi300x": Target("mi300x", "hip", "gfx942", 304, 64 * 1024, 192 * 10**9, fp8_cache_dtype="float8_e4m3fnuz"),
    "cpu": Target("cpu", "cpu", "cpu", 1, 0, 0, lowering="eager"),
}


def get_target(name: str) -> Target:
    if name not in TARGETS:
        raise ValueError(f"unknown target {name!r}; choose one of {', '.join(TARGETS)}")
    return TARGETS[name]
