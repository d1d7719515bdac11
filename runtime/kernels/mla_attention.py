"""The generic MLA decode kernel and the absorbed prefill kernel: one source,
``_mla_attention_kernel`` (DECODE: one new token per sequence).

``mla_decode_generic``  what engines fall back to for head counts the split-KV kernel
    (``mla_split_kv.py``) does not take: one program per (batch, head), vector math (a
    1-row tile cannot use the matrix units). Correct for any head count, but every head
    re-reads the context and a batch-1 step runs only H programs, so its time grows with
    the context.
``mla_prefill_absorbed``  causal prefill for any head count (K3 at TP8: 12): 16-row
    tiles of a sequence's (token, head) rows, so 12 heads fill the matrix units too;
    each tile reads the context only up to its last row's position.

:data:`GENERIC` and :data:`PREFILL` declare what they accept; semantics and the family's
overview are in ``mla_decode.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from k3compile.mla_cache_fp8 import is_fp8_cache, is_fp8_dtype
from k3compile.ops import mla as mla_ops
from k3compile.runtime.kernels import counted
from k3compile.runtime.kernels.aot import TRITON_DTYPES, KernelLaunch
from k3compile.runtime.kernels.mla_common import (
    _DTYPES,
    _INTERPRETED,
    _LN2,
    HEAD_TILE,
    LOG2E,
    MLAKernel,
    _check_decode_batch,
    _check_inputs,
    _dot_constexprs,
    _empty,
    _fp8_row_scales,
    _kernel_launch,
    _widths,
)
from k3compile.runtime.kernels.targets import device_target


@triton.jit
def _local_length(length, cycle, interleave, offset):
    """How many of a sequence's first ``length`` positions a DCP member stores (its first
    position in each cycle of ``cycle`` is ``offset``): ``ContextLayout.local_length``."""
    rest = tl.minimum(tl.maximum(length % cycle - offset, 0), interleave)
    return (length // cycle) * interleave + rest


@counted
@triton.jit
def _mla_attention_kernel(
    q_ptr, kv_ptr, cu_seqlens_ptr, block_table_ptr, seq_lens_ptr, position_offset_ptr, o_ptr, lse_ptr,
    scale_log2, num_heads, cycle, interleave,
    stride_qt, stride_qh, stride_kvb, stride_kvt, stride_btb,
    stride_ot, stride_oh, stride_lt, stride_lh,
    block_size,
    L: tl.constexpr, R: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DECODE: tl.constexpr, USE_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, FP32_DOT: tl.constexpr, KV_FP8: tl.constexpr, CONTEXT_SPLIT: tl.constexpr,
):
    """Program (row tile, sequence n): BLOCK_M rows (token, head) of n's new tokens
    against every position they see. Row (t, h) sees context positions up to t's own
    (the sequence's new tokens are its last positions, already in the cache).

    DECODE: one new token per sequence (cu_seqlens unused), rows are heads.
    USE_DOT: matrix units (BLOCK_M >= 16); else BLOCK_M is 1 and the row's products are
    multiply + row sums. FP32_DOT: dots on fp32 copies of the operands (exact for
    bf16/fp16 values; p is still rounded to the cache dtype first, as on the GPU), set
    only under TRITON_INTERPRET, whose tl.dot multiplies bf16 bit patterns (triton#11584).
    KV_FP8: an FP8 cache (k3compile/mla_cache_fp8.py): codes converted to the model dtype
    in registers; each row's latent and k_pe scales multiply its score terms and its
    probability (the value's factor), never the tiles. CONTEXT_SPLIT: the cache holds one
    DCP member's positions (``k3::mla_prefill_partial``): a row sees the local rows whose
    global positions are up to its own, the first ``_local_length(its position + 1)``.
    o/lse: the final [tokens, H, L] / [tokens, H] outputs."""
    n = tl.program_id(1)
    if DECODE:
        start = n
        n_new = 1
    else:
        start = tl.load(cu_seqlens_ptr + n)
        n_new = tl.load(cu_seqlens_ptr + n + 1) - start
    ctx = tl.load(seq_lens_ptr + n)

    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n_new * num_heads
    tok = rows // num_heads
    head = rows % num_heads
    row_end = tl.where(row_ok, ctx - n_new + tok + 1, 0)  # exclusive causal limit of each row
    if CONTEXT_SPLIT:  # ... in this member's local rows
        row_end = _local_length(row_end, cycle, interleave, tl.load(position_offset_ptr).to(tl.int32))
    tile_end = tl.max(row_end, axis=0)  # a tile with no rows gets an empty range

    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    p_ty = q_ptr.dtype.element_ty  # the model dtype (a float cache has it too)
    dot_ty = tl.float32 if FP32_DOT else p_ty
    q_row = q_ptr + (start + tok).to(tl.int64) * stride_qt + head * stride_qh
    q_lat = tl.load(q_row[:, None] + offs_l[None, :], mask=row_ok[:, None] & (offs_l[None, :] < L), other=0.0)
    q_pe = tl.load(q_row[:, None] + L + offs_r[None, :], mask=row_ok[:, None] & (offs_r[None, :] < R), other=0.0)
    q_lat = q_lat.to(dot_ty)
    q_pe = q_pe.to(dot_ty)

    bt_row = block_table_ptr + n.to(tl.int64) * stride_btb
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_L], tl.float32)
    for n0 in range(0, tile_end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = pos < tile_end
        block = tl.load(bt_row + pos // block_size, mask=valid, other=0)
        kv_row = kv_ptr + block.to(tl.int64) * stride_kvb + (pos % block_size).to(tl.int64) * stride_kvt
        k_lat = tl.load(kv_row[:, None] + offs_l[None, :], mask=valid[:, None] & (offs_l[None, :] < L), other=0.0)
        k_pe = tl.load(kv_row[:, None] + L + offs_r[None, :], mask=valid[:, None] & (offs_r[None, :] < R), other=0.0)
        if USE_DOT:
            s_lat = tl.dot(q_lat, tl.trans(k_lat.to(dot_ty)), input_precision=DOT_PRECISION)
            s_pe = tl.dot(q_pe, tl.trans(k_pe.to(dot_ty)), input_precision=DOT_PRECISION)
        else:  # one row: it broadcasts over the tile's positions
            s_lat = tl.sum(q_lat.to(tl.float32) * k_lat.to(tl.float32), axis=1)[None, :]
            s_pe = tl.sum(q_pe.to(tl.float32) * k_pe.to(tl.float32), axis=1)[None, :]
        if KV_FP8:
            sc_lat, sc_pe = _fp8_row_scales(kv_row, L + R, valid)
            s = s_lat * sc_lat[None, :] + s_pe * sc_pe[None, :]
        else:
            s = s_lat + s_pe
        s = tl.where(pos[None, :] < row_end[:, None], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row with no visible position yet keeps m = -inf; subtracting 0 instead keeps
        # its exp2 terms at 0 rather than NaN (-inf - -inf).
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_sub)
        p = tl.exp2(s - m_sub[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if KV_FP8:
            p = p * sc_lat[None, :]  # the values' scales
        if USE_DOT:
            pv = tl.dot(p.to(p_ty).to(dot_ty), k_lat.to(dot_ty), input_precision=DOT_PRECISION)
        else:
            pv = tl.sum(tl.trans(p) * k_lat.to(tl.float32), axis=0)[None, :]
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    # An empty range leaves l = 0, m = -inf: o = 0 and lse = -inf + log2(0) = -inf.
    o = tl.where(l_i[:, None] > 0, acc / l_i[:, None], 0.0)
    out_tok = (start + tok).to(tl.int64)
    o_row = o_ptr + out_tok * stride_ot + head * stride_oh
    tl.store(o_row[:, None] + offs_l[None, :], o, mask=row_ok[:, None] & (offs_l[None, :] < L))
    lse = (m_i + tl.log2(l_i)) * _LN2
    tl.store(lse_ptr + out_tok * stride_lt + head * stride_lh, lse, mask=row_ok)


# ---------------------------------------------------------------------------------------
# Launch configuration (shared by the launchers and the AOT check)
# ---------------------------------------------------------------------------------------


# Generic and prefill kernels: 4 warps; with 8, AMD's 16-row MFMA tiles are replicated
# across more warps (AOT reports).
_NUM_WARPS = 4


def default_block_n(matrix_units: bool, target: str, dtype: torch.dtype) -> int:
    """KV rows per tile of the prefill (matrix units) and generic kernels, from the AOT
    reports (tests/test_kernel_mla_decode.py prints them). The split-KV kernel's come from
    ``mla_split_kv.split_kv_config``.

    Prefill: a 16-row MFMA tile does not split across warps, so on AMD every warp holds
    the whole 16 x 512 query operand and its own K operand. 16 KV rows need 236 (gfx950)
    / 246 (gfx942) of the 512 VGPRs, 2 waves per SIMD; 32 rows 315 / 339, 1 wave. Until
    measured on an MI355X, 16. On sm_90, 32 rows use 207 registers and 82 KiB of shared
    memory without spills (64 rows spill). fp32 rows are twice as wide: half as many (at
    least 16, the smallest dot). Generic kernel: 16, its [16, L] fp32 product lives in
    registers."""
    rows = 32 if matrix_units and target == "sm_90" else 16
    return max(16, rows // 2) if dtype == torch.float32 else rows


def _attention_constexprs(kernel: MLAKernel, qk_dim: int, value_dim: int, dtype: torch.dtype, block_n: int,
                          kv_fp8: bool, interpreted: bool = _INTERPRETED, context_split: bool = False
                          ) -> dict[str, object]:
    matrix_units = kernel is not GENERIC
    return {
        **_widths(qk_dim, value_dim),
        "BLOCK_M": HEAD_TILE if matrix_units else 1, "BLOCK_N": block_n,
        "DECODE": kernel.phase == "decode", "USE_DOT": matrix_units,
        **_dot_constexprs(dtype, interpreted), "KV_FP8": kv_fp8, "CONTEXT_SPLIT": context_split,
    }


# ---------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------


def attention_grid(sequences: int, max_new_tokens: int, heads: int, block_m: int) -> tuple[int, int]:
    """(row tiles, sequences): the row tiles on the first axis, the only one CUDA lets
    exceed 65,535 (a 128K-token prompt at 12 heads is 98,304 tiles of 16 rows)."""
    return triton.cdiv(max_new_tokens * heads, block_m), sequences


def _launch(kernel: MLAKernel, q: Tensor, kv_cache: Tensor, cu_seqlens: Tensor | None, block_table: Tensor,
            seq_lens: Tensor, scale: float, value_dim: int, max_new_tokens: int,
            block_n: int | None, split: tuple[Tensor, int, int] | None = None) -> tuple[Tensor, Tensor]:
    """Run the generic or prefill kernel on rows q [tokens, H, W]; decode has one token per
    sequence. ``split``: (position offset, dcp, interleave) of a DCP member's cache."""
    _check_inputs(kernel, q, kv_cache, block_table, seq_lens, value_dim)
    q = q if q.stride(-1) == 1 else q.contiguous()
    T, H, W = q.shape
    o = _empty((T, H, value_dim), q.dtype, q.device)
    lse = _empty((T, H), torch.float32, q.device)
    if T == 0 or max_new_tokens == 0:
        return o, lse
    block_n = block_n or default_block_n(kernel is not GENERIC, device_target(q.device), q.dtype)
    c = _attention_constexprs(kernel, W, value_dim, q.dtype, block_n, is_fp8_cache(kv_cache),
                              context_split=split is not None)
    offset, dcp, interleave = split if split is not None else (seq_lens, 1, 1)  # (the offset unread then)
    _mla_attention_kernel[attention_grid(seq_lens.shape[0], max_new_tokens, H, c["BLOCK_M"])](
        q, kv_cache, seq_lens if cu_seqlens is None else cu_seqlens, block_table, seq_lens, offset, o, lse,
        scale * LOG2E, H, dcp * interleave, interleave,
        q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), block_table.stride(0),
        *o.stride()[:2], *lse.stride(),
        kv_cache.shape[1],
        **c, num_warps=_NUM_WARPS, num_stages=1,
    )
    return o, lse


def mla_decode_generic(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, scale: float,
                       value_dim: int = 512, block_n: int | None = None) -> tuple[Tensor, Tensor]:
    """GENERIC decode: any head count, one program per (batch, head), no KV split."""
    _check_decode_batch(GENERIC.name, q, seq_lens)
    return _launch(GENERIC, q, kv_cache, None, block_table, seq_lens, scale, value_dim, 1, block_n)


def mla_prefill_absorbed(q: Tensor, kv_cache: Tensor, cu_seqlens: Tensor, block_table: Tensor, seq_lens: Tensor,
                         scale: float, value_dim: int = 512, max_new_tokens: int | None = None,
                         block_n: int | None = None,
                         split: tuple[Tensor, int, int] | None = None) -> tuple[Tensor, Tensor]:
    """Causal prefill, absorbed form: q [T, H, W] packed new tokens (sequence i's are rows
    cu_seqlens[i]:cu_seqlens[i+1], the last of its seq_lens[i] positions, already in the
    cache) -> (o [T, H, value_dim] in q.dtype, lse [T, H] fp32). ``max_new_tokens`` (the
    most new tokens of one sequence) sizes the grid; read from cu_seqlens when not given.
    ``split``: (position offset, dcp, interleave) when the cache holds one DCP member's
    positions."""
    N = seq_lens.shape[0]
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.shape != (N + 1,):
        raise ValueError(f"{PREFILL.name}: cu_seqlens must be int32 [{N + 1}], got {cu_seqlens.dtype} "
                         f"{tuple(cu_seqlens.shape)}")
    if max_new_tokens is None:  # a device sync; prefill runs eagerly
        max_new_tokens = int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if N else 0
    return _launch(PREFILL, q, kv_cache, cu_seqlens, block_table, seq_lens, scale, value_dim, max_new_tokens, block_n,
                   split)


def mla_prefill_partial(q: Tensor, kv_cache: Tensor, block_table: Tensor, cu_seqlens: Tensor, seq_lens: Tensor,
                        position_offset: Tensor, dcp: int, interleave: int, scale: float,
                        value_dim: int) -> tuple[Tensor, Tensor]:
    """``k3::mla_prefill_partial``: the prefill kernel over one DCP member's cache (rows
    mapped to global positions for the causal limit), or the op's torch reference for a
    shape it does not take; ``max_new_tokens`` read from cu_seqlens (a device sync;
    prefill runs eagerly)."""
    if not PREFILL.accepts(q.shape[1], q.dtype, q.shape[2], value_dim):
        return mla_ops.mla_prefill_partial_reference(q, kv_cache, block_table, cu_seqlens, seq_lens, position_offset,
                                                     dcp, interleave, scale, value_dim)
    return mla_prefill_absorbed(q, kv_cache, cu_seqlens, block_table, seq_lens, scale, value_dim,
                                split=(position_offset.reshape(1), dcp, interleave))


GENERIC = MLAKernel("mla_decode_generic", "decode", 1, _DTYPES, 576, 512, False, mla_decode_generic)
PREFILL = MLAKernel("mla_prefill_absorbed", "prefill", 1, _DTYPES, 576, 512, False, mla_prefill_absorbed)


def attention_aot_launches(target: str, qk_dim: int = 576, value_dim: int = 512,
                           dtype: torch.dtype = torch.bfloat16, kv_dtype: torch.dtype | None = None) -> list[KernelLaunch]:
    """The generic and prefill kernels as their launchers specialise them on ``target``
    ("hip" or "cuda") for a ``kv_dtype`` cache (default ``dtype``), for AOT checks."""
    t = TRITON_DTYPES[dtype]
    kv_dtype = kv_dtype or dtype
    fp8 = is_fp8_dtype(kv_dtype)
    launches = []
    for kernel, split in ((GENERIC, False), (PREFILL, False), (PREFILL, True)):
        c = _attention_constexprs(kernel, qk_dim, value_dim, dtype,
                                  default_block_n(kernel is not GENERIC, target, dtype), fp8, interpreted=False,
                                  context_split=split)
        ptrs = {"q_ptr": t, "kv_ptr": TRITON_DTYPES[kv_dtype], "cu_seqlens_ptr": "i32", "block_table_ptr": "i32",
                "seq_lens_ptr": "i32", "position_offset_ptr": "i64" if split else "i32", "o_ptr": t, "lse_ptr": "fp32"}
        name = kernel.name + ("_context_split" if split else "") + ("_fp8" if fp8 else "")
        launches.append(_kernel_launch(name, _mla_attention_kernel, ptrs, c, _NUM_WARPS,
                                       pointers_over_2gib=("kv_ptr",)))
    return launches
