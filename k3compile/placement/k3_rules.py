"""The placement rules and costs of the ``k3::`` ops, one section per op module.

The op library (:mod:`k3compile.ops`) defines what the ops compute; this module declares
how each places its outputs under tensor (and decode context) parallelism and what one
call costs, in the vocabulary of :mod:`k3compile.placement.rules`. It is imported by
``k3compile.placement`` itself, so every user of the analysis sees the rules, and the op
library does not depend on the analysis. Every ``k3::`` op needs a rule here: the
analysis raises on an op without one (``tests/test_placement.py`` checks them all).
"""

from __future__ import annotations

from typing import Any

from torch.fx import Node

from k3compile.mla_cache_fp8 import SCALE_BYTES
from k3compile.ops.activations import situ_and_mul, situ_and_mul_proj
from k3compile.ops.attn_res import attn_res_mix, attn_res_mix_norm
from k3compile.ops.dcp import (dcp_history_order, dcp_local_blocks, dcp_local_lengths, dcp_merge, dcp_pack,
                              dcp_rescale)
from k3compile.ops.kda import gated_rms_norm, kda_decode, kda_gate, kda_prefill, short_conv_decode, short_conv_prefill
from k3compile.ops.kda_fused import MUTATED as KDA_FUSED_CACHES
from k3compile.ops.kda_fused import PROJECTION_WEIGHTS, kda_decode_fused, kda_decode_fused_proj
from k3compile.ops.mla import (
    mla_cache_write,
    mla_decode,
    mla_decode_split_kv,
    mla_prefill,
    mla_prefill_new_tokens,
    mla_prefill_partial,
    narrow_heads,
    pad_heads,
)
from k3compile.ops.mla_proj import PROJECTION_WEIGHTS as MLA_PROJECTION_WEIGHTS
from k3compile.ops.mla_proj import mla_input_proj
from k3compile.ops.moe import moe_experts, moe_experts_mxfp4, router_logits, sigmoid_topk_route
from k3compile.ops.moe_input import PROJECTION_WEIGHTS as MOE_INPUT_WEIGHTS
from k3compile.ops.moe_input import moe_input_proj
from k3compile.ops.norm import rms_norm
from k3compile.ops.partial import add_rank_block, add_rank_block_linear
from k3compile.placement.nodes import R, PlacementError, PlacementValue
from k3compile.placement.rules import (
    Cost,
    CostCall,
    OpRule,
    elementwise,
    group_complete,
    rank_local,
    register_op_rules,
    replicated,
    rowwise,
    shard_into_partial,
    split,
)
from k3compile.sharding import Partial, Shard

# --------------------------------------------------------------------------- activations
# Pointwise in gate and up (column-parallel shards stay sharded); about 9 FLOPs per element
# (two tanh, a sigmoid, scalings and products).

register_op_rules({situ_and_mul: elementwise("gate", "up", flops_per_element=9)})


def _situ_proj_cost(call: CostCall) -> Cost:
    """The two projections' GEMM (2 FLOPs per weight and row) and the activation (9 per output)."""
    rows = call.numel("x") // call.size("x", -1)
    return Cost(2 * rows * (call.numel("gate_weight") + call.numel("up_weight")) + 9 * rows * call.size("gate_weight", 0))


# With its projections: x Replicate, the column-parallel weights Shard(0) -> output Shard(-1).
register_op_rules({situ_and_mul_proj: split({"gate_weight": 0, "up_weight": 0}, out=-1, what="intermediate",
                                            cost=_situ_proj_cost)})

# --------------------------------------------------------------------------- norm
# Normalises each row over the last dim; 4 FLOPs per element.

register_op_rules({rms_norm: rowwise("x", flops_per_element=4)})

# --------------------------------------------------------------------------- attn_res
# Mixes whole rows (the hidden dim is reduced), so the candidates share one placement that
# does not split the last dim. Cost per candidate element: square + mean (2), scale (1),
# score product + sum (2), weighted sum (2); attn_res_mix_norm adds the norm's 4 per element.


def _attn_res_cost(call: CostCall) -> Cost:
    return Cost(7 * (call.count("blocks") + 1) * call.numel("partial"))


def _attn_res_norm_cost(call: CostCall) -> Cost:
    return Cost(_attn_res_cost(call).flops + 4 * call.numel("partial"))


register_op_rules({
    attn_res_mix: rowwise("partial", "blocks", cost=_attn_res_cost),
    attn_res_mix_norm: rowwise("partial", "blocks", cost=_attn_res_norm_cost),
})

