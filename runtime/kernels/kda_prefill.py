"""KDA prefill: the chunked gated delta rule over packed sequences: the preparation
(here) and the launcher; the state recurrence and the outputs are in ``kda_prefill_scan.py``.

Semantics are those of ``torch.ops.k3.kda_prefill`` (k3compile/ops/kda.py, whose torch
reference ``kda_chunked`` is the numerical truth and names the math): per sequence and
head, from the state ``S0 = state[slot, h]`` [D, DV] fp32, with q and k L2-normalised (fla's
convention) and q scaled, in chunks of BT tokens with in-chunk inclusive gate cumsum G_r:

    A[r, j]  = beta_j k_r . (e^{G_r - G_j} k_j)            j < r   (strictly lower)
    Aq[r, j] = beta_j q_r . (e^{G_r - G_j} k_j)            j <= r
    T        = (I + A)^-1;  W = T (k e^G);  U~ = T v
    U        = U~ - W S0
    o        = (q e^G) S0 + Aq U
    S1       = e^{G_last} S0 + (beta k e^{G_last - G})^T U

``_kda_chunk_prep_kernel``, grid (chunks, heads): everything that does not depend on the
state, for every chunk of every sequence in parallel: the norms and G (to scratch
tiles: q and k in the workspaces' dtype, as fla-core's l2norm writes them, G in fp32
and base 2, G log2(e), so that each decay is one exp2);
A and Aq by row blocks of 16 (sub-chunks), each a [16, 64] product against the whole
chunk's keys, accumulated over head-dim slices (:data:`HEAD_SLICE`) so that each
slice of the keys is loaded once for the four row blocks, with the decay split at the
row block's first token (e^{G_r - G_j} = e^{G_r - G_ref} e^{G_ref - G_j}; for keys
before the row block both exponents are <= 0, so nothing overflows however strong the
gate; keys after it are masked; within it the second exponent reaches a sub-chunk's
decay, taken as a product below e^80, else one key column at a time); T = (I + A)^-1 as
the inverse of the rest times the diagonal blocks' inverse (products of log2 factors:
batched [16, 16] ones, then [64, 64] ones); W
and U~; the factors the state pass multiplies by (q e^G, beta k e^{G_last - G},
e^{G_last}). Stored in workspaces per (chunk, head) (:func:`work_dtype`).
Then ``kda_prefill_scan``: the state pass, which writes the outputs as it walks the chunks
(by chunk groups where sequences x heads leave the GPU idle).

Workspaces at D = DV = 128 in a bf16 model: about 72 KB per (chunk, head) of the
preparation's outputs and 80 KB of scratch (q and k in bf16; G and A, then T, in fp32)
freed after it: at most about 0.9 GB for 32K tokens at 12 heads, freed after the call
(about 1.6 GB for an fp32 model, whose outputs and q / k scratch double);
``RuntimeOptions.prefill_chunk`` bounds them.

Chunks are found on the device: each sequence's chunks are numbered after the previous
sequences', and the grids are sized for the worst case, ``cdiv(T, BT) + sequences``;
programs past the real count exit. No host synchronisation. The preparation, launched
first, finds its own chunk (``packed_chunks.locate_chunks``): the device waits for whatever the
host does before that launch. The state pass reads ``packed_chunks.chunk_table`` (one
launch) and, by chunk groups, ``packed_chunks.chunk_groups`` (one more).

Numerics: the preparation in fp32 (from q and k normalised in the workspaces' dtype);
A, Aq and the inverse's products exact for an fp32 model, at the backend's default
precision for fp32 operands otherwise (tf32 on CUDA: ``dot_precision``; exact fp32
products spilled thousands of bytes per thread on sm_90, AOT; exact ones for the
diagonal blocks' inverse ran on the FMA units, 5% of the preparation's time, decision 78).
W, U~, the state pass and the outputs multiply the workspaces' dtype (T, k e^G and v in
bf16 for a bf16 model, as fla-core does; decision 79) with fp32 sums and an fp32 carried
state.
Padding rows of a sequence's last chunk hold q = k = v = 0, g = 0 and beta = 0, so they
neither decay nor write the state, as in the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from k3compile.ops import kda as kda_ops
from k3compile.ops.kda import L2NORM_EPS
from k3compile.runtime.kernels import counted, interpreted
from k3compile.runtime.kernels import kda_prefill_scan as scan
from k3compile.runtime.kernels import packed_chunks
from k3compile.runtime.kernels.aot import TRITON_DTYPES, KernelLaunch, launch_signature
from k3compile.runtime.kernels.packed_chunks import locate_chunks
from k3compile.runtime.kernels.targets import compute_units, device_target, register_cap

#: tokens per chunk (the reference's default), and per sub-chunk of the preparation's blocks
CHUNK = 64
SUB_CHUNK = 16
#: columns per block of the preparation's W / U~ products (and the state factors)
W_BLOCK = 64
#: head-dim columns per slice of the A / Aq products (the chunk's keys [BT, slice] and the
#: row blocks' [16, BT] sums are live together), per target. sm_90: the fastest of
#: benchmarks/kda_prefill.py --prep-sweep; AMD: two workgroups per gfx950 / gfx942 CU at
#: every pointer width (AOT, docs/kernels.md; 64 leaves one where buffer loads are off)
HEAD_SLICE = {"sm_90": 32, "gfx950": 32, "gfx942": 32}
#: the largest decay exponent a diagonal A / Aq block takes as one product, base 2 (the
#: scratch holds G in base 2, G log2(e), so that a decay is one exp2): 2^115 = e^79.7 (fp32
#: overflows past e^88; normalised keys and 64 terms leave the margin)
MAX_EXP2 = tl.constexpr(115.0)
LOG2E = tl.constexpr(1.4426950408889634)
#: warps of the preparation and of the state pass / group scan per target
#: (``targets.device_target``). CUDA: the fastest of an H200 sweep
#: (benchmarks/kda_prefill.py --sweep, BENCHMARKS.md), none spilling; AMD: from the AOT
#: resources (no spills at 4 warps, two preparation workgroups per gfx950 CU)
WARPS = {"sm_90": {"prep": 4, "scan": 4}, "gfx950": {"prep": 4, "scan": 4}, "gfx942": {"prep": 4, "scan": 4}}
#: a cap on the preparation's registers per thread (Triton's ``maxnreg``: NVIDIA targets
#: only): 168 lets three programs reside per H200 SM instead of two (fastest of
#: benchmarks/kda_prefill.py --prep-sweep, BENCHMARKS.md; a few spilled words, AOT)
PREP_MAX_REGISTERS = {"sm_90": 168}
#: software-pipeline stages of the preparation (sm_90: its loops' loads issued ahead of the
#: products that wait on them, three the fastest of benchmarks/kda_prefill.py --modules,
#: BENCHMARKS.md; AMD: one until measured)
PREP_STAGES = {"sm_90": 3, "gfx950": 1, "gfx942": 1}
#: software-pipeline stages of the state pass, of the group summaries (fewer: two programs
#: a unit instead of one, kda_prefill_scan.group_size) and of the group scan (its [D, D]
#: summary blocks: three stages overflow an H200's shared memory). CUDA: the fastest of
#: benchmarks/kda_prefill.py --state-sweep (BENCHMARKS.md); AMD: one until measured
SCAN_STAGES = {"sm_90": 3, "gfx950": 1, "gfx942": 1}
SUMMARY_STAGES = {"sm_90": 2, "gfx950": 1, "gfx942": 1}
GROUP_SCAN_STAGES = {"sm_90": 2, "gfx950": 1, "gfx942": 1}
#: the kernels' pointers to workspaces in :func:`work_dtype`
WORKSPACES = ("w_ptr", "u_ptr", "aq_ptr", "qg_ptr", "ke_ptr")


@triton.jit
def _row_block_products(q_s, k_s, g_s, a: tl.constexpr, k_c, g_c, sub, dks, acc_a, acc_q, D: tl.constexpr,
                        BC: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Row block a of A and Aq plus one head-dim slice's products: a's keys and queries
    decayed to its first row, k_r e^{G_r - G_ref} and q_r e^{G_r - G_ref}, against the
    chunk's keys ``k_c`` decayed from that row, e^{G_ref - G_j} k_j (capped at 2^MAX_EXP2:
    the keys after a, masked out later)."""
    tile = (a * BC + sub)[:, None] * D + dks[None, :]
    g_ref = tl.load(g_s + a * BC * D + dks)
    e_a = tl.exp2(tl.load(g_s + tile) - g_ref[None, :])
    kt = tl.trans(k_c * tl.exp2(tl.minimum(g_ref[None, :] - g_c, MAX_EXP2)))
    return (tl.dot(tl.load(k_s + tile).to(tl.float32) * e_a, kt, acc_a, input_precision=DOT_PRECISION),
            tl.dot(tl.load(q_s + tile).to(tl.float32) * e_a, kt, acc_q, input_precision=DOT_PRECISION))


