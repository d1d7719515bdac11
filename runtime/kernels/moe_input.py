"""A MoE layer's input projections as one GEMM and two launches: ``k3::moe_input_proj``.

The op (``k3compile/ops/moe_input.py``) is four linears of x and their consumers: the
router's fp32 logits and the sigmoid top-k routing, the routed experts' input z (x's dtype),
and the shared expert's SiTU-GLU h. Here:

- ONE GEMM with fp32 output when the runtime laid the four weights out as consecutive rows
  of one buffer (``weight_layout``: router, down, gate, up in that order): the router's
  logits are the product's first columns as the reference has them (products of bf16 /
  fp16 values are exact in fp32, the sum fp32);
- the routing kernel (``routing.py``) reading the logits' columns in place (row stride);
- ONE Triton launch over the rest, a program per (row, column block): z's blocks rounded
  to x's dtype (what the reference's linear stores), and the SiTU-GLU of the gate / up
  blocks, each first rounded to x's dtype as the reference's linears store them, in fp32
  (``activations.py``'s math), rounded once.

Weights not laid out together run the ops one by one (their own kernels). Under Triton's
interpreter fp32 -> bf16 casts truncate, so the kernel rounds bf16 to nearest even by hand
there (``ROUND_BY_HAND``), as the experts' kernels do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.jit import JITFunction

from k3compile.runtime.kernels import counted
from k3compile.runtime.kernels.activations import situ_glu
from k3compile.runtime.kernels.aot import KernelLaunch, launch_signature
from k3compile.runtime.kernels.routing import sigmoid_topk_route
from k3compile.runtime.kernels.targets import on_nvidia
from k3compile.runtime.weight_layout import consecutive_rows

BLOCK = 1024  # columns per program
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _rounded(v, dtype: tl.constexpr, ROUND_BY_HAND: tl.constexpr):
    """fp32 -> the nearest value of ``dtype`` (ties to even), as fp32."""
    if ROUND_BY_HAND and dtype == tl.bfloat16:
        bits = v.to(tl.int32, bitcast=True)
        return ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
    return v.to(dtype).to(tl.float32)


@counted
@triton.jit
def _moe_input_kernel(prod_ptr, z_ptr, h_ptr, stride, z_col, Z, g_col, u_col, I, beta, linear_beta,
                      BLOCK: tl.constexpr, ROUND_BY_HAND: tl.constexpr):
    """Program (row, block): blocks below cdiv(Z, BLOCK) store z's columns, the rest the
    SiTU-GLU of the gate / up columns, in the outputs' dtype."""
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    z_blocks = tl.cdiv(Z, BLOCK)
    src = prod_ptr + row * stride
    if blk < z_blocks:
        zc = blk * BLOCK + tl.arange(0, BLOCK)
        z_mask = zc < Z
        zv = _rounded(tl.load(src + z_col + zc, mask=z_mask, other=0.0), z_ptr.dtype.element_ty, ROUND_BY_HAND)
        tl.store(z_ptr + row * Z + zc, zv.to(z_ptr.dtype.element_ty), mask=z_mask)
    else:
        hc = (blk - z_blocks) * BLOCK + tl.arange(0, BLOCK)
        h_mask = hc < I
        out: tl.constexpr = h_ptr.dtype.element_ty
        g = _rounded(tl.load(src + g_col + hc, mask=h_mask, other=0.0), out, ROUND_BY_HAND)
        u = _rounded(tl.load(src + u_col + hc, mask=h_mask, other=0.0), out, ROUND_BY_HAND)
        h = _rounded(situ_glu(g, u, beta, linear_beta), out, ROUND_BY_HAND)
        tl.store(h_ptr + row * I + hc, h.to(out), mask=h_mask)


#: TRITON_INTERPRET was set when this module was imported: @triton.jit made an interpreter wrapper
_INTERPRETED = not isinstance(_moe_input_kernel, JITFunction)


