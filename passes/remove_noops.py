"""Remove no-op views, casts, slices and copies.

Matches nodes whose result equals their input:

* views and reshapes to the input's own shape, full-range slices, ``alias``;
* ``aten.to`` / ``_to_copy`` to the input's dtype (and device, layout);
* ``clone`` whose copy nobody needs: neither the clone nor its source is written by
  any op in the graph, so sharing one buffer cannot be observed.

Before::

    %x    = k3.rms_norm(%h, %w, 1e-05)          : f32[s0, 64]
    %xf   = aten.to.dtype(%x, torch.float32)    : f32[s0, 64]
    %v    = aten.view(%xf, [s0, 64])            : f32[s0, 64]
    %c    = aten.clone(%v)                      : f32[s0, 64]
    %y    = aten.linear(%c, %p_w)

After::

    %x    = k3.rms_norm(%h, %w, 1e-05)          : f32[s0, 64]
    %y    = aten.linear(%x, %p_w)

Does not apply to a copy whose source or result is mutated later (e.g. a copy of a
cache before an in-place cache write): such candidates are reported as skipped. Views
and casts are compared with symbolic shapes: a reshape that is a no-op only for some
sizes is kept.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from k3compile.pipeline.interface import GraphPass, PassContext, PassResult, Skipped, register_pass
from k3compile.pipeline.node_queries import tensor_val
from k3compile.targets import DEVICE_KINDS

aten = torch.ops.aten

_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.alias.default}
_CASTS = {aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default, aten.to.device}
_COPIES = {aten.clone.default, aten._to_copy.default}




def _same_shape(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dim() == b.dim() and all(statically_known_true(x == y) for x, y in zip(a.shape, b.shape))


def _same_tensor_type(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.device == b.device and a.layout == b.layout and _same_shape(a, b)


def _is_full_slice(node: Node, src: torch.Tensor) -> bool:
    if node.target is not aten.slice.Tensor:
        return False
    dim = node.args[1] if len(node.args) > 1 else 0
    start = node.args[2] if len(node.args) > 2 else None
    end = node.args[3] if len(node.args) > 3 else None
    step = node.args[4] if len(node.args) > 4 else 1
    size = src.shape[dim]
    full_end = end is None or (isinstance(end, int) and statically_known_true(end >= size))
    return start in (None, 0) and step == 1 and full_end


def written_nodes(gm: GraphModule) -> dict[Node, Node]:
    """Node -> the first op that writes it in place (schema args with is_write)."""
    writes: dict[Node, Node] = {}
    for node in gm.graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op != "call_function" or schema is None:
            continue
        for i, arg in enumerate(schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            for v in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(v, Node):
                    writes.setdefault(v, node)
    return writes


def _bytes(val: torch.Tensor) -> int:
    from torch.fx.experimental.symbolic_shapes import size_hint

    numel = 1
    for s in val.shape:
        numel *= int(size_hint(s)) if isinstance(s, torch.SymInt) else int(s)
    return numel * val.element_size()


@register_pass
class RemoveNoops(GraphPass):
    """Drop views, casts, slices and copies whose result equals their input."""

    name = "remove_noops"
    default_on = frozenset(DEVICE_KINDS)

    def run(self, gm: GraphModule, ctx: PassContext) -> PassResult:
        result = PassResult(changed=False)
        writes = written_nodes(gm)
        removed = launches = nbytes = 0
        for node in list(gm.graph.nodes):
            if node.op != "call_function" or not node.args or not isinstance(node.args[0], Node):
                continue
            src_node = node.args[0]
            out, src = tensor_val(node), tensor_val(src_node)
            if out is None or src is None:
                continue
            is_view = node.target in _VIEWS and _same_shape(out, src)
            is_view |= _is_full_slice(node, src)
            is_cast = node.target in _CASTS and _same_tensor_type(out, src) and not node.kwargs.get("memory_format")
            is_copy = node.target in _COPIES and _same_tensor_type(out, src)
            if not (is_view or is_cast or is_copy):
                continue
            result.matches += 1
            copies = node.target in _COPIES
            if copies and (node in writes or src_node in writes):
                writer = writes.get(node) or writes[src_node]
                result.skipped.append(Skipped(node.name, f"copy needed: {writer.name} writes it in place"))
                continue
            if copies and any(u.op == "output" for u in node.users) and src_node.op == "placeholder":
                result.skipped.append(Skipped(node.name, "copy of a graph input returned as output"))
                continue
            node.replace_all_uses_with(src_node)
            gm.graph.erase_node(node)
            removed += 1
            if copies:
                launches += 1
                nbytes += 2 * _bytes(out)
        result.changed = removed > 0
        result.stats = {"nodes_removed": removed, "launches_removed": launches, "bytes_removed": nbytes}
        return result
