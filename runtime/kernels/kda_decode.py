"""Fused single-token KDA decode: everything between the projections and ``o_proj`` in one launch.

The unfused chain (``k3compile/model/kda.py``, decode branch; one token per sequence)::

    q, k, v = short_conv_decode(q_proj x), ... (k, v)      conv + SiLU, shifts 3 conv states
    g       = kda_gate(f_b_proj(f_a_proj x), A_log, dt_bias, lower_bound)
    beta    = sigmoid(b_proj x)
    o       = kda_decode(q, k, v, g, beta, state, slots, scale)
    y       = gated_rms_norm(o, g_proj x, o_norm.weight, eps)

is about 30 small kernels in eager torch and 4-5 in a serving engine (conv, gate + recurrence,
norm). At decode the recurrent state dominates the bytes and everything else is tiny, so the
chain is one memory-bound pass over the state, launched once.

Algorithm, per program: one sequence b, one head h, and NT consecutive value tiles of BV
columns (``tiles_per_program``; 1 unless given); D is the key width, DV the value width, K
the conv kernel size (4):

1. Short conv + SiLU of this head's D query and D key channels (and, per value tile, of its
   BV value channels), from the conv states (the K-1 previous inputs, oldest first) and this
   token's projections. Outputs are rounded to the model dtype, as the unfused chain stores
   them.
2. fp32 L2 norm of q and k (fla's convention: ``x / sqrt(sum x^2 + 1e-6)``), q times ``scale``;
   decay gate ``g = lower_bound * sigmoid(exp(A_log[h]) * (a + dt_bias))`` [D];
   ``beta = sigmoid(beta logits)``.
3. Delta rule on each [D, BV] slice of the fp32 state ``S[slot, h]`` (layout [D_k, D_v]):
   ``S' = diag(exp g) S;  u = v - S'^T k;  S <- S' + beta k u^T``, and the output
   ``o = S^T q = S'^T q + beta (k . q) u``: one reduction of the pair (S'^T k, S'^T q) over
   the key dim instead of two in sequence, taken as ``S^T (exp(g) k)`` and ``S^T (exp(g)
   q)`` so that S' is never formed: the new slice is one fused multiply-add per value,
   ``S * exp(g) + (beta k) u^T``. Each slice is read once and written once; o [BV] is
   rounded to the model dtype (the chain does).
4. ``y = RMSNorm_DV(o) * o_norm * sigmoid(gate)`` over the head's whole DV row.

Grid ``(DV // (BV * NT), H, B)``: a head's programs fastest, then its sequence's heads, so
programs running side by side cover one sequence's contiguous state. Why value tiles: a
sequence's state is H [D, DV] matrices (12 x 64 KiB at K3 per rank), and at batch 1 one
program per head would leave 120 of the H200's 132 SMs idle while 12 stream the state.
Every column of the state is independent given q, k, g, beta, so splitting DV over programs
multiplies them by DV / (BV NT) (96 at batch 1, BV = 16). The price is that each program
recomputes the per-head q/k parts (conv of 2 x D channels, norms, gate: about 7 KB of reads
per program at K3, served from L2 after the first) and that two things need the whole head:

- The RMSNorm needs sum(o^2) over all DV. Each program stores its o tiles (model dtype) to
  the output, then increments a per-(b, h) arrival counter (``atomic_add``, acq_rel). The
  program that arrives last, and only it, reads the whole o row back, normalises and gates it
  in place, and resets the counter to 0 for the next launch (so the counters stay zero
  between launches and CUDA-graph replays need no memset). Cost per (b, h): one int32
  atomic per program plus one extra read and write of the DV outputs (~0.5 KB at K3, about
  0.4% of the 128 KiB of state traffic). With one program per head there is no counter: it
  normalises its own row (in registers if that row is one or two tiles).
- The q/k conv states must be updated exactly once, yet every program reads the old ones.
  The last-arriving program writes them (re-reading the old ones and this token's q and k,
  ~2 KB from L2, rather than keeping the conv windows in registers all along): when it has
  seen the counter reach its programs per head - 1, every other has already passed its
  atomic, and its reads of the old conv states precede its atomic (a barrier orders all
  its threads' accesses before the release), so no program can read a state another
  already overwrote. Each program writes its own v conv channels, which no other touches.

A program with several tiles (NT > 1) convolves and normalises q and k once for all of them
and streams its tiles in turn, ``num_stages`` of them in flight (each in its own registers:
the tile loop is unrolled). Whatever the plan, the reads of the first tiles (state slice, v
input and v conv state) go out together with the q/k conv reads, pinned there by a barrier
(the compiler would otherwise sink them below the conv math, which waits for the conv reads:
two round trips in a row instead of one). ``evict_state`` puts an evict-first cache hint on
the state stream (touched once per step). By default it is on only when one program takes
a head's whole row (tile 64 or wider) and the heads fit in fewer than two programs per CU:
on an H200 (``benchmarks/kda_decode.py --sweep --sweep-only evict``) it made batch 8
faster (whole rows, 96 programs: 7.4-7.6 against 7.9 us), but since the gate and norm
weight are read with the state (fifth session) it made batch 64 and 256 slower (34.3 /
119.1 against 33.7 / 114.7 us; in the fourth session, with those reads after the update,
it had been 4% faster there). On narrow tiles its cache policy
costs registers (value tile 32, 4 warps: 80 instead of 72, 24 instead of 28 resident
warps per SM) and the data it would protect in L2 (weights, activations) is touched by
every program, so LRU keeps it anyway.

Programmatic dependent launch (``pdl``; CUDA, compute capability 9.0 and newer): the
kernel may start while the kernel before it on the stream is still running. Each program
reads its slot, its state tile, the conv states and the weights, then waits for that
kernel (``griddepcontrol.wait``) before reading this token's projections, which that
kernel may be writing, and writes nothing before the wait. So the state's first round trip
and the launch overlap the previous kernel's tail, which matters most where a step is a
few waves of programs: on an H200 at batch 64 33.0 -> 30.9 us after another step (with
``launch_config``'s plan under PDL, a row as two tiles), 35.1 -> 32.0 us after the q
projection's GEMM (``benchmarks/kda_decode_pieces.py``). The caller
promises that the kernel just before writes neither the states, the slots nor the
weights (``k3::kda_decode_fused`` checks it for the weights it casts).

Launch choices (``launch_config``): ``block_v`` (``choose_block_v``: a head's whole row once
the batch has half as many heads as CUs, else the widest tile that still gives two programs
per CU), ``tiles_per_program``
(``choose_tiles_per_program``, capped at ``MAX_TILES_PER_PROGRAM``), ``num_warps``
(``num_warps_for``), ``num_stages``, ``evict_state`` (on for whole-row tiles of 64 or more
while the heads give fewer than two programs per CU), ``max_registers`` and ``pdl`` (off
unless asked for); ``benchmarks/kda_decode.py --sweep`` times a grid of them on a GPU.

Bytes per step (``bytes_moved``), the floor a memory-bound kernel cannot beat:
fp32 state read + written once, ``2 * B * H * D * DV * 4`` (1.5 MiB per sequence at K3 per
rank: H=12, D=DV=128), plus q, k, v, a, gate and beta in the model dtype, the three conv
states read + written (``2 * B * 3 * H * D * (K-1)`` elements), the output, and the weights
once (conv weights 3 x H*D*K fp32, dt_bias, o_norm; 80 KB at K3). At batch 1 that is 1.7 MB;
the state is 91% of it and grows with the batch while the weights do not.

Slots are the caller's contract, as for the unfused ops: distinct within a launch and in
range (checking would cost a device sync). The arrival counters are a per-device workspace
shared by launches: do not run two of these kernels concurrently on different streams of one
device. The first launch on a device allocates the counters (4096, grown for B*H beyond), so run
once at the largest batch before capturing CUDA graphs (warm-up does); buffers are never freed,
as captured graphs keep their addresses.

On CPU the launcher runs only under the Triton interpreter: ``TRITON_INTERPRET=1`` set before
triton is first imported in the process (triton.language's own jit functions, ``tl.sum`` and
``tl.sigmoid``, are built then). The runtime uses the torch reference on CPU
(``k3compile.ops.kda_fused.kda_decode_chain_reference``, the op's default implementation).

:func:`register_kernels` makes :func:`kda_decode_fused_op` (argument preparation, then this
launcher) the implementation of ``k3::kda_decode_fused`` on a device type.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from k3compile.ops import kda_fused as fused_op
from k3compile.ops.kda import L2NORM_EPS
from k3compile.runtime.kernels.aot import TRITON_DTYPES
from k3compile.runtime.kernels.counters import ArrivalCounters

__all__ = [
    "MAX_BLOCK_V",
    "MAX_TILES_PER_PROGRAM",
    "MIN_BLOCK_V",
    "WHOLE_ROW_TILES",
    "LaunchConfig",
    "aot_signature",
    "bytes_moved",
    "choose_block_v",
    "choose_tiles_per_program",
    "kda_decode_fused",
    "kda_decode_fused_op",
    "kda_decode_kernel",
    "launch_config",
    "launch_grid",
    "num_warps_for",
    "register_kernels",
    "supports_pdl",
]

#: widest value tile (see choose_block_v)
MAX_BLOCK_V = 128
MIN_BLOCK_V = 16
"""Narrowest value tile the launcher picks by itself (a smaller one may be passed)."""
MAX_TILES_PER_PROGRAM = 1
"""Most value tiles per program the launcher picks by itself (see choose_tiles_per_program)."""
WHOLE_ROW_TILES = 2
"""Tiles a head's whole row is cut into under programmatic dependent launch (see launch_config)."""

MODEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_L2_EPS = tl.constexpr(L2NORM_EPS)


# --------------------------------------------------------------------------- kernel


@triton.jit
def _load_conv_state(conv_state_ptr, channels, cols, K: tl.constexpr):
    """The K-1 stored inputs of ``channels``, oldest first, as [C, KP] (columns >= K-1 are 0)."""
    return tl.load(
        conv_state_ptr + channels[:, None] * (K - 1) + cols[None, :], mask=cols[None, :] < K - 1, other=0.0
    )


@triton.jit
def _conv_taps(weight_ptr, conv_state_ptr, channels, cols, K: tl.constexpr):
    """The conv reads that do not involve this token: (stored [C, KP] conv state, weight [C, KP])."""
    stored = _load_conv_state(conv_state_ptr, channels, cols, K)
    w = tl.load(weight_ptr + channels[:, None] * K + cols[None, :], mask=cols[None, :] < K, other=0.0)
    return stored, w


@triton.jit
def _conv_window(x, stored, cols, K: tl.constexpr):
    """[C, KP] fp32: the K inputs the conv sees, oldest first (the K-1 stored ones, then x)."""
    return tl.where(cols[None, :] == K - 1, x[:, None].to(tl.float32), stored.to(tl.float32))


@triton.jit
def _conv_apply(x, stored, w, cols, K: tl.constexpr):
    """Depthwise causal conv + SiLU of one token x [C] with ``_conv_taps``' reads.

    Returns (y [C] fp32 rounded to x's dtype, window [C, KP] fp32, see ``_conv_window``).
    """
    window = _conv_window(x, stored, cols, K)
    acc = tl.sum(window * w.to(tl.float32), axis=1)
    y = acc * tl.sigmoid(acc)
    return y.to(x.dtype).to(tl.float32), window


@triton.jit
def _store_conv_state(conv_state_ptr, channels, cols, window, K: tl.constexpr):
    """New conv state = the window without its oldest input: column c goes to slot c - 1."""
    tl.store(
        conv_state_ptr + channels[:, None] * (K - 1) + cols[None, :] - 1,
        window.to(conv_state_ptr.dtype.element_ty),
        mask=(cols[None, :] >= 1) & (cols[None, :] < K),
    )


