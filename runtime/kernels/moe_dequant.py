"""Routed experts for long prefills: the MXFP4 experts dequantised to bf16 a group of
experts at a time, then grouped bf16 GEMMs (``torch._grouped_mm``); and the op's entry on
GPUs, which picks this path or the fused kernels (``moe.py``).

Semantics are those of ``torch.ops.k3.moe_experts_mxfp4`` (k3compile/ops/moe.py). From a few
thousand tokens a prefill picks every expert many times over (a 32K-token prompt: 585 pairs
per expert on average), so decoding each weight once into a bf16 scratch costs little next
to the products, which then run on the matrix units at a dense GEMM's rate; the fused MXFP4
kernels (``moe.py``) decode in registers for every block of pairs instead, which on sm_90
(no E2M1 conversion in hardware) kept them at 13x their FLOP floor at that size
(BENCHMARKS.md).

    pairs sorted by expert (stable: an expert's pairs in pair order)
    for each group of ``group`` experts with pairs:
        W1, W3 (bf16) = dequantise;  gate, up = x W1^T, x W3^T   (one grouped GEMM each)
        h = SiTU-GLU(gate, up)                                    (k3::situ_and_mul)
        W2 (bf16) = dequantise;      y = h W2^T                   (bf16, as the reference)
    out[t] = sum_k weights[t, k] y[slot of pair (t, k)]           (moe.combine, k order)

``_mxfp4_dequant_kernel``: one program per (BLOCK_R weight rows, BLOCK_B packed bytes):
each byte's two E2M1 codes (low nibble the even column) times the group's E8M0 scale, exact
in bf16, the magnitude built from the code's bits rather than by selects (the kernel is
bound by its arithmetic as much as by its bytes). One host synchronisation per call (the experts' pair counts, to slice the groups):
prefill runs eagerly. Scratch: a group's bf16 weights (3 x group x I x D x 2 bytes: 1 GB at
128 experts of one TP8 rank) and x / y [T * top_k, D] in z's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from k3compile.runtime.kernels import counted
from k3compile.runtime.kernels.aot import TRITON_DTYPES, KernelLaunch, launch_signature
from k3compile.runtime.kernels.moe import (
    PLANS, _check_experts, combine, device_target, moe_experts_mxfp4, pairs_by_expert,
)

#: experts dequantised at a time (bounds the bf16 scratch)
EXPERT_GROUP = 128
BLOCK_R = 32
BLOCK_B = 64  # packed bytes per program row: 128 weights, 4 scale groups
DEQUANT_WARPS = 2


@triton.jit
def _e2m1_value(code, scale):
    """An E2M1 code (bit 3 the sign, bits 2-1 the exponent, bit 0 the mantissa) times
    ``scale`` in fp32. Its magnitude from bits: exponent field e + 126 over mantissa m is
    2^(e - 1) (1 + m / 2), the code's value for e > 0; e == 0 is 0 or 0.5."""
    bits = ((code & 7) << 22) + (126 << 23)
    mag = tl.where((code & 6) == 0, (code & 1).to(tl.float32) * 0.5, bits.to(tl.float32, bitcast=True))
    return (mag.to(tl.int32, bitcast=True) | ((code & 8) << 28)).to(tl.float32, bitcast=True) * scale


@triton.jit
def _as_unsigned(x, BITS: tl.constexpr):
    """x's BITS bits, zero-extended into a word of twice that width."""
    if BITS == 16:
        word = x.to(tl.uint16, bitcast=True).to(tl.uint32)
    else:
        word = x.to(tl.uint32, bitcast=True).to(tl.uint64)
    return word


