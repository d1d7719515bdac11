"""An MLA layer's input projections as one GEMM and one launch: ``k3::mla_input_proj``.

The op (``k3compile/ops/mla_proj.py``) is three linears of x and their consumers: an
RMSNorm of q_a's product (q_c), an RMSNorm of kv_a's first kv_lora_rank columns followed by
its k_pe columns (the cached kv), and a sigmoid of g_proj's product (the output gate).
Here:

- ONE GEMM when the runtime laid the three weights out as consecutive rows of one buffer
  (``weight_layout``: q_a, kv_a, g in that order), else one GEMM per weight (the same
  values, up to the GEMM's accumulation order);
- ONE Triton launch over the product's column blocks, read in place through their row
  stride: a program per (row, segment). Segment 0 normalises q (the row, up to K3's 1536
  values, in registers in one pass), segment 1 normalises the latent (512) and copies k_pe
  (64) behind it, segments 2.. apply the sigmoid to BLOCK_G columns of the gate each.

The norms are ``rows.rms_norm_row`` (the RMSNorm kernel's row): fp32 in registers, ``x *
(1 / sqrt(sum(x^2) / width + eps)) * w``, rounded once to the output dtype. The sigmoid is
the overflow-free fp32 form of the SiTU kernel (``activations.py``). Outputs are new
contiguous tensors in the product's dtype (x's), as the reference returns them.

:func:`register_kernels` makes :func:`mla_input_proj` the op's implementation on a device
type (``k3compile.runtime.kernels.register_gpu_kernels``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from k3compile.runtime.kernels import counted
from k3compile.runtime.kernels.aot import TRITON_DTYPES, KernelLaunch, launch_signature
from k3compile.runtime.kernels.rows import rms_norm_row
from k3compile.runtime.weight_layout import column_blocks, consecutive_rows

BLOCK_G = 1024  # gate columns per program
NORM_SEGMENTS = 2  # programs 0 (q) and 1 (latent + k_pe) of each row; the gate's follow (2 in the kernel)


@counted
@triton.jit
def _mla_input_proj_kernel(q_ptr, c_ptr, g_ptr, q_out_ptr, kv_out_ptr, gate_out_ptr, q_norm_ptr, kv_norm_ptr,
                           q_stride, c_stride, g_stride, Q, L, R, G, q_eps, kv_eps,
                           BLOCK_Q: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
                           BLOCK_G: tl.constexpr):
    """Program (row, segment): 0 q's norm; 1 the latent's norm and k_pe's copy; 2 + i the
    sigmoid of gate columns [i * BLOCK_G, (i + 1) * BLOCK_G)."""
    row = tl.program_id(0).to(tl.int64)
    seg = tl.program_id(1)
    # Each branch names its values apart: Triton merges same-named values of if / else.
    if seg == 0:
        rms_norm_row(q_ptr + row * q_stride, q_norm_ptr, q_out_ptr + row * Q, Q, q_eps, BLOCK_Q)
    elif seg == 1:
        kv_row = kv_out_ptr + row * (L + R)
        rms_norm_row(c_ptr + row * c_stride, kv_norm_ptr, kv_row, L, kv_eps, BLOCK_L)
        rc = tl.arange(0, BLOCK_R)
        r_mask = rc < R
        k_pe = tl.load(c_ptr + row * c_stride + L + rc, mask=r_mask, other=0.0)
        tl.store(kv_row + L + rc, k_pe.to(kv_out_ptr.dtype.element_ty), mask=r_mask)
    else:
        gc = (seg - 2) * BLOCK_G + tl.arange(0, BLOCK_G)
        g_mask = gc < G
        g = tl.load(g_ptr + row * g_stride + gc, mask=g_mask, other=0.0).to(tl.float32)
        e = tl.exp(-tl.abs(g))  # sigmoid without overflow: e / (1 + e) for negative g
        sig = tl.where(g >= 0, 1.0, e) / (1.0 + e)
        tl.store(gate_out_ptr + row * G + gc, sig.to(gate_out_ptr.dtype.element_ty), mask=g_mask)


def _rows(t: Tensor) -> Tensor:
    """``t`` [T, width] with contiguous rows (a view when they are already)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _constexprs(Q: int, L: int, R: int) -> dict[str, int]:
    return {"BLOCK_Q": triton.next_power_of_2(Q), "BLOCK_L": triton.next_power_of_2(L),
            "BLOCK_R": triton.next_power_of_2(R), "BLOCK_G": BLOCK_G}


