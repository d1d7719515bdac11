"""The packed-sequence prefill ops as standard torch operators, for exporters.

The references of ``short_conv_prefill``, ``kda_prefill`` and ``mla_prefill`` loop on the
host over ``cu_seqlens.tolist()``. Here the sequence boundaries are data instead: each
packed token's sequence and its place among the sequence's new tokens come from
comparisons with ``cu_seqlens`` (:func:`token_sequences`), and every op works on all
tokens at once with gathers and masks. Nothing reads a tensor's value on the host, so
``torch.export`` traces them with a dynamic token count and batch. Each keeps its op's
contract: the caches given are updated in place (the export's copies of them), a new
sequence's state slot is zero beforehand (the runtime zeroes it), and a sequence may
continue from the state and cache of its earlier tokens.

``kda_prefill`` runs the gated delta rule as a segmented scan of affine maps. One token's
update of a head's state ``S`` [D, Dv] is ``S <- M S + B`` with

    M = (I - beta k k^T) diag(e^g) = diag(e^g) - (beta k)(k e^g)^T,    B = beta k v^T

(``kda_recurrent``'s step). Maps compose associatively, ``(M2, B2) o (M1, B1) = (M2 M1,
M2 B1 + B2)``, so ``ceil(log2 n)`` doubling steps (Hillis-Steele: each token composes
with the token ``span`` before it when that one is of the same sequence, span 1, 2, 4,
...) give every token the map from its sequence's start state, for sequences of at most
``n`` new tokens. The number of steps is fixed when the trace is made: ``n`` is the
upper bound of the traced token count (a dynamic dimension's ``max``), which bounds every
sequence. Every ``M`` is a contraction (``|k| <= 1``, ``0 < beta < 1``, ``g < 0``), so
no product grows: no exponential of a cumulative gate is taken, and nothing overflows
whatever the sequence's length. Memory is O(T H D (D + Dv)); the work O(T H D^2 (D +
Dv) log n), affordable at an export's sizes.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from k3compile.mla_cache_fp8 import cache_rows_as_values, cache_value_width
from k3compile.ops.kda import l2norm


def token_sequences(cu_seqlens: Tensor, tokens: int) -> tuple[Tensor, Tensor]:
    """For each of ``tokens`` packed tokens: its sequence's index, and its index among
    that sequence's new tokens (int64 [tokens] each). Sequences without new tokens are
    skipped over."""
    cu = cu_seqlens.long()
    t = torch.arange(tokens, device=cu.device)
    seq = (t[:, None] >= cu[1:][None, :]).sum(1)
    return seq, t - cu[seq]


def size_bound(size: int | torch.SymInt) -> int:
    """``size`` itself, or the upper bound of a traced size's range (its dynamic
    dimension's ``max``); a ValueError when the range has none."""
    if isinstance(size, int):
        return size
    upper = size.node.shape_env.bound_sympy(size.node.expr).upper
    if not upper.is_finite:
        raise ValueError(f"the token count {size} has no upper bound: the scan's steps need one")
    return int(upper)


def _history_and_inputs(x: Tensor, history: Tensor, starts: Tensor, seq: Tensor, index: Tensor) -> Tensor:
    """Rows ``index`` of sequence ``seq``'s (history ++ new inputs), [..., C] fp32, where
    ``history`` [N, K-1, C] holds each sequence's last K-1 earlier inputs (oldest first)
    and its new inputs are ``x[starts[seq]:]``."""
    keep = history.shape[1]
    rows = x[(starts[seq] + index - keep).clamp(min=0)]
    return torch.where((index >= keep)[..., None], rows, history[seq, index.clamp(max=keep - 1)])


def short_conv_prefill(x: Tensor, weight: Tensor, conv_state: Tensor, cu_seqlens: Tensor, slots: Tensor) -> Tensor:
    """``k3::short_conv_prefill``: token t reads the K inputs ending at itself of its
    sequence's (conv state ++ new inputs); each sequence's state becomes the last K-1."""
    T, K = x.shape[0], weight.shape[1]
    cu = cu_seqlens.long()
    starts, lengths = cu[:-1], cu[1:] - cu[:-1]
    history = conv_state[slots].float().transpose(1, 2)  # [N, K-1, C]
    xf = x.float()
    seq, index = token_sequences(cu_seqlens, T)
    taps = torch.arange(K, device=x.device)
    window = _history_and_inputs(xf, history, starts, seq[:, None], index[:, None] + taps)  # [T, K, C]
    y = F.silu((window * weight.float().t()).sum(1))
    sequences = torch.arange(slots.shape[0], device=x.device)
    tail = _history_and_inputs(xf, history, starts, sequences[:, None], lengths[:, None] + taps[:K - 1])
    conv_state.index_copy_(0, slots, tail.transpose(1, 2).to(conv_state.dtype))
    return y.to(x.dtype)


