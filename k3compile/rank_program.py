"""A program as validation runs it, cheap to send to spawned ranks.

Translation validation at TP > 1 sends every version of a program to its gloo ranks.
``torch.export.save`` / ``load`` of a tiny program take about 1 s and 2.5 s (save
canonicalizes a deep copy, load re-verifies), while running it on the validation steps
takes a fraction of that. A :class:`RankProgram` holds only what running the graph needs:
the graph's nodes as plain records (ops named by their qualified names; ``torch.cond``
branches as nested records), the order and kind of its lifted inputs, and the dtypes of
its parameters and buffers. It packs and unpacks in tens of milliseconds and regenerates
the same Python code. It is for our own spawned processes only: artifacts are written
and read with ``torch.export`` (``artifact_writer.save_program``).
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass
from typing import Any

import torch
from torch._ops import HigherOrderOperator, OpOverload
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind
from torch.fx import Graph, GraphModule, Node
from torch.fx.node import map_aggregate, map_arg


@dataclass(frozen=True)
class _NodeRef:
    """An argument that is another node of the same graph."""

    name: str


@dataclass(frozen=True)
class _GraphRecord:
    """A graph module as plain data: nodes ``(name, op, target, args, kwargs)`` in order,
    and the attributes its ``get_attr`` nodes read (subgraphs as records, tensors as is)."""

    nodes: list[tuple[str, str, Any, Any, Any]]
    attributes: dict[str, _GraphRecord | torch.Tensor]


def _ref(node: Node) -> _NodeRef:
    return _NodeRef(node.name)


def _record(gm: GraphModule) -> _GraphRecord:
    nodes, attributes = [], {}
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            value = getattr(gm, n.target)
            if isinstance(value, GraphModule):
                attributes[n.target] = _record(value)
            elif isinstance(value, torch.Tensor):
                attributes[n.target] = value
            else:
                raise TypeError(f"get_attr {n.target!r} reads a {type(value).__name__}: cannot send it to a rank")
        nodes.append((n.name, n.op, n.target, map_arg(n.args, _ref), map_arg(n.kwargs, _ref)))
    return _GraphRecord(nodes, attributes)


def _graph_module(record: _GraphRecord) -> GraphModule:
    root = torch.nn.Module()
    for name, value in record.attributes.items():
        if isinstance(value, _GraphRecord):
            root.add_module(name, _graph_module(value))
        else:
            root.register_buffer(name, value)
    graph, env = Graph(), {}

    def resolve(a: Any) -> Any:
        return env[a.name] if isinstance(a, _NodeRef) else a

    for name, op, target, args, kwargs in record.nodes:
        env[name] = graph.create_node(op, target, map_aggregate(args, resolve), map_aggregate(kwargs, resolve),
                                      name=name)
    return GraphModule(root, graph)


class _OpPickler(pickle.Pickler):
    """Ops by qualified name (``OpOverload`` and higher-order ops do not pickle)."""

    def persistent_id(self, obj: Any) -> tuple[str, ...] | None:
        if isinstance(obj, OpOverload):
            return ("op", obj._schema.name, obj._overloadname)
        if isinstance(obj, HigherOrderOperator):
            return ("higher_order", obj.__name__)
        return None


class _OpUnpickler(pickle.Unpickler):
    def persistent_load(self, pid: tuple[str, ...]) -> Any:
        if pid[0] == "op":
            namespace, name = pid[1].split("::")
            return getattr(getattr(getattr(torch.ops, namespace), name), pid[2] or "default")
        return getattr(torch.ops.higher_order, pid[1])


@dataclass
class RankProgram:
    """A program's graph and what feeding it needs: its lifted inputs in call order as
    ``(kind, name)`` (``name`` None for user inputs) and the dtypes of its parameters and
    buffers."""

    graph_module: GraphModule
    inputs: list[tuple[InputKind, str | None]]
    dtypes: dict[str, torch.dtype]

    @classmethod
    def of(cls, program: ExportedProgram) -> RankProgram:
        inputs = [(s.kind, s.target) for s in program.graph_signature.input_specs]
        return cls(program.graph_module, inputs, {k: v.dtype for k, v in program.state_dict.items()})

    def pack(self) -> bytes:
        buf = io.BytesIO()
        _OpPickler(buf).dump((_record(self.graph_module), self.inputs, self.dtypes))
        return buf.getvalue()

    @classmethod
    def unpack(cls, data: bytes) -> RankProgram:
        record, inputs, dtypes = _OpUnpickler(io.BytesIO(data)).load()
        return cls(_graph_module(record), inputs, dtypes)
