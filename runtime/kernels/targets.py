"""The GPU a launch runs on, named by the compile target whose launch tables it takes.

Launch choices (tiles, warps, stages, layouts) belong to a target, not to a vendor: an
MI355X (gfx950) and an MI300X (gfx942) differ in LDS per CU and in what a kernel
compiles to. Tables are keyed by the targets of ``aot.TARGETS``, so that the launches CI
compiles for a target are the ones a runtime on it makes: "sm_90" (the H200; other
NVIDIA GPUs and the CPU interpreter take its table), "gfx950" (MI355X), "gfx942"
(MI300X; other AMD GPUs take its table).
"""

from __future__ import annotations

import functools

import torch

#: the AMD targets with tables of their own
AMD_TARGETS = ("gfx950", "gfx942")
#: the NVIDIA targets: the only ones given NVIDIA-only launch options (``maxnreg``)
NVIDIA_TARGETS = ("sm_90",)


def device_target(device: torch.device) -> str:
    """The launch-table key for ``device`` (module docstring)."""
    if device.type == "cuda" and torch.version.hip:
        arch = torch.cuda.get_device_properties(device).gcnArchName.split(":")[0]
        return arch if arch in AMD_TARGETS else "gfx942"
    return "sm_90"


def on_nvidia(device: torch.device) -> bool:
    """Whether ``device`` is a GPU of an NVIDIA target (NVIDIA-only options and libraries)."""
    return device.type == "cuda" and device_target(device) in NVIDIA_TARGETS


@functools.cache
def compute_units(device: torch.device) -> int:
    """SMs (NVIDIA) / CUs (ROCm reports them in the same field) of a GPU; 1 for the CPU
    interpreter (the launch plans then take their smallest choices)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def register_cap(target: str, max_registers: int | None) -> dict[str, int]:
    """Triton's ``maxnreg`` launch option for a cap on registers per thread, where
    ``target`` has it (NVIDIA); nothing elsewhere or without a cap."""
    return {"maxnreg": max_registers} if max_registers and target in NVIDIA_TARGETS else {}
