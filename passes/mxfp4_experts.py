"""Run the routed experts on their MXFP4 codes as the checkpoint stores them.

K3's routed experts are MXFP4 in the checkpoint: per weight, E2M1 codes packed two per
byte and one E8M0 scale byte per 32 input values (0.53 bytes per value). The captured
model holds them dense (``k3.moe_experts`` on bf16 ``w1``/``w3``/``w2``, which the loader
fills by dequantising), 3.76x their stored size: 656 GiB per GPU for K3 at TP8, more than
an MI355X has. This pass makes each rank hold, and the op read, the stored bytes:

- the parameters ``w1``, ``w3``, ``w2`` [E, rows, cols] become ``w*_packed`` [E, rows,
  cols / 2] and ``w*_scale`` [E, rows, cols / 32] (uint8), with shard specs naming the
  checkpoint's ``weight_packed`` / ``weight_scale`` tensors, split on the same dim (the
  intermediate one: rows of w1/w3, input columns of w2, so a rank reads whole bytes and
  whole scale groups of its slice straight from the safetensors files);
- ``k3.moe_experts`` becomes ``k3.moe_experts_mxfp4``, which dequantises in registers on
  the GPU (``k3compile/runtime/kernels/moe.py``) and only the picked experts in its torch
  reference.

Exact: dequantisation is exact in bf16 and fp32, and the op's reference runs the dense
reference on the dequantised experts, so the graph computes the same function (the GPU
kernels differ only in accumulation order).

Before (layer 3 of ``tiny``, decode)::

    %moe_experts_2 = k3.moe_experts(%linear_42, %getitem_9, %getitem_10,
        %p_..._experts_w1, %p_..._experts_w3, %p_..._experts_w2, 4.0, 25.0)
        # w1/w3 [8, 128, 32], w2 [8, 32, 128] in the model dtype

After::

    %moe_experts_mxfp4 = k3.moe_experts_mxfp4(%linear_42, %getitem_9, %getitem_10,
        %p_..._experts_w1_packed, %p_..._experts_w1_scale, %p_..._experts_w3_packed,
        %p_..._experts_w3_scale, %p_..._experts_w2_packed, %p_..._experts_w2_scale, 4.0, 25.0)
        # w1/w3 packed [8, 128, 16] + scales [8, 128, 1], w2 packed [8, 32, 64] + scales [8, 32, 4], uint8

Skipped, with the reason in the record: a checkpoint whose experts are bf16 (the config's
``expert_format``, which the compiler reads from the safetensors index), and weights that
are not plain parameters with shard specs.
"""

from __future__ import annotations

import math

import torch
from torch.fx import GraphModule, Node

from k3compile.checkpoint.mxfp4 import GROUP_SIZE
from k3compile.pipeline.graph_edits import add_parameter, remove_parameter
from k3compile.pipeline.interface import GraphPass, PassContext, PassResult, Rewrite, Skipped, register_pass
from k3compile.sharding import ShardSpec
from k3compile.targets import DEVICE_KINDS

k3 = torch.ops.k3

#: (weight argument of k3.moe_experts, its position there)
_WEIGHTS = (("w1", 3), ("w3", 4), ("w2", 5))


def packed_specs(dense: ShardSpec) -> tuple[ShardSpec, ShardSpec]:
    """The specs of the codes and scales a checkpoint stores for the dense expert weight
    ``dense`` (logical [rows, cols], cols the input dim): [rows, cols / 2] and
    [rows, cols / 32] bytes, split on the same dim."""
    rows, cols = dense.shape
    if cols % GROUP_SIZE:
        raise ValueError(f"{dense.names[0]}: input dim {cols} is not a multiple of the MXFP4 group size {GROUP_SIZE}")

    def stored(suffix: str, width: int) -> ShardSpec:
        names = tuple(n.removesuffix(".weight") + f".weight_{suffix}" for n in dense.names)
        return ShardSpec(names=names, shape=(rows, width), dtype="u8", dim=dense.dim)

    return stored("packed", cols // 2), stored("scale", cols // GROUP_SIZE)


@register_pass
class MXFP4Experts(GraphPass):
    """Routed experts read as stored MXFP4 codes and scales (see the module docstring)."""

    name = "mxfp4_experts"
    default_on = frozenset(DEVICE_KINDS)

    def __init__(self, config=None):
        super().__init__(config)
        self._dense: dict[str, ShardSpec] = {}  # specs of the replaced weights, for later phases

    def run(self, gm: GraphModule, ctx: PassContext) -> PassResult:
        result = PassResult(changed=False)
        nodes = [n for n in gm.graph.nodes if n.target is k3.moe_experts.default]
        if nodes and ctx.config.expert_format != "mxfp4":
            result.skipped += [Skipped(n.name, "the checkpoint stores the routed experts in bf16") for n in nodes]
            return result
        params = {s.arg.name: s.target for s in ctx.program.graph_signature.input_specs if s.target is not None}
        for node in nodes:
            names = [params.get(getattr(node.args[i], "name", None)) for _, i in _WEIGHTS]
            if any(n is None or (n not in ctx.specs and n not in self._dense) for n in names):
                result.skipped.append(Skipped(node.name, "an expert weight is not a parameter with a shard spec"))
                continue
            result.add_rewrite(self._rewrite(gm, ctx, node, names))
        result.changed = result.matches > 0
        return result

    def _rewrite(self, gm: GraphModule, ctx: PassContext, node: Node, names: list[str]) -> Rewrite:
        graph = gm.graph
        weight_args: list[Node] = []
        dense_bytes = packed_bytes = 0
        for name in names:
            dense = self._dense.setdefault(name, ctx.specs.get(name))
            dense_bytes += ctx.program.state_dict[name].nbytes
            for spec, suffix in zip(packed_specs(dense), ("_packed", "_scale")):
                weight_args.append(add_parameter(ctx, name + suffix, spec, before=name))
                packed_bytes += math.prod(spec.local_shape(ctx.plan))
        z, weights, ids, *_, beta, linear_beta = node.args
        with graph.inserting_before(node):
            fused = graph.create_node("call_function", k3.moe_experts_mxfp4.default,
                                      (z, weights, ids, *weight_args, beta, linear_beta), name="moe_experts_mxfp4")
        fused.meta["nn_module_stack"] = node.meta.get("nn_module_stack", {})
        node.replace_all_uses_with(fused)
        graph.erase_node(node)
        for name in names:
            remove_parameter(ctx, name)
        module = next(reversed(fused.meta["nn_module_stack"].values()), ("<no module>",))[0]
        # Per rank: the weights as the device holds them (in the model dtype before).
        stats = {"weight_bytes_removed": dense_bytes - packed_bytes}
        return Rewrite(node.name, f"{module}: w1, w3, w2 kept as MXFP4 codes + scales", stats)

