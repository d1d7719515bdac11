"""Placement rules of the aten views, data movement, gathers and creation ops.

- views (``view``/``reshape``/``flatten``/``unflatten``): the input and output shapes are
  matched into groups of dims with equal products (symbolic sizes compared with sympy).
  A sharded dim that is split (``[T, h*D] -> [T, h, D]``) shards the group's outermost
  output dim; merged dims (``[T, h, D] -> [T, h*D]``) stay sharded only when the sharded
  dim is the outermost of the merged group (dims before it of size 1), since only then is
  each rank's block contiguous in the merged dim; otherwise the view fails. Partial and
  Replicate pass through. ``unsqueeze``/``squeeze``/``permute``/``transpose``/``movedim``/
  ``expand`` move the shard dim explicitly; ``slice``/``select``/``split`` of a sharded
  dim fail unless the slice keeps the whole dim; ``cat``/``stack`` need one placement on
  all inputs and not along a sharded dim; ``index``/``index_select``/``gather`` need
  replicated indices and an unindexed shard dim.
- ``embedding(weight S(0), ids R) -> P`` (vocab parallel). As DTensor's ``_MaskPartial``,
  the local rows of ids outside the rank's vocab range are not zero until the model
  multiplies by its mask (``mul(P, R) -> P``); the analysis trusts that the mask follows.
- ``pad`` / ``copy_`` / ``slice_scatter``: placed like their input (a zero-filled buffer
  takes the placement of what is scattered into it); ``*_like`` keeps a Shard, creation
  ops are Replicate.

Registered into :data:`k3compile.placement.aten_rules.ATEN_RULES` on import.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sympy
from torch.fx import Node

from k3compile.placement.aten_rules import _packets, _register, aten
from k3compile.placement.nodes import (
    R,
    PlacementValue,
    _expr,
    _fail,
    _input_placements,
    _is_one,
    _is_tensor,
    _ndim,
    _norm_dim,
    _outputs,
    _shape,
)
from k3compile.sharding import Partial, Shard


def _eq(a: sympy.Expr, b: sympy.Expr) -> bool:
    return sympy.expand(a - b) == 0


def _divides(a: sympy.Expr, b: sympy.Expr) -> bool:
    """a divides b (symbolically: b / a simplifies to an integer polynomial)."""
    if a.is_Integer and b.is_Integer:
        return int(b) % int(a) == 0
    num, den = sympy.fraction(sympy.cancel(b / a))
    return den == 1


def _view_groups(ishape: Sequence[Any], oshape: Sequence[Any]) -> list[tuple[list[int], list[int]]]:
    """Match input and output dims into groups of equal products (size-1 dims go with the
    group that follows them)."""
    I = [_expr(s) for s in ishape]
    O = [_expr(s) for s in oshape]
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(I) or j < len(O):
        gi: list[int] = []
        gj: list[int] = []
        pi = pj = sympy.Integer(1)
        while True:
            if gi and gj and _eq(pi, pj):
                break
            if _eq(pi, pj):
                took = False
                if i < len(I):
                    gi.append(i); pi *= I[i]; i += 1; took = True  # noqa: E702
                if j < len(O):
                    gj.append(j); pj *= O[j]; j += 1; took = True  # noqa: E702
                if not took:
                    break
            elif i < len(I) and _divides(pi, pj):
                gi.append(i); pi *= I[i]; i += 1  # noqa: E702
            elif j < len(O) and _divides(pj, pi):
                gj.append(j); pj *= O[j]; j += 1  # noqa: E702
            else:
                raise ValueError(f"cannot match view shapes {tuple(ishape)} -> {tuple(oshape)}")
        groups.append((gi, gj))
    return groups


def _view(node: Node, bound: dict[str, Any]) -> PlacementValue:
    x = bound.get("self", bound.get("input"))
    p = x.meta["placement"]
    pls = _input_placements(bound)
    if not isinstance(p, Shard):
        return p
    ishape, oshape = _shape(x), _shape(node)
    try:
        groups = _view_groups(ishape, oshape)
    except ValueError as e:
        _fail(node, str(e), pls)
    for gi, gj in groups:
        if p.dim not in gi:
            continue
        before = gi[: gi.index(p.dim)]
        if any(not _is_one(ishape[d]) for d in before):
            _fail(node, f"view merges the sharded dim {p.dim} with outer dims {before} of {tuple(ishape)}: "
                        "each rank's block is not contiguous in the merged dim", pls)
        if not gj:
            _fail(node, f"view drops the sharded dim {p.dim}", pls)
        return Shard(gj[0])
    raise AssertionError("shard dim not in any view group")


_register(_packets("view", "reshape", "_unsafe_view", "flatten", "unflatten", "_reshape_alias", "view_copy"),
          "free")(_view)


def _unsqueeze(node: Node, bound: dict[str, Any]) -> PlacementValue:
    p = bound["self"].meta["placement"]
    if not isinstance(p, Shard):
        return p
    d = _norm_dim(bound["dim"], _ndim(node))
    return Shard(p.dim + (1 if p.dim >= d else 0))


def _squeeze(node: Node, bound: dict[str, Any]) -> PlacementValue:
    x = bound["self"]
    p = x.meta["placement"]
    if not isinstance(p, Shard):
        return p
    nd = _ndim(x)
    dims = bound.get("dim")
    if dims is None:
        dims = [d for d, s in enumerate(_shape(x)) if _is_one(s)]
    dims = [dims] if isinstance(dims, int) else list(dims)
    removed = {_norm_dim(d, nd) for d in dims if _is_one(_shape(x)[_norm_dim(d, nd)])}
    if p.dim in removed:
        _fail(node, f"squeeze removes the sharded dim {p.dim}", _input_placements(bound))
    return Shard(p.dim - sum(1 for d in removed if d < p.dim))


def _permutation(node: Node, bound: dict[str, Any]) -> list[int]:
    """perm[i] = the input dim that output dim i comes from."""
    packet = node.target.overloadpacket
    nd = _ndim(bound["self"])
    if packet is aten.permute:
        return [_norm_dim(d, nd) for d in bound["dims"]]
    if packet in (aten.transpose, aten.swapaxes) or packet is getattr(aten, "swapdims", None):
        a = _norm_dim(bound.get("dim0", bound.get("axis0")), nd)
        b = _norm_dim(bound.get("dim1", bound.get("axis1")), nd)
        perm = list(range(nd))
        perm[a], perm[b] = perm[b], perm[a]
        return perm
    if packet is aten.t or packet is getattr(aten, "numpy_T", None):
        return list(reversed(range(nd)))
    if packet is aten.movedim:
        src, dst = bound["source"], bound["destination"]
        src = [src] if isinstance(src, int) else list(src)
        dst = [dst] if isinstance(dst, int) else list(dst)
        src = [_norm_dim(d, nd) for d in src]
        dst = [_norm_dim(d, nd) for d in dst]
        perm = [-1] * nd
        for s, d in zip(src, dst):
            perm[d] = s
        rest = iter(d for d in range(nd) if d not in src)
        return [p if p >= 0 else next(rest) for p in perm]
    raise AssertionError(packet)


def _permute(node: Node, bound: dict[str, Any]) -> PlacementValue:
    p = bound["self"].meta["placement"]
    if not isinstance(p, Shard):
        return p
    return Shard(_permutation(node, bound).index(p.dim))


def _expand(node: Node, bound: dict[str, Any]) -> PlacementValue:
    x = bound["self"]
    p = x.meta["placement"]
    if not isinstance(p, Shard):
        return p
    shift = _ndim(node) - _ndim(x)
    d = p.dim + shift
    if not _eq(_expr(_shape(x)[p.dim]), _expr(_shape(node)[d])):
        _fail(node, f"expand broadcasts the sharded dim {p.dim}", _input_placements(bound))
    return Shard(d)


_register(_packets("unsqueeze"), "free")(_unsqueeze)
_register(_packets("squeeze"), "free")(_squeeze)
_register(_packets("permute", "transpose", "swapaxes", "swapdims", "t", "numpy_T", "movedim"), "free")(_permute)
_register(_packets("expand"), "free")(_expand)


def _slice_like(node: Node, bound: dict[str, Any]) -> PlacementValue:
    """slice / narrow / select: fine unless they cut the sharded dim."""
    x = bound.get("self", bound.get("input"))
    p = x.meta["placement"]
    pls = _input_placements(bound)
    if not isinstance(p, Shard):
        return p
    nd = _ndim(x)
    d = _norm_dim(bound.get("dim", 0), nd)
    packet = node.target.overloadpacket
    if packet is aten.select:
        if d == p.dim:
            _fail(node, f"select on the sharded dim {d}", pls)
        return Shard(p.dim - (1 if d < p.dim else 0))
    if d == p.dim and not _eq(_expr(_shape(x)[d]), _expr(_shape(node)[d])):
        _fail(node, f"slice of the sharded dim {d} (each rank would keep a different part)", pls)
    return p


_register(_packets("slice", "narrow", "select"), "free")(_slice_like)


def _split(node: Node, bound: dict[str, Any]) -> PlacementValue:
    x = bound["self"]
    p = x.meta["placement"]
    nd = _ndim(x)
    d = _norm_dim(bound.get("dim", 0), nd)
    packet = node.target.overloadpacket
    if isinstance(p, Shard) and p.dim == d:
        _fail(node, f"{packet.__name__.split('.')[-1]} along the sharded dim {d}", _input_placements(bound))
    if isinstance(p, Shard) and packet is aten.unbind:
        p = Shard(p.dim - (1 if d < p.dim else 0))
    return _outputs(node, p)


_register(_packets("split", "split_with_sizes", "chunk", "unbind", "tensor_split"), "free")(_split)


def _cat(node: Node, bound: dict[str, Any]) -> PlacementValue:
    tensors = [t for t in bound["tensors"] if _is_tensor(t)]
    pls = _input_placements(bound)
    ps = [t.meta["placement"] for t in tensors]
    if any(q != ps[0] for q in ps):
        _fail(node, "inputs must share one placement", pls)
    p = ps[0]
    packet = node.target.overloadpacket
    if not isinstance(p, Shard):
        return p
    nd_out = _ndim(node)
    d = _norm_dim(bound.get("dim", 0), nd_out)
    if packet is aten.stack:
        return Shard(p.dim + (1 if p.dim >= d else 0))
    if d == p.dim:
        _fail(node, f"cat along the sharded dim {d} interleaves the ranks' blocks", pls)
    return p


_register(_packets("cat", "stack"), "copy")(_cat)


def _index(node: Node, bound: dict[str, Any]) -> PlacementValue:
    x = bound["self"]
    pls = _input_placements(bound)
    p = x.meta["placement"]
    indices = list(bound["indices"])
    idx_nodes = [i for i in indices if _is_tensor(i)]
    if any(i.meta["placement"] != R for i in idx_nodes):
        _fail(node, "index tensors must be Replicate", pls)
    if not isinstance(p, Shard):
        return p  # R, or P gathered by replicated indices (linear)
    if p.dim < len(indices) and indices[p.dim] is not None:
        _fail(node, f"indexing the sharded dim {p.dim}", pls)
    positions = [k for k, i in enumerate(indices) if i is not None]
    contiguous = positions == list(range(positions[0], positions[-1] + 1)) if positions else True
    idx_nd = max((_ndim(i) for i in idx_nodes), default=0)
    if not contiguous or not positions:
        _fail(node, "only contiguous advanced indexing is supported on a sharded tensor", pls)
    if p.dim < positions[0]:
        return Shard(p.dim)
    return Shard(p.dim - len(positions) + idx_nd)


def _index_select(node: Node, bound: dict[str, Any]) -> PlacementValue:
    x, idx = bound["self"], bound["index"]
    pls = _input_placements(bound)
    p = x.meta["placement"]
    d = _norm_dim(bound["dim"], _ndim(x))
    packet = node.target.overloadpacket
    ip = idx.meta["placement"]
    if packet is aten.gather:
        if p != ip or isinstance(p, Partial) or (isinstance(p, Shard) and p.dim == d):
            _fail(node, "gather needs input and index placed alike and not sharded along dim", pls)
        return p
    if ip != R:
        _fail(node, "index tensors must be Replicate", pls)
    if isinstance(p, Shard) and p.dim == d:
        _fail(node, f"indexing the sharded dim {d}", pls)
    return p


def _embedding(node: Node, bound: dict[str, Any]) -> PlacementValue:
    w, ids = bound["weight"], bound["indices"]
    pls = _input_placements(bound)
    wp, ip = w.meta["placement"], ids.meta["placement"]
    if wp == R:
        if isinstance(ip, Partial):
            _fail(node, "embedding ids cannot be Partial", pls)
        return ip
    if ip != R:
        _fail(node, "a sharded embedding table needs Replicate ids", pls)
    if wp == Shard(0):
        return Partial()  # vocab parallel; valid once the model masks out-of-range rows
    if wp == Shard(1):
        return Shard(_ndim(ids))
    _fail(node, "unsupported embedding placement", pls)


_register(_packets("index"), "gather")(_index)
_register(_packets("index_select", "gather"), "gather")(_index_select)
_register(_packets("embedding"), "gather")(_embedding)


def _pad(node: Node, bound: dict[str, Any]) -> PlacementValue:
    x = bound["self"]
    p = x.meta["placement"]
    pls = _input_placements(bound)
    if isinstance(p, Partial):
        if bound.get("value", 0) != 0:
            _fail(node, "padding a Partial with a nonzero value", pls)
        return p
    if isinstance(p, Shard):
        padded = {_ndim(x) - 1 - k // 2 for k, v in enumerate(bound["pad"]) if v != 0}
        if p.dim in padded:
            _fail(node, f"padding the sharded dim {p.dim}", pls)
    return p


_register(_packets("constant_pad_nd", "pad"), "copy")(_pad)


def _copy(node: Node, bound: dict[str, Any]) -> PlacementValue:
    dst, src = bound["self"], bound["src"]
    if dst.meta["placement"] != src.meta["placement"]:
        _fail(node, "copy source and destination must be placed alike", _input_placements(bound))
    return dst.meta["placement"]


_register(_packets("copy_", "copy"), "copy")(_copy)


_ZERO_FACTORIES = frozenset(_packets("new_zeros", "zeros", "zeros_like"))


def _scatter(node: Node, bound: dict[str, Any]) -> PlacementValue:
    """``slice_scatter``/``select_scatter(self, src, dim)``: self and src share a placement
    not sharded along ``dim``; a zero-filled buffer (a staging buffer) takes the placement
    of what is scattered into it, since zeros are the same under every placement."""
    base, src = bound["self"], bound["src"]
    pb, ps = base.meta["placement"], src.meta["placement"]
    pls = _input_placements(bound)
    zeros = base.op == "call_function" and getattr(base.target, "overloadpacket", None) in _ZERO_FACTORIES
    if pb != ps and not (zeros and pb == R):
        _fail(node, "self and src must share a placement (or self be a zero-filled buffer)", pls)
    if isinstance(ps, Shard) and ps.dim == _norm_dim(bound.get("dim", 0), _ndim(base)):
        _fail(node, f"scatter along the sharded dim {ps.dim}", pls)
    return ps


_register(_packets("slice_scatter", "select_scatter"), "copy")(_scatter)


def _like(node: Node, bound: dict[str, Any]) -> PlacementValue:
    p = bound["self"].meta["placement"]
    return p if isinstance(p, Shard) else R  # values made on each rank: R (Partial input: its shape only)


def _create(node: Node, bound: dict[str, Any]) -> PlacementValue:
    if any(_is_tensor(v) for v in bound.values()):
        _fail(node, "creation op with tensor arguments", _input_placements(bound))
    return _outputs(node, R)


def _new(node: Node, bound: dict[str, Any]) -> PlacementValue:
    return R  # explicit size: the same on every rank


_register(_packets("zeros_like", "ones_like", "empty_like", "full_like"), "create")(_like)
_register(_packets("new_zeros", "new_ones", "new_empty", "new_full"), "create")(_new)
_register(_packets("arange", "zeros", "ones", "full", "empty", "scalar_tensor", "empty_strided"), "create")(_create)
