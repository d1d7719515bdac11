"""Questions passes ask of FX nodes: a node's tensor value, an op call's argument by name,
its only user, its layer, sizes at one token, and which placeholders are parameters.

Helpers only read the graph; rewriting stays in each pass.
"""

from __future__ import annotations

import re
from typing import Any

import sympy
import torch
from torch.export import ExportedProgram
from torch.fx import Node


def tensor_val(node: object) -> torch.Tensor | None:
    """The fake tensor a node produces (``meta["val"]``), or None for non-tensors."""
    val = node.meta.get("val") if isinstance(node, Node) else None
    return val if isinstance(val, torch.Tensor) else None


def op_arg(node: Node, name: str) -> Any:
    """Argument ``name`` of a call to an OpOverload, positional or keyword (its default if absent)."""
    schema = node.target._schema
    for i, a in enumerate(schema.arguments):
        if a.name == name:
            if i < len(node.args):
                return node.args[i]
            return node.kwargs.get(name, a.default_value)
    raise KeyError(f"{node.target} has no argument {name!r}")


def is_call(node: object, targets) -> bool:
    """``node`` calls one of ``targets``."""
    return isinstance(node, Node) and node.op == "call_function" and node.target in targets


def parameter_placeholders(program: ExportedProgram) -> dict[str, str]:
    """Placeholder node name -> parameter name, for the program's parameters."""
    return dict(program.graph_signature.inputs_to_parameters)


def is_parameter(node: object, params: dict[str, str]) -> bool:
    """``node`` is the placeholder of a parameter (a key of :func:`parameter_placeholders`)."""
    return isinstance(node, Node) and node.op == "placeholder" and node.name in params


def is_linear_of_parameter(node: object, params: dict[str, str]) -> bool:
    """``node`` is a bias-free ``aten.linear(x, W)`` whose W is a parameter (a key of
    :func:`parameter_placeholders`): a weight the runtime loads and may lay out."""
    if not (is_call(node, {torch.ops.aten.linear.default}) and len(node.args) == 2 and not node.kwargs):
        return False
    return is_parameter(node.args[1], params)


#: what a rewrite carries from a replaced node to its replacement: the module path (layer
#: and module of records and diffs) and the source line
SOURCE_META = ("nn_module_stack", "stack_trace")


def carry_meta(new: Node, old: Node, val: bool = True) -> None:
    """Copy ``old``'s :data:`SOURCE_META` (and, with ``val``, its fake value) to ``new``."""
    keys = (*SOURCE_META, "val") if val else SOURCE_META
    new.meta.update({k: v for k, v in old.meta.items() if k in keys})


def other_users(node: Node, user: Node) -> str:
    """'' if ``user`` is the only user of ``node``, else the reason it is not."""
    others = [u.name for u in node.users if u is not user]
    return f"{node.name} has other users ({', '.join(others)}): it would be computed anyway" if others else ""


def numel_at_one(t: torch.Tensor) -> int:
    """Elements of ``t`` with every symbolic size set to 1 (one sequence, one token)."""
    n = sympy.Integer(1)
    for s in t.shape:
        n *= sympy.sympify(s.node.expr) if hasattr(s, "node") else sympy.Integer(s)
    return int(n.subs({sym: 1 for sym in n.free_symbols}))


def layer_of(node: Node) -> str:
    """The decoder layer a node was traced in ("-" outside the layers)."""
    stack = node.meta.get("nn_module_stack") or {}
    path = list(stack.values())[-1][0] if stack else ""
    found = re.search(r"layers\.(\d+)", path)
    return found.group(1) if found else "-"


def op_name(node: Node) -> str:
    """``k3.rms_norm``, ``aten.linear``: how pass reports name an op."""
    return node.target.overloadpacket._qualified_op_name.replace("::", ".")
