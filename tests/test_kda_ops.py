"""Tests for the KDA ops in k3compile.ops.kda (fp32 reference math, CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import k3compile.ops  # noqa: F401  (registers torch.ops.k3.*)
from k3compile.ops.kda import kda_chunked, kda_recurrent, l2norm

H, D, DV = 2, 16, 16
SCALE = D**-0.5
LENGTHS = [1, 3, 64, 70, 130]
K_CONV = 4


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _inputs(T: int, gen: torch.Generator, weak_decay: bool = False):
    """Raw (un-normalised) q, k, v, gate output g, beta for T tokens."""
    q = torch.randn(T, H, D, generator=gen)
    k = torch.randn(T, H, D, generator=gen)
    v = torch.randn(T, H, DV, generator=gen)
    if weak_decay:
        # Near-1 decays keep the whole chunk coupled: stresses the triangular solve.
        g = -0.05 * torch.rand(T, H, D, generator=gen)
    else:
        a = torch.randn(T, H, D, generator=gen)
        A_log = torch.randn(H, generator=gen) * 0.5
        dt_bias = torch.randn(H * D, generator=gen) * 0.5
        g = torch.ops.k3.kda_gate(a, A_log, dt_bias, -5.0)
    beta = torch.rand(T, H, generator=gen)
    return q, k, v, g, beta


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


# --------------------------------------------------------------------------- delta rule


@pytest.mark.parametrize("T", LENGTHS)
@pytest.mark.parametrize("weak_decay", [False, True])
def test_chunked_matches_recurrent(T: int, weak_decay: bool) -> None:
    gen = _gen(T)
    q, k, v, g, beta = _inputs(T, gen, weak_decay)
    q, k = l2norm(q), l2norm(k)
    S0 = torch.randn(H, D, DV, generator=gen)
    o_ref, s_ref = kda_recurrent(q, k, v, g, beta, SCALE, S0)
    o, s = kda_chunked(q, k, v, g, beta, SCALE, S0)
    torch.testing.assert_close(o, o_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(s, s_ref, rtol=1e-4, atol=1e-5)
    # The helpers must not write through to the caller's initial state.
    o0, s0 = kda_chunked(q, k, v, g, beta, SCALE, None)
    o0_ref, s0_ref = kda_recurrent(q, k, v, g, beta, SCALE, None)
    torch.testing.assert_close(o0, o0_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(s0, s0_ref, rtol=1e-4, atol=1e-5)


def test_chunked_small_chunk_size() -> None:
    gen = _gen(1)
    q, k, v, g, beta = _inputs(37, gen, weak_decay=True)
    q, k = l2norm(q), l2norm(k)
    S0 = torch.randn(H, D, DV, generator=gen)
    o_ref, s_ref = kda_recurrent(q, k, v, g, beta, SCALE, S0)
    o, s = kda_chunked(q, k, v, g, beta, SCALE, S0, chunk_size=8)
    torch.testing.assert_close(o, o_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(s, s_ref, rtol=1e-4, atol=1e-5)


def test_l2norm_convention() -> None:
    x = torch.randn(5, H, D, generator=_gen(2))
    expected = x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(l2norm(x), expected)
    # eps dominates a zero vector instead of dividing by zero.
    assert torch.equal(l2norm(torch.zeros(1, D)), torch.zeros(1, D))


def test_prefill_packed_permuted_slots() -> None:
    gen = _gen(3)
    lengths = LENGTHS
    q, k, v, g, beta = _inputs(sum(lengths), gen)
    n_slots = 8
    state = torch.randn(n_slots, H, D, DV, generator=gen)
    state_before = state.clone()
    slots = torch.tensor([5, 0, 7, 2, 3], dtype=torch.int64)
    cu = _cu(lengths)

    out = torch.ops.k3.kda_prefill(q, k, v, g, beta, state, cu, slots, SCALE)

    assert out.shape == v.shape and out.dtype == v.dtype
    qn, kn = l2norm(q), l2norm(k)
    for i, slot in enumerate(slots.tolist()):
        s, e = cu[i].item(), cu[i + 1].item()
        o_ref, s_ref = kda_recurrent(
            qn[s:e], kn[s:e], v[s:e], g[s:e], beta[s:e], SCALE, state_before[slot]
        )
        torch.testing.assert_close(out[s:e], o_ref, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(state[slot], s_ref, rtol=1e-4, atol=1e-5)
    for slot in sorted(set(range(n_slots)) - set(slots.tolist())):
        assert torch.equal(state[slot], state_before[slot])


def test_prefill_then_decode_matches_full_prefill() -> None:
    gen = _gen(4)
    lengths = [70, 5]  # a chunk boundary inside the first, a tiny second sequence
    n_decode = 4
    full = [_inputs(L, gen) for L in lengths]
    n_slots = 4
    slots = torch.tensor([3, 1], dtype=torch.int64)

    def pack(parts, lo, hi):
        return [torch.cat([p[j][lo(L):hi(L)] for p, L in zip(parts, lengths)]) for j in range(5)]

    # Reference: one prefill of every full sequence.
    state_ref = torch.zeros(n_slots, H, D, DV)
    o_full = torch.ops.k3.kda_prefill(
        *pack(full, lambda L: 0, lambda L: L), state_ref, _cu(lengths), slots, SCALE
    )

    # Prefill all but the last n_decode tokens, then decode them as a batch of 2.
    state = torch.zeros(n_slots, H, D, DV)
    pre_lengths = [L - n_decode for L in lengths]
    o_pre = torch.ops.k3.kda_prefill(
        *pack(full, lambda L: 0, lambda L: L - n_decode), state, _cu(pre_lengths), slots, SCALE
    )
    cu_full = _cu(lengths)
    cu_pre = _cu(pre_lengths)
    for i in range(len(lengths)):
        torch.testing.assert_close(
            o_pre[cu_pre[i] : cu_pre[i + 1]],
            o_full[cu_full[i] : cu_full[i + 1] - n_decode],
            rtol=1e-4, atol=1e-5,
        )
    for t in range(n_decode):
        step = [torch.stack([p[j][L - n_decode + t] for p, L in zip(full, lengths)]) for j in range(5)]
        o_dec = torch.ops.k3.kda_decode(*step, state, slots, SCALE)
        for i in range(len(lengths)):
            torch.testing.assert_close(
                o_dec[i], o_full[cu_full[i + 1] - n_decode + t], rtol=1e-4, atol=1e-5
            )
    torch.testing.assert_close(state, state_ref, rtol=1e-4, atol=1e-5)


def test_prefill_bf16_io() -> None:
    gen = _gen(5)
    q, k, v, g, beta = _inputs(20, gen)
    state = torch.zeros(1, H, D, DV)
    slots = torch.tensor([0])
    out = torch.ops.k3.kda_prefill(
        q.bfloat16(), k.bfloat16(), v.bfloat16(), g, beta.bfloat16(), state, _cu([20]), slots, SCALE
    )
    assert out.dtype == torch.bfloat16 and state.dtype == torch.float32
    ref = torch.ops.k3.kda_prefill(
        q.bfloat16().float(), k.bfloat16().float(), v.bfloat16().float(), g,
        beta.bfloat16().float(), torch.zeros(1, H, D, DV), _cu([20]), slots, SCALE,
    )
    torch.testing.assert_close(out, ref.bfloat16())


# --------------------------------------------------------------------------- fla cross-check


def test_recurrent_matches_fla_naive_recurrent() -> None:
    from fla.ops.kda.naive import naive_recurrent_kda

    gen = _gen(6)
    B, T = 2, 70
    parts = [_inputs(T, gen) for _ in range(B)]
    q, k, v, g, beta = (torch.stack([p[j] for p in parts]) for j in range(5))
    q, k = l2norm(q), l2norm(k)
    S0 = torch.randn(B, H, D, DV, generator=gen)
    o_fla, s_fla = naive_recurrent_kda(
        q, k, v, g, beta, scale=SCALE, initial_state=S0, output_final_state=True
    )
    for b in range(B):
        o, s = kda_recurrent(q[b], k[b], v[b], g[b], beta[b], SCALE, S0[b])
        torch.testing.assert_close(o, o_fla[b], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(s, s_fla[b], rtol=1e-4, atol=1e-5)


def test_prefill_op_matches_fla_naive_chunk() -> None:
    from fla.ops.kda.naive import naive_chunk_kda

    gen = _gen(7)
    T = 128  # fla's naive chunk form needs T % 64 == 0
    # Moderate decays: fla's naive form exponentiates unmasked positive gate
    # differences, which overflow for the full (-5, 0) range.
    q, k, v, _, beta = _inputs(T, gen)
    g = -0.2 * torch.rand(T, H, D, generator=gen)
    S0 = torch.randn(H, D, DV, generator=gen)
    o_fla, s_fla = naive_chunk_kda(
        l2norm(q)[None], l2norm(k)[None], v[None], g[None], beta[None],
        scale=SCALE, initial_state=S0[None], output_final_state=True,
    )
    state = torch.zeros(3, H, D, DV)
    state[2] = S0
    out = torch.ops.k3.kda_prefill(q, k, v, g, beta, state, _cu([T]), torch.tensor([2]), SCALE)
    torch.testing.assert_close(out, o_fla[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state[2], s_fla[0], rtol=1e-4, atol=1e-4)


def test_gate_matches_fla() -> None:
    from fla.ops.kda.gate import naive_kda_lowerbound_gate

    gen = _gen(8)
    a = torch.randn(9, H, D, generator=gen).bfloat16()
    A_log = torch.randn(H, generator=gen)
    dt_bias = torch.randn(H * D, generator=gen)
    g = torch.ops.k3.kda_gate(a, A_log, dt_bias, -5.0)
    ref = naive_kda_lowerbound_gate(a, A_log, dt_bias, lower_bound=-5.0)
    assert g.dtype == torch.float32
    torch.testing.assert_close(g, ref)
    assert bool((g < 0).all()) and bool((g > -5.0).all())


# --------------------------------------------------------------------------- short conv


def _conv_inputs(lengths: list[int], C: int, gen: torch.Generator):
    x = torch.randn(sum(lengths), C, generator=gen)
    weight = torch.randn(C, K_CONV, generator=gen)
    return x, weight


def test_short_conv_prefill_matches_conv1d() -> None:
    gen = _gen(9)
    C = 6
    lengths = [1, 2, 10, 5]  # includes sequences shorter than K-1
    x, weight = _conv_inputs(lengths, C, gen)
    conv_state = torch.full((6, C, K_CONV - 1), 7.0)
    slots = torch.tensor([4, 1, 0, 3])
    conv_state[slots] = 0.0  # the caller zeroes fresh sequences' slots
    untouched = conv_state[[2, 5]].clone()
    cu = _cu(lengths)
    y = torch.ops.k3.short_conv_prefill(x, weight, conv_state, cu, slots)
    for i, slot in enumerate(slots.tolist()):
        s, e = cu[i].item(), cu[i + 1].item()
        xs = x[s:e].T[None]  # [1, C, L]
        ref = F.silu(F.conv1d(F.pad(xs, (K_CONV - 1, 0)), weight[:, None, :], groups=C))[0].T
        torch.testing.assert_close(y[s:e], ref, rtol=1e-5, atol=1e-6)
        # New state = last K-1 inputs, left-padded with the (zero) old state.
        expected_state = F.pad(xs[0], (K_CONV - 1, 0))[:, -(K_CONV - 1) :]
        torch.testing.assert_close(conv_state[slot], expected_state)
    assert torch.equal(conv_state[[2, 5]], untouched)


def test_short_conv_prefill_then_decode_matches_single_prefill() -> None:
    gen = _gen(10)
    C = 5
    L = 9
    x, weight = _conv_inputs([L], C, gen)
    slot = torch.tensor([1])

    ref_state = torch.zeros(2, C, K_CONV - 1)
    y_ref = torch.ops.k3.short_conv_prefill(x, weight, ref_state, _cu([L]), slot)

    # Prefill in pieces of 1 and 2 tokens (shorter than K-1), then decode the rest.
    state = torch.zeros(2, C, K_CONV - 1)
    ys = [
        torch.ops.k3.short_conv_prefill(x[0:1], weight, state, _cu([1]), slot),
        torch.ops.k3.short_conv_prefill(x[1:3], weight, state, _cu([2]), slot),
        torch.ops.k3.short_conv_prefill(x[3:6], weight, state, _cu([3]), slot),
    ]
    for t in range(6, L):
        ys.append(torch.ops.k3.short_conv_decode(x[t : t + 1], weight, state, slot))
    torch.testing.assert_close(torch.cat(ys), y_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(state, ref_state)


def test_short_conv_decode_batch_and_dtypes() -> None:
    gen = _gen(11)
    C, B = 4, 3
    x = torch.randn(B, C, generator=gen).bfloat16()
    weight = torch.randn(C, K_CONV, generator=gen)
    state = torch.randn(5, C, K_CONV - 1, generator=gen).bfloat16()
    before = state.clone()
    slots = torch.tensor([4, 0, 2])
    y = torch.ops.k3.short_conv_decode(x, weight, state, slots)
    assert y.dtype == torch.bfloat16 and state.dtype == torch.bfloat16
    for b, slot in enumerate(slots.tolist()):
        xx = torch.cat([before[slot].float(), x[b].float()[:, None]], dim=1)
        ref = F.silu((xx * weight).sum(-1))
        torch.testing.assert_close(y[b], ref.bfloat16())
        assert torch.equal(state[slot], xx[:, 1:].bfloat16())
    assert torch.equal(state[[1, 3]], before[[1, 3]])


# --------------------------------------------------------------------------- output norm


def test_gated_rms_norm() -> None:
    gen = _gen(12)
    x = torch.randn(7, H, D, generator=gen)
    gate = torch.randn(7, H, D, generator=gen)
    weight = torch.randn(D, generator=gen)
    out = torch.ops.k3.gated_rms_norm(x.bfloat16(), gate.bfloat16(), weight, 1e-5)
    assert out.dtype == torch.bfloat16
    xb, gb = x.bfloat16().double(), gate.bfloat16().double()
    ref = xb / torch.sqrt((xb**2).mean(-1, keepdim=True) + 1e-5) * weight.double() * torch.sigmoid(gb)
    torch.testing.assert_close(out, ref.bfloat16())


# --------------------------------------------------------------------------- opcheck


def _opcheck_cases():
    gen = _gen(13)
    q, k, v, g, beta = _inputs(5, gen)
    state = torch.randn(4, H, D, DV, generator=gen)
    C = 6
    x = torch.randn(5, C, generator=gen)
    w = torch.randn(C, K_CONV, generator=gen)
    conv_state = torch.randn(4, C, K_CONV - 1, generator=gen)
    cu = _cu([3, 2])
    slots = torch.tensor([2, 0])
    return {
        "short_conv_prefill": (x, w, conv_state, cu, slots),
        "short_conv_decode": (x[:2], w, conv_state, slots),
        "kda_gate": (torch.randn(5, H, D, generator=gen), torch.randn(H, generator=gen),
                     torch.randn(H * D, generator=gen), -5.0),
        "kda_prefill": (q, k, v, g, beta, state, cu, slots, SCALE),
        "kda_decode": (q[:2], k[:2], v[:2], g[:2], beta[:2], state, slots, SCALE),
        "gated_rms_norm": (q, k, torch.randn(D, generator=gen), 1e-5),
    }


@pytest.mark.parametrize("name", list(_opcheck_cases()))
def test_opcheck(name: str) -> None:
    args = _opcheck_cases()[name]
    torch.library.opcheck(getattr(torch.ops.k3, name).default, args)
