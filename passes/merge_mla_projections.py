"""Put an MLA layer's three input projections into one op: ``k3::mla_input_proj``.

An MLA layer reads its normalised input x with three bias-free linears: q_a (-> the query's
low-rank latent, RMS-normalised), kv_a (-> the cached latent, RMS-normalised, and k_pe) and
g_proj (the output gate, through a sigmoid). At a decode batch each GEMM is latency, not
bytes (3-5 us above its floor plus a split-K reduction on an H200). ``k3::mla_input_proj(x,
W_qa, W_kva, W_g, ...)`` takes the input, the three weights and the consumers' norm
weights, and returns what the consumers returned. The runtime lays the three weights out
as consecutive rows of one buffer at load (``k3compile/runtime/weight_layout.py``), so on
GPUs the op runs ONE GEMM over them and one Triton kernel then does both norms, the k_pe
copy and the sigmoid, reading the product's column blocks in place. On the CPU the op runs
the same ops as the graph: the rewrite is exact.

Before (layer 2 of ``tiny``, decode; weights' names shortened)::

    %linear_22  = aten.linear(%rms_norm_5, %q_a_proj_weight)                     [s, 32]
    %rms_norm_6 = k3.rms_norm(%linear_22, %q_a_layernorm_weight, 1e-06)
    %linear_24  = aten.linear(%rms_norm_5, %kv_a_proj_with_mqa_weight)           [s, 40]
    %slice_1    = aten.slice(%linear_24, 1, 0, 32)
    %rms_norm_7 = k3.rms_norm(%slice_1, %kv_a_layernorm_weight, 1e-06)
    %slice_2    = aten.slice(%linear_24, 1, 32, 9223372036854775807)
    %cat        = aten.cat([%rms_norm_7, %slice_2], -1)                          -> k3.mla_cache_write
    ...
    %linear_25  = aten.linear(%rms_norm_5, %g_proj_weight)                       [s, 64]
    %sigmoid_2  = aten.sigmoid(%linear_25)                                       -> mul by the attention

After (the consumers read the getitems)::

    %mla_input_proj_default = k3.mla_input_proj(%rms_norm_5, %q_a_proj_weight,
        %kv_a_proj_with_mqa_weight, %g_proj_weight, %q_a_layernorm_weight,
        %kv_a_layernorm_weight, 1e-06, 1e-06, 32)
    %getitem_22 = getitem(%mla_input_proj_default, 0)     (q_c  -> q_b_proj)        [s, 32]
    %getitem_23 = getitem(%mla_input_proj_default, 1)     (kv   -> mla_cache_write) [s, 40]
    %getitem_24 = getitem(%mla_input_proj_default, 2)     (gate -> mul)             [s, 64]

Matched by semantics from each cached-latent concatenation ``cat([rms_norm(P[:, :L]),
P[:, L:]], -1)`` (last-dim slices of one P, in order): P is a bias-free linear of x by a
parameter; among x's other readers, one such linear feeds an RMSNorm (q_a) and one a
sigmoid (the gate). Not rewritten (reported in ``skipped``): P not such a linear, x not
[T, hidden], no q_a or no gate linear of x (or several: ambiguous), or a projection or an
intermediate (the latent slice, its norm, k_pe's slice) with another reader (it is
computed anyway).

Stats per step (per rank): ``matches``; ``launches_removed`` 4 per match on a GPU (three
GEMMs become one; the two norms and the cat become the one kernel, which also takes the
sigmoid: that one is not counted, as Inductor would fuse it into the gate's product);
``nodes_removed`` / ``nodes_added``.
"""

from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule, Node

import k3compile.ops.mla_proj  # noqa: F401  (registers torch.ops.k3.mla_input_proj)
from k3compile.pipeline.interface import GraphPass, PassContext, PassResult, Rewrite, Skipped, register_pass
from k3compile.pipeline.node_queries import (
    carry_meta,
    is_call,
    is_linear_of_parameter,
    layer_of,
    op_arg,
    parameter_placeholders,
    tensor_val,
)
from k3compile.targets import GPU_DEVICES

k3 = torch.ops.k3
aten = torch.ops.aten


@register_pass
class MergeMlaProjections(GraphPass):
    """Replace an MLA layer's q_a / kv_a / g_proj linears and their consumers by one
    ``mla_input_proj``."""

    name = "merge_mla_projections"
    #: GPU targets: the merged GEMM and kernel save launches there; on the CPU it runs the same ops.
    default_on = GPU_DEVICES
    after = ("dedup_replicated_linear",)

    def run(self, gm: GraphModule, ctx: PassContext) -> PassResult:
        result = PassResult(changed=False)
        params = parameter_placeholders(ctx.program)
        for cat in [n for n in gm.graph.nodes if is_call(n, {aten.cat.default})]:
            kv = _cached_latent(cat)
            if kv is None:
                continue  # not a candidate
            found = _match(kv, params)
            if isinstance(found, str):
                result.skipped.append(Skipped(cat.name, found))
                continue
            result.add_rewrite(_rewrite(gm, found))
        result.changed = result.matches > 0
        return result


