"""Placement rules of the aten ops: pointwise, contractions, reductions, scalars; the aten registry.

Rules (an input combination not listed is a :class:`PlacementError` that names the node
and its input placements; nothing is defaulted silently, and an op with no rule fails):

- contractions (``linear``, ``matmul``/``mm``/``bmm``, ``einsum``), by index letters:
  ``R x R -> R``; shards must all be on one letter L (and every replicated operand that
  has L must broadcast it): L kept in the output -> ``Shard`` of its output dim (column
  parallel: ``linear(R, S(0) weight) -> S(-1)``), L contracted -> ``Partial`` (row
  parallel: ``linear(S(-1), S(1) weight) -> P``); one Partial operand with the others R ->
  P (a contraction is linear in each operand); anything else fails. A bias must match the
  product's placement (R with R, S(0) with S(-1)); a bias on a Partial product fails.
- pointwise ops with broadcasting: shards align from the right; every sharded operand
  must shard the same output dim and replicated operands must broadcast it (size 1 or
  absent). Partial survives only ops linear in that operand: ``add``/``sub`` of P and P,
  ``mul`` of P by R (or a scalar), ``div`` of P by R (or a scalar), ``neg``, dtype casts,
  copies, ``masked_fill(P, mask, 0)``. Any other op on a Partial (``sigmoid``, ``exp``,
  ``add(P, R)``, ``mul(P, P)`` ...) fails.
- reductions: over a sharded dim ``sum``/``mean``/``amax``/``amin`` give
  ``Partial(sum/avg/max/min)``, others fail; over other dims the shard moves with the
  remaining dims. ``sum``/``mean`` of P stay P. Softmax-like ops and top-k need their dim
  unsharded.
- size queries are Replicate (splits are even); reading a scalar out of a tensor needs a
  Replicate tensor; asserts have no value.

Views, data movement and gathers are in :mod:`k3compile.placement.aten_views`, the
functional collectives in :mod:`k3compile.placement.collectives`; both register into
:data:`ATEN_RULES` here, by op overload packet, each rule with its cost kind (see
:mod:`k3compile.placement.redundancy`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import Node

from k3compile.placement.nodes import (
    R,
    PlacementValue,
    _bind,
    _fail,
    _fmt,
    _input_placements,
    _is_one,
    _is_tensor,
    _ndim,
    _norm_dim,
    _num_outputs,
    _outputs,
    _shape,
)
from k3compile.sharding import Partial, Placement, Shard

aten = torch.ops.aten


@dataclass(frozen=True)
class AtenRule:
    """The placement rule of an aten (or collective) op and its cost kind."""

    propagate: Callable[[Node, dict[str, Any]], PlacementValue]
    cost: str  # "free" | "collective" | "create" | "gather" | "copy" | "pointwise" | "reduce" | "softmax" | "contract"


#: The rules of aten and functional-collective ops, by overload packet (or op).
ATEN_RULES: dict[Any, AtenRule] = {}


def _register(packets: Iterable[Any], cost: str):
    """Decorator: ``fn`` is the rule of every op of ``packets``, costed as ``cost``."""

    def deco(fn):
        for p in packets:
            ATEN_RULES[p] = AtenRule(fn, cost)
        return fn

    return deco


def _p(name: str) -> Any | None:
    return getattr(aten, name, None)


def _packets(*names: str) -> list[Any]:
    """The aten overload packets of these names (those this torch has)."""
    return [p for n in names if (p := _p(n)) is not None]


# --- pointwise ---------------------------------------------------------------

_LINEAR_SUM = _packets("add", "sub")
_LINEAR_PRODUCT = _packets("mul")
_LINEAR_QUOTIENT = _packets("div")
_NEGATION = _packets("neg")
_LINEAR_UNARY = _packets("to", "_to_copy", "clone", "contiguous", "alias", "detach", "detach_", "positive",
                         "lift_fresh_copy", "type_as", "_to_dtype")
_NONLINEAR = _packets(
    "sigmoid", "silu", "exp", "exp2", "expm1", "log", "log1p", "log2", "log10", "tanh", "rsqrt", "sqrt", "relu",
    "gelu", "abs", "pow", "square", "reciprocal", "sin", "cos", "tan", "atan", "atan2", "sinh", "cosh", "erf",
    "softplus", "clamp", "clamp_min", "clamp_max", "sign", "sgn", "floor", "ceil", "round", "trunc", "eq", "ne",
    "lt", "le", "gt", "ge", "logical_and", "logical_or", "logical_not", "logical_xor", "bitwise_and",
    "bitwise_or", "bitwise_not", "bitwise_xor", "__and__", "__or__", "__xor__", "__invert__", "maximum",
    "minimum", "where", "masked_fill", "nan_to_num", "fmod", "remainder", "floor_divide", "isnan", "isinf",
    "isfinite", "hardtanh", "leaky_relu", "elu", "mish", "hardsigmoid", "hardswish", "lerp", "addcmul", "addcdiv",
)
_UNARY_OPERAND = {"self"}  # the only operand of the linear unary ops (to.other's ``other`` is a dtype source)


def _pointwise(node: Node, bound: dict[str, Any]) -> PlacementValue:
    packet = node.target.overloadpacket
    pls = _input_placements(bound)
    if packet in _LINEAR_UNARY:
        operands = {k: v for k, v in pls.items() if k in _UNARY_OPERAND}
    else:
        operands = pls
    flat = {k: v for k, v in operands.items() if not isinstance(v, list)}
    partial = [k for k, p in flat.items() if isinstance(p, Partial)]
    if partial:
        return _pointwise_partial(node, bound, packet, flat, partial, pls)
    out_nd = _ndim(node)
    out_dim: int | None = None
    for k, p in flat.items():
        if isinstance(p, Shard):
            d = p.dim + out_nd - _ndim(bound[k])
            if out_dim is not None and d != out_dim:
                _fail(node, "operands are sharded on different output dims", pls)
            out_dim = d
    if out_dim is None:
        return _outputs(node, R)
    for k, p in flat.items():
        if p == R:
            in_d = out_dim - (out_nd - _ndim(bound[k]))
            if in_d >= 0 and not _is_one(_shape(bound[k])[in_d]):
                _fail(node, f"operand {k} is Replicate but not broadcast along the sharded dim {out_dim}", pls)
    return _outputs(node, Shard(out_dim))


def _pointwise_partial(node, bound, packet, flat, partial, pls) -> PlacementValue:
    ps = [flat[k] for k in partial]
    if any(p != ps[0] for p in ps):
        _fail(node, "Partial operands with different reduce ops", pls)
    out = ps[0]
    linear = out.reduce_op in ("sum", "avg")
    nonp = {k: p for k, p in flat.items() if k not in partial}
    if packet in _LINEAR_UNARY:  # casts and copies keep any Partial
        return _outputs(node, out)
    if linear and packet in _NEGATION:
        return _outputs(node, out)
    if linear and packet in _LINEAR_SUM:
        if nonp or not all(_is_tensor(bound.get(k)) for k in ("self", "other")):
            _fail(node, "add/sub of a Partial and a non-Partial counts the other operand once per rank", pls)
        return _outputs(node, out)
    if linear and packet in _LINEAR_PRODUCT:
        if len(partial) > 1:
            _fail(node, "product of two Partials is not a Partial", pls)
        if any(p != R for p in nonp.values()):
            _fail(node, "a Partial can only be scaled by a Replicate", pls)
        return _outputs(node, out)
    if linear and packet in _LINEAR_QUOTIENT:
        if partial != ["self"] or any(p != R for p in nonp.values()) or bound.get("rounding_mode") is not None:
            _fail(node, "only a Partial numerator divided by a Replicate (no rounding) stays Partial", pls)
        return _outputs(node, out)
    if linear and packet is aten.masked_fill and partial == ["self"] and bound.get("value") == 0:
        if any(p != R for p in nonp.values()):
            _fail(node, "masked_fill of a Partial needs a Replicate mask", pls)
        return _outputs(node, out)
    _fail(node, "nonlinear op on a Partial input (all-reduce it first)", pls)


_register(_LINEAR_SUM + _LINEAR_PRODUCT + _LINEAR_QUOTIENT + _NEGATION + _NONLINEAR, "pointwise")(_pointwise)
_register(_LINEAR_UNARY, "copy")(_pointwise)


# --- contractions ------------------------------------------------------------

_LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def _einsum_letters(equation: str, ndims: Sequence[int]) -> tuple[list[str], str]:
    eq = equation.replace(" ", "")
    lhs, rhs = eq.split("->") if "->" in eq else (eq, None)
    terms = lhs.split(",")
    if len(terms) != len(ndims):
        raise ValueError(f"einsum {equation!r} has {len(terms)} operands, got {len(ndims)}")
    used = set(c for c in eq if c.isalpha())
    free = [c for c in _LETTERS if c not in used]
    n_ell = max((nd - len(t.replace("...", "")) for t, nd in zip(terms, ndims) if "..." in t), default=0)
    ell = "".join(free[:n_ell])
    ops = []
    for t, nd in zip(terms, ndims):
        if "..." in t:
            k = nd - len(t.replace("...", ""))
            t = t.replace("...", ell[n_ell - k:] if k else "")
        ops.append(t)
    if rhs is None:
        counts = {c: sum(t.count(c) for t in ops) for c in set("".join(ops))}
        rhs = ell + "".join(sorted(c for c, n in counts.items() if n == 1 and c not in ell))
    else:
        rhs = rhs.replace("...", ell)
    return ops, rhs


def _contraction(node: Node) -> tuple[list[Node], list[str], str, Node | None]:
    """(operands, their index letters, output letters, bias) of a contraction node."""
    b = _bind(node)
    packet = node.target.overloadpacket
    if packet is aten.einsum:
        operands = list(b["tensors"])
        letters, out = _einsum_letters(b["equation"], [_ndim(o) for o in operands])
        return operands, letters, out, None
    if packet is aten.linear:
        x, w = b["input"], b["weight"]
        batch = _LETTERS[: _ndim(x) - 1]
        if _ndim(w) == 1:
            return [x, w], [batch + "y", "y"], batch, b.get("bias")
        return [x, w], [batch + "y", "zy"], batch + "z", b.get("bias")
    if packet in (aten.matmul, aten.mm, aten.bmm, aten.addmm):
        x, y = (b["mat1"], b["mat2"]) if packet is aten.addmm else (b["self"], b.get("other", b.get("mat2")))
        bias = b["self"] if packet is aten.addmm else None
        xa, ya = _ndim(x), _ndim(y)
        if xa == 1 and ya == 1:
            return [x, y], ["k", "k"], "", bias
        if xa == 1:
            bt = _LETTERS[: ya - 2]
            return [x, y], ["k", bt + "kn"], bt + "n", bias
        if ya == 1:
            bt = _LETTERS[: xa - 2]
            return [x, y], [bt + "mk", "k"], bt + "m", bias
        nb = max(xa, ya) - 2
        bt = "ABCDEFGHIJ"[:nb]
        return [x, y], [bt[nb - (xa - 2):] + "mk", bt[nb - (ya - 2):] + "kn"], bt + "mn", bias
    raise AssertionError(packet)


def _contract(node: Node, bound: dict[str, Any]) -> PlacementValue:
    operands, letters, out, bias = _contraction(node)
    pls = _input_placements(bound)
    ops_pl = [o.meta["placement"] for o in operands]
    partial = [i for i, p in enumerate(ops_pl) if isinstance(p, Partial)]
    shards = {i: letters[i][p.dim] for i, p in enumerate(ops_pl) if isinstance(p, Shard)}
    if partial:
        if shards or len(partial) > 1 or ops_pl[partial[0]].reduce_op not in ("sum", "avg"):
            _fail(node, "a contraction is linear in one Partial operand only, with the others Replicate", pls)
        result: Placement = ops_pl[partial[0]]
    elif not shards:
        result = R
    else:
        sharded = set(shards.values())
        if len(sharded) > 1:
            _fail(node, f"operands are sharded on different indices {sorted(sharded)} (one mesh dim)", pls)
        (letter,) = sharded
        for i, o in enumerate(operands):
            if i in shards or letter not in letters[i]:
                continue
            if not _is_one(_shape(o)[letters[i].index(letter)]):
                _fail(node, f"operand {i} is Replicate but has the sharded index {letter!r}", pls)
        result = Shard(out.index(letter)) if letter in out else Partial()
    if isinstance(bias, Node):
        bp = bias.meta["placement"]
        want = R if result == R else Shard(_ndim(bias) - 1) if result == Shard(len(out) - 1) else None
        if want is None or bp != want:
            _fail(node, f"bias placement {_fmt(bp)} does not match the product's {_fmt(result)}", pls)
    return result


_register(_packets("linear", "matmul", "mm", "bmm", "addmm", "einsum"), "contract")(_contract)


# --- reductions --------------------------------------------------------------

_REDUCE_KIND = {"sum": "sum", "mean": "avg", "amax": "max", "amin": "min", "max": "max", "min": "min"}
_REDUCTIONS = _packets("sum", "mean", "amax", "amin", "max", "min", "argmax", "argmin", "prod", "any", "all",
                       "var", "std", "logsumexp", "norm", "linalg_vector_norm")


def _reduce(node: Node, bound: dict[str, Any]) -> PlacementValue:
    if _is_tensor(bound.get("other")):  # max.other / min.other: elementwise maximum
        return _pointwise(node, bound)
    x = bound["self"]
    pls = _input_placements(bound)
    p = x.meta["placement"]
    name = node.target.overloadpacket.__name__.split(".")[-1]
    nd = _ndim(x)
    dims = bound.get("dim")
    if dims is None or dims == [] or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        reduced = set(range(nd))
    else:
        dims = [dims] if isinstance(dims, int) else list(dims)
        reduced = {_norm_dim(d, nd) for d in dims}
    keep = bool(bound.get("keepdim", False))
    if isinstance(p, Partial):
        if name in ("sum", "mean") and p.reduce_op in ("sum", "avg"):
            return _outputs(node, p)
        _fail(node, f"{name} of a Partial is not a Partial", pls)
    if p == R:
        return _outputs(node, R)
    if p.dim in reduced:
        kind = _REDUCE_KIND.get(name)
        if kind is None or (name in ("max", "min") and _num_outputs(node)):
            _fail(node, f"{name} over the sharded dim {p.dim} has no Partial form", pls)
        return _outputs(node, Partial(kind))
    new = p.dim if keep else p.dim - sum(1 for d in reduced if d < p.dim)
    return _outputs(node, Shard(new))


_register(_REDUCTIONS, "reduce")(_reduce)


def _along_dim(node: Node, bound: dict[str, Any]) -> PlacementValue:
    """softmax / cumsum / topk / sort: the dim they work along must not be sharded."""
    x = bound["self"]
    pls = _input_placements(bound)
    p = x.meta["placement"]
    name = node.target.overloadpacket.__name__.split(".")[-1]
    d = _norm_dim(bound.get("dim", -1), _ndim(x))
    if isinstance(p, Partial):
        if name == "cumsum" and p.reduce_op == "sum":
            return _outputs(node, p)
        _fail(node, f"nonlinear op {name} on a Partial input (all-reduce it first)", pls)
    if isinstance(p, Shard) and p.dim == d:
        _fail(node, f"{name} along the sharded dim {d}", pls)
    return _outputs(node, p)


_register(_packets("_softmax", "softmax", "_log_softmax", "log_softmax"), "softmax")(_along_dim)
_register(_packets("cumsum", "cumprod", "logcumsumexp", "topk", "sort"), "reduce")(_along_dim)


# --- scalars and asserts -----------------------------------------------------


def _size_query(node: Node, bound: dict[str, Any]) -> PlacementValue:
    return R  # local sizes are equal on every rank (even splits)


def _to_scalar(node: Node, bound: dict[str, Any]) -> PlacementValue:
    if bound["self"].meta["placement"] != R:
        _fail(node, "reading a scalar out of a non-Replicate tensor gives a different value per rank",
              _input_placements(bound))
    return R


def _no_value(node: Node, bound: dict[str, Any]) -> PlacementValue:
    return None


_register(_packets("sym_size", "sym_numel", "sym_stride", "sym_storage_offset"), "free")(_size_query)
_register(_packets("_local_scalar_dense", "item"), "free")(_to_scalar)
_register(_packets("_assert_tensor_metadata", "_assert_scalar", "sym_constrain_range_for_size",
                   "sym_constrain_range", "_assert_async"), "free")(_no_value)
