"""KDA prefill after the preparation: the chunks' state recurrence (the only sequential
part) and, in the same walk, every chunk's output; by chunk groups when the sequences and
heads alone do not fill the GPU.

From the preparation's per-(chunk, head) factors (``kda_prefill.py``: W, U~, KE = beta k
e^{G_last - G}, GL = e^{G_last}, QG = q e^G, Aq), with S_c the state a chunk starts from:

    U_c     = U~_c - W_c S_c                         the chunk's values, corrected by S_c
    S_{c+1} = GL_c S_c + KE_c^T U_c                  = M_c S_c + KE_c^T U~_c,
                                                       M_c = diag(GL_c) - KE_c^T W_c  [D, D]
    o_c     = QG_c S_c + Aq_c U_c

Launches:

1. ``_kda_state_pass_kernel``, grid (segments, heads, column tiles): a segment's chunks in
   order, a [D, BX] column tile X in registers, X <- GL X + KE^T (U~ - W X), two products
   a chunk. STATES: a segment is a sequence or a chunk group and X a tile of its state;
   the chunk's output columns o_c[:, tile] = QG_c X + Aq_c U_c[:, tile] are two more
   products off the recurrence's chain (S_c and U_c are never stored). SUMMARY: a segment
   is a chunk group and X a tile of [M_g | B_g] [D, D + DV], the group as one affine map
   S -> M_g S + B_g (X starts as [I | 0]; the M columns skip U~). A chunk step waits on
   no load of its own: the factors are software-pipelined, GL is loaded a chunk ahead, and
   a chunk's tokens follow from its segment's first token (a segment lies in one sequence).
2. ``_kda_group_scan_kernel``, grid (sequences, heads, value tiles): S <- M_g S + B_g over a
   sequence's groups, storing each group's start state; the final state into its slot.

Without groups: (1, STATES) over sequences from the state slots, storing the final states.
With groups of G chunks: (1, SUMMARY), (2), (1, STATES) over groups from their start
states: about twice the state work (the summaries' M columns), spread over more programs,
and a sequential chain of 2 G chunk steps and chunks / G scan steps instead of one step per
chunk (:func:`group_size`).
"""

from __future__ import annotations

import math

import triton
import triton.language as tl

from k3compile.runtime.kernels import counted

#: columns of a state (or summary) tile per program, per target (sm_90: an H200 sweep,
#: BENCHMARKS.md; AMD: no spills at 4 warps, AOT)
BLOCK_X = {"sm_90": 64, "gfx950": 32, "gfx942": 32}


@counted
@triton.jit
def _kda_state_pass_kernel(
    w_ptr, u_ptr, ke_ptr, gl_ptr,  # the preparation's [chunks, H, BT, D], [.., BT, DV], [.., BT, D], [.., D]
    qg_ptr, aq_ptr, o_ptr,  # STATES: [chunks, H, BT, D], [.., BT, BT]; the outputs o [T, H, DV]
    cu_ptr, chunk_seq_ptr, chunk_first_ptr,  # STATES: cu_seqlens [N+1]; per chunk: sequence, first token
    x0_ptr, x0_row_ptr,  # STATES: start tiles [*, H, D, DV], segment s at row x0_row[s]
    end_ptr, end_row_ptr,  # STATES: final states [*, H, D, DV] at row end_row[s] (< 0: none); SUMMARY: [s, H, D, D + DV]
    seg_chunk0_ptr, seg_chunks_ptr, n_seg_ptr,  # per segment: first chunk, chunk count; [1] segments
    H,
    D: tl.constexpr, DV: tl.constexpr, BT: tl.constexpr, BX: tl.constexpr, SUMMARY: tl.constexpr,
    DOT_PRECISION: tl.constexpr, FP32_DOT: tl.constexpr,
):
    s = tl.program_id(0)
    h = tl.program_id(1)
    if s >= tl.load(n_seg_ptr):
        return
    XC: tl.constexpr = D + DV if SUMMARY else DV  # columns of X
    dot_ty: tl.constexpr = tl.float32 if FP32_DOT else w_ptr.dtype.element_ty
    cols = tl.program_id(2) * BX + tl.arange(0, BX)
    rows = tl.arange(0, BT)
    dk = tl.arange(0, D)
    c0 = tl.load(seg_chunk0_ptr + s)
    if SUMMARY:  # [I | 0]; columns of B read U~'s columns cols - D
        X = tl.where(dk[:, None] == cols[None, :], 1.0, 0.0)
        ucols = cols - D
    else:
        x0_row = tl.load(x0_row_ptr + s).to(tl.int64)
        X = tl.load(x0_ptr + ((x0_row * H + h) * D + dk[:, None]) * DV + cols[None, :])
        ucols = cols
    u_mask = (ucols >= 0)[None, :]
    n = tl.load(seg_chunks_ptr + s)
    if not SUMMARY:  # a segment's chunks are consecutive chunks of one sequence
        t0 = tl.load(chunk_first_ptr + c0)
        end = tl.load(cu_ptr + tl.load(chunk_seq_ptr + c0) + 1)
    GL_next = tl.load(gl_ptr + (c0 * H + h).to(tl.int64) * D + dk, mask=dk < (n > 0) * D, other=0.0)
    for cc in range(n):
        c = c0 + cc
        base = (c * H + h).to(tl.int64)
        GL = GL_next  # loaded a chunk ahead: off the chain of dependent steps
        GL_next = tl.load(gl_ptr + (base + H) * D + dk, mask=dk < (cc + 1 < n) * D, other=0.0)
        W = tl.load(w_ptr + base * BT * D + rows[:, None] * D + dk[None, :])
        KEt = tl.load(ke_ptr + base * BT * D + rows[None, :] * D + dk[:, None])  # [D, BT]
        Xw = X.to(W.dtype)  # the products' operands in the workspaces' dtype, X itself stays fp32
        Y = tl.load(u_ptr + base * BT * DV + rows[:, None] * DV + ucols[None, :], mask=u_mask,
                    other=0.0).to(tl.float32) - tl.dot(W.to(dot_ty), Xw.to(dot_ty), input_precision=DOT_PRECISION)
        Yw = Y.to(W.dtype)
        X = GL[:, None] * X + tl.dot(KEt.to(dot_ty), Yw.to(dot_ty), input_precision=DOT_PRECISION)
        if not SUMMARY:  # the chunk's outputs from its start state (Xw) after the next state
            QG = tl.load(qg_ptr + base * BT * D + rows[:, None] * D + dk[None, :])
            Aq = tl.load(aq_ptr + base * BT * BT + rows[:, None] * BT + rows[None, :])
            o = tl.dot(QG.to(dot_ty), Xw.to(dot_ty), input_precision=DOT_PRECISION)
            o += tl.dot(Aq.to(dot_ty), Yw.to(dot_ty), input_precision=DOT_PRECISION)
            tok = (t0 + cc * BT + rows).to(tl.int64)
            tl.store(o_ptr + (tok[:, None] * H + h) * DV + cols[None, :], o.to(o_ptr.dtype.element_ty),
                     mask=(tok < end)[:, None])
    if SUMMARY:
        tl.store(end_ptr + ((s.to(tl.int64) * H + h) * D + dk[:, None]) * XC + cols[None, :], X)
    else:
        end_row = tl.load(end_row_ptr + s).to(tl.int64)
        if end_row >= 0:
            tl.store(end_ptr + ((end_row * H + h) * D + dk[:, None]) * DV + cols[None, :], X)


