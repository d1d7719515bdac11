"""The FAST MLA decode kernel (flash-decoding) and its split combine: what runs
``k3::mla_decode_split_kv``, and plain ``k3::mla_decode`` where it takes the head count.

``_mla_decode_split_kv_kernel``: grid (head tiles, KV splits, batch); a program takes
BLOCK_H heads of one sequence (all of them at 16, 32, 64 heads; 48 and 96 heads take
three head-tile programs, adjacent in the grid so that they read the same KV tiles close
together in time, the later ones from L2) against one of ``num_splits`` chunks of its
context, so that even batch 1 fills every CU/SM. Each program writes a partial (o, lse)
in fp32; ``_combine_splits_kernel`` merges the splits with LSE weights. Head counts must
be multiples of 16, the smallest head tile (``HEAD_TILE``). Launch choices (head tile, KV
tile, warps, pipeline stages, tensor-descriptor tiles, splits): :func:`split_kv_config`,
:func:`choose_num_splits`; :func:`_kv_descriptors` says where descriptors apply.

The split-KV kernel's tile math is one ``@triton.jit`` helper, ``_online_softmax_tile``,
shared by its two ways of loading KV tiles: tensor descriptors (TMA on sm_90: one bulk
copy per tile, whole tiles only) and masked pointer gathers (any block size; the partial
last tile of a context). (Under TRITON_INTERPRET helper calls leave ``triton.language``
patched; :func:`.aot.compile_many` then compiles in a fresh process.)

:data:`SPLIT_KV` declares what the kernel accepts; semantics and the family's overview
are in ``mla_decode.py``.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.tools.tensor_descriptor import TensorDescriptor

from k3compile.mla_cache_fp8 import cache_value_width, is_fp8_cache, is_fp8_dtype
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
from k3compile.runtime.kernels.targets import AMD_TARGETS, compute_units, device_target

#: what a KV split costs besides its KV tiles, in cache rows (1152 B each at K3's width),
#: for choose_num_splits: its fp32 partial (16 heads x 512 x 4 B = 32 KiB ~ 28 rows)
#: written and read back by the combine, the query load, and the latency of the first
#: tiles before the pipeline streams. An estimate: benchmarks/mla_decode.py --sweep
#: times the split counts around the choice.
SPLIT_OVERHEAD_TOKENS = 64
#: the most KV splits on sm_90 and for fp32 inputs (the H200 sweep's best at batch 1,
#: BENCHMARKS.md); the AMD configurations allow as many as the device holds resident
#: programs (SplitKVConfig.max_splits)
MAX_SPLITS = 256


# ---------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------


@triton.jit
def _online_softmax_tile(k_lat, k_pe, q_lat, q_pe, valid, m_i, l_i, acc, scale_log2, sc_lat, sc_pe,
                         P_TY: tl.constexpr, KV_FP8: tl.constexpr, DOT_PRECISION: tl.constexpr,
                         FP32_DOT: tl.constexpr):
    """One KV tile of the split-KV kernel: [BLOCK_N, *] latent / k_pe rows in the cache
    dtype (``valid`` marks those in the context) against the [*, BLOCK_H] query columns
    (already in the dot dtype); returns the updated running max m_i, sum l_i (log2
    domain) and [BLOCK_L, BLOCK_H] accumulator. The latent tile is also the value: the
    dots put the KV rows on the M side. Probabilities meet the values rounded to P_TY.

    KV_FP8: the rows are FP8 codes, converted to P_TY (fp16 under a 16-bit model: every
    code is an exact fp16 value) against queries of that dtype; sc_lat / sc_pe [BLOCK_N]
    are the rows' scales. A row's scale is a factor of its score terms and of its value,
    so it scales the [BLOCK_N, BLOCK_H] scores and probabilities, never the tiles."""
    dot_ty = tl.float32 if FP32_DOT else P_TY
    if KV_FP8:
        lat = k_lat.to(P_TY)
        s = tl.dot(lat.to(dot_ty), q_lat, input_precision=DOT_PRECISION) * sc_lat[:, None]
        s += tl.dot(k_pe.to(P_TY).to(dot_ty), q_pe, input_precision=DOT_PRECISION) * sc_pe[:, None]
    else:
        lat = k_lat
        s = tl.dot(k_lat.to(dot_ty), q_lat, input_precision=DOT_PRECISION)
        s = tl.dot(k_pe.to(dot_ty), q_pe, acc=s, input_precision=DOT_PRECISION)
    s = tl.where(valid[:, None], s * scale_log2, float("-inf"))
    # Every tile has a valid row, so m_new is finite: no -inf - -inf.
    m_new = tl.maximum(m_i, tl.max(s, axis=0))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[None, :])
    l_i = l_i * alpha + tl.sum(p, axis=0)
    p_v = p * sc_lat[:, None] if KV_FP8 else p
    acc = tl.dot(tl.trans(lat.to(dot_ty)), p_v.to(P_TY).to(dot_ty), acc=acc * alpha[None, :],
                 input_precision=DOT_PRECISION)
    return m_new, l_i, acc


# num_splits and the block table's width vary with batch and context; specialising them
# (multiple of 16 or not) would only compile the same kernel twice.
@counted
@triton.jit(do_not_specialize=["num_splits", "stride_btb"])
def _mla_decode_split_kv_kernel(
    q_ptr, kv_ptr, lat_desc, pe_desc, block_table_ptr, seq_lens_ptr, o_ptr, lse_ptr,
    scale_log2, num_heads, num_splits,
    stride_qb, stride_qh, stride_kvb, stride_kvt, stride_btb,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_ls,
    block_size,
    L: tl.constexpr, R: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, FP32_DOT: tl.constexpr,
    USE_TMA: tl.constexpr, GATHER_N: tl.constexpr, KV_FP8: tl.constexpr,
):
    """Program (head tile, KV split, sequence n): BLOCK_H heads of n against the split's
    share of n's context.

    The dots put the KV rows on the M side, the heads on N: s^T = K q^T [BLOCK_N, BLOCK_H]
    and o^T += V^T p^T [L, BLOCK_H]. On sm_90 the value product is then a wgmma with M =
    L = 512 whatever the head count, reading V^T straight from the shared-memory tile the
    pipeline loaded (the score product is a wgmma too at 64 KV rows, mma.sync at 32), and
    the query is a [W, BLOCK_H] operand staged in shared memory once. With the heads on
    M, 16 heads made both products mma.sync with the [16, 576] query held in every warp's
    registers (255 registers). On AMD the same source lowers to MFMA tiles, with fewer
    VGPRs than the heads-on-M form (AOT).
    FP32_DOT: as in _mla_attention_kernel (interpreter only).
    KV_FP8: an FP8 cache (k3compile/mla_cache_fp8.py): codes converted to fp16 in
    registers, each row's two scales loaded beside it, q moved into fp16's range by a power
    of two that the score scale takes back; fp16 dots, fp32 accumulation (see
    _online_softmax_tile). fp16, not the model's bf16: sm_90 converts E4M3 pairs to fp16
    in one instruction, to bf16 through fp32 (1.5x slower kernel, H200).
    USE_TMA: KV tiles through tensor descriptors (``lat_desc`` [rows, L] and ``pe_desc``
    [rows, W] over the cache's rows, see :func:`_kv_descriptors`): one bulk copy per
    tile instead of a 16-byte cp.async per thread and row, so the copy engine, not the
    warps, moves the bytes. A tile must lie in one cache block (block_size a multiple
    of BLOCK_N), and rows past the context are not masked by the copy: the last,
    partial tile's values are zeroed in registers. Else (``lat_desc`` / ``pe_desc``
    unused) masked gathers through pointers, any block size.
    o/lse: [B, H, splits, L] / [B, H, splits] fp32 partials, or with one split (stride_os
    = stride_ls = 0) the final [B, H, L] / [B, H] outputs."""
    head_tile = tl.program_id(0)
    split = tl.program_id(1)
    n = tl.program_id(2)
    ctx = tl.load(seq_lens_ptr + n)
    # This split's share of [0, ctx), in whole BLOCK_N tiles so that only the context's
    # last tile is partial; splits past the end get an empty range (o = 0, lse = -inf).
    per_split = tl.cdiv(tl.cdiv(ctx, num_splits), BLOCK_N) * BLOCK_N
    kv_start = split * per_split
    kv_end = tl.minimum(kv_start + per_split, ctx)

    heads = head_tile * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < num_heads  # a head tile wider than the heads left (a sweep's choice)
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    # the dots' dtype: the model's, or fp16 for an FP8 cache under a 16-bit model (its codes
    # are exact fp16 values)
    p_ty = tl.float16 if KV_FP8 and q_ptr.dtype.element_ty != tl.float32 else q_ptr.dtype.element_ty
    dot_ty = tl.float32 if FP32_DOT else p_ty
    q_col = q_ptr + n.to(tl.int64) * stride_qb + heads * stride_qh
    q_lat = tl.load(q_col[None, :] + offs_l[:, None], mask=head_ok[None, :] & (offs_l[:, None] < L), other=0.0)
    q_pe = tl.load(q_col[None, :] + L + offs_r[:, None], mask=head_ok[None, :] & (offs_r[:, None] < R), other=0.0)
    score_log2 = scale_log2
    if KV_FP8:
        # q into fp16's range by a power of two (exact): its largest |value| below 2^15
        q_max = tl.maximum(tl.max(tl.max(tl.abs(q_lat.to(tl.float32)), axis=1), axis=0),
                           tl.max(tl.max(tl.abs(q_pe.to(tl.float32)), axis=1), axis=0))
        q_shift = tl.maximum(tl.ceil(tl.log2(q_max)) - 14.0, 0.0)
        q_lat = q_lat.to(tl.float32) * tl.exp2(-q_shift)
        q_pe = q_pe.to(tl.float32) * tl.exp2(-q_shift)
        score_log2 = scale_log2 * tl.exp2(q_shift)  # the scores get it back; the values never had it
    q_lat = q_lat.to(p_ty).to(dot_ty)  # [BLOCK_L, BLOCK_H]: q^T
    q_pe = q_pe.to(p_ty).to(dot_ty)

    bt_row = block_table_ptr + n.to(tl.int64) * stride_btb
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_L, BLOCK_H], tl.float32)
    if USE_TMA:
        # Whole tiles by tensor descriptors, straight from the copy engine to the dots:
        # the context's last, partial tile is left to the loop below. (Zeroing its extra
        # rows inside this loop made Triton stage every tile through registers: 230
        # instead of 125 registers, one program per SM instead of two; AOT.)
        # One block id per tile: its rows are consecutive rows of one cache block.
        tail_start = kv_start + (kv_end - kv_start) // BLOCK_N * BLOCK_N
        block = tl.load(bt_row + kv_start // block_size, mask=kv_start < tail_start, other=0)
        for n0 in range(kv_start, tail_start, BLOCK_N):
            block_next = tl.load(bt_row + (n0 + BLOCK_N) // block_size, mask=n0 + BLOCK_N < tail_start, other=0)
            row0 = block * block_size + n0 % block_size
            k_lat = lat_desc.load([row0, 0])  # columns past L read as 0 (the descriptor's shape)
            k_pe = pe_desc.load([row0, L])  # columns past W read as 0
            whole = tl.full([BLOCK_N], True, tl.int1)
            sc_lat = tl.zeros([BLOCK_N], tl.float32)  # unused without KV_FP8
            sc_pe = sc_lat
            if KV_FP8:  # the tile's rows are consecutive rows of one block
                rows = kv_ptr + (row0 + tl.arange(0, BLOCK_N)).to(tl.int64) * stride_kvt
                sc_lat, sc_pe = _fp8_row_scales(rows, L + R, whole)
            m_i, l_i, acc = _online_softmax_tile(k_lat, k_pe, q_lat, q_pe, whole, m_i, l_i, acc, score_log2,
                                                 sc_lat, sc_pe, p_ty, KV_FP8, DOT_PRECISION, FP32_DOT)
            block = block_next
    else:
        tail_start = kv_start
    # Masked gathers through pointers, GATHER_N rows at a time: every tile without
    # USE_TMA (GATHER_N = BLOCK_N), else the context's last, partial tile, unpipelined
    # and in 16-row steps (a whole 32-row tile in registers spilled at 32 heads; a
    # descriptor load of it zeroed in registers spilled more; AOT). The block ids of a
    # tile are loaded one iteration ahead and carried through the loop. Loaded in the
    # same iteration, they make the KV load an indirect one, which Triton's pipeliner
    # gives a stage of its own: num_stages=3 then issued each KV tile only one
    # iteration ahead, after the previous tile's dots, so nothing overlapped them
    # (TTGIR). Carried, the KV load is issued two tiles ahead and streams while a tile
    # is computed.
    pos = tail_start + tl.arange(0, GATHER_N)
    block = tl.load(bt_row + pos // block_size, mask=pos < kv_end, other=0)
    for n0 in tl.range(tail_start, kv_end, GATHER_N, num_stages=1 if USE_TMA else None):
        pos = n0 + tl.arange(0, GATHER_N)
        valid = pos < kv_end
        block_next = tl.load(bt_row + (pos + GATHER_N) // block_size, mask=pos + GATHER_N < kv_end, other=0)
        kv_row = kv_ptr + block.to(tl.int64) * stride_kvb + (pos % block_size).to(tl.int64) * stride_kvt
        # Masked rows read as 0: an unwritten cache row may hold NaN, and 0 * NaN = NaN.
        k_lat = tl.load(kv_row[:, None] + offs_l[None, :], mask=valid[:, None] & (offs_l[None, :] < L), other=0.0)
        k_pe = tl.load(kv_row[:, None] + L + offs_r[None, :], mask=valid[:, None] & (offs_r[None, :] < R), other=0.0)
        sc_lat = tl.zeros([GATHER_N], tl.float32)  # unused without KV_FP8
        sc_pe = sc_lat
        if KV_FP8:
            sc_lat, sc_pe = _fp8_row_scales(kv_row, L + R, valid)
        m_i, l_i, acc = _online_softmax_tile(k_lat, k_pe, q_lat, q_pe, valid, m_i, l_i, acc, score_log2,
                                             sc_lat, sc_pe, p_ty, KV_FP8, DOT_PRECISION, FP32_DOT)
        block = block_next

    # An empty range leaves l = 0, m = -inf: o = 0 and lse = -inf + log2(0) = -inf.
    o_col = o_ptr + n.to(tl.int64) * stride_ob + heads * stride_oh + split * stride_os
    o = tl.where(l_i[None, :] > 0, acc / l_i[None, :], 0.0)
    tl.store(o_col[None, :] + offs_l[:, None], o, mask=head_ok[None, :] & (offs_l[:, None] < L))
    lse = (m_i + tl.log2(l_i)) * _LN2
    tl.store(lse_ptr + n.to(tl.int64) * stride_lb + heads * stride_lh + split * stride_ls, lse, mask=head_ok)


@counted
@triton.jit(do_not_specialize=["num_splits"])
def _combine_splits_kernel(
    o_part_ptr, lse_part_ptr, o_ptr, lse_ptr,
    stride_pb, stride_ph, stride_ps, stride_lpb, stride_lph,
    stride_ob, stride_oh, stride_lb, stride_lh,
    num_splits,
    L: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """Program (b, h, BLOCK_L of the L value columns): o = sum_s exp(lse_s - lse) o_s,
    lse = ln sum_s exp(lse_s). Empty splits have lse_s = -inf and weigh 0; all empty
    gives o = 0, lse = -inf.

    [BLOCK_S splits, BLOCK_L columns] per step: many loads in flight per program and
    B x H x L / BLOCK_L programs, so that batch 1 with hundreds of splits takes a few
    latency-bound steps (this kernel used to take one split's row per step: 132 dependent
    round trips to L2 per program at batch 1, with only B x H = 16 programs). Block shapes:
    :func:`_combine_constexprs`."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    chunk = tl.program_id(2)
    offs_s = tl.arange(0, BLOCK_S)
    offs_l = chunk * BLOCK_L + tl.arange(0, BLOCK_L)
    lse_row = lse_part_ptr + b * stride_lpb + h * stride_lph
    m = tl.full([BLOCK_S], float("-inf"), tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        m = tl.maximum(m, tl.load(lse_row + s0 + offs_s, mask=s0 + offs_s < num_splits, other=float("-inf")))
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # all splits empty: weights exp(-inf) = 0, not NaN
    total = tl.zeros([BLOCK_S], tl.float32)
    acc = tl.zeros([BLOCK_L], tl.float32)
    part = o_part_ptr + b * stride_pb + h * stride_ph
    for s0 in range(0, num_splits, BLOCK_S):
        split = s0 + offs_s
        w = tl.exp(tl.load(lse_row + split, mask=split < num_splits, other=float("-inf")) - m_max)
        total += w
        o_s = tl.load(part + split[:, None] * stride_ps + offs_l[None, :],
                      mask=(split[:, None] < num_splits) & (offs_l[None, :] < L), other=0.0)
        acc += tl.sum(w[:, None] * o_s, axis=0)
    total_sum = tl.sum(total, axis=0)
    o = tl.where(total_sum > 0, acc / total_sum, 0.0)
    tl.store(o_ptr + b * stride_ob + h * stride_oh + offs_l, o, mask=offs_l < L)
    tl.store(lse_ptr + b * stride_lb + h * stride_lh, m_max + tl.log(total_sum), mask=chunk == 0)


# ---------------------------------------------------------------------------------------
# Launch configuration (shared by the launcher and the AOT check)
# ---------------------------------------------------------------------------------------


#: the split combine: one warp (see _combine_constexprs)
_COMBINE_WARPS = 1


#: 64-row KV tiles gave wrong outputs (1 stage) and illegal memory accesses (H=32) on an
#: H200 in the launch sweep, by tensor descriptors too (Triton 3.6; the score product is a
#: wgmma there); until that is understood the launcher refuses them on NVIDIA GPUs (AMD
#: compiles another kernel: its limits come from its own resources, issue #24).
MAX_SPLIT_KV_BLOCK_N = 32


@dataclass(frozen=True)
class SplitKVConfig:
    """Launch choices of the split-KV decode kernel (benchmarks/mla_decode.py --sweep
    times alternatives on a GPU)."""

    block_h: int  # heads per program, the N side of the dots: a power of two >= 16
    block_n: int  # KV rows per tile, the M side of the score dot: a power of two >= 16
    num_warps: int
    num_stages: int  # pipeline depth of the KV loop: 3 issues each tile's loads two tiles ahead
    programs_per_sm: int  # resident programs per SM / CU at this configuration (AOT occupancy)
    #: KV tiles by tensor descriptors (TMA on sm_90) where the cache allows, see
    #: :func:`_kv_descriptors`; else, and always when False, pointer gathers
    tma: bool = False
    #: the most KV splits :func:`choose_num_splits` picks; None: as many as the device
    #: holds resident programs (units x programs_per_sm: one wave of a batch-1 step whose
    #: heads fit one head tile)
    max_splits: int | None = MAX_SPLITS


#: sm_90 launches with an FP8 cache, by head tile: the fastest of an H200 sweep
#: (benchmarks/mla_decode_fp8.py --sweep, BENCHMARKS.md) at 12 heads padded to 16 and 24
#: padded to 32, batch 1 and 16, 128K; the 64-head tile's is not timed. The converted
#: tiles live in registers: 255 registers and some spilled (AOT), where bf16 tiles go from
#: shared memory to the dots.
FP8_CUDA_CONFIGS = {
    16: SplitKVConfig(16, 32, 4, 3, 2),
    32: SplitKVConfig(32, 16, 4, 3, 2, tma=True),
    64: SplitKVConfig(64, 16, 8, 3, 1, tma=True),
}


def split_kv_head_tiles(target: str, dtype: torch.dtype = torch.bfloat16) -> tuple[int, ...]:
    """The head tiles :func:`split_kv_config` uses on ``target``. 64 heads hold a [512,
    64] fp32 accumulator, which fits sm_90's 8 warps but spills VGPRs on AMD (gfx942 /
    gfx950, AOT). fp32 inputs (dots without matrix units) take 16: 32 spills on sm_90
    and gfx942."""
    if dtype == torch.float32:
        return (16,)
    return (16, 32, 64) if target == "sm_90" else (16, 32)


def split_kv_config(target: str, num_heads: int, dtype: torch.dtype = torch.bfloat16,
                    kv_dtype: torch.dtype | None = None) -> SplitKVConfig:
    """The split-KV kernel's launch for ``num_heads`` (a multiple of 16) on ``target``, for
    ``dtype`` queries and a ``kv_dtype`` cache (default ``dtype``).

    Head tile: the widest of :func:`split_kv_head_tiles` that divides ``num_heads``, so
    no padded head is computed: 16, 32, 64 heads take one program per (sequence, split),
    48 and 96 three (of 16 / 32), adjacent in the grid, so the KV tile the first reads
    from HBM the others mostly find in L2.

    sm_90 (bf16, 576/512): 32 KV rows per tile by tensor descriptors (TMA), 3 stages:
    Triton keeps two [32, 576] tiles in flight, each one bulk copy. The H200 sweep
    (BENCHMARKS.md): at 16 heads 1.5x faster than cp.async pointer gathers at batch 16
    (86% / 96% of copy bandwidth at 32K / 128K, from 58% / 64%); at 32 heads 32-row
    tiles beat 16 (the pointer kernel preferred 16); 8 warps and 2 or 4 stages were
    slower. AOT: 16 heads 91 KiB of shared memory, 167 registers, 2 programs per SM; 32
    heads 110 KiB, 254 registers, 2 per SM; 64 heads, 8 warps (two warpgroups split the
    [512, 64] accumulator): 148 KiB, 1 per SM. 64-row tiles are refused
    (MAX_SPLIT_KV_BLOCK_N).
    AMD: 32-row tiles, no software pipeline (its buffers cost VGPRs on gfx942), 4 warps;
    16 heads: 237 / 246 VGPRs (gfx942 / gfx950), 2 waves per SIMD; 32 heads: 401 / 468,
    1 wave. fp32 inputs (twice the bytes per row, dots without matrix units): 16 rows, 8
    warps, no spills anywhere. AMD and fp32: chosen from compiler reports, not timed.

    An FP8 cache (k3compile/mla_cache_fp8.py): its tiles are converted to the model dtype
    in registers, which costs registers. AMD: the same tiles, 340 / 326 VGPRs at 16 heads
    (gfx950 / gfx942; 16-row tiles still 260 / 311), so 1 wave per SIMD. sm_90: see
    :data:`FP8_CUDA_CONFIGS`."""
    tiles = split_kv_head_tiles(target, dtype)
    block_h = max((t for t in tiles if num_heads % t == 0), default=HEAD_TILE)
    if dtype == torch.float32:
        return SplitKVConfig(block_h, 16, 8, 1, 1)
    if target in AMD_TARGETS:
        fp8 = kv_dtype is not None and is_fp8_dtype(kv_dtype)
        return SplitKVConfig(block_h, 32, 4, 1, 2 if block_h == 16 and not fp8 else 1, max_splits=None)
    if kv_dtype is not None and is_fp8_dtype(kv_dtype):
        return FP8_CUDA_CONFIGS[block_h]
    if block_h == 64:
        return SplitKVConfig(block_h, 32, 8, 3, 1, tma=True)
    return SplitKVConfig(block_h, 32, 4, 3, 2, tma=True)


def _split_kv_constexprs(config: SplitKVConfig, qk_dim: int, value_dim: int, dtype: torch.dtype,
                         use_tma: bool, kv_fp8: bool, interpreted: bool = _INTERPRETED) -> dict[str, object]:
    return {**_widths(qk_dim, value_dim), "BLOCK_H": config.block_h, "BLOCK_N": config.block_n,
            **_dot_constexprs(dtype, interpreted), "USE_TMA": use_tma,
            "GATHER_N": HEAD_TILE if use_tma else config.block_n,  # 16: the smallest dot
            "KV_FP8": kv_fp8}


def _kv_descriptors(kv_cache: Tensor, value_dim: int, block_n: int) -> tuple[TensorDescriptor, TensorDescriptor] | None:
    """Tensor descriptors of the split-KV kernel's USE_TMA loads over the cache's rows
    [num_blocks * block_size, W]: the latent part (shape [rows, L], tiles [block_n,
    BLOCK_L]: columns past L read as 0) and the k_pe part (shape [rows, W], tiles
    [block_n, BLOCK_R] at column L). None where the cache does not allow them: blocks
    not stored back to back, a block size that is not a multiple of ``block_n`` (a tile
    must lie in one block), rows or base not 16-byte aligned (TMA), or a CUDA device
    without TMA (before sm_90)."""
    num_blocks, block_size, W = *kv_cache.shape[:2], cache_value_width(kv_cache)
    if kv_cache.is_cuda and not _INTERPRETED and torch.cuda.get_device_capability(kv_cache.device)[0] < 9:
        return None
    if kv_cache.is_cuda and device_target(kv_cache.device) in AMD_TARGETS:  # plain loads: measured only so
        return None
    rows_contiguous = kv_cache.stride(0) == block_size * kv_cache.stride(1) and kv_cache.stride(2) == 1
    aligned = kv_cache.data_ptr() % 16 == 0 and (kv_cache.stride(1) * kv_cache.element_size()) % 16 == 0
    if not (rows_contiguous and aligned and block_size % block_n == 0 and num_blocks > 0):
        return None
    widths = _widths(W, value_dim)
    rows, row_stride = num_blocks * block_size, kv_cache.stride(1)
    return (TensorDescriptor(kv_cache, [rows, value_dim], [row_stride, 1], [block_n, widths["BLOCK_L"]]),
            TensorDescriptor(kv_cache, [rows, W], [row_stride, 1], [block_n, widths["BLOCK_R"]]))


def _combine_constexprs(value_dim: int, num_splits: int) -> dict[str, object]:
    """[BLOCK_S splits, BLOCK_L columns] fp32 per step, 4096 values on one warp
    (_COMBINE_WARPS): the fastest shape of an H200 sweep (fifth session, partials in L2,
    BENCHMARKS.md) at 16 to 256 splits, 1.6-2.6x faster than the [64, 64] steps on 4 warps
    it replaced (batch 1, 16 heads: 128 splits 4.2 -> 2.5 us, 256 splits 6.6 -> 3.4 us;
    batch 16, 16 splits: 7.7 -> 2.9 us)."""
    block_s = min(128, max(32, triton.next_power_of_2(num_splits)))
    return {"L": value_dim, "BLOCK_L": min(128, triton.next_power_of_2(value_dim), 4096 // block_s),
            "BLOCK_S": block_s}


# ---------------------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------------------


def _compute_units(device: torch.device) -> int:
    # the CPU interpreter: 8, any small number exercises the split path
    return compute_units(device) if device.type == "cuda" else 8


@functools.lru_cache(maxsize=4096)
def choose_num_splits(batch: int, num_heads: int, max_context: int, num_sms: int, config: SplitKVConfig) -> int:
    """KV splits for the split-KV kernel, from a cost model of its launch.

    The batch x head tiles x splits programs run in waves of num_sms x
    ``config.programs_per_sm`` resident programs; a wave lasts as long as one program's
    KV rows plus SPLIT_OVERHEAD_TOKENS. The cost, waves x (rows per split + overhead),
    is the least when the splits fill the last wave and are no shorter than needed: one
    wave of whole programs where possible (batch 16 at 32K on 132 SMs x 2: 16 splits,
    256 programs; batch 1: 256 splits of 128 rows), more waves only where the split
    length they save is worth a program's overhead. The least cost with the fewest
    splits wins (fewer partials). On an H200 (fifth session) each choice was the fastest
    of the counts measured or within 3% of it (batch 1 at 32K: 256 splits 21.8 us, 128
    21.3 us, 147 or 192 (one or two programs per SM) 25-27 us). At most
    ``config.max_splits`` (on AMD one wave of resident programs: 512 at batch 1 on an
    MI355X, where the H200's cap of 256 left half its slots empty). ``max_context`` is the
    block table's capacity, a static bound (CUDA graphs); ``config`` the launch
    (:func:`split_kv_config`)."""
    programs = batch * triton.cdiv(num_heads, config.block_h)
    slots = num_sms * config.programs_per_sm
    cap = config.max_splits or slots
    best, best_cost = 1, None
    for splits in range(1, min(cap, triton.cdiv(max_context, config.block_n)) + 1):
        rows = triton.cdiv(triton.cdiv(max_context, splits), config.block_n) * config.block_n  # as the kernel cuts
        cost = triton.cdiv(programs * splits, slots) * (rows + SPLIT_OVERHEAD_TOKENS)
        if best_cost is None or cost < best_cost:
            best, best_cost = splits, cost
    return best


def mla_decode_split_kv(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, scale: float,
                        value_dim: int = 512, num_splits: int | None = None, num_sms: int | None = None,
                        block_n: int | None = None, config: SplitKVConfig | None = None) -> tuple[Tensor, Tensor]:
    """FAST decode: q [B, H, W] with H a multiple of 16 -> (o [B, H, value_dim] in q.dtype,
    lse [B, H] fp32). ``config`` (head tile, KV tile, warps, stages) defaults to
    :func:`split_kv_config`, ``block_n`` (KV rows per tile, a power of two >= 16)
    overrides its KV tile; ``num_splits`` defaults to :func:`choose_num_splits` for
    ``num_sms`` (default: the device's CU/SM count)."""
    _check_decode_batch(SPLIT_KV.name, q, seq_lens)
    _check_inputs(SPLIT_KV, q, kv_cache, block_table, seq_lens, value_dim)
    cfg = config or split_kv_config(device_target(q.device), q.shape[1], q.dtype, kv_cache.dtype)
    if block_n is not None:
        cfg = dataclasses.replace(cfg, block_n=block_n)
    if cfg.block_n > MAX_SPLIT_KV_BLOCK_N and q.is_cuda and device_target(q.device) == "sm_90":
        raise ValueError(
            f"{SPLIT_KV.name}: KV tiles of {cfg.block_n} rows are not supported (at most {MAX_SPLIT_KV_BLOCK_N}): "
            "64-row tiles gave wrong results and illegal memory accesses on an H200 (issue #6)"
        )
    if num_splits is None:
        units = num_sms if num_sms is not None else _compute_units(q.device)
        num_splits = choose_num_splits(q.shape[0], q.shape[1], block_table.shape[-1] * kv_cache.shape[1], units, cfg)
    if not 1 <= num_splits <= 4096:
        raise ValueError(f"{SPLIT_KV.name}: num_splits must be in 1..4096, got {num_splits}")
    q = q if q.stride(-1) == 1 else q.contiguous()
    B, H, W = q.shape
    o = _empty((B, H, value_dim), q.dtype, q.device)
    lse = _empty((B, H), torch.float32, q.device)
    if B == 0:
        return o, lse
    if num_splits == 1:  # the programs' results are final: no partials, no combine
        o_part, lse_part = o, lse
        o_strides, lse_strides = (*o.stride()[:2], 0), (*lse.stride(), 0)
    else:
        o_part = _empty((B, H, num_splits, value_dim), torch.float32, q.device)
        lse_part = _empty((B, H, num_splits), torch.float32, q.device)
        o_strides, lse_strides = o_part.stride()[:3], lse_part.stride()
    # head tiles fastest: the programs that read the same KV tiles run together (L2)
    descriptors = _kv_descriptors(kv_cache, value_dim, cfg.block_n) if cfg.tma else None
    lat_desc, pe_desc = descriptors or (None, None)
    grid = (triton.cdiv(H, cfg.block_h), num_splits, B)
    _mla_decode_split_kv_kernel[grid](
        q, kv_cache, lat_desc, pe_desc, block_table, seq_lens, o_part, lse_part,
        scale * LOG2E, H, num_splits,
        q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), block_table.stride(0),
        *o_strides, *lse_strides,
        kv_cache.shape[1],
        **_split_kv_constexprs(cfg, W, value_dim, q.dtype, descriptors is not None, is_fp8_cache(kv_cache)),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if num_splits > 1:
        c = _combine_constexprs(value_dim, num_splits)
        _combine_splits_kernel[(B, H, triton.cdiv(value_dim, c["BLOCK_L"]))](
            o_part, lse_part, o, lse,
            *o_part.stride()[:3], *lse_part.stride()[:2], *o.stride()[:2], *lse.stride(),
            num_splits, **c, num_warps=_COMBINE_WARPS,
        )
    return o, lse


SPLIT_KV = MLAKernel("mla_decode_split_kv", "decode", HEAD_TILE, _DTYPES, 576, 512, True, mla_decode_split_kv)


def split_kv_aot_launches(target: str, qk_dim: int = 576, value_dim: int = 512,
                          dtype: torch.dtype = torch.bfloat16, kv_dtype: torch.dtype | None = None) -> list[KernelLaunch]:
    """The split-KV kernel as :func:`mla_decode_split_kv` specialises it on ``target``
    ("hip" or "cuda") for a ``kv_dtype`` cache (default ``dtype``; an FP8 format: the FP8
    layout), for AOT checks: once per head tile (``mla_decode_split_kv_h16`` ...)."""
    t = TRITON_DTYPES[dtype]
    kv_dtype = kv_dtype or dtype
    kv, fp8 = TRITON_DTYPES[kv_dtype], is_fp8_dtype(kv_dtype)
    launches = []
    for block_h in split_kv_head_tiles(target, dtype):
        cfg = split_kv_config(target, block_h, dtype, kv_dtype)
        c = _split_kv_constexprs(cfg, qk_dim, value_dim, dtype, cfg.tma, fp8, interpreted=False)
        ptrs = {"q_ptr": t, "kv_ptr": kv, "block_table_ptr": "i32", "seq_lens_ptr": "i32",
                "o_ptr": "fp32", "lse_ptr": "fp32"}  # fp32 partials
        if cfg.tma:  # the descriptors of _kv_descriptors
            w = _widths(qk_dim, value_dim)
            typed = {"lat_desc": f"tensordesc<{kv}[{cfg.block_n}, {w['BLOCK_L']}]>",
                     "pe_desc": f"tensordesc<{kv}[{cfg.block_n}, {w['BLOCK_R']}]>"}
        else:
            typed, c = {}, {**c, "lat_desc": None, "pe_desc": None}
        name = f"{SPLIT_KV.name}_h{block_h}" + ("_fp8" if fp8 else "")
        launches.append(_kernel_launch(name, _mla_decode_split_kv_kernel, ptrs, c, cfg.num_warps, cfg.num_stages,
                                       typed, pointers_over_2gib=("kv_ptr",)))
    return launches


def combine_aot_launch(value_dim: int = 512, dtype: torch.dtype = torch.bfloat16, num_splits: int = 64) -> KernelLaunch:
    """The split combine as :func:`mla_decode_split_kv` launches it after ``num_splits``
    splits, for AOT checks."""
    t = TRITON_DTYPES[dtype]
    c = _combine_constexprs(value_dim, num_splits)
    ptrs = {"o_part_ptr": "fp32", "lse_part_ptr": "fp32", "o_ptr": t, "lse_ptr": "fp32"}
    return _kernel_launch("mla_decode_combine_splits", _combine_splits_kernel, ptrs, c, _COMBINE_WARPS)