@triton.jit
def _shift_conv_state(x_ptr, conv_state_ptr, channels, cols, K: tl.constexpr):
    """Write the new conv state of ``channels`` (as ``_store_conv_state``) from memory: the old
    state, which only the caller writes, and the token's input x. For the program that shifts
    a head's q/k conv states last, so that their windows need not stay in registers."""
    window = _conv_window(tl.load(x_ptr + channels), _load_conv_state(conv_state_ptr, channels, cols, K), cols, K)
    _store_conv_state(conv_state_ptr, channels, cols, window, K)


@triton.jit
def _gated_store(o, rstd, gate, weight, out_ptrs):
    """out = o * rstd * weight * sigmoid(gate) for some columns of a head row (gate and weight
    their loaded output-gate logits and norm weight)."""
    y = o * rstd * weight.to(tl.float32) * tl.sigmoid(gate.to(tl.float32))
    tl.store(out_ptrs, y.to(out_ptrs.dtype.element_ty))


@triton.jit
def _gated_rms_norm_store(o, gate, weight, out_ptrs, eps, DV: tl.constexpr):
    """out = o * rsqrt(mean(o^2) + eps) * weight * sigmoid(gate); o is a whole head row."""
    _gated_store(o, tl.rsqrt(tl.sum(o * o, axis=0) / DV + eps), gate, weight, out_ptrs)


@triton.jit
def _add2(a0, a1, b0, b1):
    return a0 + b0, a1 + b1


@triton.jit
def _add3(a0, a1, a2, b0, b1, b2):
    return a0 + b0, a1 + b1, a2 + b2


@triton.jit
def _tile_ptrs(head_state, dk, tile, DV: tl.constexpr, BV: tl.constexpr):
    """Pointers to value tile ``tile`` ([D, BV], rows DV apart) of one head's [D, DV] state."""
    return head_state + dk[:, None] * DV + (tile * BV + tl.arange(0, BV))[None, :]


@triton.jit
def _tile_reads(
    head_state, dk, tile, v_conv_w_row, v_conv_state_row, cols,
    DV: tl.constexpr, BV: tl.constexpr, K: tl.constexpr, STATE_EVICT: tl.constexpr,
):
    """What value tile ``tile`` reads that no earlier kernel of the step writes, issued
    together: (its [D, BV] fp32 state slice, its v channels' stored conv state and conv
    weights)."""
    dv = tile * BV + tl.arange(0, BV)
    s = tl.load(_tile_ptrs(head_state, dk, tile, DV, BV), eviction_policy=STATE_EVICT)
    v_stored, v_w = _conv_taps(v_conv_w_row, v_conv_state_row, dv, cols, K)
    return s, v_stored, v_w


@triton.jit
def _tile_input(v_row, tile, BV: tl.constexpr):
    """This token's v projection for value tile ``tile`` (written by the step's previous kernels)."""
    return tl.load(v_row + tile * BV + tl.arange(0, BV))


@triton.jit
def _value_tile(
    reads, v_x, s_ptrs, tile, decay, q, k, beta, beta_kq, v_conv_state_row, out_row, cols,
    BV: tl.constexpr, K: tl.constexpr, STATE_EVICT: tl.constexpr, STORE_O: tl.constexpr,
):
    """Delta rule on one [D, BV] state tile from ``_tile_reads`` (the state slice as loaded
    from ``s_ptrs``) and ``_tile_input`` (v_x): stores the new slice and (if STORE_O) its o
    columns in the model dtype;
    returns o (fp32 of the rounded values). Convolves the tile's v channels and shifts their
    conv state (no other program touches them).

    ``o = S_new^T q = (decay S)^T q + beta (k . q) u``, so the two sums over the key dim,
    ``(decay S)^T k`` and ``(decay S)^T q``, are one reduction of a pair instead of two in
    sequence (the second used to wait for the updated state)."""
    s, v_stored, v_w = reads
    dv = tile * BV + tl.arange(0, BV)
    v, v_window = _conv_apply(v_x, v_stored, v_w, cols, K)
    _store_conv_state(v_conv_state_row, dv, cols, v_window, K)
    sk, sq = tl.reduce((s * (decay * k)[:, None], s * (decay * q)[:, None]), 0, _add2)
    u = v - sk
    tl.store(s_ptrs, tl.fma(s, decay[:, None], (beta * k)[:, None] * u[None, :]), eviction_policy=STATE_EVICT)
    o = (sq + beta_kq * u).to(out_row.dtype.element_ty)
    if STORE_O:
        tl.store(out_row + dv, o)
    return o.to(tl.float32)


