"""``k3::kda_decode_fused``: one KDA decode step, from the projections to the gated norm.

The op the ``fuse_kda_decode`` pass (``passes/fuse_kda_decode.py``) puts in place of the
unfused decode chain of a KDA layer (``k3compile/model/kda.py``, one token per sequence)::

    q, k, v = short_conv_decode(q_proj x, ...), ... (k, v)   3 conv states updated
    g       = kda_gate(view(f_b_proj ...), A_log, dt_bias, lower_bound)
    beta    = sigmoid(b_proj(x).float())
    o       = kda_decode(q, k, v, g, beta, state, slots, scale)  recurrent state updated
    y       = gated_rms_norm(o, view(g_proj x), o_norm.weight, eps)

Signature (the arguments of the Triton launcher
``k3compile.runtime.kernels.kda_decode.kda_decode_fused``, in its order)::

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

- reference (every device; the numerical truth): ``kda_decode_chain_reference`` of the
  runtime kernel module, i.e. the five k3 ops above in the model's order, so the fused op
  is bit-identical to the chain it replaces. Imported on first call (that module imports
  Triton; ``import k3compile`` must not).
- ``cuda`` (CUDA and ROCm): the Triton launcher, also imported on first call. It needs
  contiguous activations sharing one dtype, fp32 conv weights / A_log / dt_bias /
  norm_weight, and power-of-two D and DV; small parameters in another dtype are cast here.
  On CUDA GPUs of compute capability 9.0 or newer it launches with programmatic dependent
  launch (the kernel reads its state while the projection before it finishes; H200:
  33.0 -> 30.9 us at batch 64, BENCHMARKS.md) unless it had to cast a weight, whose copy
  the launch just before wrote.
- fake: ``[B, H, DV]`` like v.

Placement: everything is per head, as for the ops it replaces: under TP activations are
Shard(1), conv weights, A_log and dt_bias Shard(0), the caches Shard(1) (conv states by
channel, the recurrent state by head), slots and the norm weight Replicate; the output
is Shard(1) (heads).
"""

from __future__ import annotations

import torch
from torch import Tensor

from k3compile.placement import Cost, CostCall, register_op_rules, split

__all__ = ["MUTATED", "kda_decode_fused"]

#: The op's in-place arguments (rank-local caches).
MUTATED = ("conv_state_q", "conv_state_k", "conv_state_v", "state")


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
    # Lazy: the runtime kernel module imports Triton (the reference itself does not use it).
    from k3compile.runtime.kernels.kda_decode import kda_decode_chain_reference

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


@kda_decode_fused.register_kernel("cuda")
def _(
    q: Tensor, k: Tensor, v: Tensor, conv_weight_q: Tensor, conv_weight_k: Tensor, conv_weight_v: Tensor,
    conv_state_q: Tensor, conv_state_k: Tensor, conv_state_v: Tensor, a: Tensor, A_log: Tensor,
    dt_bias: Tensor, lower_bound: float, beta: Tensor, state: Tensor, slots: Tensor, scale: float,
    gate: Tensor, norm_weight: Tensor, eps: float,
) -> Tensor:
    from k3compile.runtime.kernels.kda_decode import kda_decode_fused as launch
    from k3compile.runtime.kernels.kda_decode import supports_pdl

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
    return launch(
        act(q), act(k), act(v), conv_wq, conv_wk, conv_wv,
        conv_state_q, conv_state_k, conv_state_v, act(a), a_log, dt_b, lower_bound,
        act(beta), state, slots, scale, act(gate), norm_w, eps, pdl=pdl,
    )


# --------------------------------------------------------------------------- placement


def _fused_cost(call: CostCall) -> Cost:
    """The replaced ops' FLOPs (conv 2K+4 per channel, gate 5 and L2 norms 6 per key
    element, beta sigmoid 1 per head, delta rule 7*D*DV per head, norm 6 per value) and the
    bytes one launch must move: inputs and output (weights included) plus the three conv
    states and the fp32 recurrent state, each read and written once per sequence."""
    B = call.size("q", 0)
    _, H, D, DV = call.shape("state")
    K = call.size("conv_weight_q", 1)
    qk, vv = H * D, H * DV
    flops = B * ((2 * K + 4) * (2 * qk + vv) + 11 * qk + H + H * 7 * D * DV + 6 * vv)
    n = call.numel("slots")
    conv = 2 * n * (K - 1) * sum(
        call.size(name, 1) * call.itemsize(name) for name in ("conv_state_q", "conv_state_k", "conv_state_v")
    )
    state = 2 * n * H * D * DV * call.itemsize("state")
    return Cost(flops, call.io_bytes() + conv + state)


_SHARDED = {
    "q": 1, "k": 1, "v": 1,
    "conv_weight_q": 0, "conv_weight_k": 0, "conv_weight_v": 0,
    "conv_state_q": 1, "conv_state_k": 1, "conv_state_v": 1,
    "a": 1, "A_log": 0, "dt_bias": 0, "beta": 1, "state": 1, "gate": 1,
}
register_op_rules({
    kda_decode_fused: split(_SHARDED, out=1, what="heads", caches=MUTATED, cost=_fused_cost),
})