@triton.jit
def _store_row_block(a_s, aq_s, blk_a, blk_q, a: tl.constexpr, beta_c, sub, cols, BT: tl.constexpr,
                     BC: tl.constexpr):
    """Row block a of A (strictly lower) and Aq (lower) times beta of the key columns."""
    r = a * BC + sub
    off = r[:, None] * BT + cols[None, :]
    tl.store(a_s + off, tl.where(cols[None, :] < r[:, None], blk_a * beta_c[None, :], 0.0))
    tl.store(aq_s + off, tl.where(cols[None, :] <= r[:, None], blk_q * beta_c[None, :], 0.0)
             .to(aq_s.dtype.element_ty))


@triton.jit
def _diagonal_by_columns(q_s, k_s, g_s, a, sub, dk, D: tl.constexpr, BC: tl.constexpr):
    """Diagonal block (a, a) of A and Aq one key column j at a time, e^{G_r - G_j} whole
    (gates too strong for the split; the rows above j may overflow: the store's mask drops
    them)."""
    tile = (a * BC + sub)[:, None] * D + dk[None, :]
    G_a = tl.load(g_s + tile)
    k_a = tl.load(k_s + tile).to(tl.float32)
    q_a = tl.load(q_s + tile).to(tl.float32)
    blk_a = tl.zeros([BC, BC], dtype=tl.float32)
    blk_q = tl.zeros([BC, BC], dtype=tl.float32)
    for j in range(BC):
        G_j = tl.load(g_s + (a * BC + j) * D + dk)
        kd = tl.exp2(G_a - G_j[None, :]) * tl.load(k_s + (a * BC + j) * D + dk).to(tl.float32)[None, :]
        col = (sub == j)[None, :]
        blk_a += tl.where(col, tl.sum(k_a * kd, axis=1)[:, None], 0.0)
        blk_q += tl.where(col, tl.sum(q_a * kd, axis=1)[:, None], 0.0)
    return blk_a, blk_q