def _last_dim_slice(node: object, ndim: int) -> tuple[Node, int, int] | None:
    """(source, start, end) of a step-1 ``aten.slice`` of the last dim, else None."""
    if not is_call(node, {aten.slice.Tensor}):
        return None
    dim, start, end, step = (op_arg(node, a) for a in ("dim", "start", "end", "step"))
    if dim % ndim != ndim - 1 or step != 1 or not isinstance(start or 0, int) or not isinstance(end, int):
        return None
    return node.args[0], start or 0, end


def _cached_latent(cat: Node) -> dict[str, Node] | None:
    """The nodes of ``cat([rms_norm(P[..., :L]), P[..., L:]], -1)`` (P's last dim ending at
    the k_pe slice), or None when ``cat`` is not that."""
    tensors, dim = op_arg(cat, "tensors"), op_arg(cat, "dim")
    val = tensor_val(cat)
    if val is None or len(tensors) != 2 or dim % val.dim() != val.dim() - 1:
        return None
    norm, pe = tensors
    if not is_call(norm, {k3.rms_norm.default}):
        return None
    latent, k_pe = _last_dim_slice(op_arg(norm, "x"), val.dim()), _last_dim_slice(pe, val.dim())
    if latent is None or k_pe is None or latent[0] is not k_pe[0]:
        return None
    proj = latent[0]
    width = tensor_val(proj).shape[-1] if tensor_val(proj) is not None else None
    L = latent[2]
    if latent[1] != 0 or k_pe[1] != L or not isinstance(width, int) or not 0 < L < width or k_pe[2] < width:
        return None
    return {"kv_proj": proj, "latent": op_arg(norm, "x"), "kv_norm": norm, "k_pe": pe, "cat": cat}


def _consumed_linears(x: Node, params: dict[str, str], consumer: object, skip: Node) -> list[tuple[Node, Node]]:
    """(linear, its consumer) for the bias-free linears of ``x`` by parameters that ``consumer``
    (an op) reads as its first argument."""
    return [(u, v) for u in x.users if u is not skip and is_linear_of_parameter(u, params)
            for v in u.users if is_call(v, {consumer}) and v.args[0] is u]


def _match(kv: dict[str, Node], params: dict[str, str]) -> dict[str, Node] | str:
    """All nodes of the layer's pattern by role, or why it is not rewritten."""
    proj = kv["kv_proj"]
    if not is_linear_of_parameter(proj, params):
        return f"the cached latent's projection {proj.name} is not a bias-free linear by a parameter"
    x = proj.args[0]
    if tensor_val(x) is None or tensor_val(x).dim() != 2:
        return f"the projections' input {x.name} is not [T, hidden]"
    nodes = dict(kv)
    for role, consumer in (("q", k3.rms_norm.default), ("gate", aten.sigmoid.default)):
        found = _consumed_linears(x, params, consumer, proj)
        if len(found) != 1:
            what = "no" if not found else f"{len(found)} ({', '.join(p.name for p, _ in found)}): ambiguous,"
            return f"{what} linear of {x.name} by a parameter feeding a {consumer.name()} ({role})"
        nodes[f"{role}_proj"], nodes[f"{role}_out"] = found[0]
    readers = {"q_proj": "q_out", "gate_proj": "gate_out", "latent": "kv_norm", "kv_norm": "cat", "k_pe": "cat"}
    for role, reader in readers.items():
        if set(nodes[role].users) != {nodes[reader]}:
            return f"{role} {nodes[role].name} has other readers: it is computed anyway"
    if set(proj.users) != {nodes["latent"], nodes["k_pe"]}:
        return f"kv_proj {proj.name} has other readers: it is computed anyway"
    return nodes


def _rewrite(gm: GraphModule, nodes: dict[str, Node]) -> Rewrite:
    graph = gm.graph
    q_norm, kv_norm = nodes["q_out"], nodes["kv_norm"]
    x = nodes["kv_proj"].args[0]
    args = (x, nodes["q_proj"].args[1], nodes["kv_proj"].args[1], nodes["gate_proj"].args[1],
            op_arg(q_norm, "weight"), op_arg(kv_norm, "weight"), op_arg(q_norm, "eps"), op_arg(kv_norm, "eps"),
            tensor_val(nodes["latent"]).shape[-1])
    order = {n: i for i, n in enumerate(graph.nodes)}
    outputs = (nodes["q_out"], nodes["cat"], nodes["gate_out"])
    with graph.inserting_before(min(nodes.values(), key=order.__getitem__)):
        merged = graph.call_function(k3.mla_input_proj.default, args)
        items = [graph.call_function(operator.getitem, (merged, i)) for i in range(3)]
    carry_meta(merged, nodes["cat"], val=False)
    merged.meta["val"] = tuple(tensor_val(o) for o in outputs)
    for item, old in zip(items, outputs, strict=True):
        carry_meta(item, old)
        old.replace_all_uses_with(item)
    removed = ("cat", "k_pe", "kv_norm", "latent", "kv_proj", "q_out", "q_proj", "gate_out", "gate_proj")
    for role in removed:
        graph.erase_node(nodes[role])
    detail = (f"layer {layer_of(merged)}: aten.linear x3 + k3.rms_norm x2 + slices, cat, sigmoid -> "
              "k3.mla_input_proj (one GEMM, one kernel)")
    return Rewrite(merged.name, detail, {"launches_removed": 4, "nodes_removed": len(removed), "nodes_added": 4})


__all__ = ["MergeMlaProjections"]
