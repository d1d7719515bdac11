"""Triton kernels for the runtime (installed as ``k3compile.runtime.kernels``).

One source serves CUDA and ROCm. Every kernel module declares which shapes its kernel
accepts (the target tables that passes consult are derived from those declarations),
and every kernel compiles ahead of time for gfx950 / gfx942 in CI
(:mod:`k3compile.runtime.kernels.aot`).
"""
