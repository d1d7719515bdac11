"""What every placement rule works with: the error a rule raises, and FX node helpers.

A rule reads a node's arguments by schema name (:func:`_bind`), the placements of its
tensor arguments (:func:`_input_placements`), and its shapes from ``node.meta["val"]``;
it answers a :data:`PlacementValue` (:func:`_outputs` repeats one placement over a
multi-output node) or fails with a :class:`PlacementError` that names the node and its
input placements (:func:`_fail`). The underscored names are internal to the
``k3compile.placement`` package.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, NoReturn, Union

import sympy
import torch
from torch.fx import Node

from k3compile.sharding import Partial, Placement, Replicate

R = Replicate()

#: A node's placement: one placement, a tuple (multi-output), or None (no value).
PlacementValue = Union[Placement, tuple, None]


class PlacementError(RuntimeError):
    """A node's inputs have placements its op cannot take (or the op has no rule)."""


def _fmt(p: Any) -> str:
    """A placement (or a list of them, or None) as error messages write it: ``P(max)``."""
    if p is None:
        return "-"
    if isinstance(p, (list, tuple)):
        return "[" + ", ".join(_fmt(x) for x in p) + "]"
    if isinstance(p, Partial) and p.reduce_op != "sum":
        return f"P({p.reduce_op})"
    return str(p)


def _op_name(node: Node) -> str:
    """``namespace.op.overload`` of an op node (the callable's name otherwise)."""
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        return f"{t.namespace}.{t._schema.name.split('::')[-1]}.{t._overloadname}"
    return getattr(t, "__name__", str(t))


def _fail(node: Node, msg: str, inputs: Mapping[str, Any] | None = None) -> NoReturn:
    """Raise a :class:`PlacementError` naming ``node`` (and its input placements)."""
    where = f"node {node.name!r} ({_op_name(node)})"
    if inputs:
        desc = ", ".join(f"{k}={_fmt(v)}" for k, v in inputs.items() if v is not None)
        raise PlacementError(f"{where}: {msg}; input placements: {desc or 'none'}")
    raise PlacementError(f"{where}: {msg}")


def _is_tensor(v: Any) -> bool:
    return isinstance(v, Node) and isinstance(v.meta.get("val"), torch.Tensor)


def _ndim(node: Node) -> int:
    return node.meta["val"].dim()


def _shape(node: Node) -> tuple:
    return tuple(node.meta["val"].shape)


def _expr(s: Any) -> sympy.Expr:
    """A size (int or SymInt) as a sympy expression."""
    if isinstance(s, torch.SymInt):
        return sympy.sympify(s.node.expr)
    return sympy.Integer(int(s))


def _is_one(s: Any) -> bool:
    return _expr(s) == 1


def _norm_dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def _placement(v: Any) -> Any:
    """The placement of a bound argument: a tensor node's, a list for a list of tensors,
    None for anything else (scalars, sizes, dtypes, strings)."""
    if isinstance(v, Node):
        return v.meta["placement"] if _is_tensor(v) else None
    if isinstance(v, (list, tuple)) and any(_is_tensor(x) for x in v):
        return [_placement(x) for x in v]
    return None


def _bind(node: Node) -> dict[str, Any]:
    """The node's arguments by schema name (defaults filled in)."""
    schema = node.target._schema
    out: dict[str, Any] = {}
    for i, arg in enumerate(schema.arguments):
        if i < len(node.args):
            out[arg.name] = node.args[i]
        elif arg.name in node.kwargs:
            out[arg.name] = node.kwargs[arg.name]
        elif arg.has_default_value():
            out[arg.name] = arg.default_value
        else:
            out[arg.name] = None
    return out


def _input_placements(bound: Mapping[str, Any]) -> dict[str, Any]:
    """The placements of the bound arguments that are tensors (or lists of them)."""
    return {k: p for k, v in bound.items() if (p := _placement(v)) is not None}


def _flat(pls: Iterable[Any]) -> list[Placement]:
    """Placements with lists (list arguments) flattened and Nones dropped."""
    out: list[Placement] = []
    for p in pls:
        if isinstance(p, list):
            out.extend(x for x in p if x is not None)
        elif p is not None:
            out.append(p)
    return out


def _num_outputs(node: Node) -> int | None:
    """None: one tensor; 0: no value; k: a tuple of k values."""
    v = node.meta.get("val")
    if isinstance(v, (tuple, list)):
        return len(v)
    return 0 if v is None else None


def _outputs(node: Node, p: PlacementValue) -> PlacementValue:
    """``p`` for every output of ``node`` (a tuple for a multi-output node, None for none)."""
    n = _num_outputs(node)
    if n == 0:
        return None
    if n is None:
        return p
    return tuple(p for _ in range(n))


def _tensor_vals(v: Any) -> list[torch.Tensor]:
    """The tensors of a ``meta["val"]`` (one tensor, or a tuple's tensors)."""
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, (list, tuple)):
        return [x for x in v if isinstance(x, torch.Tensor)]
    return []
