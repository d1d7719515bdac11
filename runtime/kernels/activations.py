"""The SiTU-GLU activation as one launch: ``k3::situ_and_mul`` (and ``k3::situ_and_mul_proj``,
its projections as one GEMM first).

The op's torch reference (``k3compile/ops/activations.py``) is a chain of about a dozen
elementwise kernels on a GPU (two fp32 casts, two divisions, two tanh, a sigmoid, the
products, the cast back). Inductor cannot fuse inside a custom op, so every use (the dense
MLP, each layer's shared expert) paid all of them. Here it is one program per (row, column
block): gate and up read once, the product written once, in fp32 in registers::

    out = beta * tanh(gate / beta) * sigmoid(gate) * (linear_beta * tanh(up / linear_beta))

tanh as in the routed-expert kernel (``moe.py``): an odd Taylor polynomial for |v| < 0.3,
else (1 - t) / (1 + t) with t = exp(-2|v|); sigmoid without overflow. Within a few fp32
roundings of torch's; the result is rounded once to gate's dtype, as the reference does.
gate and up may be row-strided (each row contiguous).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from k3compile.runtime.kernels import counted
from k3compile.runtime.kernels.aot import TRITON_DTYPES, KernelLaunch, launch_signature
from k3compile.runtime.weight_layout import column_blocks, consecutive_rows

BLOCK = 1024  # columns per program


@triton.jit
def _tanh(v):
    """tanh in fp32: the odd Taylor polynomial for |v| < 0.3 (no cancellation; < 2e-7
    relative), else (1 - t) / (1 + t), t = exp(-2|v|) <= 0.55."""
    v2 = v * v
    poly = v * (1.0 + v2 * (-1.0 / 3.0 + v2 * (2.0 / 15.0 + v2 * (-17.0 / 315.0 + v2 * (62.0 / 2835.0)))))
    t = tl.exp(-2.0 * tl.abs(v))
    far = (1.0 - t) / (1.0 + t)
    return tl.where(tl.abs(v) < 0.3, poly, tl.where(v < 0, -far, far))


@triton.jit
def situ_glu(g, u, beta, linear_beta):
    """The SiTU-GLU of fp32 gate and up values (the module docstring), in fp32."""
    e = tl.exp(-tl.abs(g))  # sigmoid without overflow: e / (1 + e) for negative g
    sig = tl.where(g >= 0, 1.0, e) / (1.0 + e)
    return beta * _tanh(g / beta) * sig * (linear_beta * _tanh(u / linear_beta))


@counted
@triton.jit
def _situ_and_mul_kernel(gate_ptr, up_ptr, out_ptr, width, gate_stride, up_stride, beta, linear_beta,
                         BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    g = tl.load(gate_ptr + row * gate_stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * up_stride + cols, mask=mask, other=0.0).to(tl.float32)
    out = situ_glu(g, u, beta, linear_beta)
    tl.store(out_ptr + row * width + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: Tensor) -> Tensor:
    """``t`` as [rows, width] with contiguous rows (a view where it can be one)."""
    flat = t.reshape(-1, t.shape[-1]) if t.dim() != 2 else t
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    return flat


def situ_and_mul(gate: Tensor, up: Tensor, beta: float, linear_beta: float) -> Tensor:
    """``k3::situ_and_mul`` in one launch (the module docstring); out has gate's shape and dtype."""
    if gate.shape != up.shape:
        raise ValueError(f"situ_and_mul: gate {list(gate.shape)} and up {list(up.shape)} must have one shape")
    if gate.device != up.device:
        raise ValueError(f"situ_and_mul: gate is on {gate.device}, up on {up.device}")
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if gate.numel() == 0:
        return out
    g, u = _rows(gate), _rows(up)
    width = g.shape[1]
    _situ_and_mul_kernel[(g.shape[0], triton.cdiv(width, BLOCK))](
        g, u, out, width, g.stride(0), u.stride(0), float(beta), float(linear_beta), BLOCK=BLOCK, num_warps=4)
    return out


def situ_and_mul_proj(x: Tensor, gate_weight: Tensor, up_weight: Tensor, beta: float, linear_beta: float) -> Tensor:
    """``k3::situ_and_mul_proj``: gate and up as ONE GEMM when the runtime laid their weights
    out as consecutive rows (``weight_layout``), else one each; then the kernel above,
    reading the product's two column blocks in place."""
    both = consecutive_rows((gate_weight, up_weight))
    if both is not None:
        gate, up = column_blocks(torch.nn.functional.linear(x, both), (gate_weight, up_weight))
    else:
        gate, up = torch.nn.functional.linear(x, gate_weight), torch.nn.functional.linear(x, up_weight)
    return situ_and_mul(gate, up, beta, linear_beta)


def register_kernels(device_type: str) -> None:
    """Use the kernels for ``k3::situ_and_mul`` and ``k3::situ_and_mul_proj`` on
    ``device_type`` tensors (registering again replaces the same functions)."""
    from k3compile.ops import activations

    activations.situ_and_mul.register_kernel(device_type)(situ_and_mul)
    activations.situ_and_mul_proj.register_kernel(device_type)(situ_and_mul_proj)


def aot_launch(dtype: torch.dtype = torch.bfloat16) -> KernelLaunch:
    """The kernel as :func:`situ_and_mul` launches it on ``dtype`` rows, for AOT checks."""
    t = TRITON_DTYPES[dtype]
    types = {"gate_ptr": f"*{t}", "up_ptr": f"*{t}", "out_ptr": f"*{t}", "beta": "fp32", "linear_beta": "fp32"}
    constexprs = {"BLOCK": BLOCK}
    return KernelLaunch("situ_and_mul", _situ_and_mul_kernel, launch_signature(_situ_and_mul_kernel, types, constexprs),
                        constexprs, 4)
