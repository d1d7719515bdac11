"""KDA (Kimi Delta Attention) ops: short conv, decay gate, delta rule, gated RMSNorm.

Math: ../shared/K3_ARCHITECTURE.md section 3 "KDA layer"; the delta-rule reference is
fla-org/flash-linear-attention ``fla/ops/kda/{naive,gate,fused_recurrent}.py``.

Packing. Prefill tensors are token-major ``[T, ...]`` holding N sequences back to back,
delimited by ``cu_seqlens`` (int32, [N+1], ``cu_seqlens[0] == 0``). Decode tensors are
``[B, ...]``, one token per sequence. ``slots`` (int64, [N] or [B], on the state's
device) names the row of the state tensors each sequence owns; slots within one call
must be distinct. The caller zeroes the slots of new sequences before their first
prefill.

State layouts (per slot, head-sharded like the weights):

- conv state ``[S, C, K-1]``: the last K-1 pre-conv inputs per channel, oldest first,
  in the conv_state tensor's dtype (C = H*D of one of q/k/v; K = 4).
- recurrent state ``[S, H, D, Dv]`` fp32: S per head is ``[D_k, D_v]``, the layout of
  fla's KDA kernels (``initial_state`` ``[B, H, K, V]``); prefill and decode share it.

Ops (all ``k3::``; each has an fp32 pure-torch reference that runs on any device, and a
fake implementation for export):

- ``short_conv_prefill(x, weight, conv_state, cu_seqlens, slots)``: depthwise causal
  conv (kernel K) then SiLU per sequence, continuing from and updating the conv state.
  ``y[t] = silu(sum_j weight[:, j] * xx[t + j])``, ``xx = conv_state[slot] ++ x_seq``.
- ``short_conv_decode(x, weight, conv_state, slots)``: the same for one token/sequence.
- ``kda_gate(a, A_log, dt_bias, lower_bound)``: fp32 log-decay
  ``g = lower_bound * sigmoid(exp(A_log[h]) * (a + dt_bias))`` in (lower_bound, 0);
  same as fla's ``naive_kda_lowerbound_gate`` (A_log one per head).
- ``kda_prefill(q, k, v, g, beta, state, cu_seqlens, slots, scale)``: L2-normalise q, k,
  scale q, run the gated delta rule per sequence in the chunked (WY/UT, chunk 64)
  form starting from ``state[slot]``, write the final state back.
- ``kda_decode(q, k, v, g, beta, state, slots, scale)``: one recurrent step per sequence.
- ``gated_rms_norm(x, gate, weight, eps)``: ``RMSNorm_D(x) * weight * sigmoid(gate)``.

Delta rule per head, per token (fp32): ``S <- diag(exp g) S; u = v - S^T k;
S <- S + beta k u^T; o = S^T q`` (o is read after the update).

L2 norm convention: fla's ``l2norm`` / ``use_qk_l2norm_in_kernel``, i.e.
``x / sqrt(sum(x^2) + 1e-6)`` (eps inside the square root, sum not mean), computed in
fp32 before the ``scale`` multiply.

Plain helpers ``kda_recurrent`` and ``kda_chunked`` run one sequence in ``[T, H, ...]``
layout on already-normalised q/k; the ops and the tests use them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "l2norm",
    "kda_recurrent",
    "kda_chunked",
    "short_conv_prefill",
    "short_conv_prefill_reference",
    "short_conv_decode",
    "kda_gate",
    "kda_prefill",
    "kda_prefill_reference",
    "kda_decode",
    "gated_rms_norm",
]

L2NORM_EPS = 1e-6


def l2norm(x: Tensor, eps: float = L2NORM_EPS) -> Tensor:
    """fp32 L2 normalisation over the last dim, fla's convention (eps inside the sqrt)."""
    x = x.float()
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + eps)


def _initial_state(
    initial_state: Tensor | None, H: int, D: int, Dv: int, device: torch.device
) -> Tensor:
    if initial_state is None:
        return torch.zeros(H, D, Dv, dtype=torch.float32, device=device)
    # clone: the helpers must never write through to the caller's state tensor.
    return initial_state.to(device=device, dtype=torch.float32).clone()


