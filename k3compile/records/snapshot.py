"""Graph snapshots: every node of a graph as one readable line, with its place in the model.

The pipeline snapshots the graph before and after every pass (:func:`snapshot`). A
snapshot is one line per node::

    %linear_3 = aten.linear.default(%rms_norm, %p_k3_model_layers_0_self_attn_q_proj_weight) : (s37, 64) f32 [S(1)]

with the node's innermost module path (``k3.model.layers.0.self_attn.q_proj``) and
layer index (``0``, parsed from ``layers.N``) on the side, so a snapshot (and a record)
can be narrowed to one layer or module. Nodes of branch subgraphs (``torch.cond``)
follow their ``get_attr`` node, named ``<subgraph>.<node>`` and indented.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.fx import GraphModule, Node

#: Node kinds that are not operations (left out of op counts).
_NON_OPS = frozenset({"placeholder", "output", "get_attr"})
_LAYER_IN_PATH = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")
#: Export names parameters/buffers ``p_<fqn with _>`` / ``b_<...>``: the layer survives.
_LAYER_IN_NAME = re.compile(r"(?:^|_)layers_(\d+)(?:_|$)")
_EMPTY_STACK = "_empty_nn_module_stack"

_DTYPE_SHORT = {
    torch.float32: "f32",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.float64: "f64",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "b8",
    torch.complex64: "c64",
}



@dataclass(frozen=True)
class NodeLine:
    """One node as a line of text, with where it sits in the model."""

    name: str  # node name; ``<subgraph>.<node>`` inside a branch subgraph
    op: str  # 'aten.linear.default', 'k3.rms_norm.default', 'placeholder', ...
    text: str  # '%name = op(args...) : shape dtype [placement]'
    module: str = ""  # innermost module path, '' if none
    layer: int | None = None  # from 'layers.N' in the module path

    def matches(self, layer: int | None = None, module: str | None = None) -> bool:
        if layer is not None and self.layer != layer:
            return False
        return module is None or module in self.module


@dataclass(frozen=True)
class GraphSnapshot:
    """A graph as text lines (in graph order) plus its op counts."""

    lines: tuple[NodeLine, ...]
    op_counts: dict[str, int] = field(default_factory=dict, compare=False)

    @classmethod
    def from_lines(cls, lines: Iterable[NodeLine]) -> GraphSnapshot:
        lines = tuple(lines)
        counts = Counter(line.op for line in lines if line.op not in _NON_OPS)
        return cls(lines, dict(sorted(counts.items())))

    def __len__(self) -> int:
        return len(self.lines)

    def __iter__(self) -> Iterator[NodeLine]:
        return iter(self.lines)

    @property
    def texts(self) -> list[str]:
        return [line.text for line in self.lines]

    def by_name(self) -> dict[str, NodeLine]:
        return {line.name: line for line in self.lines}

    def filter(self, layer: int | None = None, module: str | None = None) -> GraphSnapshot:
        """The nodes of layer ``layer`` whose module path contains ``module``."""
        if layer is None and module is None:
            return self
        return GraphSnapshot.from_lines(line for line in self.lines if line.matches(layer, module))

    def to_text(self) -> str:
        return "\n".join(self.texts)


def snapshot(gm: GraphModule, signature: Any = None) -> GraphSnapshot:
    """The readable lines of every node of ``gm`` (and of its branch subgraphs).

    ``signature`` (an ``ExportedProgram`` or its ``graph_signature``, optional) gives
    parameter and buffer placeholders the module path they belong to; without it
    their layer index is still read from export's ``p_..._layers_N_...`` names."""
    owners = _placeholder_owners(signature)
    lines: list[NodeLine] = []
    _snapshot_graph(gm, "", 0, owners, lines, set(), ("", None))
    return GraphSnapshot.from_lines(lines)


def _placeholder_owners(signature: Any) -> dict[str, str]:
    if signature is None:
        return {}
    sig = getattr(signature, "graph_signature", signature)
    owners: dict[str, str] = {}
    for attr in ("inputs_to_parameters", "inputs_to_buffers", "inputs_to_lifted_tensor_constants"):
        for name, fqn in (getattr(sig, attr, None) or {}).items():
            owners[name] = fqn.rpartition(".")[0]
    return owners


def _snapshot_graph(
    gm: torch.nn.Module,
    prefix: str,
    depth: int,
    owners: dict[str, str],
    out: list[NodeLine],
    seen: set[int],
    parent: tuple[str, int | None],
) -> None:
    for node in gm.graph.nodes:
        line = node_line(node, prefix, depth, owners if depth == 0 else {})
        if depth and not line.module and line.layer is None:
            # Branch-subgraph nodes carry no module stack: they sit where the branch does.
            line = dataclasses.replace(line, module=parent[0], layer=parent[1])
        out.append(line)
        if node.op == "get_attr":
            sub = _get_attr(gm, node.target)
            if isinstance(sub, torch.nn.Module) and hasattr(sub, "graph") and id(sub) not in seen:
                seen.add(id(sub))
                _snapshot_graph(sub, f"{prefix}{node.target}.", depth + 1, owners, out, seen, (line.module, line.layer))


