"""Deduplicate replicated linears whose result joins an all-reduced partial sum.

Under TP a linear with a replicated input and a replicated weight computes the same
result on every rank: ``tp`` times the FLOPs and weight bytes for one value. When that
result is then added to the output of an all-reduce of a Partial tensor, the all-reduce
can assemble it instead: rank r computes only rows [r*N/tp, (r+1)*N/tp) of the weight
(its output coordinates), adds them at their place into its own partial before the
all-reduce, and the sum over ranks contributes every coordinate exactly once. No
collective is added, and each rank then holds (and reads from the checkpoint) only its
rows of the weight. In K3 this is the latent MoE's routed-expert up-projection (3584 ->
7168), added to the all-reduced shared-expert output.

Matched by placements, not names (``node.meta["placement"]`` from
:mod:`k3compile.placement`):

    %y = aten.linear(%x R, %W R [, %b R])  ->  [unary pointwise chain, e.g. casts]  -> %y'
    %s = all_reduce(%p P, "sum") ; %w = wait_tensor(%s)
    %o = aten.add(%y', %w)            (either order; same shape and dtype as %p)

Before (layer 1 of ``tiny`` at TP2, decode)::

    %rms_norm_4   = k3.rms_norm(%wait_tensor_4, %p_..._routed_expert_norm_weight, 1e-05)  R
    %linear_21    = aten.linear(%rms_norm_4, %p_..._routed_expert_up_proj_weight)      R [s, 64]
    %linear_24    = aten.linear(%situ_and_mul_1, %p_..._shared_experts_down_proj_weight)  P [s, 64]
    %all_reduce_5 = _c10d_functional.all_reduce(%linear_24, "sum", "0")
    %wait_tensor_5 = _c10d_functional.wait_tensor(%all_reduce_5)
    %add_2        = aten.add.Tensor(%linear_21, %wait_tensor_5)

After (the weight placeholder now holds this rank's 32 of 64 rows; ``row_start`` is a
per-rank constant buffer: 0 on rank 0, 32 on rank 1). With no bias and nothing between
the linear and the add, the rows GEMV and the add are one op (one kernel on a GPU)::

    %add_rank_block_linear = k3.add_rank_block_linear(%linear_24, %rms_norm_4,
                                 %p_..._routed_expert_up_proj_weight, %b_..._row_start)  P [s, 64]
    %all_reduce_6  = _c10d_functional.all_reduce(%add_rank_block_linear, "sum", "0")
    %wait_tensor_6 = _c10d_functional.wait_tensor(%all_reduce_6)

With a bias or a unary chain (below), the rows are computed first and then added::

    %linear_25      = aten.linear(%x, %W, %b)                                       S(1) [s, 32]
    %add_rank_block = k3.add_rank_block(%linear_24, [chain](%linear_25), %b_..._row_start, 1)  P [s, 64]

What stays replicated: the linear's input and anything before it (the RMSNorm in K3) is
unchanged. A unary pointwise chain between the linear and the add (casts, scalar
scaling) is applied to the rows instead of the full output, which is exact because it
acts per element.

Skipped, with the reason in the record: TP1 (nothing is redundant); a weight that is not
a parameter (computed in the graph, e.g. cast from another dtype); an output dim that
does not divide by tp; a linear whose result has other users or does not meet an
all-reduced partial (sharding it would need a new collective, an all-gather: reported,
not rewritten); an all-reduced value with other users (adding the rows before the
all-reduce would change what they see); shape or dtype mismatches at the add.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node

from k3compile.pipeline.graph_edits import add_rank_constant, reshard_parameter
from k3compile.pipeline.interface import GraphPass, PassContext, PassResult, Rewrite, Skipped, register_pass
from k3compile.pipeline.node_queries import layer_of, parameter_placeholders
from k3compile.sharding import Partial, Replicate, ShardOffset
from k3compile.targets import DEVICE_KINDS

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
R = Replicate()

_CASTS = {aten.to.dtype, aten._to_copy.default, aten.clone.default}


@dataclass
class _Match:
    linear: Node
    chain: list[Node]  # unary pointwise nodes from the linear's output to the add
    add: Node
    wait: Node
    all_reduce: Node


def _is_unary_pointwise(node: Node) -> bool:
    """One tensor input, same shape out, acting element by element (so it commutes with
    taking a block of the last dim)."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    tensor_args = [a for a in (*node.args, *node.kwargs.values()) if isinstance(a, Node)]
    if len(tensor_args) != 1:
        return False
    pointwise = node.target in _CASTS or torch.Tag.pointwise in node.target.tags
    return pointwise and node.meta["val"].shape == tensor_args[0].meta["val"].shape


def _all_reduced_partial(node: object) -> tuple[Node, Node] | None:
    """(wait, all_reduce) when ``node`` is ``wait_tensor(all_reduce(P, "sum"))``."""
    if not (isinstance(node, Node) and node.target is c10d.wait_tensor.default):
        return None
    ar = node.args[0]
    if not (isinstance(ar, Node) and ar.target is c10d.all_reduce.default and ar.args[1] == "sum"):
        return None
    return (node, ar) if ar.args[0].meta.get("placement") == Partial() else None




