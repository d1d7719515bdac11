"""Routed-expert kernels: the MXFP4 experts of a latent MoE (routing: ``routing.py``).

Semantics are those of ``torch.ops.k3.moe_experts_mxfp4`` (k3compile/ops/moe.py, whose torch references are the
numerical truth). Expert weights stay as the checkpoint stores them
(k3compile/checkpoint/mxfp4.py): E2M1 codes two per byte (low nibble = even input
column) and one E8M0 scale byte per 32 input columns, stacked over experts; they are
decoded in registers, on one of two units:

- the matrix unit: ``tl.dot_scaled(w, w_scale, "e2m1", x^T, None, "bf16")`` with the
  WEIGHT ROWS ON THE M SIDE and the tokens (pairs) on the N side, padded to 16 under masks
  (sm_90: an e2m1 -> bf16 upcast in registers feeding the MMA; gfx950:
  ``v_cvt_scalef32_pk_bf16_fp4`` + bf16 MFMA; gfx942: a software upcast);
- the vector units (``_mxfp4_fma_step``, one pair per program): codes read as int32 words,
  two codes per register decoded to fp16 bit patterns by shifts and masks, converted to
  fp32 and multiplied into fp32 sums per 32-value group, which the group's scale then
  multiplies. No shared memory: on the H200 it ran 2.7x (batch 1) to 2.1x (T = 64) faster
  than the matrix unit (docs/kernels.md).

Kernels (every one runs inside CUDA graphs: no host synchronisation, grids sized from
shapes only, for the worst case, with early exit):

- ``_expert_gemm_kernel``: one source for both products. GLU: ``h[p] = situ_glu(W1[e] z_t,
  W3[e] z_t)`` stored in z's dtype; else ``y[p] = W2[e] h[p]`` in fp32 (p = t * top_k + k
  is a (token, slot) pair, e = ids[p]). Grid (pair rows, weight-row tiles): a program reads
  one [BLOCK_N, KD] slab of its expert's weights once and multiplies every pair row of its
  tile with it. PAIR-MAJOR (decode): a program is one pair, on the vector units
  (``BLOCK_M`` 1) or as one real column of 16 on the matrix unit; no sorting, so no extra
  launch. GROUPED (``GROUPED`` constexpr): a program is BLOCK_M pairs
  of ONE expert from the align kernel's table, so an expert's slab is read once per
  BLOCK_M pairs; unused blocks of the worst-case grid exit at once. Pair rows are the
  fastest grid axis, so the programs of one weight slab run together (grouped: the blocks
  of one expert share the slab in L2). Loads: the codes through Triton's software
  pipeline (cp.async on sm_90); the scales as int32 words of four groups when KD and
  BLOCK_K are multiples of 128 (as bytes Triton loads them one by one, synchronously, and
  every K step would wait for them); the x tile one step ahead by hand for wgmma-sized
  tiles (``_prefetch_x``: Triton does not pipeline it there). w13 may split K
  (``SPLIT_K``): the last split to arrive at its tile's counter sums the partials in split
  order and finishes the SiTU-GLU. A warp's MMA tile is 16 weight rows: 16-row tiles run
  one warp per program (with more, every warp decodes the same tile).
- :func:`align_pairs` (grouped only, torch ops): groups the pairs by expert: a stable sort
  of the ids (an expert's pairs stay in pair order, so the layout, and the result, are
  deterministic), per-expert counts padded to multiples of BLOCK_M, per-block expert ids
  (-1 for the unused blocks of the worst-case grid ``cdiv(P, BLOCK_M) + min(E, P)``), each
  pair's slot = its expert's first slot + its rank among the expert's pairs. Padding slots
  hold the sentinel P. (A single-program Triton kernel did this before: 91 ns a pair, 48
  ms at a 32K-token prefill's 524,288 pairs; BENCHMARKS.md.)
- ``_combine_kernel``: ``out[t] = sum_k weights[t, k] * y[t * top_k + k]`` in fp32, in k
  order (no atomics: deterministic), stored in z's dtype; 1024 columns of a token per
  program.

Launches: experts pair-major 3 (w13, w2, combine), grouped the align's torch ops and the
same three. The path and tiles come from a per-target :class:`MoePlan` table
(:func:`choose_plan`): pair-major below ``grouped_min_pairs`` pairs (T * top_k).

Numerics: the weights enter the matrix unit as exact bf16 values (E2M1 x 2^k), bf16 z and
h as they are, fp16 / fp32 z and h as two bf16 parts (the value rounded, then the
remainder: about 16 significant bits, so fp32 artifacts stay close to their fp32
reference); products accumulate in fp32. The vector units multiply exact fp32 weights
(2^-14 x E2M1, the 2^14 and the scale applied to each group's sum: powers of two) by x in
fp32, accumulating in fp32. The SiTU-GLU runs in fp32 on the fp32
accumulators (the reference rounds W1 z and W3 z to z's dtype first), h is rounded to z's
dtype, y = W2 h stays fp32, the k sum is fp32, the output is rounded once to z's dtype.
Under TRITON_INTERPRET (CPU tests) the kernels round to bf16 by hand (see ``_combine_kernel``): the
interpreter's own fp32 -> bf16 cast truncates where GPUs round to nearest even.
(Helpers are inlined and ``tl.full`` used for ``tl.zeros``: the interpreter pays ~3 ms for
each call of a ``@triton.jit`` function, ``tl.zeros`` included.)

Workspaces come from ``torch.empty`` on the caller's stream (the graph's pool under
capture): h [P, I] (z dtype), y [P, D] fp32 (P = T * top_k; 59 MB at T = 256 and K3's
D = 3584), and for grouped launches the align tables (int32). Requirements (checked):
contiguous uint8 weights, D and I multiples of 32, ids in [0, E) (not checked: that
would need a host sync), top_k <= E.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.jit import JITFunction

from k3compile.runtime.kernels.aot import TRITON_DTYPES, KernelLaunch, launch_signature
from k3compile.runtime.kernels import counted, routing
from k3compile.runtime.kernels.counters import ArrivalCounters
from k3compile.runtime.kernels.moe_plans import (  # noqa: F401  (the plans are part of this module's API)
    PLANS, GemmPlan, MoePlan, TargetPlans, _check_plan, _fit, choose_plan, grouped_blocks,
)
from k3compile.runtime.kernels.targets import device_target

COMBINE_BLOCK = 1024  # output columns per combine program, one token each (56 registers on sm_90, 62 VGPRs on
# gfx950; 4 tokens: 144 / 260); 4 tokens per program under the interpreter, whose cost is per program


# --------------------------------------------------------------------------- kernels


@triton.jit
def _mxfp4_step(acc, w_ptrs, s_ptrs, rows_ok, x, x_lo, s_other, shifts, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, SCALE_WORDS: tl.constexpr, TWO_PARTS: tl.constexpr):
    """acc += W @ x for one K step of one weight: codes [BLOCK_N, BLOCK_K / 2], scales as
    bytes or as int32 words of four groups, x^T [BLOCK_K, BLOCK_M] in bf16 (plus its
    remainder with TWO_PARTS)."""
    w = tl.load(w_ptrs, mask=rows_ok[:, None], other=0)
    s = tl.load(s_ptrs, mask=rows_ok[:, None], other=s_other)
    if SCALE_WORDS:
        s = tl.reshape((s[:, :, None] >> shifts) & 0xFF, [BLOCK_N, BLOCK_K // 32]).to(tl.uint8)
    acc = tl.dot_scaled(w, s, "e2m1", x, None, "bf16", acc)
    if TWO_PARTS:
        acc = tl.dot_scaled(w, s, "e2m1", x_lo, None, "bf16", acc)
    return acc


@triton.jit
def _mxfp4_fma_step(acc, q, s, x_ptrs, shifts, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    SCALE_WORDS: tl.constexpr):
    """acc[BLOCK_N, BLOCK_K / 32] += (W codes . x) * scale per 32-value group, on the vector
    units: codes q as int32 words of 8 values [BLOCK_N, BLOCK_K / 8], scales s as bytes or
    words; x_ptrs [1, BLOCK_K / 8]: the first x value of each word. An E2M1 code's sign, exponent and mantissa bits placed
    at the low end of fp16's fields are an fp16 of 2^-14 times the E2M1 value (0.5 becomes
    an fp16 subnormal, exact), so a code decodes in a few integer operations and one
    fp16 -> fp32 conversion; 2^14 and the group's E8M0 scale multiply the group's sum."""
    if SCALE_WORDS:
        s = tl.reshape((s[:, :, None] >> shifts) & 0xFF, [BLOCK_N, BLOCK_K // 32])
    word = tl.full([BLOCK_N, BLOCK_K // 8], 0.0, tl.float32)
    for i in tl.static_range(4):  # codes i and i + 4 of each word at once, in its two 16-bit halves
        if i < 3:
            mag = q << (9 - 4 * i)
        else:
            mag = q >> 3
        bits = (mag & 0x0E000E00) | ((q << (12 - 4 * i)) & -2147450880)  # -2147450880 = 0x80008000
        lo = bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = (bits >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        word += lo * tl.load(x_ptrs + i).to(tl.float32)  # two statements: two fused multiply-adds
        word += hi * tl.load(x_ptrs + i + 4).to(tl.float32)
    group = tl.sum(tl.reshape(word, [BLOCK_N, BLOCK_K // 32, 4]), axis=2)
    e = s.to(tl.int32)
    scale = tl.where(e == 0, 5.877471754111438e-39, (e << 23).to(tl.float32, bitcast=True))  # 2^(e - 127)
    return acc + group * 16384.0 * scale


@counted
@triton.jit
def _expert_gemm_kernel(
    x_ptr,  # GLU: z [T, KD]; else h [P, KD]
    ids_ptr,  # [P] expert of each pair (pair-major)
    sorted_ptr,  # [blocks * BLOCK_M] pair of each grouped column, P = padding (grouped)
    block_expert_ptr,  # [blocks] expert of each block, -1 = unused (grouped)
    wa_ptr, sa_ptr,  # packed codes [E, N, KD / 2] and scales [E, N, KD / 32]: w1, or w2
    wb_ptr, sb_ptr,  # w3 (GLU only)
    out_ptr,  # GLU: h [P, N] in z's dtype; else y [P, N] fp32
    ws_ptr,  # SPLIT_K > 1: fp32 partials [SPLIT_K, tiles, 2, BLOCK_N, BLOCK_M]
    counter_ptr,  # SPLIT_K > 1: int32 arrival counter per tile, zero between launches
    P, N, KD, beta, linear_beta,
    TOP_K: tl.constexpr, GLU: tl.constexpr, GROUPED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_WORDS: tl.constexpr,
    PREFETCH_X: tl.constexpr, ROUND_BY_HAND: tl.constexpr, SPLIT_K: tl.constexpr,
):
    """Program (pair row tile, weight row tile, K split): acc[BLOCK_N, BLOCK_M] = W[e, rows, :]
    @ x^T over its share of KD in BLOCK_K steps (KD % BLOCK_K == 0). With SPLIT_K > 1 (GLU
    only) each split stores its partial sums, and the last to arrive at the tile's counter
    adds them in split order (deterministic) and finishes the SiTU-GLU."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    cols = tl.arange(0, BLOCK_M)
    if GROUPED:
        e = tl.load(block_expert_ptr + pid_m)
        if e < 0:
            return
        pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + cols)
        ok = pairs < P
    else:
        e = tl.load(ids_ptr + pid_m).to(tl.int32)
        pairs = pid_m + cols * 0
        ok = cols == 0
    if GLU:
        xrow = pairs // TOP_K  # the pair's token
    else:
        xrow = pairs
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_ok = rows < N
    w_rows = e.to(tl.int64) * N + rows  # [BLOCK_N] rows of the stacked [E * N, ...] weight
    FMA: tl.constexpr = BLOCK_M == 1  # one pair, no matrix unit: products on the vector units
    if FMA:  # codes as int32 words of 8 values
        w_off = w_rows[:, None] * (KD // 8) + tl.arange(0, BLOCK_K // 8)[None, :]
        wa_ptr = wa_ptr.to(tl.pointer_type(tl.int32))
        wb_ptr = wb_ptr.to(tl.pointer_type(tl.int32))
        w_step: tl.constexpr = BLOCK_K // 8
    else:
        w_off = w_rows[:, None] * (KD // 2) + tl.arange(0, BLOCK_K // 2)[None, :]
        w_step: tl.constexpr = BLOCK_K // 2
    # A row's scales of one step are only BLOCK_K / 32 bytes: as bytes, Triton loads them one
    # by one and synchronously (its software pipeline takes loads of 4+ bytes), so every
    # step would wait for them. SCALE_WORDS (KD and BLOCK_K multiples of 128): int32 words
    # of 4 scale bytes, split in registers (little endian: byte j is group j).
    if SCALE_WORDS:
        s_off = w_rows[:, None] * (KD // 128) + tl.arange(0, BLOCK_K // 128)[None, :]
        sa_ptr = sa_ptr.to(tl.pointer_type(tl.int32))
        sb_ptr = sb_ptr.to(tl.pointer_type(tl.int32))
        s_step: tl.constexpr = BLOCK_K // 128
        s_other: tl.constexpr = 0x7F7F7F7F
    else:
        s_off = w_rows[:, None] * (KD // 32) + tl.arange(0, BLOCK_K // 32)[None, :]
        s_step: tl.constexpr = BLOCK_K // 32
        s_other: tl.constexpr = 127
    shifts = (tl.arange(0, 4) * 8)[None, None, :]
    TWO_PARTS: tl.constexpr = x_ptr.dtype.element_ty != tl.bfloat16 and not FMA
    if FMA:  # the first x value of each code word
        x_off = xrow.to(tl.int64)[:, None] * KD + tl.arange(0, BLOCK_K // 8)[None, :] * 8
        acc_a = tl.full([BLOCK_N, BLOCK_K // 32], 0.0, tl.float32)  # per group of 32 until the end
        acc_b = tl.full([BLOCK_N, BLOCK_K // 32], 0.0, tl.float32)
    else:
        x_off = xrow.to(tl.int64)[None, :] * KD + tl.arange(0, BLOCK_K)[:, None]  # x^T tile [BLOCK_K, BLOCK_M]
        acc_a = tl.full([BLOCK_N, BLOCK_M], 0.0, tl.float32)  # tl.full, not tl.zeros: a builtin (cheap interpreted)
        acc_b = tl.full([BLOCK_N, BLOCK_M], 0.0, tl.float32)
    steps = KD // BLOCK_K
    k_lo = 0
    k_hi = steps
    if SPLIT_K > 1:
        per_split = tl.cdiv(steps, SPLIT_K)
        k_lo = tl.program_id(2) * per_split
        k_hi = tl.minimum(k_lo + per_split, steps)
    if PREFETCH_X:
        x_next = tl.load(x_ptr + x_off + k_lo * BLOCK_K, mask=ok[None, :], other=0.0)
    if FMA:  # the vector path's loads are not software-pipelined: one step ahead, by hand
        k0 = tl.minimum(k_lo, steps - 1)  # (an empty K split reads a step it does not use)
        qa_next = tl.load(wa_ptr + w_off + k0 * w_step, mask=rows_ok[:, None], other=0)
        sa_next = tl.load(sa_ptr + s_off + k0 * s_step, mask=rows_ok[:, None], other=s_other)
        qb_next = qa_next
        sb_next = sa_next
        if GLU:
            qb_next = tl.load(wb_ptr + w_off + k0 * w_step, mask=rows_ok[:, None], other=0)
            sb_next = tl.load(sb_ptr + s_off + k0 * s_step, mask=rows_ok[:, None], other=s_other)
    for kb in range(k_lo, k_hi):
        if FMA:
            qa = qa_next
            sa = sa_next
            qb = qb_next
            sb = sb_next
            kn = tl.minimum(kb + 1, k_hi - 1)
            qa_next = tl.load(wa_ptr + w_off + kn * w_step, mask=rows_ok[:, None], other=0)
            sa_next = tl.load(sa_ptr + s_off + kn * s_step, mask=rows_ok[:, None], other=s_other)
            if GLU:
                qb_next = tl.load(wb_ptr + w_off + kn * w_step, mask=rows_ok[:, None], other=0)
                sb_next = tl.load(sb_ptr + s_off + kn * s_step, mask=rows_ok[:, None], other=s_other)
            acc_a = _mxfp4_fma_step(acc_a, qa, sa, x_ptr + x_off + kb * BLOCK_K, shifts, BLOCK_N, BLOCK_K,
                                    SCALE_WORDS)
            if GLU:
                acc_b = _mxfp4_fma_step(acc_b, qb, sb, x_ptr + x_off + kb * BLOCK_K, shifts, BLOCK_N, BLOCK_K,
                                        SCALE_WORDS)
        else:
            if PREFETCH_X:  # the next step's x requested now, by hand (see the launcher's _prefetch_x)
                x = x_next
                x_next = tl.load(x_ptr + x_off + tl.minimum(kb + 1, k_hi - 1) * BLOCK_K, mask=ok[None, :],
                                 other=0.0)
            else:
                x = tl.load(x_ptr + x_off + kb * BLOCK_K, mask=ok[None, :], other=0.0)
            x_lo = x  # read only with TWO_PARTS
            if TWO_PARTS:  # fp16 / fp32 x: its bf16 rounding and the remainder, ~16 significant bits
                xf = x.to(tl.float32)
                if ROUND_BY_HAND:  # see _combine_kernel
                    xb = xf.to(tl.int32, bitcast=True)
                    hi = ((xb + 0x7FFF + ((xb >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
                else:
                    hi = xf.to(tl.bfloat16).to(tl.float32)
                x_lo = (xf - hi).to(tl.bfloat16)
                x = hi.to(tl.bfloat16)
            acc_a = _mxfp4_step(acc_a, wa_ptr + w_off + kb * w_step, sa_ptr + s_off + kb * s_step, rows_ok,
                                x, x_lo, s_other, shifts, BLOCK_N, BLOCK_K, SCALE_WORDS, TWO_PARTS)
            if GLU:
                acc_b = _mxfp4_step(acc_b, wb_ptr + w_off + kb * w_step, sb_ptr + s_off + kb * s_step,
                                    rows_ok, x, x_lo, s_other, shifts, BLOCK_N, BLOCK_K, SCALE_WORDS, TWO_PARTS)
    if FMA:
        acc_a = tl.reshape(tl.sum(acc_a, axis=1), [BLOCK_N, 1])
        acc_b = tl.reshape(tl.sum(acc_b, axis=1), [BLOCK_N, 1])
    out_off = pairs.to(tl.int64)[None, :] * N + rows[:, None]
    out_mask = ok[None, :] & rows_ok[:, None]
    if SPLIT_K > 1:
        tile = pid_m * tl.num_programs(1) + pid_n
        part = tl.num_programs(0) * tl.num_programs(1) * (2 * BLOCK_N * BLOCK_M)  # one split's partials
        ws_off = tile.to(tl.int64) * (2 * BLOCK_N * BLOCK_M) + tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + cols[None, :]
        tl.store(ws_ptr + tl.program_id(2) * part + ws_off, acc_a)
        tl.store(ws_ptr + tl.program_id(2) * part + ws_off + BLOCK_N * BLOCK_M, acc_b)
        tl.debug_barrier()  # all threads' stores precede the release below
        arrived = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel")
        last = arrived == SPLIT_K - 1
        tl.debug_barrier()
        mine = (tl.full([BLOCK_N, BLOCK_M], 0, tl.int32) + last.to(tl.int32)) != 0  # the last split's tile
        acc_a = tl.full([BLOCK_N, BLOCK_M], 0.0, tl.float32)
        acc_b = tl.full([BLOCK_N, BLOCK_M], 0.0, tl.float32)
        for sp in range(SPLIT_K):  # split order, whoever arrived last
            acc_a += tl.load(ws_ptr + sp * part + ws_off, mask=mine, other=0.0, cache_modifier=".cg")
            acc_b += tl.load(ws_ptr + sp * part + ws_off + BLOCK_N * BLOCK_M, mask=mine, other=0.0,
                             cache_modifier=".cg")
        if last:
            tl.store(counter_ptr + tile, 0)
        out_mask = out_mask & mine
    if GLU:
        # SiTU-GLU in fp32: gate' = b tanh(g / b) sigmoid(g), up' = bl tanh(u / bl), with
        # tanh of both at once (inline: Triton helpers are slow under the interpreter): an
        # odd Taylor polynomial for |v| < 0.3 (no cancellation; error < 2e-7 relative), else
        # (1 - t) / (1 + t) with t = exp(-2|v|) (t <= 0.55: 1 - t loses < 2 bits).
        v = tl.join(acc_a / beta, acc_b / linear_beta)
        v2 = v * v
        poly = v * (1.0 + v2 * (-1.0 / 3.0 + v2 * (2.0 / 15.0 + v2 * (-17.0 / 315.0 + v2 * (62.0 / 2835.0)))))
        t = tl.exp(-2.0 * tl.abs(v))
        far = (1.0 - t) / (1.0 + t)
        th_a, th_b = tl.split(tl.where(tl.abs(v) < 0.3, poly, tl.where(v < 0, -far, far)))
        ea = tl.exp(-tl.abs(acc_a))  # sigmoid without overflow: e / (1 + e) for negative g
        h = beta * th_a * tl.where(acc_a >= 0, 1.0, ea) / (1.0 + ea) * (linear_beta * th_b)
        if ROUND_BY_HAND and out_ptr.dtype.element_ty == tl.bfloat16:  # see _combine_kernel
            hb = h.to(tl.int32, bitcast=True)
            h = ((hb + 0x7FFF + ((hb >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
        tl.store(out_ptr + out_off, h.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        tl.store(out_ptr + out_off, acc_a, mask=out_mask)


@counted
@triton.jit
def _combine_kernel(y_ptr, weights_ptr, out_ptr, rows_ptr, T, D, TOP_K: tl.constexpr, BLOCK_T: tl.constexpr,
                    BLOCK_D: tl.constexpr, ROUND_BY_HAND: tl.constexpr, GATHER: tl.constexpr):
    """out[t] = sum_k weights[t, k] y[row of pair t * TOP_K + k]: that row itself, or with
    GATHER ``rows[pair]`` (y laid out in another order)."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    t_ok = t < T
    m = t_ok[:, None] & (d < D)[None, :]
    pair = t.to(tl.int64) * TOP_K
    acc = tl.full([BLOCK_T, BLOCK_D], 0.0, tl.float32)
    for k in tl.static_range(TOP_K):  # k order: deterministic
        w = tl.load(weights_ptr + pair + k, mask=t_ok, other=0.0)
        row = pair + k
        if GATHER:
            row = tl.load(rows_ptr + row, mask=t_ok, other=0).to(tl.int64)
        acc += w[:, None] * tl.load(y_ptr + row[:, None] * D + d[None, :], mask=m, other=0.0).to(tl.float32)
    if ROUND_BY_HAND and out_ptr.dtype.element_ty == tl.bfloat16:
        # fp32 -> the nearest bf16 value (ties to even), still fp32: Triton's interpreter casts
        # fp32 to bf16 by truncation where GPUs round to nearest even, so under TRITON_INTERPRET
        # the kernels round by hand first and the cast is then exact. (Inline: a @triton.jit
        # helper costs the interpreter ~3 ms per call.)
        bits = acc.to(tl.int32, bitcast=True)
        acc = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
    tl.store(out_ptr + t.to(tl.int64)[:, None] * D + d[None, :], acc.to(out_ptr.dtype.element_ty), mask=m)


#: TRITON_INTERPRET was set when this module was imported: @triton.jit made interpreter wrappers
_INTERPRETED = not isinstance(_combine_kernel, JITFunction)
#: arrival counters of split-K w13 launches (runtime/kernels/counters.py: run a shape once
#: before capturing it in a CUDA graph)
_counters = ArrivalCounters("moe_experts_mxfp4 w13")


def _scale_words(kd: int, block_k: int, *scales: Tensor) -> bool:
    """Scales read as int32 words: scale rows and steps are whole words (4 groups) and the
    tensors start on a word (a view at an odd offset takes the byte path)."""
    return kd % 128 == 0 and block_k % 128 == 0 and all(t.data_ptr() % 4 == 0 for t in scales)


def _prefetch_x(g: GemmPlan, block_m: int) -> bool:
    """Load the x tile of the next K step by hand, one step ahead. Triton (3.6 and 3.9)
    stages weights and scales through its software pipeline (cp.async) but loads the x
    tile of a wgmma (sm_90, 64+ weight rows per warpgroup, A from registers after the
    e2m1 upcast) synchronously in each step; mma.sync tiles (16/32 rows) get x staged too
    and keep that. (The vector path loads its own steps ahead.)"""
    return g.block_n >= 64 and block_m >= 16


# --------------------------------------------------------------------------- launchers


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """Every output and workspace of the launchers (tests replace it to poison them)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _check_experts(z: Tensor, weights: Tensor, ids: Tensor, w1p: Tensor, w1s: Tensor, w3p: Tensor, w3s: Tensor,
                   w2p: Tensor, w2s: Tensor) -> tuple[int, int, int, int, int]:
    """(T, D, I, E, K) after checking dtypes, shapes, devices and contiguity."""
    if z.dim() != 2 or z.dtype not in TRITON_DTYPES:
        raise ValueError(f"moe_experts_mxfp4: z must be [T, D] bf16/fp16/fp32, got {tuple(z.shape)} {z.dtype}")
    T, D = z.shape
    if weights.dim() != 2 or weights.shape[0] != T or ids.shape != weights.shape:
        raise ValueError(f"moe_experts_mxfp4: weights {tuple(weights.shape)} and ids {tuple(ids.shape)} must both be "
                         f"[T={T}, top_k]")
    if not weights.dtype.is_floating_point or ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"moe_experts_mxfp4: weights must be floating point (used as fp32) and ids int64/int32, "
                         f"got {weights.dtype}, {ids.dtype}")
    if w1p.dim() != 3:
        raise ValueError(f"moe_experts_mxfp4: w1_packed must be [E, I, D/2], got {list(w1p.shape)}")
    E, I = w1p.shape[0], w1p.shape[1]
    want = {"w1_packed": (w1p, (E, I, D // 2)), "w1_scale": (w1s, (E, I, D // 32)),
            "w3_packed": (w3p, (E, I, D // 2)), "w3_scale": (w3s, (E, I, D // 32)),
            "w2_packed": (w2p, (E, D, I // 2)), "w2_scale": (w2s, (E, D, I // 32))}
    if D % 32 or I % 32 or I <= 0 or D <= 0:
        raise ValueError(f"moe_experts_mxfp4: D={D} and I={I} must be positive multiples of 32 (the scale group)")
    for name, (t, shape) in want.items():
        if t.dtype != torch.uint8 or tuple(t.shape) != shape:
            raise ValueError(f"moe_experts_mxfp4: {name} must be uint8 {list(shape)}, got {t.dtype} "
                             f"{list(t.shape)}")
        if not t.is_contiguous():
            raise ValueError(f"moe_experts_mxfp4: {name} must be contiguous (the checkpoint layout)")
        if t.device != z.device:
            raise ValueError(f"moe_experts_mxfp4: {name} is on {t.device}, z on {z.device}")
    K = ids.shape[1]
    if not 1 <= K <= E:
        raise ValueError(f"moe_experts_mxfp4: top_k={K} must be in [1, E={E}]")
    if weights.device != z.device or ids.device != z.device:
        raise ValueError("moe_experts_mxfp4: z, weights and ids must be on one device")
    return T, D, I, E, K


def pairs_by_expert(ids: Tensor, experts: int) -> tuple[Tensor, Tensor]:
    """(order, counts) of pairs with experts ``ids`` [P] (int64): the pairs sorted by expert,
    each expert's in pair order (a stable sort: deterministic layouts), and each expert's
    pair count [experts] (int64)."""
    counts = torch.zeros(experts, dtype=torch.int64, device=ids.device).scatter_add_(0, ids, torch.ones_like(ids))
    return torch.sort(ids, stable=True).indices, counts


def align_pairs(ids: Tensor, experts: int, block_m: int, n_blocks: int) -> tuple[Tensor, Tensor]:
    """The grouped layout of pairs with experts ``ids`` [P] (module docstring): (sorted
    [n_blocks * block_m] int32, pair of each slot, P for padding; block_expert [n_blocks]
    int32, -1 past the used blocks). Torch ops only, no host synchronisation (CUDA graphs
    capture it)."""
    P = ids.numel()
    dev = ids.device
    order, counts = pairs_by_expert(ids, experts)
    blocks = (counts + block_m - 1) // block_m
    block_ends = torch.cumsum(blocks, 0)
    e = ids[order]
    rank = torch.arange(P, device=dev) - (torch.cumsum(counts, 0) - counts)[e]
    sorted_pairs = torch.full((n_blocks * block_m,), P, dtype=torch.int32, device=dev)
    sorted_pairs[(block_ends - blocks)[e] * block_m + rank] = order.to(torch.int32)
    block_expert = torch.searchsorted(block_ends, torch.arange(n_blocks, device=dev), right=True)
    return sorted_pairs, torch.where(block_expert < experts, block_expert, -1).to(torch.int32)


def moe_experts_mxfp4(z: Tensor, weights: Tensor, ids: Tensor, w1_packed: Tensor, w1_scale: Tensor,
                      w3_packed: Tensor, w3_scale: Tensor, w2_packed: Tensor, w2_scale: Tensor,
                      situ_beta: float, situ_linear_beta: float, plan: MoePlan | None = None) -> Tensor:
    """``k3::moe_experts_mxfp4``: 3 launches pair-major, 4 grouped (see the module
    docstring); ``plan`` defaults to :func:`choose_plan` for the device's target."""
    T, D, I, E, K = _check_experts(z, weights, ids, w1_packed, w1_scale, w3_packed, w3_scale, w2_packed, w2_scale)
    out = _empty(z.shape, z.dtype, z.device)
    P = T * K
    if T == 0:
        return out
    plan = plan or choose_plan(P, device_target(z.device))
    _check_plan(plan)
    if plan.block_m == 1 and any(t.data_ptr() % 4 for t in (w1_packed, w3_packed, w2_packed)):
        plan = replace(plan, block_m=16)  # codes read as int32 words need word-aligned tensors
    z, weights, ids = z.contiguous(), weights.float().contiguous(), ids.contiguous()
    dev = z.device
    h = _empty((P, I), z.dtype, dev)
    y = _empty((P, D), torch.float32, dev)
    n_blocks = pair_blocks(plan, P, E)
    if plan.grouped:
        sorted_pairs, block_expert = align_pairs(ids.view(-1), E, plan.block_m, n_blocks)
    else:
        sorted_pairs, block_expert = ids, ids  # not read
    common = {"TOP_K": K, "GROUPED": plan.grouped, "BLOCK_M": plan.block_m, "ROUND_BY_HAND": _INTERPRETED}
    g13, g2 = _fit(plan.w13, I, D), _fit(plan.w2, D, I)
    grid13, grid2 = expert_gemm_grids(plan, n_blocks, D, I)
    tiles = grid13[0] * grid13[1]
    if g13.split_k > 1:
        ws = _empty((g13.split_k * tiles * 2 * g13.block_n * plan.block_m,), torch.float32, dev)
        counters = _counters.get(dev, tiles)
    else:
        ws = counters = h  # not read
    _expert_gemm_kernel[grid13](
        z, ids, sorted_pairs, block_expert, w1_packed, w1_scale, w3_packed, w3_scale, h, ws, counters,
        P, I, D, float(situ_beta), float(situ_linear_beta), GLU=True, BLOCK_N=g13.block_n, BLOCK_K=g13.block_k,
        SCALE_WORDS=_scale_words(D, g13.block_k, w1_scale, w3_scale), PREFETCH_X=_prefetch_x(g13, plan.block_m),
        SPLIT_K=g13.split_k, **common, num_warps=g13.num_warps, num_stages=g13.num_stages)
    _expert_gemm_kernel[grid2](
        h, ids, sorted_pairs, block_expert, w2_packed, w2_scale, w2_packed, w2_scale, y, y, y,
        P, D, I, 1.0, 1.0, GLU=False, BLOCK_N=g2.block_n, BLOCK_K=g2.block_k,
        SCALE_WORDS=_scale_words(I, g2.block_k, w2_scale),
        PREFETCH_X=_prefetch_x(g2, plan.block_m), SPLIT_K=1,
        **common, num_warps=g2.num_warps, num_stages=g2.num_stages)
    combine(y, weights, out)
    return out


def combine(y: Tensor, weights: Tensor, out: Tensor, rows: Tensor | None = None) -> None:
    """out [T, D] = the weighted sum over each token's top_k pairs of y's rows (pair order,
    or ``rows[pair]``), in k order, fp32, rounded once to out's dtype."""
    T, K = weights.shape
    D = out.shape[1]
    block_t = 4 if _INTERPRETED else 1
    _combine_kernel[(triton.cdiv(T, block_t), triton.cdiv(D, COMBINE_BLOCK))](
        y, weights, out, y if rows is None else rows, T, D, TOP_K=K, BLOCK_T=block_t, BLOCK_D=COMBINE_BLOCK,
        ROUND_BY_HAND=_INTERPRETED, GATHER=rows is not None, num_warps=4)


# --------------------------------------------------------------------------- AOT


def aot_requests(target: str, E: int = 896, top_k: int = 16, D: int = 3584, I: int = 384,
                 dtype: torch.dtype = torch.bfloat16, plans: TargetPlans | None = None) -> list[KernelLaunch]:
    """Every specialisation the launchers pick with ``plans`` (default: ``target``'s) at
    one TP8 rank's K3 shapes: routing (``routing.aot_requests``), combine, and per
    distinct plan the w13 / w2 products. Integer arguments
    that are multiples of 16 there are marked so, as Triton's JIT specialises them."""
    t = TRITON_DTYPES[dtype]
    launches = routing.aot_requests(E, top_k)
    for gather, y_type in ((False, "*fp32"), (True, f"*{t}")):  # the kernels' y; the dequantised path's
        c = {"TOP_K": top_k, "BLOCK_T": 1, "BLOCK_D": COMBINE_BLOCK, "ROUND_BY_HAND": False, "GATHER": gather}
        launches.append(KernelLaunch("combine" + (" gather" if gather else ""), _combine_kernel,
                                     launch_signature(_combine_kernel, {
                                         "y_ptr": y_type, "weights_ptr": "*fp32", "out_ptr": f"*{t}",
                                         "rows_ptr": "*i64" if gather else y_type}, c), c, 4, 1, ("D",)))
    plans = plans or PLANS[target]
    seen = set()
    for label, plan in (("pair", plans.pair), ("grouped", plans.grouped), ("grouped_prefill", plans.prefill)):
        for glu in (True, False):
            key = (glu, plan.grouped, plan.block_m, plan.w13 if glu else plan.w2)
            if key not in seen:
                seen.add(key)
                launches.append(expert_gemm_launch(plan, glu, label, top_k, D, I, dtype))
    return launches


def expert_gemm_launch(plan: MoePlan, glu: bool, label: str, top_k: int = 16, D: int = 3584, I: int = 384,
                       dtype: torch.dtype = torch.bfloat16) -> KernelLaunch:
    """The w13 (``glu``) or w2 product as :func:`moe_experts_mxfp4` launches it with
    ``plan`` at these shapes (``label`` names the plan in the launch's name)."""
    t = TRITON_DTYPES[dtype]
    g, n, kd = (_fit(plan.w13, I, D), I, D) if glu else (_fit(plan.w2, D, I), D, I)
    c = {"TOP_K": top_k, "GLU": glu, "GROUPED": plan.grouped, "BLOCK_M": plan.block_m,
         "BLOCK_N": g.block_n, "BLOCK_K": g.block_k, "SCALE_WORDS": _scale_words(kd, g.block_k),
         "PREFETCH_X": _prefetch_x(g, plan.block_m), "ROUND_BY_HAND": False, "SPLIT_K": g.split_k}
    table = "*i32" if plan.grouped else "*i64"  # pair-major passes ids there (not read)
    types = {"x_ptr": f"*{t}", "ids_ptr": "*i64", "sorted_ptr": table, "block_expert_ptr": table,
             "wa_ptr": "*u8", "sa_ptr": "*u8", "wb_ptr": "*u8", "sb_ptr": "*u8",
             "out_ptr": f"*{t}" if glu else "*fp32", "ws_ptr": "*fp32", "counter_ptr": "*i32",
             "beta": "fp32", "linear_beta": "fp32"}
    # P = T * top_k pairs: a multiple of 16 at every T when top_k is (K3: 16)
    div = tuple(a for a, v in (("P", top_k), ("N", n), ("KD", kd)) if v % 16 == 0)
    return KernelLaunch(f"{'w13' if glu else 'w2'}_{label}_{g}", _expert_gemm_kernel,
                        launch_signature(_expert_gemm_kernel, types, c), c, g.num_warps, g.num_stages, div)


def pair_blocks(plan: MoePlan, pairs: int, E: int) -> int:
    """The expert products' row blocks: one per pair pair-major, the grouped worst case
    (:func:`grouped_blocks`) grouped."""
    return grouped_blocks(pairs, E, plan.block_m) if plan.grouped else pairs


def expert_gemm_grids(plan: MoePlan, n_blocks: int, D: int, I: int) -> tuple[tuple[int, int, int], ...]:
    """The grids of the w13 and the w2 launch of :func:`moe_experts_mxfp4` over ``n_blocks``."""
    g13, g2 = _fit(plan.w13, I, D), _fit(plan.w2, D, I)
    return (n_blocks, triton.cdiv(I, g13.block_n), g13.split_k), (n_blocks, triton.cdiv(D, g2.block_n), 1)