@counted
@triton.jit
def _kda_group_scan_kernel(
    summary_ptr, starts_ptr, state_ptr,  # [groups, H, D, D + DV]; [groups, H, D, DV]; [S, H, D, DV] in place
    slots_ptr, seq_group0_ptr, seq_groups_ptr,  # per sequence: slot, first group, group count
    H,
    D: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    i = tl.program_id(0)
    h = tl.program_id(1)
    cols = tl.program_id(2) * BV + tl.arange(0, BV)
    dk = tl.arange(0, D)
    slot = tl.load(slots_ptr + i).to(tl.int64)
    g0 = tl.load(seq_group0_ptr + i)
    s_off = ((slot * H + h) * D + dk[:, None]) * DV + cols[None, :]
    S = tl.load(state_ptr + s_off)
    for gg in range(tl.load(seq_groups_ptr + i)):
        g = (g0 + gg).to(tl.int64)
        tl.store(starts_ptr + ((g * H + h) * D + dk[:, None]) * DV + cols[None, :], S)
        summary = summary_ptr + ((g * H + h) * D + dk[:, None]) * (D + DV)
        M = tl.load(summary + dk[None, :])
        S = tl.dot(M, S, input_precision=DOT_PRECISION) + tl.load(summary + D + cols[None, :])
    tl.store(state_ptr + s_off, S)


def group_size(sequences: int, heads: int, value_tiles: int, worst_chunks: int, units: int) -> int | None:
    """Chunks per group, or None for one segment per sequence. Groups only where the state
    pass over sequences would leave compute units idle (fewer programs than units) and the
    sequences are long enough to cut. A program's chunk step is bound by its own latency
    until programs share a unit, so the groups are as few as keep the summary pass (2
    ``value_tiles`` programs a group and head) at about SUMMARY_PROGRAMS_PER_UNIT programs
    a unit, and at least MIN_GROUPS a sequence (fewer shorten the chain too little for the
    summaries' cost): 5 groups a sequence at batch 1, 12 heads, 132 units (an H200 sweep,
    BENCHMARKS.md)."""
    per_sequence = worst_chunks / sequences
    if sequences * heads * value_tiles >= units or per_sequence < MIN_GROUPS * MIN_GROUP:
        return None
    groups = max(MIN_GROUPS, SUMMARY_PROGRAMS_PER_UNIT * units // (sequences * heads * 2 * value_tiles))
    return max(MIN_GROUP, math.ceil(per_sequence / groups))


#: the fewest chunks a group holds, and the fewest groups a sequence is cut into
MIN_GROUP = 4
MIN_GROUPS = 4
#: the group summaries' programs a compute unit takes while a chunk step's time stays its latency
SUMMARY_PROGRAMS_PER_UNIT = 2
