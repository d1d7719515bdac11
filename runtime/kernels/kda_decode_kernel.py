"""The Triton kernel of the fused single-token KDA decode: everything between the
projections and ``o_proj`` in one launch.

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
two round trips in a row instead of one). ``STATE_EVICT`` puts an evict-first cache hint on
the state stream (touched once per step; when the launcher asks for it:
``kda_decode_plans.launch_config``).

Programmatic dependent launch (``PDL``, the launcher's ``pdl``; CUDA, compute capability 9.0 and newer): the
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

The launch plans (value tile, tiles per program, warps, stages, the hint, PDL) are in
``kda_decode_plans.py``, the launcher and ``k3::kda_decode_fused``'s registration in
``kda_decode.py``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from k3compile.ops.kda import L2NORM_EPS
from k3compile.runtime.kernels import counted

__all__ = ["kda_decode_kernel"]

_L2_EPS = tl.constexpr(L2NORM_EPS)


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


@counted
@triton.jit
def kda_decode_kernel(
    q_ptr, k_ptr, v_ptr,  # [B, H*D], [B, H*D], [B, H*DV] projections (pre-conv), model dtype (rows strided)
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
    # row strides (elements) of q, k, v, a, beta and gate: views of one projection's output
    # (a row of [B, N] holding them side by side) are read in place
    q_stride, k_stride, v_stride, a_stride, beta_stride, gate_stride,
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
    v_row = v_ptr + i_b * v_stride + i_h * DV
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
    a = tl.load(a_ptr + i_b * a_stride + qk_channels).to(tl.float32) + dt_bias
    beta_logit = tl.load(beta_ptr + i_b * beta_stride + i_h).to(tl.float32)
    gate_row = gate_ptr + i_b * gate_stride + i_h * DV
    if DIRECT:
        gate0 = tl.load(gate_row + tile_v)
        if NT == 2:
            gate1 = tl.load(gate_row + BV + tile_v)
    tl.debug_barrier()
    q, q_window = _conv_apply(tl.load(q_ptr + i_b * q_stride + qk_channels), q_stored, q_w, cols, K)
    k, k_window = _conv_apply(tl.load(k_ptr + i_b * k_stride + qk_channels), k_stored, k_w, cols, K)
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
            _shift_conv_state(q_ptr + i_b * q_stride, q_conv_state, qk_channels, cols, K)
            _shift_conv_state(k_ptr + i_b * k_stride, k_conv_state, qk_channels, cols, K)
            tl.store(counter, 0)
