"""Triton kernels for the runtime (installed as ``k3compile.runtime.kernels``).

One source serves CUDA and ROCm. Every kernel module declares which shapes its kernel
accepts (the target tables that passes consult are derived from those declarations),
and every kernel compiles ahead of time for gfx950 / gfx942 in CI
(:mod:`k3compile.runtime.kernels.aot`).

The op library (``k3compile.ops``) never imports this package: each k3 op's default
implementation is its torch reference, and :func:`register_gpu_kernels` makes these
kernels the ops' implementations on a device type. Each module that accelerates k3 ops
has a ``register_kernels(device_type)`` that registers its own, with whatever launch
decisions the op needs (which shapes go to a kernel and which fall back to the
reference, casts, programmatic dependent launch); the engine calls the entry point when
it runs on a GPU, and so must GPU tests and benchmarks that call the ops.
"""

from __future__ import annotations

__all__ = ["DEVICE_TYPES", "register_gpu_kernels"]

#: Device types these kernels can be registered for. ROCm builds of torch report "cuda"
#: too. A later "cpu" entry would run the same Triton kernels under the interpreter
#: (TRITON_INTERPRET=1 set before triton is first imported).
DEVICE_TYPES = ("cuda",)

_registered: set[str] = set()


def register_gpu_kernels(device_type: str = "cuda") -> None:
    """Register every runtime kernel for its k3 ops on ``device_type`` tensors, so that
    ``torch.ops.k3.*`` (eager, in exported programs, under CUDA graphs) run the Triton
    kernels there instead of the torch references. Idempotent: a second call for the
    same device type does nothing. Imports Triton (``import k3compile`` does not)."""
    if device_type not in DEVICE_TYPES:
        raise ValueError(f"register_gpu_kernels: device_type must be one of {DEVICE_TYPES}, got {device_type!r}")
    if device_type in _registered:
        return
    # Imported here: they import Triton, which importing this package must not.
    from k3compile.runtime.kernels import dcp_merge, kda_decode, mla_decode, moe, routing, rows

    for module in (rows, routing, moe, mla_decode, kda_decode, dcp_merge):
        module.register_kernels(device_type)
    _registered.add(device_type)