@register_pass
class DedupReplicatedLinear(GraphPass):
    """Rank r computes its 1/tp of a replicated linear's rows and lets the existing
    all-reduce assemble them (see the module docstring)."""

    name = "dedup_replicated_linear"
    default_on = frozenset(DEVICE_KINDS)
    needs = frozenset({"placements"})  # matches by node.meta["placement"]

    def run(self, gm: GraphModule, ctx: PassContext) -> PassResult:
        result = PassResult(changed=False)
        if ctx.plan.tp == 1:
            result.skipped.append(Skipped("*", "tp=1: no work is replicated across ranks"))
            return result
        params = parameter_placeholders(ctx.program)
        for node in list(gm.graph.nodes):
            if node.target is not aten.linear.default or node.meta.get("placement") != R:
                continue
            match, reason = self._match(node, params, ctx.plan.tp)
            if match is None:
                result.skipped.append(Skipped(node.name, reason))
                continue
            result.add_rewrite(self._rewrite(gm, ctx, match, params))
        result.changed = result.matches > 0
        return result

    def _match(self, linear: Node, params: dict[str, str], tp: int) -> tuple[_Match | None, str]:
        weight, bias = linear.args[1], linear.args[2] if len(linear.args) > 2 else None
        for arg in (weight, bias):
            if isinstance(arg, Node) and arg.name not in params:
                return None, f"{arg.name} is computed in the graph, not a parameter the loader can slice by rows"
        rows = weight.meta["val"].shape[0]
        if rows % tp:
            return None, f"{rows} output rows do not divide by tp={tp}"
        chain, end = [], linear
        while len(end.users) == 1:
            (user,) = end.users
            if not _is_unary_pointwise(user):
                break
            chain.append(user)
            end = user
        if len(end.users) != 1:
            return None, f"its output has {len(end.users)} users; sharding it would need a new collective (all-gather)"
        (add,) = end.users
        partial = None
        if add.target is aten.add.Tensor and not add.kwargs and len(add.args) == 2:
            other = add.args[1] if add.args[0] is end else add.args[0]
            partial = _all_reduced_partial(other)
        if partial is None:
            return None, (
                f"its result feeds {add.target}, not a sum with an all-reduced partial; "
                "sharding it would need a new collective (all-gather)"
            )
        wait, ar = partial
        if len(wait.users) != 1:
            return None, f"the all-reduced {wait.name} has other users; adding rows before the all-reduce would change them"
        p_val, out_val, add_val = ar.args[0].meta["val"], end.meta["val"], add.meta["val"]
        if p_val.shape != out_val.shape or add_val.dtype != p_val.dtype:
            return None, (
                f"the add mixes {tuple(out_val.shape)} {out_val.dtype} with a partial of "
                f"{tuple(p_val.shape)} {p_val.dtype} (broadcast or type promotion)"
            )
        return _Match(linear, chain, add, wait, ar), ""

    def _rewrite(self, gm: GraphModule, ctx: PassContext, m: _Match, params: dict[str, str]) -> Rewrite:
        tp, graph = ctx.plan.tp, gm.graph
        weight, bias = m.linear.args[1], m.linear.args[2] if len(m.linear.args) > 2 else None
        rows, cols = weight.meta["val"].shape
        itemsize = weight.meta["val"].dtype.itemsize
        removed_bytes = (rows * cols + (rows if bias is not None else 0)) * itemsize * (tp - 1) // tp
        for arg in (weight, bias):
            if arg is not None:
                name = params[arg.name]
                reshard_parameter(ctx, name, dataclasses.replace(ctx.specs[name], dim=0))
        module = params[weight.name].removesuffix(".weight")
        start = add_rank_constant(ctx, f"{module}.row_start", ShardOffset(rows))
        dim = m.add.meta["val"].dim() - 1
        partial = m.all_reduce.args[0]
        fused = bias is None and not m.chain and not m.linear.kwargs

        with graph.inserting_before(m.add):
            if fused:
                block = acc = graph.call_function(
                    torch.ops.k3.add_rank_block_linear.default, (partial, m.linear.args[0], weight, start))
            else:
                block = graph.call_function(aten.linear.default, m.linear.args, m.linear.kwargs)
                for node in m.chain:
                    block = graph.call_function(node.target, (block, *node.args[1:]), node.kwargs)
                acc = graph.call_function(torch.ops.k3.add_rank_block.default, (partial, block, start, dim))
            reduced = graph.call_function(c10d.all_reduce.default, (acc, *m.all_reduce.args[1:]), m.all_reduce.kwargs)
            waited = graph.call_function(c10d.wait_tensor.default, (reduced,))
        for new, old in ((block, m.linear), (acc, m.linear), (reduced, m.all_reduce), (waited, m.wait)):
            new.meta["nn_module_stack"] = old.meta.get("nn_module_stack", {})
        m.add.replace_all_uses_with(waited)
        for node in (m.add, m.wait, m.all_reduce, *reversed(m.chain), m.linear):
            graph.erase_node(node)

        stats = {
            "weight_bytes_removed": removed_bytes,
            "flops_removed_per_token": 2 * rows * cols * (tp - 1) // tp,
        }
        detail = (
            f"layer {layer_of(block)}: {params[weight.name]} [{rows}, {cols}] -> {rows // tp} rows per rank, "
            f"added into {partial.name} before its all-reduce"
            + (" (k3.add_rank_block_linear: rows GEMV and add in one op)" if fused
               else " (aten.linear + k3.add_rank_block)")
        )
        return Rewrite(m.linear.name, detail, stats)