# --------------------------------------------------------------------------- kda
# Everything here is per head (or per channel of a head): under TP the heads are split, so
# activations are Shard(1) of [T, C] / [T, H, ...], the conv and gate weights Shard(0),
# and the caches are rank-local state split the same way (conv_state [S, C, K-1] and
# state [S, H, D, Dv]: Shard(1)).


def _short_conv_cost(call: CostCall) -> Cost:
    """2*K multiply-adds and a SiLU (4) per element; reads and writes K-1 states per channel."""
    K = call.size("weight", 1)
    state = 2 * call.numel("slots") * call.size("x", 1) * (K - 1) * call.itemsize("conv_state")
    return Cost((2 * K + 4) * call.numel("x"), call.io_bytes() + state)


def _kda_cost(call: CostCall) -> Cost:
    """Recurrent form per token and head: decay (D*Dv), S^T k (2*D*Dv), the rank-1 update
    (2*D*Dv), S^T q (2*D*Dv), and the L2 norms (6*D). Prefill is counted the same way
    (the chunked form's intra-chunk work is not added). State: read + write per sequence."""
    T, H, D = call.shape("q")
    Dv = call.size("v", -1)
    state = 2 * call.numel("slots") * H * D * Dv * call.itemsize("state")
    return Cost(T * H * (7 * D * Dv + 6 * D), call.io_bytes() + state)


_HEADS = {"q": 1, "k": 1, "v": 1, "g": 1, "beta": 1, "state": 1}
_CHANNELS = {"x": 1, "weight": 0, "conv_state": 1}
register_op_rules({
    short_conv_prefill: split(_CHANNELS, out=1, what="channels", caches=("conv_state",), cost=_short_conv_cost),
    short_conv_decode: split(_CHANNELS, out=1, what="channels", caches=("conv_state",), cost=_short_conv_cost),
    kda_gate: split({"a": 1, "A_log": 0, "dt_bias": 0}, out=1, what="heads", flops_per_element=5),
    kda_prefill: split(_HEADS, out=1, what="heads", caches=("state",), cost=_kda_cost),
    kda_decode: split(_HEADS, out=1, what="heads", caches=("state",), cost=_kda_cost),
    gated_rms_norm: split({"x": 1, "gate": 1}, out=1, what="heads", flops_per_element=6),
})

# --------------------------------------------------------------------------- kda_fused
# Everything is per head, as for the ops it replaces: under TP activations are Shard(1),
# conv weights, A_log and dt_bias Shard(0), the caches Shard(1) (conv states by channel,
# the recurrent state by head), slots and the norm weight Replicate; the output is
# Shard(1) (heads).


def _fused_cost(call: CostCall, batch_arg: str = "q") -> Cost:
    """The replaced ops' FLOPs (conv 2K+4 per channel, gate 5 and L2 norms 6 per key
    element, beta sigmoid 1 per head, delta rule 7*D*DV per head, norm 6 per value) and the
    bytes one launch must move: inputs and output (weights included) plus the three conv
    states and the fp32 recurrent state, each read and written once per sequence."""
    B = call.size(batch_arg, 0)
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


_FUSED_SHARDED = {
    "q": 1, "k": 1, "v": 1,
    "conv_weight_q": 0, "conv_weight_k": 0, "conv_weight_v": 0,
    "conv_state_q": 1, "conv_state_k": 1, "conv_state_v": 1,
    "a": 1, "A_log": 0, "dt_bias": 0, "beta": 1, "state": 1, "gate": 1,
}


def _fused_proj_cost(call: CostCall) -> Cost:
    """The fused step's cost plus the projections' GEMMs (2 FLOPs per weight and row)."""
    step = _fused_cost(call, batch_arg="x")
    gemm = 2 * call.size("x", 0) * sum(call.numel(w) for w in (*PROJECTION_WEIGHTS, "f_b_weight"))
    return Cost(step.flops + gemm, step.bytes)


