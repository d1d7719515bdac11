"""Put a MoE layer's four input projections into one op: ``k3::moe_input_proj``.

A latent-MoE layer reads its normalised input x with four bias-free linears: the router
(-> fp32 logits -> sigmoid top-k routing), the latent down-projection (-> the routed
experts' input z) and the shared expert's gate and up (-> its SiTU-GLU, one
``situ_and_mul_proj`` after ``merge_glu_projections``). At a decode batch each GEMM is
latency, not bytes (on an H200 at batch 1: router 8 us, down 17.7, gate / up 12.5, against
about 21 for their 86 MB together). ``k3::moe_input_proj(x, W_router, bias, W_down,
W_gate, W_up, ...)`` takes the input, the four weights and the consumers' arguments, and
returns what the consumers returned. The runtime lays the four weights out as consecutive
rows of one buffer at load (``k3compile/runtime/weight_layout.py``), so on GPUs the op runs
ONE GEMM over them (fp32 output: the logits' dtype), the routing kernel on the logits'
columns in place and one kernel for z and the SiTU-GLU. On the CPU the op runs the same ops
as the graph: the rewrite is exact.

Before (layer 1 of ``tiny``, decode, after merge_glu_projections; names shortened)::

    %router_logits = k3.router_logits(%x, %gate_weight)                            [s, 8] f32
    %route = k3.sigmoid_topk_route(%router_logits, %e_score_correction_bias, 2, True, 1.0)
    %getitem_2 = getitem(%route, 0) ; %getitem_3 = getitem(%route, 1)
    %linear_17 = aten.linear(%x, %routed_expert_down_proj_weight)                  [s, 32]
    %moe_experts_mxfp4 = k3.moe_experts_mxfp4(%linear_17, %getitem_2, %getitem_3, ...)
    ...
    %situ_and_mul_proj_1 = k3.situ_and_mul_proj(%x, %shared_gate_proj_weight, %shared_up_proj_weight, 4.0, 25.0)

After::

    %moe_input_proj = k3.moe_input_proj(%x, %gate_weight, %e_score_correction_bias,
        %routed_expert_down_proj_weight, %shared_gate_proj_weight, %shared_up_proj_weight,
        2, True, 1.0, 4.0, 25.0)
    %getitem_a = getitem(%moe_input_proj, 0)   (routing weights) ; %getitem_b = ... 1 (ids)
    %getitem_c = getitem(%moe_input_proj, 2)   (z -> the experts) ; %getitem_d = ... 3 (h)
    %moe_experts_mxfp4 = k3.moe_experts_mxfp4(%getitem_c, %getitem_a, %getitem_b, ...)

Matched by semantics from each routed-experts call (``k3.moe_experts_mxfp4`` or
``k3.moe_experts``): its z is a bias-free linear of x by a parameter, its weights and ids
the two outputs of one ``sigmoid_topk_route`` of a ``router_logits`` of the same x by a
parameter, and x has exactly one ``situ_and_mul_proj`` reader with parameter weights (the
shared expert). Not rewritten (reported in ``skipped``): any of that missing or ambiguous,
x not [T, hidden], or the logits with another reader (they are computed anyway).

Stats per step (per rank): ``matches``; ``launches_removed`` 4 per match on a GPU (three
GEMMs and their split-K reductions become one GEMM; the routing and SiTU kernels stay,
the latter also storing z); ``nodes_removed`` / ``nodes_added``.
"""

from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule, Node

import k3compile.ops.moe_input  # noqa: F401  (registers torch.ops.k3.moe_input_proj)
from k3compile.pipeline.interface import GraphPass, PassContext, PassResult, Rewrite, Skipped, register_pass
from k3compile.pipeline.node_queries import (
    carry_meta,
    is_call,
    is_linear_of_parameter,
    is_parameter,
    layer_of,
    op_arg,
    parameter_placeholders,
    tensor_val,
)
from k3compile.targets import GPU_DEVICES

k3 = torch.ops.k3
_EXPERTS = {k3.moe_experts.default, k3.moe_experts_mxfp4.default}