def mla_input_consumers(q: Tensor, c: Tensor, g: Tensor, q_norm_weight: Tensor, kv_norm_weight: Tensor,
                        q_eps: float, kv_eps: float, kv_lora_rank: int) -> tuple[Tensor, Tensor, Tensor]:
    """The consumers of the three products q [T, Q], c [T, L + R], g [T, G] (row-strided
    views of one product are read in place) in one launch: (q_c, kv, gate)."""
    T, Q = q.shape
    L, W, G = kv_lora_rank, c.shape[-1], g.shape[-1]
    if c.shape[0] != T or g.shape[0] != T or not 0 < L < W or q_norm_weight.shape != (Q,) \
            or kv_norm_weight.shape != (L,):
        raise ValueError(f"mla_input_proj: products q {list(q.shape)}, c {list(c.shape)}, g {list(g.shape)} with "
                         f"norm weights {list(q_norm_weight.shape)}, {list(kv_norm_weight.shape)} and "
                         f"kv_lora_rank {L} do not fit")
    if not q.dtype == c.dtype == g.dtype:
        raise ValueError(f"mla_input_proj: products of dtypes {q.dtype}, {c.dtype}, {g.dtype}")
    q_c, kv, gate = (torch.empty(T, n, dtype=q.dtype, device=q.device) for n in (Q, W, G))
    if T == 0:
        return q_c, kv, gate
    q, c, g = _rows(q), _rows(c), _rows(g)
    grid = (T, NORM_SEGMENTS + triton.cdiv(G, BLOCK_G))
    _mla_input_proj_kernel[grid](q, c, g, q_c, kv, gate, q_norm_weight.contiguous(), kv_norm_weight.contiguous(),
                                 q.stride(0), c.stride(0), g.stride(0), Q, L, W - L, G, float(q_eps),
                                 float(kv_eps), **_constexprs(Q, L, W - L), num_warps=4)
    return q_c, kv, gate


def mla_input_proj(x: Tensor, q_a_weight: Tensor, kv_a_weight: Tensor, g_weight: Tensor, q_norm_weight: Tensor,
                   kv_norm_weight: Tensor, q_eps: float, kv_eps: float,
                   kv_lora_rank: int) -> tuple[Tensor, Tensor, Tensor]:
    """``k3::mla_input_proj``: the three projections as ONE GEMM when the runtime laid their
    weights out as consecutive rows (``weight_layout``), else one each; then the kernel
    above, reading the product's column blocks in place."""
    weights = (q_a_weight, kv_a_weight, g_weight)
    merged = consecutive_rows(weights)
    if merged is not None:
        q, c, g = column_blocks(torch.nn.functional.linear(x, merged), weights)
    else:
        q, c, g = (torch.nn.functional.linear(x, w) for w in weights)
    return mla_input_consumers(q, c, g, q_norm_weight, kv_norm_weight, q_eps, kv_eps, kv_lora_rank)


def aot_launch(dtype: torch.dtype = torch.bfloat16, Q: int = 1536, L: int = 512, R: int = 64) -> KernelLaunch:
    """The kernel as the launcher specialises it for K3's widths (q_lora_rank 1536,
    kv_lora_rank 512, rope 64) in ``dtype``, for AOT checks."""
    t = TRITON_DTYPES[dtype]
    types = {a: f"*{t}" for a in _mla_input_proj_kernel.arg_names if a.endswith("_ptr")}
    types.update(q_eps="fp32", kv_eps="fp32")
    constexprs = _constexprs(Q, L, R)
    return KernelLaunch("mla_input_proj", _mla_input_proj_kernel,
                        launch_signature(_mla_input_proj_kernel, types, constexprs), constexprs, 4)


def register_kernels(device_type: str) -> None:
    """Use :func:`mla_input_proj` for ``k3::mla_input_proj`` on ``device_type`` tensors
    (registering again replaces the same function)."""
    from k3compile.ops import mla_proj

    mla_proj.mla_input_proj.register_kernel(device_type)(mla_input_proj)