# The proj variant reads x (Replicate) and the projection weights in place of the
# projections: column-parallel (Shard(0)) but for f_a, whose low-rank output every rank
# computes whole (Replicate), as the model's ReplicatedLinear does.
_FUSED_PROJ_SHARDED = {
    **{k: d for k, d in _FUSED_SHARDED.items() if k not in ("q", "k", "v", "a", "beta", "gate")},
    **{w: 0 for w in (*PROJECTION_WEIGHTS, "f_b_weight") if w != "f_a_weight"},
}
register_op_rules({
    kda_decode_fused: split(_FUSED_SHARDED, out=1, what="heads", caches=KDA_FUSED_CACHES, cost=_fused_cost),
    kda_decode_fused_proj: split(_FUSED_PROJ_SHARDED, out=1, what="heads", caches=KDA_FUSED_CACHES,
                                 cost=_fused_proj_cost),
})

# --------------------------------------------------------------------------- mla
# Heads are split across TP ranks (q, and kv_b_proj by whole heads); the latent cache is
# replicated (every rank caches the full latent of every token: q_a/kv_a are replicated),
# so the cache write is replicated work. In the context-parallel layout the cache, block
# table and slot mapping are each rank's own (``context_split``: RankLocal), see
# k3compile/context_parallel.py. Costs count the context as the block table's width x
# block size (an upper bound on each sequence's cached length).


def _cache_row_bytes(call: CostCall) -> int:
    """Bytes per cached token (an FP8 cache's rows include their scales)."""
    return call.size("kv_cache", 2) * call.itemsize("kv_cache")


def _cache_values(call: CostCall) -> int:
    """Values per cached token, W = L + R (an FP8 cache's rows are W + SCALE_BYTES wide)."""
    width = call.size("kv_cache", 2)
    return width - SCALE_BYTES if call.itemsize("kv_cache") == 1 else width


def _mla_cache_write_cost(call: CostCall) -> Cost:
    written = call.size("kv", 0) * _cache_row_bytes(call)
    return Cost(0, call.nbytes("kv") + call.nbytes("slot_mapping") + written)


def _mla_prefill_cost(call: CostCall) -> Cost:
    """Per sequence: decompress k_nope and v for the context (2*ctx*L*H*(Dn+Dv)); per new
    token and head: scores and values (2*ctx*(Dqk+Dv)) and the softmax (5*ctx)."""
    T, H, Dqk = call.shape("q")
    L = call.size("kv_b_weight", 1)
    Dn = Dqk - (_cache_values(call) - L)
    Dv = call.size("kv_b_weight", 0) // H - Dn
    N = call.numel("seq_lens")
    ctx = call.size("block_table", 1) * call.size("kv_cache", 1)
    flops = 2 * N * ctx * L * H * (Dn + Dv) + T * H * ctx * (2 * (Dqk + Dv) + 5)
    return Cost(flops, call.io_bytes() + N * ctx * _cache_row_bytes(call))


def _mla_prefill_new_tokens_cost(call: CostCall) -> Cost:
    """As ``mla_prefill`` with each sequence's context its own new tokens (bounded by T)."""
    T, H, Dqk = call.shape("q")
    L = call.size("kv_b_weight", 1)
    W = call.size("kv", 1)
    Dn = Dqk - (W - L)
    Dv = call.size("kv_b_weight", 0) // H - Dn
    flops = 2 * T * L * H * (Dn + Dv) + T * H * T * (2 * (Dqk + Dv) + 5)
    return Cost(flops, call.io_bytes())


def _mla_decode_cost(call: CostCall) -> Cost:
    """Per sequence and head: W-wide scores and value_dim-wide values over the context,
    and the softmax: ctx*(2*W + 2*value_dim + 5)."""
    B, H, W = call.shape("q")
    ctx = call.size("block_table", 1) * call.size("kv_cache", 1)
    flops = B * H * ctx * (2 * W + 2 * int(call.arg("value_dim")) + 5)
    return Cost(flops, call.io_bytes() + B * ctx * _cache_row_bytes(call))


def _mla_prefill_partial_cost(call: CostCall) -> Cost:
    """Per new token and head: W-wide scores and value_dim-wide values over the member's
    share of the context (bounded by the block table), and the softmax."""
    T, H, W = call.shape("q")
    ctx = call.size("block_table", 1) * call.size("kv_cache", 1)
    flops = T * H * ctx * (2 * W + 2 * int(call.arg("value_dim")) + 5)
    return Cost(flops, call.io_bytes() + call.numel("seq_lens") * ctx * _cache_row_bytes(call))


_MLA_DECODE_RULE = split(
    {"q": 1}, out=(1, 1), what="heads", caches=("kv_cache",), cost=_mla_decode_cost,
    context_split=("kv_cache", "block_table"),
)
# Per rank block of the heads: a head-sharded input gives a head-sharded output whose
# logical tensor is the ranks' padded (narrowed) blocks side by side. Pure copies.
_HEAD_BLOCK_RULE = split({"x": 1}, out=1, what="heads", flops_per_element=0.0)

