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
it runs on a GPU, or on the CPU when asked to (``RuntimeOptions.kernels="triton"``: the
same kernels under Triton's interpreter, so that CI runs the GPU dispatch), and so must
GPU tests and benchmarks that call the ops.

Every kernel is declared with :func:`counted`, so :func:`kernel_launches` tells which
kernels a process launched (a test's proof that the kernels ran, not the references).
"""

from __future__ import annotations

from collections import Counter
from typing import Any, TypeVar

__all__ = ["DEVICE_TYPES", "counted", "interpreted", "kernel_launches", "register_gpu_kernels", "registered",
           "reset_kernel_launches"]

#: Device types these kernels can be registered for. ROCm builds of torch report "cuda"
#: too. "cpu" runs the same Triton kernels under Triton's interpreter, which must be on
#: (TRITON_INTERPRET=1 set before triton is first imported in the process; see :func:`interpreted`).
DEVICE_TYPES = ("cuda", "cpu")

_registered: set[str] = set()
_kernels: dict[str, Any] = {}  # every counted kernel by name
_launches: Counter[str] = Counter()  # launches of each since the last reset, in this process

K = TypeVar("K")


def counted(kernel: K) -> K:
    """Declare a Triton kernel (the object ``@triton.jit`` made; put this decorator above it):
    every launch is counted under its function name in :func:`kernel_launches`. A pre-run
    hook, so the count is host-side: under CUDA graphs it counts captures, not replays."""
    name = kernel.__name__  # type: ignore[attr-defined]
    module = kernel.fn.__module__  # type: ignore[attr-defined]
    known = _kernels.get(name)
    if known is not None and known.fn.__module__ != module:  # a reloaded module replaces its own
        raise ValueError(f"counted: kernels named {name!r} in {known.fn.__module__} and {module}")
    _kernels[name] = kernel

    def count(*args: object, **kwargs: object) -> None:
        _launches[name] += 1

    kernel.add_pre_run_hook(count)  # type: ignore[attr-defined]
    return kernel


def kernel_launches() -> dict[str, int]:
    """Launches of each counted kernel in this process since :func:`reset_kernel_launches`
    (kernels never launched are absent)."""
    return dict(_launches)


def reset_kernel_launches() -> None:
    """Start the launch counts of :func:`kernel_launches` again from zero."""
    _launches.clear()


def registered(device_type: str) -> bool:
    """Whether :func:`register_gpu_kernels` made the kernels the k3 ops' implementations on
    ``device_type`` tensors in this process (for good: nothing here undoes it)."""
    return device_type in _registered


def interpreted() -> bool:
    """Whether Triton runs under its interpreter in this process: triton.language's own jit
    functions (built when triton was first imported) and every kernel here (built when its
    module was imported) are interpreter wrappers. TRITON_INTERPRET set after either import
    is not enough, so the objects are checked, not the variable. Imports triton."""
    import triton.language as tl
    from triton.runtime.jit import JITFunction

    _import_kernel_modules()
    return not any(isinstance(f, JITFunction) for f in (tl.standard.sum, *_kernels.values()))


def _import_kernel_modules() -> tuple[Any, ...]:
    """The modules that register kernels, in registration order (imported here: they import
    Triton, which importing this package must not)."""
    from k3compile.runtime.kernels import (activations, attn_res, dcp_merge, kda_decode, kda_prefill, mla_cache_write,
                                           mla_decode, mla_input_proj, moe_dequant, moe_input, routing, rows,
                                           short_conv)

    return (rows, activations, attn_res, routing, moe_dequant, moe_input, mla_input_proj, mla_cache_write, mla_decode,
            kda_decode, kda_prefill, short_conv, dcp_merge)


def register_gpu_kernels(device_type: str = "cuda") -> None:
    """Register every runtime kernel for its k3 ops on ``device_type`` tensors, so that
    ``torch.ops.k3.*`` (eager, in exported programs, under CUDA graphs) run the Triton
    kernels there instead of the torch references: "cuda" on GPUs, "cpu" under Triton's
    interpreter (a ValueError otherwise, before anything is registered). Process-wide and
    idempotent: a second call for the same device type does nothing. Imports Triton
    (``import k3compile`` does not)."""
    if device_type not in DEVICE_TYPES:
        raise ValueError(f"register_gpu_kernels: device_type must be one of {DEVICE_TYPES}, got {device_type!r}")
    if device_type in _registered:
        return
    if device_type == "cpu" and not interpreted():
        raise ValueError(
            "register_gpu_kernels('cpu'): Triton is not running under its interpreter in this process; "
            "set TRITON_INTERPRET=1 before triton is first imported (e.g. in the environment of the process)"
        )
    for module in _import_kernel_modules():
        module.register_kernels(device_type)
    _registered.add(device_type)
