"""``k3::kda_decode_fused``: one KDA decode step, from the projections to the gated norm.

The op the ``fuse_kda_decode`` pass (``passes/fuse_kda_decode.py``) puts in place of the
unfused decode chain of a KDA layer (``k3compile/model/kda.py``, one token per sequence)::

    q, k, v = short_conv_decode(q_proj x, ...), ... (k, v)   3 conv states updated
    g       = kda_gate(view(f_b_proj ...), A_log, dt_bias, lower_bound)
    beta    = sigmoid(b_proj(x).float())
    o       = kda_decode(q, k, v, g, beta, state, slots, scale)  recurrent state updated
    y       = gated_rms_norm(o, view(g_proj x), o_norm.weight, eps)

Signature (also the arguments of the runtime's Triton launcher, in its order)::

    kda_decode_fused(q [B, H*D], k [B, H*D], v [B, H*DV],            pre-conv projections
                     conv_weight_q [H*D, K], conv_weight_k, conv_weight_v [H*DV, K],
                     conv_state_q! [S, H*D, K-1], conv_state_k!, conv_state_v! [S, H*DV, K-1],
                     a [B, H*D], A_log [H], dt_bias [H*D], lower_bound: float,
                     beta [B, H] (LOGITS), state! [S, H, D, DV] fp32, slots [B] int64,
                     scale: float, gate [B, H*DV], norm_weight [DV], eps: float)
        -> y [B, H, DV] in v's dtype                      (! = mutated in place)

H, D, DV are read from ``state``. Flat ``[B, C]`` activations, not ``[B, H, D]`` views:
they are what the projections produce, what the short conv reads, and what the kernel
indexes, so the fused graph needs no view nodes.

Why ``beta`` is the logits, not ``sigmoid(logits)``: the kernel applies the sigmoid itself
(one scalar per head, free inside the launch), and the graph's ``sigmoid`` and its fp32
cast are two more launches and a [B, H] fp32 round trip that fusing them removes. It is
exact: the reference computes ``sigmoid(beta.float())``, which is precisely what the graph
computed from ``b_proj``'s output (``.float()`` then ``sigmoid``), in any model dtype.

Implementations:

- reference (the op's default, every device; the numerical truth):
  :func:`kda_decode_chain_reference`, the five k3 ops above in the model's order, so the
  fused op is bit-identical to the chain it replaces.
- GPU kernel: the runtime registers its one-launch Triton kernel for this op
  (``k3compile.runtime.kernels.register_gpu_kernels``); this module does not import it.
- fake: ``[B, H, DV]`` like v.

``k3::kda_decode_fused_proj`` is the same step from the layer's input ``x`` and the
projection weights that read it: q, k, v, g and b (column-parallel) and the forget gate's
low-rank pair, ``a = f_b(f_a(x))`` (f_a replicated, f_b column-parallel), so that every
projection of x runs as ONE GEMM: the runtime lays q, k, v, g, f_a and b out as consecutive
rows of one buffer at load (``k3compile/runtime/weight_layout.py``), and its GPU
implementation multiplies x by all their rows at once, runs f_b on the f_a columns and
hands the kernel column views of the product. Its reference computes the seven ``linear``s
and then the chain: exactly what the graph did.

Placement: per head, as for the ops it replaces (``k3compile/placement/k3_rules.py``).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["MUTATED", "PROJECTION_WEIGHTS", "kda_decode_chain_reference", "kda_decode_fused",
           "kda_decode_fused_proj"]

#: The op's in-place arguments (rank-local caches).
MUTATED = ("conv_state_q", "conv_state_k", "conv_state_v", "state")
#: ``kda_decode_fused_proj``'s weights that multiply x, in the order the runtime lays their
#: rows out (the 16-byte-aligned widths first: b has only H rows)
PROJECTION_WEIGHTS = ("q_weight", "k_weight", "v_weight", "g_weight", "f_a_weight", "b_weight")


def kda_decode_chain_reference(
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
) -> Tensor:
    """The unfused chain with the repo's k3 ops, in the model's order: the reference of
    ``k3::kda_decode_fused`` (same arguments; updates the states in place)."""
    B = q.shape[0]
    _, H, D, DV = state.shape
    ops = torch.ops.k3
    qc = ops.short_conv_decode(q, conv_weight_q, conv_state_q, slots).view(B, H, D)
    kc = ops.short_conv_decode(k, conv_weight_k, conv_state_k, slots).view(B, H, D)
    vc = ops.short_conv_decode(v, conv_weight_v, conv_state_v, slots).view(B, H, DV)
    g = ops.kda_gate(a.view(B, H, D), A_log, dt_bias, lower_bound)
    o = ops.kda_decode(qc, kc, vc, g, torch.sigmoid(beta.float()), state, slots, scale)
    return ops.gated_rms_norm(o, gate.view(B, H, DV), norm_weight, eps)


@torch.library.custom_op("k3::kda_decode_fused", mutates_args=MUTATED)
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
) -> Tensor:
    """One KDA decode step (conv, gate, beta sigmoid, delta rule, gated RMSNorm); reference."""
    return kda_decode_chain_reference(
        q, k, v, conv_weight_q, conv_weight_k, conv_weight_v, conv_state_q, conv_state_k, conv_state_v,
        a, A_log, dt_bias, lower_bound, beta, state, slots, scale, gate, norm_weight, eps,
    )


@kda_decode_fused.register_fake
def _(
    q: Tensor, k: Tensor, v: Tensor, conv_weight_q: Tensor, conv_weight_k: Tensor, conv_weight_v: Tensor,
    conv_state_q: Tensor, conv_state_k: Tensor, conv_state_v: Tensor, a: Tensor, A_log: Tensor,
    dt_bias: Tensor, lower_bound: float, beta: Tensor, state: Tensor, slots: Tensor, scale: float,
    gate: Tensor, norm_weight: Tensor, eps: float,
) -> Tensor:
    _, H, _, DV = state.shape
    return v.new_empty(v.shape[0], H, DV)



@torch.library.custom_op("k3::kda_decode_fused_proj", mutates_args=MUTATED)
def kda_decode_fused_proj(
    x: Tensor,
    q_weight: Tensor,
    k_weight: Tensor,
    v_weight: Tensor,
    g_weight: Tensor,
    b_weight: Tensor,
    f_a_weight: Tensor,
    f_b_weight: Tensor,
    conv_weight_q: Tensor,
    conv_weight_k: Tensor,
    conv_weight_v: Tensor,
    conv_state_q: Tensor,
    conv_state_k: Tensor,
    conv_state_v: Tensor,
    A_log: Tensor,
    dt_bias: Tensor,
    lower_bound: float,
    state: Tensor,
    slots: Tensor,
    scale: float,
    norm_weight: Tensor,
    eps: float,
) -> Tensor:
    """One KDA decode step from the layer input x [B, hidden]: q/k/v/g/b = x @ W^T and the
    forget gate's input a = (x @ W_fa^T) @ W_fb^T, then :func:`kda_decode_fused` (b is beta's
    logits, g the output gate); reference."""
    linear = torch.nn.functional.linear
    q, k, v, g, b = (linear(x, w) for w in (q_weight, k_weight, v_weight, g_weight, b_weight))
    a = linear(linear(x, f_a_weight), f_b_weight)
    return kda_decode_chain_reference(
        q, k, v, conv_weight_q, conv_weight_k, conv_weight_v, conv_state_q, conv_state_k, conv_state_v,
        a, A_log, dt_bias, lower_bound, b, state, slots, scale, g, norm_weight, eps,
    )


@kda_decode_fused_proj.register_fake
def _(
    x: Tensor, q_weight: Tensor, k_weight: Tensor, v_weight: Tensor, g_weight: Tensor, b_weight: Tensor,
    f_a_weight: Tensor, f_b_weight: Tensor, conv_weight_q: Tensor, conv_weight_k: Tensor, conv_weight_v: Tensor,
    conv_state_q: Tensor, conv_state_k: Tensor, conv_state_v: Tensor, A_log: Tensor, dt_bias: Tensor,
    lower_bound: float, state: Tensor, slots: Tensor, scale: float, norm_weight: Tensor, eps: float,
) -> Tensor:
    _, H, _, DV = state.shape
    return x.new_empty(x.shape[0], H, DV)


# Placement rule and cost: k3compile/placement/k3_rules.py.