register_op_rules({
    mla_cache_write: replicated(
        caches=("kv_cache",), cost=_mla_cache_write_cost, context_split=("kv_cache", "slot_mapping")
    ),
    mla_prefill: split({"q": 1, "kv_b_weight": 0}, out=1, what="heads", caches=("kv_cache",), cost=_mla_prefill_cost),
    mla_prefill_new_tokens: split({"q": 1, "kv_b_weight": 0}, out=1, what="heads", cost=_mla_prefill_new_tokens_cost),
    mla_prefill_partial: split({"q": 1}, out=(1, 1), what="heads", caches=("kv_cache",),
                               cost=_mla_prefill_partial_cost, context_split=("kv_cache", "block_table")),
    mla_decode: _MLA_DECODE_RULE,
    mla_decode_split_kv: _MLA_DECODE_RULE,
    pad_heads: _HEAD_BLOCK_RULE,
    narrow_heads: _HEAD_BLOCK_RULE,
})

# --------------------------------------------------------------------------- mla_proj
# The input projections with their consumers: x and the q_a / kv_a weights Replicate (the
# latent is cached whole on every rank) -> q_c, kv Replicate; the column-parallel g_proj
# weight Shard(0) -> gate Shard(1) (x is [T, hidden]). All Replicate (TP1) -> all Replicate.


def _mla_input_proj_cost(call: CostCall) -> Cost:
    """The three projections' GEMM (2 FLOPs per weight element and row), the two norms (4
    per element) and the gate's sigmoid (1 per element)."""
    rows = call.size("x", 0)
    gemm = 2 * rows * sum(call.numel(w) for w in MLA_PROJECTION_WEIGHTS)
    norms = 4 * rows * (call.size("q_a_weight", 0) + int(call.arg("kv_lora_rank")))
    return Cost(gemm + norms + rows * call.size("g_weight", 0))


register_op_rules({mla_input_proj: split({"g_weight": 0}, out=(R, R, 1), what="gate columns",
                                         cost=_mla_input_proj_cost)})

# --------------------------------------------------------------------------- dcp
# dcp_local_lengths is a per-rank value; dcp_rescale sees only RankLocal inputs (the
# attention partials), which the analysis's generic rule places RankLocal.


def _rescale_cost(call: CostCall) -> Cost:
    B, H, D = call.shape("o")
    return Cost(B * H * (D + 2 * int(call.arg("dcp")) + 2))


def _pack_cost(call: CostCall) -> Cost:
    B, H, D = call.shape("o")
    return Cost(B * H * (D + 1))


def _merge_cost(call: CostCall) -> Cost:
    dcp, B, h, D1 = call.shape("received")
    return Cost(dcp * B * h * (2 * D1 + 2))


def _history_order_cost(call: CostCall) -> Cost:
    return Cost(0, 2 * call.numel("gathered") * call.itemsize("gathered"))  # a reordering copy


register_op_rules({
    dcp_local_lengths: rank_local(),
    # The step's sequences' blocks of this member's cache (a copy), sent by the history
    # all-gather; reordered, the gathered blocks are the whole history on every rank.
    dcp_local_blocks: rank_local(caches=("kv_cache",), context_split=("kv_cache", "block_table"),
                                 cost=lambda call: Cost(0, call.io_bytes())),
    dcp_history_order: group_complete(cost=_history_order_cost),
    # RankLocal partials in (the generic rule); heads split per member either way.
    dcp_pack: split({"o": 1, "lse": 1}, out=2, what="heads", cost=_pack_cost),
    # Its input, the DCP all-to-all's output, holds this rank's own heads (dim 2): the TP
    # split of the heads, so the merged output is the attention's usual Shard(1).
    dcp_merge: split({"received": 2}, out=1, what="heads", cost=_merge_cost),
    # Only RankLocal inputs reach it in a valid graph; with all Replicate it would be a
    # merge of one member (dcp=1), still elementwise per head.
    dcp_rescale: split({"o": 1, "lse": 1, "lse_gathered": 1}, out=0, what="heads", cost=_rescale_cost),
})