@triton.jit
def kda_decode_kernel(
    q_ptr, k_ptr, v_ptr,  # [B, H*D], [B, H*D], [B, H*DV] projections (pre-conv), model dtype
    q_conv_w_ptr, k_conv_w_ptr, v_conv_w_ptr,  # [H*D, K], [H*D, K], [H*DV, K]
    q_conv_state_ptr, k_conv_state_ptr, v_conv_state_ptr,  # [S, H*D, K-1], ..., [S, H*DV, K-1]
    a_ptr, a_log_ptr, dt_bias_ptr,  # [B, H*D] gate input, [H], [H*D]
    beta_ptr,  # [B, H] logits
    state_ptr,  # [S, H, D, DV] fp32
    slots_ptr,  # [B] int64
    gate_ptr, norm_weight_ptr,  # [B, H*DV] output gate logits, [DV]
    out_ptr,  # [B, H, DV]
    counter_ptr,  # [>= B*H] int32, zero between launches
    lower_bound, scale, eps,
    H: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
    BV: tl.constexpr,  # value tile: state columns in registers at a time
    NT: tl.constexpr,  # value tiles per program, updated in turn
    NS: tl.constexpr,  # state tiles in flight per program (1 to 3), registers each
    STATE_EVICT: tl.constexpr,  # cache eviction policy of the state stream: "evict_first" or ""
    PDL: tl.constexpr,  # launched as a programmatic dependent launch (CUDA sm_90+): wait for the previous kernel
):
    SPLIT: tl.constexpr = DV // (BV * NT)  # programs per head
    DIRECT: tl.constexpr = SPLIT == 1 and NT <= 2  # one program per head, o of its 1-2 tiles kept in registers
    i_p = tl.program_id(0)
    i_h = tl.program_id(1)
    i_b = tl.program_id(2).to(tl.int64)
    slot = tl.load(slots_ptr + i_b).to(tl.int64)
    dk = tl.arange(0, D)
    cols = tl.arange(0, KP)
    head_state = state_ptr + (slot * H + i_h) * (D * DV)
    first = i_p * NT  # this program's first value tile
    qk_channels = i_h * D + dk
    q_conv_state = q_conv_state_ptr + slot * (H * D * (K - 1))
    k_conv_state = k_conv_state_ptr + slot * (H * D * (K - 1))

    # 1. Short conv + SiLU of q and k (v: per value tile). The reads of the conv states and
    #    weights and of the first state tile go out together, before a barrier that keeps the
    #    compiler from sinking the state read below the conv math (which waits for the conv
    #    reads): so the state's round trip overlaps theirs. A barrier does not wait for reads
    #    in flight; the conv math after it starts from this token's q and k, read after it.
    v_row = v_ptr + i_b * (H * DV) + i_h * DV
    v_conv_w_row = v_conv_w_ptr + i_h * (DV * K)
    v_conv_state_row = v_conv_state_ptr + slot * (H * DV * (K - 1)) + i_h * (DV * (K - 1))
    q_stored, q_w = _conv_taps(q_conv_w_ptr, q_conv_state, qk_channels, cols, K)
    k_stored, k_w = _conv_taps(k_conv_w_ptr, k_conv_state, qk_channels, cols, K)
    b0 = _tile_reads(head_state, dk, first, v_conv_w_row, v_conv_state_row, cols, DV, BV, K, STATE_EVICT)
    if NS > 1 and NT > 1:
        b1 = _tile_reads(head_state, dk, first + 1, v_conv_w_row, v_conv_state_row, cols, DV, BV, K, STATE_EVICT)
    if NS > 2 and NT > 2:
        b2 = _tile_reads(head_state, dk, first + 2, v_conv_w_row, v_conv_state_row, cols, DV, BV, K, STATE_EVICT)
    # The per-head inputs of steps 2 and 4 go out with them too, so that no round trip is
    # left after the state update (with one program per head, the output gate and norm
    # weight were read only after it: one more L2 round trip per program, with its
    # registers held).
    dt_bias = tl.load(dt_bias_ptr + qk_channels)
    a_log = tl.load(a_log_ptr + i_h).to(tl.float32)
    all_v = tl.arange(0, DV)
    tile_v = tl.arange(0, BV)
    if DIRECT:  # the norm weight of this program's tiles (first == 0: its head's whole row)
        norm_w0 = tl.load(norm_weight_ptr + tile_v)
        if NT == 2:
            norm_w1 = tl.load(norm_weight_ptr + BV + tile_v)
    # Everything read so far (slots, states, weights) no kernel of the decode step writes
    # just before this one; what follows (this token's projections) the previous kernel
    # may still be writing. Under programmatic dependent launch this program may start
    # while that kernel finishes: it waits for it here, with its state reads in flight, and
    # lets the next kernel's programs start (they can only take SM slots this grid frees).
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    v0 = _tile_input(v_row, first, BV)
    if NS > 1 and NT > 1:
        v1 = _tile_input(v_row, first + 1, BV)
    if NS > 2 and NT > 2:
        v2 = _tile_input(v_row, first + 2, BV)
    a = tl.load(a_ptr + i_b * (H * D) + qk_channels).to(tl.float32) + dt_bias
    beta_logit = tl.load(beta_ptr + i_b * H + i_h).to(tl.float32)
    gate_row = gate_ptr + i_b * (H * DV) + i_h * DV
    if DIRECT:
        gate0 = tl.load(gate_row + tile_v)
        if NT == 2:
            gate1 = tl.load(gate_row + BV + tile_v)
    tl.debug_barrier()
    q, q_window = _conv_apply(tl.load(q_ptr + i_b * (H * D) + qk_channels), q_stored, q_w, cols, K)
    k, k_window = _conv_apply(tl.load(k_ptr + i_b * (H * D) + qk_channels), k_stored, k_w, cols, K)
    if SPLIT == 1:  # only this program reads this head's q/k conv states
        _store_conv_state(q_conv_state, qk_channels, cols, q_window, K)
        _store_conv_state(k_conv_state, qk_channels, cols, k_window, K)

    # 2. L2 norms (fla's convention: x / sqrt(sum x^2 + eps)), k . q for o, decay, beta.
    qq, kk, qk = tl.reduce((q * q, k * k, q * k), 0, _add3)
    q_scale = tl.rsqrt(qq + _L2_EPS) * scale
    k_scale = tl.rsqrt(kk + _L2_EPS)
    q = q * q_scale
    k = k * k_scale
    decay = tl.exp(lower_bound * tl.sigmoid(tl.exp(a_log) * a))
    beta = tl.sigmoid(beta_logit)
    beta_kq = beta * (qk * q_scale * k_scale)

    # 3. Delta rule on this program's NT value tiles, each read once and written once.
    row = (i_b * H + i_h) * DV
    for t in tl.static_range(NT):
        if t > 0 and t + NS - 1 < NT:  # keep NS tiles in flight: read the one NS-1 ahead
            ahead = first + t + NS - 1
            nxt = _tile_reads(head_state, dk, ahead, v_conv_w_row, v_conv_state_row, cols, DV, BV, K, STATE_EVICT)
            nxt_v = _tile_input(v_row, ahead, BV)
            if (t + NS - 1) % NS == 0:
                b0, v0 = nxt, nxt_v
            elif (t + NS - 1) % NS == 1:
                b1, v1 = nxt, nxt_v
            else:
                b2, v2 = nxt, nxt_v
        if t % NS == 0:
            s, v_x = b0, v0
        elif t % NS == 1:
            s, v_x = b1, v1
        else:
            s, v_x = b2, v2
        o = _value_tile(s, v_x, _tile_ptrs(head_state, dk, first + t, DV, BV), first + t, decay, q, k, beta,
                        beta_kq, v_conv_state_row, out_ptr + row, cols, BV, K, STATE_EVICT, not DIRECT)
        if t == 0:
            o0 = o
        else:
            o1 = o

    # 4. Gated RMSNorm over the whole head row: from registers (one program per head of one
    #    or two tiles), by the head's only program after its tiles, or by the last of its
    #    programs to arrive.
    if DIRECT:
        sum_sq = tl.sum(o0 * o0, axis=0)
        if NT == 2:
            sum_sq += tl.sum(o1 * o1, axis=0)
        rstd = tl.rsqrt(sum_sq / DV + eps)
        _gated_store(o0, rstd, gate0, norm_w0, out_ptr + row + tile_v)
        if NT == 2:
            _gated_store(o1, rstd, gate1, norm_w1, out_ptr + row + BV + tile_v)
    elif SPLIT == 1:
        tl.debug_barrier()  # every thread's o stores precede the reads of the whole row
        o_row = tl.load(out_ptr + row + all_v).to(tl.float32)
        _gated_rms_norm_store(o_row, tl.load(gate_row + all_v), tl.load(norm_weight_ptr + all_v),
                              out_ptr + row + all_v, eps, DV)
    else:
        tl.debug_barrier()  # all threads' loads and stores precede the release below
        counter = counter_ptr + i_b * H + i_h
        arrived = tl.atomic_add(counter, 1, sem="acq_rel")
        if arrived == SPLIT - 1:
            tl.debug_barrier()
            o_row = tl.load(out_ptr + row + all_v).to(tl.float32)
            _gated_rms_norm_store(o_row, tl.load(gate_row + all_v), tl.load(norm_weight_ptr + all_v),
                                  out_ptr + row + all_v, eps, DV)
            _shift_conv_state(q_ptr + i_b * (H * D), q_conv_state, qk_channels, cols, K)
            _shift_conv_state(k_ptr + i_b * (H * D), k_conv_state, qk_channels, cols, K)
            tl.store(counter, 0)