@counted
@triton.jit
def _mxfp4_dequant_kernel(packed_ptr, scale_ptr, out_ptr, rows, K, BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr):
    """out [rows, K] = E2M1 codes of packed [rows, K / 2] (low nibble first) x 2^(scale - 127)
    per 32 columns (scale [rows, K / 32]). A program: BLOCK_R rows x BLOCK_B bytes, as
    [rows, 16-byte groups, 16]: one scale per group; each byte's two values stored as one
    word of twice their width (no interleaving in registers)."""
    GROUPS: tl.constexpr = BLOCK_B // 16
    BITS: tl.constexpr = out_ptr.dtype.element_ty.primitive_bitwidth
    WORD: tl.constexpr = tl.uint32 if BITS == 16 else tl.uint64
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    r64 = r.to(tl.int64)[:, None]
    ok = (r < rows)[:, None] & (g < K // 32)[None, :]
    e = tl.load(scale_ptr + r64 * (K // 32) + g[None, :], mask=ok, other=127).to(tl.int32)
    scale = tl.where(e == 0, 5.877471754111438e-39, (e << 23).to(tl.float32, bitcast=True))[:, :, None]  # 2^(e-127)
    byte = r64[:, :, None] * (K // 2) + (g * 16)[None, :, None] + tl.arange(0, 16)[None, None, :]
    p = tl.load(packed_ptr + byte, mask=ok[:, :, None], other=0).to(tl.int32)
    even = _as_unsigned(_e2m1_value(p & 15, scale).to(out_ptr.dtype.element_ty), BITS)
    odd = _as_unsigned(_e2m1_value(p >> 4, scale).to(out_ptr.dtype.element_ty), BITS)
    tl.store(out_ptr.to(tl.pointer_type(WORD), bitcast=True) + byte, even | (odd << BITS), mask=ok[:, :, None])


def dequantize(packed: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """MXFP4 weights packed [..., N, K / 2] and scale [..., N, K / 32] -> [..., N, K] in ``dtype``."""
    K = packed.shape[-1] * 2
    out = torch.empty((*packed.shape[:-1], K), dtype=dtype, device=packed.device)
    rows = out.numel() // K
    if rows:
        _mxfp4_dequant_kernel[(triton.cdiv(rows, BLOCK_R), triton.cdiv(K // 2, BLOCK_B))](
            packed, scale, out, rows, K, BLOCK_R=BLOCK_R, BLOCK_B=BLOCK_B, num_warps=DEQUANT_WARPS)
    return out


def takes(z: Tensor) -> bool:
    """bf16 activations (the grouped GEMM's operands) with model widths it accepts (rows of a
    multiple of 16 bytes: D and I multiples of 32 already are)."""
    return z.dtype == torch.bfloat16


def moe_experts_dequantized(z: Tensor, weights: Tensor, ids: Tensor, w1_packed: Tensor, w1_scale: Tensor,
                            w3_packed: Tensor, w3_scale: Tensor, w2_packed: Tensor, w2_scale: Tensor,
                            situ_beta: float, situ_linear_beta: float, group: int = EXPERT_GROUP) -> Tensor:
    """``k3::moe_experts_mxfp4`` by dequantised groups of ``group`` experts (module docstring)."""
    T, D, I, E, K = _check_experts(z, weights, ids, w1_packed, w1_scale, w3_packed, w3_scale, w2_packed, w2_scale)
    if not takes(z):
        raise ValueError(f"moe_experts_dequantized: bf16 activations needed, got {z.dtype}")
    out = torch.empty_like(z)
    if T == 0:
        return out
    flat = ids.reshape(-1).long()
    P = flat.numel()
    order, counts = pairs_by_expert(flat, E)
    ends = torch.cumsum(counts, 0).tolist()  # the one host synchronisation
    x = z[order // K]  # pairs' tokens in expert order
    y = torch.empty((P, D), dtype=z.dtype, device=z.device)
    for e0 in range(0, E, group):
        e1 = min(E, e0 + group)
        lo, hi = ends[e0 - 1] if e0 else 0, ends[e1 - 1]
        if hi == lo:
            continue
        offs = torch.cumsum(counts[e0:e1], 0, dtype=torch.int32)
        gate = torch._grouped_mm(x[lo:hi], dequantize(w1_packed[e0:e1], w1_scale[e0:e1], z.dtype).transpose(1, 2),
                                 offs=offs)
        up = torch._grouped_mm(x[lo:hi], dequantize(w3_packed[e0:e1], w3_scale[e0:e1], z.dtype).transpose(1, 2),
                               offs=offs)
        h = torch.ops.k3.situ_and_mul(gate, up, situ_beta, situ_linear_beta)
        y[lo:hi] = torch._grouped_mm(h, dequantize(w2_packed[e0:e1], w2_scale[e0:e1], z.dtype).transpose(1, 2),
                                     offs=offs)
    slot = torch.empty_like(order)
    slot[order] = torch.arange(P, device=z.device)
    combine(y, weights.float().contiguous(), out, slot)
    return out


def dequantized_path(pairs: int, z: Tensor) -> bool:
    """Whether ``k3::moe_experts_mxfp4`` runs dequantised: from the target's
    ``dequant_min_pairs``, bf16 activations, outside CUDA-graph capture (this path reads the
    experts' pair counts on the host)."""
    threshold = PLANS[device_target(z.device)].dequant_min_pairs
    capturing = z.is_cuda and torch.cuda.is_current_stream_capturing()
    return threshold is not None and pairs >= threshold and z.dtype == torch.bfloat16 and not capturing


def register_kernels(device_type: str) -> None:
    """``k3::moe_experts_mxfp4`` on ``device_type`` tensors: this path where
    :func:`dequantized_path` says, else the fused kernels (``moe.moe_experts_mxfp4``);
    routing's ops: ``routing.register_kernels``. Registering again replaces the same function."""
    from k3compile.ops import moe as moe_ops

    def experts(z, weights, ids, w1_packed, w1_scale, w3_packed, w3_scale, w2_packed, w2_scale,
                situ_beta, situ_linear_beta):
        args = (z, weights, ids, w1_packed, w1_scale, w3_packed, w3_scale, w2_packed, w2_scale, situ_beta,
                situ_linear_beta)
        return moe_experts_dequantized(*args) if dequantized_path(ids.numel(), z) else moe_experts_mxfp4(*args)

    moe_ops.moe_experts_mxfp4.register_kernel(device_type)(experts)


def aot_requests(dtype: torch.dtype = torch.bfloat16) -> list[KernelLaunch]:
    """The dequantisation kernel as the launcher runs it."""
    c = {"BLOCK_R": BLOCK_R, "BLOCK_B": BLOCK_B}
    types = {"packed_ptr": "*u8", "scale_ptr": "*u8", "out_ptr": f"*{TRITON_DTYPES[dtype]}"}
    return [KernelLaunch("mxfp4 dequant", _mxfp4_dequant_kernel, launch_signature(_mxfp4_dequant_kernel, types, c),
                         c, DEQUANT_WARPS, 1, ("K",))]