# --------------------------------------------------------------------------- moe
# The router's logits contract whole rows of x with a replicated gate (2 * E FLOPs per
# element of x); routing works on whole rows of expert scores (4 FLOPs per logit: sigmoid,
# bias add, top-k, weights). The experts are split on their intermediate dim (w1/w3
# [E, I, D] on I, w2 [E, D, I] on I, and the packed codes and scales of each along the
# same dim): each rank's SiTU-MLPs give a partial sum of the down projection, hence Partial.


def _router_cost(call: CostCall) -> Cost:
    return Cost(2 * call.numel("x") * call.size("weight", 0), call.io_bytes())


def _experts_cost(call: CostCall, w1: str, weight_args: tuple[str, ...]) -> Cost:
    """2*3*T*top_k*I*D (three GEMVs per routed token; I = this rank's intermediate);
    bytes: activations plus the weights of the experts touched (at most T*top_k), in the
    format the op reads them."""
    T, _ = call.shape("z")
    top_k = call.size("ids", -1)
    E, I = call.size(w1, 0), call.size(w1, 1)
    D = call.size("z", 1)
    per_expert = sum(call.nbytes(a) for a in weight_args) // E
    touched = min(E, T * top_k) * per_expert
    act = call.nbytes("z") + call.nbytes("weights") + call.nbytes("ids") + call.out_bytes()
    return Cost(2 * 3 * T * top_k * I * D, act + touched)


_PACKED = ("w1_packed", "w1_scale", "w3_packed", "w3_scale", "w2_packed", "w2_scale")
register_op_rules({
    router_logits: rowwise("x", cost=_router_cost),
    sigmoid_topk_route: rowwise("logits", flops_per_element=4),
    moe_experts: split({"w1": 1, "w3": 1, "w2": 2}, out=Partial(), what="expert intermediate",
                       cost=lambda call: _experts_cost(call, "w1", ("w1", "w3", "w2"))),
    moe_experts_mxfp4: split({"w1_packed": 1, "w1_scale": 1, "w3_packed": 1, "w3_scale": 1, "w2_packed": 2,
                              "w2_scale": 2}, out=Partial(), what="expert intermediate",
                             cost=lambda call: _experts_cost(call, "w1_packed", _PACKED)),
})

# The input projections with their consumers (k3compile/ops/moe_input.py): x, the router,
# its bias and the latent down-projection Replicate -> routing and z Replicate; the shared
# expert's column-parallel gate / up Shard(0) -> h Shard(1). All Replicate -> all Replicate.


def _moe_input_cost(call: CostCall) -> Cost:
    """The four projections' GEMM (2 FLOPs per weight element and row), the routing (4 per
    logit) and the SiTU-GLU (9 per output)."""
    rows = call.size("x", 0)
    gemm = 2 * rows * sum(call.numel(w) for w in MOE_INPUT_WEIGHTS)
    return Cost(gemm + rows * (4 * call.size("router_weight", 0) + 9 * call.size("gate_weight", 0)))


register_op_rules({moe_input_proj: split({"gate_weight": 0, "up_weight": 0}, out=(R, R, R, 1),
                                         what="shared-expert intermediate", cost=_moe_input_cost)})

# --------------------------------------------------------------------------- partial
# add_rank_block: P + S(dim) at the rank's block -> P; one add per element of the block.


def _add_rank_block_linear_rule() -> OpRule:
    """``acc`` P + ``x`` R @ ``weight`` S(0) (a row block of a replicated weight, so the
    product is S(last) and this is ``shard_into_partial`` of the product) -> P; all R -> R.
    Cost: the rows GEMV, 2*T*K*n."""
    expected = {"acc": Partial(), "x": R, "weight": Shard(0), "start": R}

    def propagate(node: Node, pls: dict[str, Any]) -> PlacementValue:
        if all(p == R for p in pls.values()):
            return R
        if any(pls.get(k) != v for k, v in expected.items()):
            got = ", ".join(f"{k}={p}" for k, p in pls.items())
            raise PlacementError(
                f"node {node.name!r} (k3.add_rank_block_linear): expected acc=P, x=R, weight=S(0), start=R "
                f"(or all R); input placements: {got}")
        return Partial()

    def cost(call: CostCall) -> Cost:
        return Cost(2 * call.numel("x") * call.size("weight", 0))

    return OpRule("shard_into_partial", propagate, cost=cost, primary="x",
                  description="acc P + (x R @ weight S(0))^T at the rank's block -> P")


register_op_rules({
    add_rank_block: shard_into_partial("acc", "block", "dim"),
    add_rank_block_linear: _add_rank_block_linear_rule(),
})