# --------------------------------------------------------------------------- launch plan


def launch_grid(
    batch: int, heads: int, head_dim_v: int, block_v: int, tiles_per_program: int = 1
) -> tuple[int, int, int]:
    """The kernel's grid: (programs per head, heads, batch); a program updates
    ``tiles_per_program`` value tiles of ``block_v`` columns."""
    return (head_dim_v // (block_v * tiles_per_program), heads, batch)


def choose_block_v(batch: int, heads: int, head_dim_v: int, compute_units: int, waves: int = 2) -> int:
    """A head's whole row (up to ``MAX_BLOCK_V``) per program once the batch has at least
    half as many heads as there are compute units; below that, the widest power-of-two
    tile that still gives ``waves`` programs per compute unit (floor ``MIN_BLOCK_V``).

    One program per head row needs no arrival counter and no re-read of the row for the
    norm (two round trips less per program) and convolves q and k once per head: on an
    H200 (benchmarks/kda_decode.py, fifth session) it was the fastest tile from batch 8
    (96 programs: 7.7 us against 8.5-8.9 at tiles 16-64) and tied with tile 64 at batch 64
    (34.2 us); at batch 256 tile 64 was 2% faster (116.0 against 118.1 us). At batch 1 its
    12 programs leave the GPU idle: tile 16 (96 programs) 5.1 us against 5.6. H=12,
    DV=128 on 132 SMs: batch 1 -> 16, 8 and more -> 128.
    """
    bv = min(head_dim_v, MAX_BLOCK_V)
    if 2 * batch * heads >= compute_units:
        return bv
    while bv > MIN_BLOCK_V and batch * heads * (head_dim_v // bv) < waves * compute_units:
        bv //= 2
    return bv


def choose_tiles_per_program(
    batch: int, heads: int, head_dim_v: int, block_v: int, compute_units: int, waves: int = 2
) -> int:
    """Most value tiles per program, a power of two up to ``MAX_TILES_PER_PROGRAM``, that
    still leaves ``waves`` programs per compute unit.

    A program that updates several tiles of one head convolves and normalises that head's q
    and k once instead of once per tile, and with all of a head's tiles it needs no arrival
    counter; but it streams its tiles one after the other (``num_stages`` of them in
    flight), so it takes longer and there are fewer programs to hide latency. ``benchmarks/kda_decode.py --sweep`` measures both; until an H200 sweep
    says otherwise the cap is 1 (one tile per program, as first measured)."""
    tiles = max(1, min(MAX_TILES_PER_PROGRAM, head_dim_v // block_v))
    while tiles > 1 and batch * heads * (head_dim_v // (block_v * tiles)) < waves * compute_units:
        tiles //= 2
    return tiles


def num_warps_for(head_dim: int, block_v: int) -> int:
    """Warps for a [D, BV] fp32 state tile: about 32 state values per thread, 2 to 4 warps
    (the H200 sweep: a [128, 64] tile on 8 warps was 1.4x slower than on 4)."""
    return max(2, min(4, head_dim * block_v // (32 * 32)))


@dataclass(frozen=True)
class LaunchConfig:
    """How ``kda_decode_fused`` launches the kernel (see ``launch_config``)."""

    block_v: int  # value tile: [D, block_v] fp32 state columns in registers at a time
    tiles_per_program: int  # value tiles one program updates, one after the other
    num_warps: int
    num_stages: int  # state tiles a program has in flight (register buffers), 1 to 3
    evict_state: bool  # evict-first cache hint on the state stream (read and written once)
    #: a cap on registers per thread (CUDA only: Triton's ``maxnreg``), for more resident
    #: programs per SM at the price of spills; None: the compiler's choice
    max_registers: int | None = None
    #: programmatic dependent launch (CUDA sm_90+): programs may start while the previous
    #: kernel finishes and read the state before waiting for it (see the kernel's PDL)
    pdl: bool = False

    def programs_per_head(self, head_dim_v: int) -> int:
        return head_dim_v // (self.block_v * self.tiles_per_program)


def launch_config(
    batch: int, heads: int, head_dim: int, head_dim_v: int, compute_units: int, *,
    block_v: int | None = None, tiles_per_program: int | None = None, num_warps: int | None = None,
    num_stages: int | None = None, evict_state: bool | None = None, max_registers: int | None = None,
    pdl: bool = False,
) -> LaunchConfig:
    """The launch plan: each choice given, or the heuristic's (``choose_block_v``,
    ``choose_tiles_per_program``, ``num_warps_for``, 2 stages, the evict-first hint when
    a program takes a head's whole row of 64 or more values and the heads give fewer than
    two programs per CU (module docstring), no register cap). Raises ValueError on a
    choice the kernel cannot run.

    With ``pdl`` and neither ``block_v`` nor ``tiles_per_program`` given, a program that
    would take a head's whole row as one tile takes it as two tiles of half the width,
    both in flight (``WHOLE_ROW_TILES``): it updates and stores the first while the second
    may still arrive, and keeps both halves of o in registers for the norm. On an H200
    under PDL: batch 64 32.1 -> 31.0 us, batch 256 112.7-113.0 -> 111.4-111.7; without
    PDL batch 64 was 0.4 us slower that way, so one tile stays the plan there.

    ``num_stages``: how many of its value tiles a program has in flight, each in its own
    registers: the first ``num_stages`` are read with the conv inputs, and tile t+num_stages-1
    is read before tile t is updated (1: no read ahead). It only matters with several tiles
    per program (with one it is 1). These are the kernel's own stages: the tile loop is
    unrolled, so Triton's pipeliner (its ``num_stages``, which would stage tiles through
    shared memory and pick a layout that converts every tile) has no loop to work on."""
    if block_v is None and tiles_per_program is None and pdl:
        block_v = choose_block_v(batch, heads, head_dim_v, compute_units)
        if block_v == head_dim_v and head_dim_v >= 2 * MIN_BLOCK_V:
            block_v, tiles_per_program = head_dim_v // WHOLE_ROW_TILES, WHOLE_ROW_TILES
    if block_v is None:
        block_v = choose_block_v(batch, heads, head_dim_v, compute_units)
    if not (_is_power_of_two(block_v) and block_v <= head_dim_v):
        raise ValueError(f"block_v must be a power of two dividing DV={head_dim_v}, got {block_v}")
    if tiles_per_program is None:
        tiles_per_program = choose_tiles_per_program(batch, heads, head_dim_v, block_v, compute_units)
    if not (_is_power_of_two(tiles_per_program) and block_v * tiles_per_program <= head_dim_v):
        raise ValueError(f"tiles_per_program must be a power of two with block_v * tiles_per_program <= "
                         f"DV={head_dim_v}, got {tiles_per_program} x {block_v}")
    if num_warps is None:
        num_warps = num_warps_for(head_dim, block_v)
    if not (_is_power_of_two(num_warps) and num_warps <= 16):
        raise ValueError(f"num_warps must be a power of two up to 16, got {num_warps}")
    if num_stages is not None and not 1 <= num_stages <= 3:
        raise ValueError(f"num_stages must be 1 to 3, got {num_stages}")
    if num_stages is None:
        num_stages = 2
    num_stages = min(num_stages, tiles_per_program)
    if max_registers is not None and not 24 <= max_registers <= 255:
        raise ValueError(f"max_registers must be 24 to 255, got {max_registers}")
    if evict_state is None:  # on for whole-row tiles of small batches, see the module docstring
        whole_rows = block_v * tiles_per_program == head_dim_v and block_v >= 64
        evict_state = whole_rows and batch * heads < 2 * compute_units
    return LaunchConfig(block_v, tiles_per_program, num_warps, num_stages, bool(evict_state), max_registers,
                        bool(pdl))


def bytes_moved(
    batch: int, heads: int, head_dim: int, head_dim_v: int, conv_kernel: int, act_bytes: int
) -> int:
    """Bytes one step must move at least: state read + write, activations, conv states, weights."""
    hd, hdv = heads * head_dim, heads * head_dim_v
    state = 2 * batch * heads * head_dim * head_dim_v * 4
    activations = batch * (3 * hd + 2 * hdv + heads + hdv) * act_bytes  # q, k, a; v, gate; beta; out
    conv_states = 2 * batch * (2 * hd + hdv) * (conv_kernel - 1) * act_bytes
    weights = (2 * hd + hdv) * conv_kernel * 4 + hd * 4 + heads * 4 + head_dim_v * 4 + batch * 8
    return state + activations + conv_states + weights


def _constexprs(
    heads: int, head_dim: int, head_dim_v: int, conv_kernel: int, config: LaunchConfig
) -> dict[str, int | str]:
    return {"H": heads, "D": head_dim, "DV": head_dim_v, "K": conv_kernel,
            "KP": triton.next_power_of_2(conv_kernel), "BV": config.block_v, "NT": config.tiles_per_program,
            "NS": config.num_stages, "STATE_EVICT": "evict_first" if config.evict_state else "",
            "PDL": config.pdl}


_FP32_POINTERS = ("q_conv_w_ptr", "k_conv_w_ptr", "v_conv_w_ptr", "a_log_ptr", "dt_bias_ptr", "state_ptr",
                  "norm_weight_ptr")


def aot_signature(
    dtype: torch.dtype, heads: int = 12, head_dim: int = 128, head_dim_v: int = 128, block_v: int = 16,
    conv_kernel: int = 4, *, tiles_per_program: int = 1, num_warps: int | None = None, num_stages: int = 2,
    evict_state: bool = False, pdl: bool = False,
) -> tuple[dict[str, str], dict[str, int | str], int]:
    """(signature, constexprs, num_warps) of the kernel as ``kda_decode_fused`` launches it with
    activations and conv states in ``dtype`` and these launch choices (``launch_config``; the
    compiler's own num_stages is 1), for ``aot.compile_for_target``; K3 per-rank defaults.
    ``pdl`` only for CUDA targets (the wait is a CUDA instruction)."""
    config = launch_config(1, heads, head_dim, head_dim_v, 1, block_v=block_v, tiles_per_program=tiles_per_program,
                           num_warps=num_warps, num_stages=num_stages, evict_state=evict_state, pdl=pdl)
    t = TRITON_DTYPES[dtype]
    pointer = {"slots_ptr": "i64", "counter_ptr": "i32", **{name: "fp32" for name in _FP32_POINTERS}}
    signature = {
        arg: f"*{pointer.get(arg, t)}" if arg.endswith("_ptr") else "fp32" if arg in ("lower_bound", "scale", "eps")
        else "constexpr"
        for arg in kda_decode_kernel.arg_names
    }
    return signature, _constexprs(heads, head_dim, head_dim_v, conv_kernel, config), config.num_warps


@functools.cache
def _compute_units(device: torch.device) -> int:
    """SMs / CUs (ROCm reports CUs here too); 1 for the CPU interpreter (one tile per head)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


@functools.cache
def supports_pdl(device: torch.device) -> bool:
    """Programmatic dependent launch: CUDA (not ROCm) from compute capability 9.0."""
    return device.type == "cuda" and torch.version.hip is None and torch.cuda.get_device_capability(device)[0] >= 9


_counters = ArrivalCounters("kda_decode_fused")


# --------------------------------------------------------------------------- checks


def _dtype_names(dtypes: tuple[torch.dtype, ...]) -> str:
    return " or ".join(str(d).removeprefix("torch.") for d in dtypes)


def _expect(
    name: str, t: object, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...], device: torch.device
) -> None:
    """Raise ValueError naming ``name`` unless t is a contiguous tensor of this shape, dtype, device."""
    if not isinstance(t, Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must be {_dtype_names(dtypes)}, got {str(t.dtype).removeprefix('torch.')}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but the state is on {device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {t.stride()}")


def _is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


# --------------------------------------------------------------------------- launcher


def kda_decode_fused(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    conv_weight_q: Tensor,
    conv_weight_k: Tensor,
    conv_weight_v: Tensor,
    conv_state_q: Tensor,
    conv_state_k: Tensor,
    conv_state_v: Tensor,
    a: Tensor,
    A_log: Tensor,
    dt_bias: Tensor,
    lower_bound: float,
    beta: Tensor,
    state: Tensor,
    slots: Tensor,
    scale: float,
    gate: Tensor,
    norm_weight: Tensor,
    eps: float,
    *,
    out: Tensor | None = None,
    block_v: int | None = None,
    tiles_per_program: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    evict_state: bool | None = None,
    max_registers: int | None = None,
    pdl: bool = False,
) -> Tensor:
    """One KDA decode step for B sequences, one launch; updates conv states and state in place.

    q, k [B, H*D] and v [B, H*DV]: q/k/v projections before the conv (model dtype: fp32,
    bf16 or fp16; a, gate share it). conv_weight_* [C, K] fp32 and conv_state_* [S, C, K-1]
    (C = H*D, or H*DV for v). a [B, H*D]: f_b_proj output (gate input); A_log [H] fp32;
    dt_bias [H*D] fp32; beta [B, H]: b_proj logits (sigmoid applied here). state
    [S, H, D, DV] fp32, slots [B] int64 (distinct rows of the states). gate [B, H*DV]:
    g_proj output; norm_weight [DV] fp32 (o_norm). Returns [B, H, DV] in the model dtype
    (written into ``out`` if given).

    Launch choices (``launch_config``; each defaults to the heuristic for this batch and
    device): ``block_v``, the value tile, a power of two dividing DV; ``tiles_per_program``,
    value tiles one program updates in turn; ``num_warps``; ``num_stages``, value tiles in
    flight per program (with several tiles per program); ``evict_state``, the evict-first
    cache hint on the state stream; ``max_registers``, a register cap per thread (CUDA's
    maxnreg; ignored elsewhere; every cap tried on an H200 was slower, BENCHMARKS.md);
    ``pdl``, launch as a programmatic dependent launch (CUDA sm_90+; ValueError elsewhere):
    the caller promises that the kernel launched just before this one on the stream writes
    neither the states nor the slots (it may write the projections, which are read after
    the wait).
    """
    if not isinstance(state, Tensor) or state.dim() != 4:
        raise ValueError(f"state must be a [S, H, D, DV] tensor, got {getattr(state, 'shape', type(state).__name__)}")
    S, H, D, DV = state.shape
    device = state.device
    _expect("state", state, (S, H, D, DV), (torch.float32,), device)
    if not (_is_power_of_two(D) and _is_power_of_two(DV)):
        raise ValueError(f"head dims must be powers of two, got D={D}, DV={DV}")
    if not isinstance(q, Tensor) or q.dim() != 2:
        raise ValueError(f"q must be a [B, H*D] tensor, got {getattr(q, 'shape', type(q).__name__)}")
    B = q.shape[0]
    if not isinstance(conv_weight_q, Tensor) or conv_weight_q.dim() != 2:
        raise ValueError("conv_weight_q must be a [H*D, K] tensor")
    K = conv_weight_q.shape[1]
    if K < 2:
        raise ValueError(f"conv kernel size must be >= 2, got {K}")
    act = q.dtype
    if act not in MODEL_DTYPES:
        raise ValueError(f"q must be {_dtype_names(MODEL_DTYPES)}, got {act}")
    f32 = (torch.float32,)
    floats = MODEL_DTYPES
    for name, t, shape, dtypes in (
        ("q", q, (B, H * D), (act,)),
        ("k", k, (B, H * D), (act,)),
        ("v", v, (B, H * DV), (act,)),
        ("conv_weight_q", conv_weight_q, (H * D, K), f32),
        ("conv_weight_k", conv_weight_k, (H * D, K), f32),
        ("conv_weight_v", conv_weight_v, (H * DV, K), f32),
        ("conv_state_q", conv_state_q, (S, H * D, K - 1), floats),
        ("conv_state_k", conv_state_k, (S, H * D, K - 1), floats),
        ("conv_state_v", conv_state_v, (S, H * DV, K - 1), floats),
        ("a", a, (B, H * D), (act,)),
        ("A_log", A_log, (H,), f32),
        ("dt_bias", dt_bias, (H * D,), f32),
        ("beta", beta, (B, H), floats),
        ("slots", slots, (B,), (torch.int64,)),
        ("gate", gate, (B, H * DV), (act,)),
        ("norm_weight", norm_weight, (DV,), f32),
    ):
        _expect(name, t, shape, dtypes, device)
    if out is None:
        out = torch.empty(B, H, DV, dtype=act, device=device)
    else:
        _expect("out", out, (B, H, DV), (act,), device)
    if pdl and not supports_pdl(device):
        raise ValueError(f"pdl (programmatic dependent launch) needs a CUDA GPU of compute capability 9.0 or "
                         f"newer, got {device}")
    config = launch_config(B, H, D, DV, _compute_units(device), block_v=block_v, tiles_per_program=tiles_per_program,
                           num_warps=num_warps, num_stages=num_stages, evict_state=evict_state,
                           max_registers=max_registers, pdl=pdl)
    if device.type == "cpu" and isinstance(kda_decode_kernel, triton.runtime.jit.JITFunction):
        raise ValueError(
            "kda_decode_fused on CPU tensors needs the Triton interpreter: set TRITON_INTERPRET=1 "
            "before triton is first imported (on CPU the runtime uses the op's torch reference)"
        )
    if B == 0:
        return out

    counters = _counters.get(device, B * H)
    kda_decode_kernel[launch_grid(B, H, DV, config.block_v, config.tiles_per_program)](
        q, k, v,
        conv_weight_q, conv_weight_k, conv_weight_v,
        conv_state_q, conv_state_k, conv_state_v,
        a, A_log, dt_bias, beta, state, slots, gate, norm_weight, out, counters,
        float(lower_bound), float(scale), float(eps),
        **_constexprs(H, D, DV, K, config),
        num_warps=config.num_warps, num_stages=1,  # the kernel has no loop for Triton to pipeline
        **({"maxnreg": config.max_registers} if config.max_registers and device.type == "cuda" else {}),
        **({"launch_pdl": True} if config.pdl else {}),
    )
    return out


# --------------------------------------------------------------------------- k3 op


def kda_decode_fused_op(
    q: Tensor, k: Tensor, v: Tensor, conv_weight_q: Tensor, conv_weight_k: Tensor, conv_weight_v: Tensor,
    conv_state_q: Tensor, conv_state_k: Tensor, conv_state_v: Tensor, a: Tensor, A_log: Tensor,
    dt_bias: Tensor, lower_bound: float, beta: Tensor, state: Tensor, slots: Tensor, scale: float,
    gate: Tensor, norm_weight: Tensor, eps: float,
) -> Tensor:
    """``k3::kda_decode_fused`` as one launch: the launcher needs contiguous activations and
    fp32 conv weights / A_log / dt_bias / norm_weight, so those in another dtype are cast
    here. On CUDA GPUs of compute capability 9.0 or newer it launches with programmatic
    dependent launch (H200: 33.0 -> 30.9 us at batch 64, BENCHMARKS.md) unless it had to
    cast a weight, whose copy the launch just before wrote."""

    def act(t: Tensor) -> Tensor:
        return t.contiguous()

    def f32(t: Tensor) -> Tensor:
        return t.float().contiguous()

    weights = (conv_weight_q, conv_weight_k, conv_weight_v, A_log, dt_bias, norm_weight)
    cast = tuple(f32(w) for w in weights)
    # Programmatic dependent launch lets the kernel read the states, slots and weights
    # before the previous kernel has finished, so none of them may come from that kernel.
    # States are only written by this op, slots are step inputs, weights are parameters;
    # but a weight cast here was written by the launch just before: then no PDL.
    pdl = supports_pdl(state.device) and all(c is w for c, w in zip(cast, weights, strict=True))
    conv_wq, conv_wk, conv_wv, a_log, dt_b, norm_w = cast
    # Caches are passed as they are: they are updated in place (the launcher checks them).
    return kda_decode_fused(
        act(q), act(k), act(v), conv_wq, conv_wk, conv_wv,
        conv_state_q, conv_state_k, conv_state_v, act(a), a_log, dt_b, lower_bound,
        act(beta), state, slots, scale, act(gate), norm_w, eps, pdl=pdl,
    )


def register_kernels(device_type: str) -> None:
    """Make :func:`kda_decode_fused_op` the ``device_type`` implementation of
    ``k3::kda_decode_fused`` (registering again replaces the same function)."""
    fused_op.kda_decode_fused.register_kernel(device_type)(kda_decode_fused_op)