@register_pass
class MergeMoeInput(GraphPass):
    """Replace a MoE layer's router, latent down-projection and shared-expert gate / up
    (with the routing and the SiTU-GLU) by one ``moe_input_proj``."""

    name = "merge_moe_input"
    #: GPU targets: the merged GEMM saves launches there; on the CPU it runs the same ops.
    default_on = GPU_DEVICES
    after = ("merge_glu_projections", "mxfp4_experts")

    def run(self, gm: GraphModule, ctx: PassContext) -> PassResult:
        result = PassResult(changed=False)
        params = parameter_placeholders(ctx.program)
        for experts in [n for n in gm.graph.nodes if is_call(n, _EXPERTS)]:
            found = _match(experts, params)
            if isinstance(found, str):
                result.skipped.append(Skipped(experts.name, found))
                continue
            result.add_rewrite(_rewrite(gm, found))
        result.changed = result.matches > 0
        return result


def _match(experts: Node, params: dict[str, str]) -> dict[str, Node] | str:
    """The layer's nodes by role, or why it is not rewritten."""
    down, weights, ids = (op_arg(experts, a) for a in ("z", "weights", "ids"))
    if not is_linear_of_parameter(down, params):
        return f"the experts' input {getattr(down, 'name', down)} is not a bias-free linear by a parameter"
    x = down.args[0]
    if tensor_val(x) is None or tensor_val(x).dim() != 2:
        return f"the projections' input {x.name} is not [T, hidden]"
    items = (weights, ids)
    if not all(is_call(i, {operator.getitem}) for i in items) or weights.args[0] is not ids.args[0] \
            or (weights.args[1], ids.args[1]) != (0, 1):
        return "the experts' weights and ids are not the two outputs of one routing"
    route = weights.args[0]
    if not is_call(route, {k3.sigmoid_topk_route.default}):
        return f"the experts' routing {route.name} is not a k3.sigmoid_topk_route"
    logits = op_arg(route, "logits")
    if not (is_call(logits, {k3.router_logits.default}) and op_arg(logits, "x") is x
            and is_parameter(op_arg(logits, "weight"), params)):
        return f"the routing's logits are not k3.router_logits of {x.name} by a parameter"
    if set(logits.users) != {route}:
        return f"the router logits {logits.name} have other readers: they are computed anyway"
    if any(not is_call(u, {operator.getitem}) for u in route.users):
        return f"the routing {route.name} is read other than by its outputs"
    shared = [u for u in x.users if is_call(u, {k3.situ_and_mul_proj.default})
              and all(is_parameter(op_arg(u, w), params) for w in ("gate_weight", "up_weight"))]
    if len(shared) != 1:
        what = "no" if not shared else f"{len(shared)}: ambiguous,"
        return f"{what} situ_and_mul_proj of {x.name} by parameters (the shared expert)"
    return {"x": x, "logits": logits, "route": route, "down": down, "shared": shared[0]}


def _rewrite(gm: GraphModule, nodes: dict[str, Node]) -> Rewrite:
    graph = gm.graph
    logits, route, down, shared = nodes["logits"], nodes["route"], nodes["down"], nodes["shared"]
    args = (nodes["x"], op_arg(logits, "weight"), op_arg(route, "correction_bias"), down.args[1],
            op_arg(shared, "gate_weight"), op_arg(shared, "up_weight"), op_arg(route, "top_k"),
            op_arg(route, "renormalize"), op_arg(route, "scaling"), op_arg(shared, "beta"),
            op_arg(shared, "linear_beta"))
    order = {n: i for i, n in enumerate(graph.nodes)}
    with graph.inserting_before(min((logits, route, down, shared), key=order.__getitem__)):
        merged = graph.call_function(k3.moe_input_proj.default, args)
        items = [graph.call_function(operator.getitem, (merged, i)) for i in range(4)]
    carry_meta(merged, route, val=False)
    merged.meta["val"] = (*route.meta["val"], tensor_val(down), tensor_val(shared))
    for i, item in enumerate(items):
        carry_meta(item, route, val=False)
        item.meta["val"] = merged.meta["val"][i]
    for old in list(route.users):
        old.replace_all_uses_with(items[old.args[1]])
        graph.erase_node(old)
    down.replace_all_uses_with(items[2])
    shared.replace_all_uses_with(items[3])
    removed = (route, logits, down, shared)
    for node in removed:
        graph.erase_node(node)
    detail = (f"layer {layer_of(merged)}: k3.router_logits + sigmoid_topk_route, aten.linear, situ_and_mul_proj "
              "-> k3.moe_input_proj (one GEMM)")
    return Rewrite(merged.name, detail, {"launches_removed": 4, "nodes_removed": len(removed) + 2, "nodes_added": 5})


__all__ = ["MergeMoeInput"]