def kda_recurrent(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float,
    initial_state: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Token-by-token gated delta rule for one sequence.

    q, k [T, H, D] (already L2-normalised; q is multiplied by ``scale`` here), v [T, H, Dv],
    g [T, H, D] log-decay, beta [T, H], initial_state [H, D, Dv] or None (zeros).
    Returns (o [T, H, Dv] in v.dtype, final state [H, D, Dv] fp32).
    """
    T, H, D = q.shape
    Dv = v.shape[-1]
    S = _initial_state(initial_state, H, D, Dv, q.device)
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    q = q * scale
    o = torch.empty(T, H, Dv, dtype=torch.float32, device=q.device)
    for t in range(T):
        S = S * g[t].exp()[..., None]
        u = v[t] - torch.einsum("hd,hdv->hv", k[t], S)
        S = S + (beta[t][:, None] * k[t])[..., None] * u[:, None, :]
        o[t] = torch.einsum("hd,hdv->hv", q[t], S)
    return o.to(v.dtype), S


def kda_chunked(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float,
    initial_state: Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[Tensor, Tensor]:
    """Chunked (WY / UT transform) gated delta rule; same contract as ``kda_recurrent``.

    Within a chunk with start state S0 and inclusive in-chunk gate cumsum G_r, unrolling
    the recurrence gives
        S_r = diag(e^{G_r}) S0 + sum_{j<=r} beta_j diag(e^{G_r - G_j}) k_j u_j^T
        u_r = v_r - (k_r e^{G_r})^T S0 - sum_{j<r} A[r, j] u_j,
        A[r, j] = beta_j k_r^T diag(e^{G_r - G_j}) k_j        (strictly lower)
    so (I + A) U = V - (K e^G) S0, i.e. U = Ũ - W S0 with Ũ = (I+A)^-1 V and
    W = (I+A)^-1 (K e^G). Phases: (1) per chunk, in parallel: A, Ũ, W and the
    query-key matrix; (2) sequential scan of chunk start states; (3) per chunk, in
    parallel: o_r = (q_r e^{G_r})^T S0 + sum_{j<=r} beta_j q_r^T diag(e^{G_r-G_j}) k_j u_j.
    Requires g <= 0 (a log-decay) so that every exponent taken is <= 0.
    """
    T, H, D = q.shape
    Dv = v.shape[-1]
    device = q.device
    S = _initial_state(initial_state, H, D, Dv, device)
    if T == 0:
        return v.new_empty(0, H, Dv), S
    BT = chunk_size
    NT = math.ceil(T / BT)
    pad = NT * BT - T

    # Padding tokens get k = v = q = 0, g = 0, beta = 0: they neither decay nor write
    # the state, so the last chunk's end state is the state after the last real token.
    def chunked(x: Tensor) -> Tensor:
        x = x.float()
        if pad:
            x = torch.cat([x, x.new_zeros(pad, *x.shape[1:])], dim=0)
        x = x.reshape(NT, BT, *x.shape[1:])
        # [NT, BT, H, ...] -> [H, NT, BT, ...]
        return x.permute(2, 0, 1, *range(3, x.dim())).contiguous()

    q, k, v, g, beta = (chunked(t) for t in (q, k, v, g, beta))
    q = q * scale
    G = g.cumsum(dim=2)

    # Phase 1. Pairwise decays e^{G_r - G_j} cannot be factored as e^{G_r} e^{-G_j}
    # (e^{-G_j} overflows fp32 once |G| > 88, reachable at gate -5 within 18 tokens),
    # so build them one key column at a time: memory stays O(size of k).
    rows = torch.arange(BT, device=device)
    Akk = torch.zeros(H, NT, BT, BT, dtype=torch.float32, device=device)
    Aqk = torch.zeros_like(Akk)
    for j in range(BT):
        diff = G - G[:, :, j : j + 1, :]
        decay = diff.masked_fill((rows < j)[:, None], float("-inf")).exp()
        kj = decay * k[:, :, j : j + 1, :]
        Akk[..., j] = (k * kj).sum(-1)
        Aqk[..., j] = (q * kj).sum(-1)
    Akk = Akk.tril(-1) * beta[:, :, None, :]
    Aqk = Aqk * beta[:, :, None, :]
    eye = torch.eye(BT, dtype=torch.float32, device=device)
    rhs = torch.cat([k * G.exp(), v], dim=-1)
    sol = torch.linalg.solve_triangular(Akk + eye, rhs, upper=False, unitriangular=True)
    W, U_tilde = sol[..., :D], sol[..., D:]

    # Phase 2: chunk-state scan.
    G_last = G[:, :, -1, :]  # [H, NT, D]
    k_to_end = k * (G_last[:, :, None, :] - G).exp() * beta[..., None]
    S_start = torch.empty(H, NT, D, Dv, dtype=torch.float32, device=device)
    U = torch.empty(H, NT, BT, Dv, dtype=torch.float32, device=device)
    for c in range(NT):
        S_start[:, c] = S
        Uc = U_tilde[:, c] - W[:, c] @ S
        U[:, c] = Uc
        S = G_last[:, c].exp()[..., None] * S + k_to_end[:, c].transpose(-1, -2) @ Uc

    # Phase 3: outputs of all chunks at once.
    o = (q * G.exp()) @ S_start + Aqk @ U  # [H, NT, BT, Dv]
    o = o.permute(1, 2, 0, 3).reshape(NT * BT, H, Dv)[:T]
    return o.to(v.dtype), S


# --------------------------------------------------------------------------- short conv


def _conv_silu(xx: Tensor, weight: Tensor, L: int) -> Tensor:
    """xx [K-1+L, C] fp32 (history ++ inputs), weight [C, K] -> silu(conv) [L, C] fp32."""
    w = weight.float()
    acc = torch.zeros(L, xx.shape[1], dtype=torch.float32, device=xx.device)
    for j in range(w.shape[1]):
        acc = acc + w[:, j] * xx[j : j + L]
    return F.silu(acc)


@torch.library.custom_op("k3::short_conv_prefill", mutates_args=("conv_state",))
def short_conv_prefill(
    x: Tensor, weight: Tensor, conv_state: Tensor, cu_seqlens: Tensor, slots: Tensor
) -> Tensor:
    """Depthwise causal conv + SiLU over packed sequences; updates conv_state[slots]."""
    return short_conv_prefill_reference(x, weight, conv_state, cu_seqlens, slots)


def short_conv_prefill_reference(
    x: Tensor, weight: Tensor, conv_state: Tensor, cu_seqlens: Tensor, slots: Tensor
) -> Tensor:
    """``k3::short_conv_prefill``'s torch reference (the numerical truth), sequence by sequence."""
    out = torch.empty_like(x)
    bounds = cu_seqlens.tolist()
    slot_list = slots.tolist()
    for i, slot in enumerate(slot_list):
        start, end = bounds[i], bounds[i + 1]
        L = end - start
        hist = conv_state[slot].float().transpose(0, 1)  # [K-1, C], oldest first
        xx = torch.cat([hist, x[start:end].float()], dim=0)
        if L:
            out[start:end] = _conv_silu(xx, weight, L).to(x.dtype)
        # Taking the tail of (history ++ inputs) also covers L < K-1.
        keep = conv_state.shape[2]
        conv_state[slot] = xx[xx.shape[0] - keep :].transpose(0, 1).to(conv_state.dtype)
    return out


@short_conv_prefill.register_fake
def _(x: Tensor, weight: Tensor, conv_state: Tensor, cu_seqlens: Tensor, slots: Tensor) -> Tensor:
    return x.new_empty(x.shape)


@torch.library.custom_op("k3::short_conv_decode", mutates_args=("conv_state",))
def short_conv_decode(x: Tensor, weight: Tensor, conv_state: Tensor, slots: Tensor) -> Tensor:
    """One token per sequence: conv over (conv_state[slot] ++ x) + SiLU; shifts the state."""
    xx = torch.cat([conv_state[slots].float(), x.float()[:, :, None]], dim=2)  # [B, C, K]
    y = F.silu((xx * weight.float()).sum(-1))
    conv_state.index_copy_(0, slots, xx[:, :, 1:].to(conv_state.dtype))
    return y.to(x.dtype)


@short_conv_decode.register_fake
def _(x: Tensor, weight: Tensor, conv_state: Tensor, slots: Tensor) -> Tensor:
    return x.new_empty(x.shape)


# --------------------------------------------------------------------------- gate


@torch.library.custom_op("k3::kda_gate", mutates_args=())
def kda_gate(a: Tensor, A_log: Tensor, dt_bias: Tensor, lower_bound: float) -> Tensor:
    """fp32 log-decay g = lower_bound * sigmoid(exp(A_log[h]) * (a + dt_bias)), a [T, H, D]."""
    H, D = a.shape[-2:]
    z = a.float() + dt_bias.float().view(H, D)
    return lower_bound * torch.sigmoid(A_log.float().view(H, 1).exp() * z)


@kda_gate.register_fake
def _(a: Tensor, A_log: Tensor, dt_bias: Tensor, lower_bound: float) -> Tensor:
    return a.new_empty(a.shape, dtype=torch.float32)


# --------------------------------------------------------------------------- delta rule


@torch.library.custom_op("k3::kda_prefill", mutates_args=("state",))
def kda_prefill(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state: Tensor,
    cu_seqlens: Tensor,
    slots: Tensor,
    scale: float,
) -> Tensor:
    """Chunked KDA over packed sequences from state[slots]; writes final states back."""
    return kda_prefill_reference(q, k, v, g, beta, state, cu_seqlens, slots, scale)


def kda_prefill_reference(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, cu_seqlens: Tensor, slots: Tensor,
    scale: float,
) -> Tensor:
    """``k3::kda_prefill``'s torch reference (the numerical truth): :func:`kda_chunked` per
    sequence, in place on ``state[slots]``."""
    T, H, _ = q.shape
    out = v.new_empty(T, H, v.shape[-1])
    qn, kn = l2norm(q), l2norm(k)
    bounds = cu_seqlens.tolist()
    for i, slot in enumerate(slots.tolist()):
        start, end = bounds[i], bounds[i + 1]
        o, S = kda_chunked(
            qn[start:end], kn[start:end], v[start:end], g[start:end], beta[start:end],
            scale, state[slot],
        )
        out[start:end] = o
        state[slot] = S.to(state.dtype)
    return out


@kda_prefill.register_fake
def _(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state: Tensor,
    cu_seqlens: Tensor,
    slots: Tensor,
    scale: float,
) -> Tensor:
    return v.new_empty(v.shape)


@torch.library.custom_op("k3::kda_decode", mutates_args=("state",))
def kda_decode(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, slots: Tensor,
    scale: float,
) -> Tensor:
    """One recurrent KDA step per sequence (q, k [B, H, D]); updates state[slots]."""
    q = l2norm(q) * scale
    k = l2norm(k)
    S = state[slots].float() * g.float().exp()[..., None]  # [B, H, D, Dv]
    u = v.float() - torch.einsum("bhd,bhdv->bhv", k, S)
    S = S + (beta.float()[..., None] * k)[..., None] * u[..., None, :]
    o = torch.einsum("bhd,bhdv->bhv", q, S)
    state.index_copy_(0, slots, S.to(state.dtype))
    return o.to(v.dtype)


@kda_decode.register_fake
def _(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, slots: Tensor,
    scale: float,
) -> Tensor:
    return v.new_empty(v.shape)


# --------------------------------------------------------------------------- output norm


@torch.library.custom_op("k3::gated_rms_norm", mutates_args=())
def gated_rms_norm(x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Per-head RMSNorm over D times weight, gated by sigmoid(gate); fp32 math."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps) * weight.float()
    return (y * torch.sigmoid(gate.float())).to(x.dtype)


@gated_rms_norm.register_fake
def _(x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
    return x.new_empty(x.shape)


# Placement rule and cost: k3compile/placement/k3_rules.py.