def _get_attr(mod: torch.nn.Module, target: str) -> Any:
    obj: Any = mod
    for part in str(target).split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def node_line(node: Node, prefix: str = "", depth: int = 0, owners: dict[str, str] | None = None) -> NodeLine:
    """``node`` as a :class:`NodeLine` (``prefix``: its subgraph's name, ``depth``: indent)."""
    name = prefix + node.name
    op = op_name(node)
    module, layer = node_location(node, owners)
    if node.op == "placeholder":
        body = "placeholder"
    elif node.op == "get_attr":
        body = f"get_attr[{node.target}]"
    elif node.op == "output":
        outs = node.args[0] if len(node.args) == 1 and isinstance(node.args[0], (tuple, list)) else node.args
        body = f"output({', '.join(_fmt_arg(a, prefix) for a in outs)})"
    else:
        parts = [_fmt_arg(a, prefix) for a in node.args]
        parts += [f"{k}={_fmt_arg(v, prefix)}" for k, v in node.kwargs.items()]
        body = f"{op}({', '.join(parts)})"
    text = f"{'  ' * depth}%{name} = {body}"
    value = _fmt_value(node)
    if value:
        text += f" : {value}"
    placement = node.meta.get("placement")
    if placement is not None:
        text += f" [{_fmt_placement(placement)}]"
    return NodeLine(name, op, text, module, layer)


def op_name(node: Node) -> str:
    """A short, stable name of what ``node`` does: 'aten.linear.default', 'operator.getitem'."""
    if node.op in ("placeholder", "output", "get_attr"):
        return node.op
    if node.op == "call_method":
        return f"method.{node.target}"
    if node.op == "call_module":
        return f"module.{node.target}"
    target = node.target
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(target)
    if isinstance(target, torch._ops.HigherOrderOperator):
        return f"higher_order.{target.name()}"
    try:
        name = torch.fx.node._get_qualified_name(target)
        return "operator." + name[len("_operator.") :] if name.startswith("_operator.") else name
    except (AttributeError, RuntimeError, TypeError):
        return getattr(target, "__name__", None) or str(target)


def node_location(node: Node, owners: dict[str, str] | None = None) -> tuple[str, int | None]:
    """(innermost module path, layer index) of ``node``; ('', None) when unknown."""
    module = ""
    stack = node.meta.get("nn_module_stack") or {}
    for key, value in reversed(list(stack.items())):
        path = value[0] if isinstance(value, (tuple, list)) and value else (value if isinstance(value, str) else key)
        if not isinstance(path, str) or path.startswith(_EMPTY_STACK) or str(key).startswith(_EMPTY_STACK):
            continue
        module = path
        break
    if not module and owners and node.op == "placeholder":
        module = owners.get(node.name, "")
    m = _LAYER_IN_PATH.search(module)
    if m:
        return module, int(m.group(1))
    if node.op == "placeholder":
        m = _LAYER_IN_NAME.search(node.name)
        if m:
            return module, int(m.group(1))
    return module, None


def _fmt_arg(a: Any, prefix: str = "") -> str:
    if isinstance(a, Node):
        return f"%{prefix}{a.name}"
    if isinstance(a, tuple):
        inner = ", ".join(_fmt_arg(x, prefix) for x in a)
        return f"({inner},)" if len(a) == 1 else f"({inner})"
    if isinstance(a, list):
        return "[" + ", ".join(_fmt_arg(x, prefix) for x in a) + "]"
    if isinstance(a, dict):
        return "{" + ", ".join(f"{_fmt_arg(k, prefix)}: {_fmt_arg(v, prefix)}" for k, v in a.items()) + "}"
    if isinstance(a, torch.dtype):
        return _DTYPE_SHORT.get(a, str(a).removeprefix("torch."))
    if isinstance(a, (torch.device, torch.memory_format, torch.layout)):
        return str(a)
    if isinstance(a, (str, int, float, bool)) or a is None:
        return repr(a)
    return str(a)


def _fmt_val(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return _fmt_shape(v.shape) + " " + _DTYPE_SHORT.get(v.dtype, str(v.dtype).removeprefix("torch."))
    if hasattr(v, "shape") and hasattr(v, "dtype"):  # TensorMetadata (fx ShapeProp), a NamedTuple
        return _fmt_shape(v.shape) + " " + _DTYPE_SHORT.get(v.dtype, str(v.dtype).removeprefix("torch."))
    if isinstance(v, (tuple, list)):
        return "(" + ", ".join(_fmt_val(x) for x in v) + ("," if len(v) == 1 else "") + ")"
    if v is None:
        return "None"
    return str(v)


def _fmt_shape(shape: Sequence[Any]) -> str:
    dims = [str(d) for d in shape]
    return f"({dims[0]},)" if len(dims) == 1 else "(" + ", ".join(dims) + ")"


def _fmt_value(node: Node) -> str:
    if "val" in node.meta:
        v = node.meta["val"]
        return "" if v is None and node.op in ("output", "get_attr") else _fmt_val(v)
    tm = node.meta.get("tensor_meta")
    return _fmt_val(tm) if tm is not None else ""


def _fmt_placement(p: Any) -> str:
    if isinstance(p, (tuple, list)):
        return "(" + ", ".join(_fmt_placement(x) for x in p) + ")"
    return str(p)