def kda_prefill(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, cu_seqlens: Tensor,
                slots: Tensor, scale: float) -> Tensor:
    """``k3::kda_prefill`` as a segmented scan of the per-token affine state maps (module
    docstring), from ``state[slots]``; each sequence's final state written back."""
    T, H, D = q.shape
    q, k = l2norm(q) * scale, l2norm(k)
    decay, bk = g.float().exp(), beta.float()[..., None] * k
    maps = torch.diag_embed(decay) - bk[..., :, None] * (k * decay)[..., None, :]  # [T, H, D, D]
    shifts = bk[..., :, None] * v.float()[..., None, :]  # [T, H, D, Dv]
    seq, index = token_sequences(cu_seqlens, T)
    positions = torch.arange(T, device=q.device)
    span = 1
    for _ in range(math.ceil(math.log2(max(size_bound(T), 1)))):
        earlier = (positions - span).clamp(min=0)
        joins = (index >= span)[:, None, None, None]  # the token `span` before is of the same sequence
        maps, shifts = (torch.where(joins, maps @ maps[earlier], maps),
                        torch.where(joins, maps @ shifts[earlier] + shifts, shifts))
        span *= 2
    start = state[slots].float()  # [N, H, D, Dv]
    states = maps @ start[seq] + shifts  # after each token
    out = torch.einsum("thd,thdv->thv", q, states)
    cu = cu_seqlens.long()
    last = states[(cu[1:] - 1).clamp(min=0)]
    final = torch.where((cu[1:] > cu[:-1])[:, None, None, None], last, start)
    state.index_copy_(0, slots, final.to(state.dtype))
    return out.to(v.dtype)


def mla_prefill(q: Tensor, kv_cache: Tensor, kv_b_weight: Tensor, cu_seqlens: Tensor, block_table: Tensor,
                seq_lens: Tensor, scale: float) -> Tensor:
    """``k3::mla_prefill`` (the naive form): each sequence's keys and values over its
    block table's positions, then each token's scores against its own sequence's
    (gathered), masked to the positions up to its own."""
    T, H, Dqk = q.shape
    L = kv_b_weight.shape[1]
    Dn = Dqk - (cache_value_width(kv_cache) - L)
    w = kv_b_weight.float().view(H, -1, L)
    w_uk, w_uv = w[:, :Dn], w[:, Dn:]  # [H, Dn, L], [H, Dv, L]
    N, width = block_table.shape
    block_size = kv_cache.shape[1]
    pos = torch.arange(width * block_size, device=q.device)
    blocks = block_table.long().gather(1, (pos // block_size).expand(N, -1))  # [N, P]
    context = cache_rows_as_values(kv_cache[blocks, (pos % block_size).expand(N, -1)], L)  # [N, P, W]
    latent, k_pe = context[..., None, :, :L], context[..., L:]  # [N, 1, P, L], [N, P, R]
    k_nope, values = latent @ w_uk.transpose(1, 2), latent @ w_uv.transpose(1, 2)  # [N, H, P, Dn or Dv]
    cu = cu_seqlens.long()
    seq, index = token_sequences(cu_seqlens, T)
    qf = q.float()
    scores = ((qf[..., None, :Dn] @ k_nope[seq].transpose(2, 3)).squeeze(2)
              + qf[..., Dn:] @ k_pe[seq].transpose(1, 2))  # [T, H, P]
    query_pos = seq_lens.long()[seq] - (cu[1:] - cu[:-1])[seq] + index
    hidden = (pos[None, :] > query_pos[:, None])[:, None, :]
    probs = torch.softmax((scores * scale).masked_fill(hidden, float("-inf")), dim=-1)
    return (probs[..., None, :] @ values[seq]).squeeze(2).to(q.dtype)