def moe_input_consumers(product: Tensor, widths: tuple[int, int, int, int], correction_bias: Tensor, top_k: int,
                        renormalize: bool, scaling: float, beta: float, linear_beta: float,
                        dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The consumers of ``product`` [T, E + Z + 2 I] fp32 (the four projections' columns,
    ``widths`` = (E, Z, I, I), each row's columns contiguous): (weights, ids, z, h), z and h
    in ``dtype``."""
    E, Z, I, I_up = widths
    T = product.shape[0]
    if product.dtype != torch.float32 or product.dim() != 2 or product.shape[1] != sum(widths) or I != I_up \
            or product.stride(-1) != 1:
        raise ValueError(f"moe_input_proj: product {product.dtype} {list(product.shape)} (column stride "
                         f"{product.stride(-1)}) does not hold fp32 router / down / gate / up columns {widths}")
    weights, ids = sigmoid_topk_route(product[:, :E], correction_bias, top_k, renormalize, scaling)
    z = torch.empty(T, Z, dtype=dtype, device=product.device)
    h = torch.empty(T, I, dtype=dtype, device=product.device)
    if T:
        grid = (T, triton.cdiv(Z, BLOCK) + triton.cdiv(I, BLOCK))
        _moe_input_kernel[grid](product, z, h, product.stride(0), E, Z, E + Z, E + Z + I, I, float(beta),
                                float(linear_beta), BLOCK=BLOCK, ROUND_BY_HAND=_INTERPRETED, num_warps=4)
    return weights, ids, z, h


def moe_input_proj(x: Tensor, router_weight: Tensor, correction_bias: Tensor, down_weight: Tensor,
                   gate_weight: Tensor, up_weight: Tensor, top_k: int, renormalize: bool, scaling: float,
                   beta: float, linear_beta: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``k3::moe_input_proj``: for weights laid out together (in x's dtype), ONE
    fp32-output GEMM, the routing kernel and the kernel above; else the ops one by one."""
    weights = (router_weight, down_weight, gate_weight, up_weight)
    merged = consecutive_rows(weights)
    if merged is None or merged.dtype != x.dtype or x.dtype not in _DTYPES or x.dim() != 2:
        k3 = torch.ops.k3
        route = k3.sigmoid_topk_route(k3.router_logits(x, router_weight), correction_bias, top_k, renormalize,
                                      scaling)
        return (*route, torch.nn.functional.linear(x, down_weight),
                k3.situ_and_mul_proj(x, gate_weight, up_weight, beta, linear_beta))
    if x.dtype == torch.float32:
        product = torch.mm(x, merged.t())
    elif on_nvidia(x.device):  # (as router_logits: out_dtype is cuBLAS's)
        product = torch.mm(x, merged.t(), out_dtype=torch.float32)
    else:  # the same products in fp32
        product = torch.nn.functional.linear(x.float(), merged.float())
    widths = tuple(w.shape[0] for w in weights)
    return moe_input_consumers(product[:, :sum(widths)], widths, correction_bias, top_k, renormalize, scaling, beta,
                               linear_beta, x.dtype)


def aot_launch() -> KernelLaunch:
    """The kernel as the launcher specialises it (bf16 outputs), for AOT checks."""
    types = {"prod_ptr": "*fp32", "z_ptr": "*bf16", "h_ptr": "*bf16", "beta": "fp32", "linear_beta": "fp32"}
    constexprs = {"BLOCK": BLOCK, "ROUND_BY_HAND": False}
    return KernelLaunch("moe_input", _moe_input_kernel, launch_signature(_moe_input_kernel, types, constexprs),
                        constexprs, 4)


def register_kernels(device_type: str) -> None:
    """Use :func:`moe_input_proj` for ``k3::moe_input_proj`` on ``device_type`` tensors
    (registering again replaces the same function)."""
    from k3compile.ops import moe_input

    moe_input.moe_input_proj.register_kernel(device_type)(moe_input_proj)