@triton.jit
def _unipotent_inverse(L, eye, LOG2: tl.constexpr, PRECISION: tl.constexpr):
    """(I + L)^-1 for L with L^(2^LOG2) = 0: the Neumann series sum_n (-L)^n as the product
    (I - L)(I + L^2)(I + L^4) ... (I + L^(2^(LOG2 - 1))), LOG2 - 1 squarings."""
    X = eye - L
    for _ in tl.static_range(LOG2 - 1):
        L = tl.dot(L, L, input_precision=PRECISION)
        X = tl.dot(X, L, X, input_precision=PRECISION)  # X (I + L)
    return X


@counted
@triton.jit
def _kda_chunk_prep_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr,  # [T, H, D], [T, H, D], [T, H, DV], [T, H, D] fp32, [T, H] fp32
    cu_ptr,  # cu_seqlens [N+1]
    w_ptr, u_ptr, aq_ptr, qg_ptr, ke_ptr, gl_ptr,  # per (chunk, head): [BT, D], [BT, DV], [BT, BT], [BT, D] x2, [D]
    qk_ptr, gc_ptr, a_ptr,  # per (chunk, head): q, k normalised [2, BT, D]; G [BT, D]; A [BT, BT]
    scale, N, H, eps,
    D: tl.constexpr, DV: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BC_LOG2: tl.constexpr,
    NC_LOG2: tl.constexpr, BD: tl.constexpr, BW: tl.constexpr, BS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    FP32_DOT: tl.constexpr,
):
    c = tl.program_id(0)
    h = tl.program_id(1)
    seq, t0, chunks = locate_chunks(cu_ptr, c + tl.arange(0, 1), N, BT, BS)  # the chunk table's, for one chunk
    if c >= chunks:
        return
    seq = tl.sum(seq, 0)
    t0 = tl.sum(t0, 0).to(tl.int32)  # int32 registers (tokens < 2^31); addresses from int64 tok
    end = tl.load(cu_ptr + seq + 1).to(tl.int32)
    rows = tl.arange(0, BT)
    cols = tl.arange(0, BT)
    dk = tl.arange(0, D)
    valid = t0 + rows < end
    tok = (t0 + rows).to(tl.int64)
    base = (c * H + h).to(tl.int64)
    tile = rows[:, None] * D + dk[None, :]
    q_s = qk_ptr + base * 2 * BT * D  # the scratch tiles [BT, D]: q and k in the workspaces' dtype, G in fp32
    k_s = q_s + BT * D
    g_s = gc_ptr + base * BT * D

    # 1. The norms and G (base 2), to scratch: the blocks below read them by sub-chunk.
    qk_off = (tok[:, None] * H + h) * D + dk[None, :]
    q = tl.load(q_ptr + qk_off, mask=valid[:, None], other=0.0).to(tl.float32)
    k = tl.load(k_ptr + qk_off, mask=valid[:, None], other=0.0).to(tl.float32)
    tl.store(q_s + tile, (q / tl.sqrt(tl.sum(q * q, axis=1) + eps)[:, None] * scale).to(qk_ptr.dtype.element_ty))
    tl.store(k_s + tile, (k / tl.sqrt(tl.sum(k * k, axis=1) + eps)[:, None]).to(qk_ptr.dtype.element_ty))
    tl.store(g_s + tile, tl.cumsum(tl.load(g_ptr + qk_off, mask=valid[:, None], other=0.0), axis=0) * LOG2E)
    tl.debug_barrier()

    # 2. A and Aq by row blocks of BC rows (sub-chunks a), each against the chunk's keys
    # [BT, BD] a head-dim slice at a time: the chunk's keys are loaded once a slice for all
    # row blocks. The decays are split at a's first row: e^{G_r - G_j} = e^{G_r - G_ref}
    # e^{G_ref - G_j}. For keys before a both exponents are <= 0 (G falls along the chunk);
    # keys after a are masked out (their exponent is capped at MAX_EXP2 so they stay
    # finite); keys within a decay by up to a sub-chunk's decay, e^75 at K3's gate (-5 a
    # token), exact while below 2^MAX_EXP2. Past that (stronger gates) the diagonal blocks
    # are taken again one key column at a time. beta of the key columns last.
    NC: tl.constexpr = BT // BC
    sub = tl.arange(0, BC)
    firsts = (tl.arange(0, NC) * BC)[:, None] * D + dk[None, :]
    span = tl.max(tl.load(g_s + firsts) - tl.load(g_s + firsts + (BC - 1) * D))  # the largest sub-chunk decay
    A0 = tl.zeros([BC, BT], dtype=tl.float32)
    A1, A2, A3, Q0, Q1, Q2, Q3 = A0, A0, A0, A0, A0, A0, A0
    for d0 in range(0, D, BD):
        dks = d0 + tl.arange(0, BD)
        chunk_tile = rows[:, None] * D + dks[None, :]
        k_c = tl.load(k_s + chunk_tile).to(tl.float32)
        g_c = tl.load(g_s + chunk_tile)
        A0, Q0 = _row_block_products(q_s, k_s, g_s, 0, k_c, g_c, sub, dks, A0, Q0, D, BC, DOT_PRECISION)
        if NC >= 2:
            A1, Q1 = _row_block_products(q_s, k_s, g_s, 1, k_c, g_c, sub, dks, A1, Q1, D, BC, DOT_PRECISION)
        if NC >= 4:
            A2, Q2 = _row_block_products(q_s, k_s, g_s, 2, k_c, g_c, sub, dks, A2, Q2, D, BC, DOT_PRECISION)
            A3, Q3 = _row_block_products(q_s, k_s, g_s, 3, k_c, g_c, sub, dks, A3, Q3, D, BC, DOT_PRECISION)
    a_s = a_ptr + base * BT * BT
    aq_s = aq_ptr + base * BT * BT
    beta_c = tl.load(beta_ptr + tok * H + h, mask=valid, other=0.0)
    _store_row_block(a_s, aq_s, A0, Q0, 0, beta_c, sub, cols, BT, BC)
    if NC >= 2:
        _store_row_block(a_s, aq_s, A1, Q1, 1, beta_c, sub, cols, BT, BC)
    if NC >= 4:
        _store_row_block(a_s, aq_s, A2, Q2, 2, beta_c, sub, cols, BT, BC)
        _store_row_block(a_s, aq_s, A3, Q3, 3, beta_c, sub, cols, BT, BC)
    if span >= MAX_EXP2:
        tl.debug_barrier()  # the diagonal blocks are stored again
        for a in range(NC):
            blk_a, blk_q = _diagonal_by_columns(q_s, k_s, g_s, a, sub, dk, D, BC)
            t_a = t0 + a * BC + sub
            beta_a = tl.load(beta_ptr + t_a.to(tl.int64) * H + h, mask=t_a < end, other=0.0)
            blk = (a * BC + sub)[:, None] * BT + (a * BC + sub)[None, :]
            tl.store(a_s + blk, tl.where(sub[:, None] > sub[None, :], blk_a * beta_a[None, :], 0.0))
            tl.store(aq_s + blk, tl.where(sub[:, None] >= sub[None, :], blk_q * beta_a[None, :], 0.0)
                     .to(aq_ptr.dtype.element_ty))
    tl.debug_barrier()

    # 3. T = (I + A)^-1. A = L + N: L its diagonal blocks (strictly lower: L^BC = 0), N the
    # blocks below them. I + A = (I + L)(I + P) with P = (I + L)^-1 N strictly block lower
    # (P^NC = 0), so T = (I + P)^-1 (I + L)^-1, each inverse a product of log2 factors
    # (_unipotent_inverse): the NC diagonal blocks' as batched products, written over them
    # in the scratch, then the rest as [BT, BT] products.
    blocks = tl.arange(0, NC)[:, None, None] * BC
    diagonal = (blocks + sub[None, :, None]) * BT + blocks + sub[None, None, :]  # [NC, BC, BC]
    inv_L = _unipotent_inverse(tl.load(a_s + diagonal), tl.where(sub[:, None] == sub[None, :], 1.0, 0.0)[None, :, :],
                               BC_LOG2, DOT_PRECISION)
    tl.debug_barrier()  # every diagonal block read before any is written over
    tl.store(a_s + diagonal, inv_L)
    tl.debug_barrier()
    block = rows[:, None] * BT + cols[None, :]
    same_block = (rows // BC)[:, None] == (cols // BC)[None, :]
    M = tl.load(a_s + block)  # (I + L)^-1 and N
    P = tl.dot(tl.where(same_block, M, 0.0), tl.where(same_block, 0.0, M), input_precision=DOT_PRECISION)
    X = _unipotent_inverse(P, tl.where(rows[:, None] == cols[None, :], 1.0, 0.0), NC_LOG2, DOT_PRECISION)
    Tinv = tl.dot(X, tl.where(same_block, tl.load(a_s + block), 0.0), input_precision=DOT_PRECISION)
    tl.debug_barrier()  # T to phase 4 through the scratch (held in registers across it, it spills)
    tl.store(a_s + block, Tinv)
    tl.debug_barrier()

    # 4. W, U~ and the state factors, BW-wide column blocks at a time (fewer live registers).
    # W and U~ multiply T and their operands in the workspaces' dtype, as the state pass does
    # (bf16 for a bf16 model, as fla-core; fp32 under the interpreter: FP32_DOT).
    dot_ty: tl.constexpr = tl.float32 if FP32_DOT else w_ptr.dtype.element_ty
    Tw = tl.load(a_s + block).to(w_ptr.dtype.element_ty).to(dot_ty)
    beta = tl.load(beta_ptr + tok * H + h, mask=valid, other=0.0)
    wide = tl.arange(0, BW)
    for d0 in range(0, D, BW):
        cols_d = d0 + wide
        blk = rows[:, None] * D + cols_d[None, :]
        G_d = tl.load(g_s + blk)
        eG_d = tl.exp2(G_d)
        G_last = tl.load(g_s + (BT - 1) * D + cols_d)
        k_d = tl.load(k_s + blk).to(tl.float32)
        w = tl.dot(Tw, (k_d * eG_d).to(w_ptr.dtype.element_ty).to(dot_ty), input_precision=DOT_PRECISION)
        tl.store(w_ptr + base * BT * D + blk, w.to(w_ptr.dtype.element_ty))
        ke = k_d * tl.exp2(G_last[None, :] - G_d) * beta[:, None]
        tl.store(ke_ptr + base * BT * D + blk, ke.to(ke_ptr.dtype.element_ty))
        tl.store(qg_ptr + base * BT * D + blk, (tl.load(q_s + blk).to(tl.float32) * eG_d).to(qg_ptr.dtype.element_ty))
        tl.store(gl_ptr + base * D + cols_d, tl.exp2(G_last))
    for e0 in range(0, DV, BW):
        cols_v = e0 + wide
        v_e = tl.load(v_ptr + (tok[:, None] * H + h) * DV + cols_v[None, :], mask=valid[:, None],
                      other=0.0)
        u = tl.dot(Tw, v_e.to(w_ptr.dtype.element_ty).to(dot_ty), input_precision=DOT_PRECISION)
        tl.store(u_ptr + base * BT * DV + rows[:, None] * DV + cols_v[None, :], u.to(u_ptr.dtype.element_ty))


def _check(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, cu_seqlens: Tensor,
           slots: Tensor) -> None:
    T, H, D = q.shape
    DV = v.shape[-1]
    problems = []
    if k.shape != q.shape or g.shape != q.shape or v.shape[:2] != (T, H) or beta.shape != (T, H):
        problems.append(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, g {tuple(g.shape)} and "
                        f"beta {tuple(beta.shape)} do not describe [T, H, D] / [T, H, DV] / [T, H]")
    if state.dim() != 4 or tuple(state.shape[1:]) != (H, D, DV):
        problems.append(f"state must be [S, {H}, {D}, {DV}], got {tuple(state.shape)}")
    if cu_seqlens.dim() != 1 or slots.shape != (cu_seqlens.numel() - 1,):
        problems.append(f"cu_seqlens [N+1] and slots [N] expected, got {tuple(cu_seqlens.shape)} and "
                        f"{tuple(slots.shape)}")
    if problems:
        raise ValueError("kda_prefill: " + "; ".join(problems))


def dot_precision(dtype: torch.dtype) -> str | None:
    """The products' precision: exact fp32 for an fp32 model; for bf16 / fp16 ones, whose
    output rounds far coarser, the backend's default for fp32 operands (CUDA: tf32 on the
    matrix units; ROCm: fp32)."""
    return "ieee" if dtype == torch.float32 else None


def head_slice(target: str, head_dim: int) -> int:
    """The preparation's head-dim columns per A / Aq product on ``target`` (HEAD_SLICE)."""
    return min(HEAD_SLICE[target], head_dim)


def w_block(head_dim: int, head_dim_v: int) -> int:
    """The preparation's columns per W / U~ block (W_BLOCK; both head dims powers of two)."""
    return min(W_BLOCK, head_dim, head_dim_v)


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the chunk factors the state pass and the outputs multiply by (W, U, q e^G,
    beta k e^{G_last - G}, Aq) and of the chunk start states: the model's for bf16 / fp16
    (their products on the matrix units at full rate, half the bytes: fla-core keeps
    them so too), fp32 for an fp32 model. A, T, G and the state carried from chunk to
    chunk stay fp32."""
    return torch.float32 if dtype == torch.float32 else dtype


def prep_constants(target: str, D: int, DV: int, chunk: int, dtype: torch.dtype) -> dict[str, object]:
    """The preparation's compile-time arguments on ``target`` for head dims ``D`` / ``DV``,
    chunks of ``chunk`` tokens and a model in ``dtype``."""
    return {"D": D, "DV": DV, "BT": chunk, "BC": SUB_CHUNK, "BC_LOG2": SUB_CHUNK.bit_length() - 1,
            "NC_LOG2": (chunk // SUB_CHUNK).bit_length() - 1, "BD": head_slice(target, D), "BW": w_block(D, DV),
            "BS": packed_chunks.TABLE_SEQUENCES, "DOT_PRECISION": dot_precision(dtype)}


def kernel_takes_dims(D: int, DV: int, chunk: int = CHUNK) -> bool:
    """Whether the kernels take head dims ``D`` / ``DV`` and ``chunk``: powers of two >= 16,
    the chunk at most four sub-chunks (the preparation's row blocks)."""
    return all(n >= 16 and n & (n - 1) == 0 for n in (D, DV, chunk)) and chunk <= 4 * SUB_CHUNK


def kernel_takes(q: Tensor, v: Tensor, state: Tensor, chunk: int = CHUNK) -> bool:
    """Whether the kernels take these shapes (else the reference runs): :func:`kernel_takes_dims`
    and an fp32 contiguous state (it is updated in place)."""
    return (kernel_takes_dims(q.shape[-1], v.shape[-1], chunk) and state.dtype == torch.float32
            and state.is_contiguous())


def kda_prefill(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, cu_seqlens: Tensor,
                slots: Tensor, scale: float, chunk: int = CHUNK, group_chunks: int | None = None) -> Tensor:
    """``k3::kda_prefill`` (module docstring); updates ``state[slots]`` in place and returns
    o [T, H, DV] in v's dtype. ``chunk``: tokens per chunk; ``group_chunks``: chunks per
    group of the state pass (``kda_prefill_scan``), 0 for none, None for
    ``kda_prefill_scan.group_size``'s choice. Shapes the kernels do not take
    (:func:`kernel_takes`) run the op's torch reference."""
    _check(q, k, v, g, beta, state, cu_seqlens, slots)
    if not kernel_takes(q, v, state, chunk):
        return kda_ops.kda_prefill_reference(q, k, v, g, beta, state, cu_seqlens, slots, scale)
    T, H, D = q.shape
    DV = v.shape[-1]
    N = slots.numel()
    if T == 0 or N == 0:
        return torch.empty((T, H, DV), dtype=v.dtype, device=v.device)
    dev = q.device
    # The preparation first (it finds its chunks itself): what the host does before its
    # launch, the device waits for.
    worst = packed_chunks.worst_chunks(T, N, chunk)
    f32 = {"dtype": torch.float32, "device": dev}
    work = {"dtype": work_dtype(v.dtype), "device": dev}
    w, qg, ke = (torch.empty((worst, H, chunk, D), **work) for _ in range(3))
    u = torch.empty((worst, H, chunk, DV), **work)
    aq = torch.empty((worst, H, chunk, chunk), **work)
    a = torch.empty((worst, H, chunk, chunk), **f32)
    qk = torch.empty((worst, H, 2, chunk, D), **work)
    g_cum = torch.empty((worst, H, chunk, D), **f32)
    gl = torch.empty((worst, H, D), **f32)
    q, k, v = (t.contiguous() for t in (q, k, v))
    precision = dot_precision(v.dtype)
    fp32_dot = interpreted()  # the interpreter's tl.dot multiplies bf16 bit patterns (triton#11584)
    target = device_target(dev)
    warps = WARPS[target]
    _kda_chunk_prep_kernel[(worst, H)](
        q, k, v, g.float().contiguous(), beta.float().contiguous(), cu_seqlens, w, u, aq, qg, ke, gl, qk, g_cum, a,
        float(scale), N, H, L2NORM_EPS,
        **prep_constants(target, D, DV, chunk, v.dtype), FP32_DOT=fp32_dot, num_warps=warps["prep"],
        num_stages=PREP_STAGES[target],
        **register_cap(target, PREP_MAX_REGISTERS.get(target)),
    )
    del qk, g_cum, a
    table = packed_chunks.chunk_table(cu_seqlens, T, chunk)
    o = torch.empty((T, H, DV), dtype=v.dtype, device=dev)
    slots = slots.to(device=dev, dtype=torch.int64)
    bx = min(scan.BLOCK_X[target], D, DV)
    c = {"D": D, "DV": DV, "BT": chunk, "BX": bx, "DOT_PRECISION": precision, "FP32_DOT": fp32_dot,
         "num_warps": warps["scan"], "num_stages": SCAN_STAGES[target]}
    factors = (w, u, ke, gl, qg, aq, o, table.cu, table.seq, table.first)
    if group_chunks is None:
        group_chunks = scan.group_size(N, H, DV // bx, worst, compute_units(dev)) or 0
    if group_chunks:
        groups = packed_chunks.chunk_groups(cu_seqlens, T, chunk, group_chunks)
        seg = groups.segments
        n = seg.chunk0.numel()
        summary = torch.empty((n, H, D, D + DV), **f32)
        starts = torch.empty((n, H, D, DV), **f32)
        scan._kda_state_pass_kernel[(n, H, (D + DV) // bx)](  # summaries: start tiles and outputs unread
            *factors, starts, seg.chunk0, summary, seg.chunk0, seg.chunk0, seg.chunks, seg.count, H, SUMMARY=True,
            **{**c, "num_stages": SUMMARY_STAGES[target]})
        scan._kda_group_scan_kernel[(N, H, DV // bx)](
            summary, starts, state, slots, groups.seq_first, groups.seq_groups, H, D=D, DV=DV, BV=bx,
            DOT_PRECISION=precision, num_warps=warps["scan"], num_stages=GROUP_SCAN_STAGES[target])
        scan._kda_state_pass_kernel[(n, H, DV // bx)](
            *factors, starts, groups.start_rows, state, groups.end_rows, seg.chunk0, seg.chunks, seg.count, H,
            SUMMARY=False, **c)
    else:
        scan._kda_state_pass_kernel[(N, H, DV // bx)](
            *factors, state, slots, state, slots, table.seq_first, table.seq_chunks, table.sequences, H,
            SUMMARY=False, **c)
    return o


def aot_requests(target: str, heads: int = 12, head_dim: int = 128,
                 dtype: torch.dtype = torch.bfloat16) -> list[KernelLaunch]:
    """Every kernel as the launcher runs it on ``target`` (a key of ``aot.TARGETS``) at K3's
    per-rank shapes (12 heads, D = DV = 128): the chunk table, the chunk groups, the
    preparation, the state pass (states and outputs; group summaries) and the group scan."""
    warps = WARPS[target]
    t, wt = TRITON_DTYPES[dtype], TRITON_DTYPES[work_dtype(dtype)]
    precision = dot_precision(dtype)
    prep_c = {**prep_constants(target, head_dim, head_dim, CHUNK, dtype), "FP32_DOT": False}
    prep_types = {"q_ptr": f"*{t}", "k_ptr": f"*{t}", "v_ptr": f"*{t}", "g_ptr": "*fp32", "beta_ptr": "*fp32",
                  "cu_ptr": "*i32",
                  **{p: f"*{wt}" for p in (*WORKSPACES, "qk_ptr")},
                  **{p: "*fp32" for p in ("gl_ptr", "gc_ptr", "a_ptr")},
                  "scale": "fp32", "eps": "fp32"}
    prep = KernelLaunch("kda_prefill prep", _kda_chunk_prep_kernel,
                        launch_signature(_kda_chunk_prep_kernel, prep_types, prep_c), prep_c, warps["prep"],
                        PREP_STAGES[target], max_registers=PREP_MAX_REGISTERS.get(target))
    launches = [packed_chunks.chunk_table_launch(CHUNK), packed_chunks.chunk_groups_launch(CHUNK), prep]
    bx = min(scan.BLOCK_X[target], head_dim)
    fp32 = ("gl_ptr", "x0_ptr", "end_ptr", "summary_ptr", "starts_ptr", "state_ptr")
    i64 = ("x0_row_ptr", "end_row_ptr", "seg_chunk0_ptr", "seg_chunks_ptr", "n_seg_ptr", "slots_ptr",
           "seq_group0_ptr", "seq_groups_ptr", "cu_ptr", "chunk_seq_ptr", "chunk_first_ptr", "n_chunks_ptr")
    types = {**{p: "*fp32" for p in fp32}, **{p: f"*{wt}" for p in WORKSPACES}, **{p: "*i64" for p in i64},
             "o_ptr": f"*{t}"}
    dims = {"D": head_dim, "DV": head_dim, "DOT_PRECISION": precision}
    for name, fn, c, stages in (("kda_prefill state pass", scan._kda_state_pass_kernel,
                                 {**dims, "BT": CHUNK, "BX": bx, "SUMMARY": False, "FP32_DOT": False}, SCAN_STAGES),
                                ("kda_prefill group summaries", scan._kda_state_pass_kernel,
                                 {**dims, "BT": CHUNK, "BX": bx, "SUMMARY": True, "FP32_DOT": False}, SUMMARY_STAGES),
                                ("kda_prefill group scan", scan._kda_group_scan_kernel, {**dims, "BV": bx},
                                 GROUP_SCAN_STAGES)):
        launches.append(KernelLaunch(name, fn, launch_signature(fn, types, c), c, warps["scan"], stages[target]))
    return launches


def register_kernels(device_type: str) -> None:
    """Make :func:`kda_prefill` the ``device_type`` implementation of ``k3::kda_prefill``."""
    kda_ops.kda_prefill.register_kernel(device_type)(kda_prefill)
