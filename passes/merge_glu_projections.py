"""Put an MLP's gate and up projections into its SiTU-GLU: ``k3::situ_and_mul_proj``.

The dense MLP and every shared expert compute ``situ_and_mul(x @ W_gate^T, x @ W_up^T)``:
two GEMMs of one input. ``k3::situ_and_mul_proj(x, W_gate, W_up, ...)`` takes the input and
the two weights instead. The runtime lays the two weights out as consecutive rows of one
buffer at load (``k3compile/runtime/weight_layout.py``), so on GPUs the op runs ONE GEMM
over both and the activation kernel reads the product's two column blocks in place. At a
decode batch each GEMM is latency, not bytes: one launch (and its split-K reduction) fewer
per MLP. On the CPU the op runs the same two linears and the op: the rewrite is exact.

Before (layer 0 of ``tiny``, decode; weights' names shortened)::

    %linear_7 = aten.linear(%attn_res_mix_norm_1, %mlp_gate_proj_weight)
    %linear_8 = aten.linear(%attn_res_mix_norm_1, %mlp_up_proj_weight)
    %situ_and_mul = k3.situ_and_mul(%linear_7, %linear_8, 4.0, 25.0)

After::

    %situ_and_mul_proj = k3.situ_and_mul_proj(%attn_res_mix_norm_1, %mlp_gate_proj_weight,
                                              %mlp_up_proj_weight, 4.0, 25.0)

Not rewritten (reported in ``skipped``): gate or up not a bias-free ``linear`` of a
parameter, the two reading different inputs, or a projection with another reader (it is
computed anyway).

Stats per step (per rank): ``matches``, ``launches_removed`` (the two GEMMs become one:
one per match), ``nodes_removed`` / ``nodes_added``.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

import k3compile.ops.activations  # noqa: F401  (registers torch.ops.k3.situ_and_mul_proj)
from k3compile.pipeline.interface import GraphPass, PassContext, PassResult, Rewrite, Skipped, register_pass
from k3compile.pipeline.node_queries import carry_meta, is_linear_of_parameter, layer_of, op_arg, parameter_placeholders
from k3compile.targets import GPU_DEVICES

k3 = torch.ops.k3


@register_pass
class MergeGluProjections(GraphPass):
    """Replace ``situ_and_mul(linear(x, W_gate), linear(x, W_up))`` by one ``situ_and_mul_proj``."""

    name = "merge_glu_projections"
    #: GPU targets: the merged GEMM saves a launch there; on the CPU it runs the same ops.
    default_on = GPU_DEVICES
    after = ("dedup_replicated_linear",)

    def run(self, gm: GraphModule, ctx: PassContext) -> PassResult:
        result = PassResult(changed=False)
        params = parameter_placeholders(ctx.program)
        for act in [n for n in gm.graph.nodes if n.target is k3.situ_and_mul.default]:
            reason = _why_not(act, params)
            if reason:
                result.skipped.append(Skipped(act.name, reason))
                continue
            result.add_rewrite(_rewrite(gm, act))
        result.changed = result.matches > 0
        return result


def _why_not(act: Node, params: dict[str, str]) -> str:
    """'' when ``act``'s gate and up are bias-free linears of one input by parameters, read
    by nothing else; else why not."""
    gate, up = op_arg(act, "gate"), op_arg(act, "up")
    for name, proj in (("gate", gate), ("up", up)):
        if not is_linear_of_parameter(proj, params):
            return f"{name} is not a bias-free linear by a parameter (found {getattr(proj, 'target', proj)})"
        if len(proj.users) != 1:
            return f"{name}'s projection {proj.name} has other readers: it is computed anyway"
    if gate is up or gate.args[0] is not up.args[0]:
        return "gate and up do not project one input"
    return ""


def _rewrite(gm: GraphModule, act: Node) -> Rewrite:
    graph = gm.graph
    gate, up = op_arg(act, "gate"), op_arg(act, "up")
    with graph.inserting_before(act):
        merged = graph.call_function(k3.situ_and_mul_proj.default,
                                     (gate.args[0], gate.args[1], up.args[1], op_arg(act, "beta"),
                                      op_arg(act, "linear_beta")))
    carry_meta(merged, act)
    act.replace_all_uses_with(merged)
    for node in (act, gate, up):
        graph.erase_node(node)
    detail = f"layer {layer_of(merged)}: aten.linear x2 + k3.situ_and_mul -> k3.situ_and_mul_proj (one GEMM)"
    return Rewrite(merged.name, detail, {"launches_removed": 1, "nodes_removed": 3, "nodes_added": 1})


__all__ = ["MergeGluProjections"]
