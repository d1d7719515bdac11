"""The vocabulary of ``k3::`` op placement rules, their cost declarations, and the registry.

A custom op's rule says how it places its outputs from its inputs' placements
(``OpRule.propagate``) and what one call costs (``OpRule.cost_of``). The rules of the
``k3::`` ops are declared in :mod:`k3compile.placement.k3_rules`, from a small vocabulary:

``elementwise(*args)``  the listed args share one placement (R or any S(d)), output the
                        same; other tensor args must be R; Partial fails (nonlinear).
``rowwise(*args)``      as elementwise, but the op reduces the last dim (norms, routing,
                        AttnRes mix), so S(last) fails.
``split(shard, out)``   the op runs independently per slice of one split dimension
                        (heads, channels, the experts' intermediate): either every
                        tensor arg is R (output R) or exactly the args in ``shard`` are
                        ``Shard(dim)`` and the rest R, giving ``out`` (a dim, a
                        placement such as ``Partial()``, or a tuple per output).
``replicated()``        every tensor arg must be R (``mla_cache_write``).
``rank_local()``        R (or RankLocal) inputs give RankLocal (``dcp_local_lengths``).
``group_complete()``    a DCP group's all-gathered RankLocal parts give R (``dcp_history_order``).
``shard_into_partial(acc, block, dim)``  ``acc`` P plus ``block`` S(dim) written at the
                        rank's block (zeros elsewhere) -> P (``add_rank_block``).

``split`` and ``replicated`` take ``caches=`` (args that are rank-local cache state,
placed as the rule says; see :mod:`k3compile.placement.propagate`) and
``context_split=`` (args that hold the rank's own positions in the context-parallel
layout). Each takes a cost: ``flops_per_element`` of the rule's first listed arg, or a
``cost`` function of a :class:`CostCall` (the call's concrete shapes) returning a
:class:`Cost`; bytes default to the tensor inputs (caches excepted) plus the outputs.

:func:`register_op_rules` records rules by op name; :func:`op_rule` looks one up.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.fx import Node

from k3compile.context_parallel import DCP_GROUP_NAME
from k3compile.placement.nodes import (
    R,
    PlacementValue,
    _bind,
    _fail,
    _flat,
    _fmt,
    _is_tensor,
    _ndim,
    _norm_dim,
    _num_outputs,
    _outputs,
    _tensor_vals,
)
from k3compile.placement.sizes import SizeEvaluator
from k3compile.sharding import Partial, Placement, RankLocal, Replicate, Shard

__all__ = [
    "Cost",
    "CostCall",
    "OpRule",
    "elementwise",
    "op_rule",
    "rank_local",
    "register_op_rules",
    "replicated",
    "rowwise",
    "shard_into_partial",
    "split",
]


@dataclass(frozen=True)
class Cost:
    """The work of one op call, per rank."""

    flops: int
    bytes: int | None = None  # None: tensor inputs (caches excepted) + outputs


class CostCall:
    """Concrete shapes of one k3 op call, for the op's declared cost function."""

    def __init__(self, node: Node, bound: Mapping[str, Any], sizes: SizeEvaluator, caches: Sequence[str]):
        self.node = node
        self.bound = bound
        self._sizes = sizes
        self.caches = tuple(caches)

    def _nodes(self, name: str) -> list[Node]:
        v = self.bound[name]
        return [x for x in v if _is_tensor(x)] if isinstance(v, (list, tuple)) else [v]

    def arg(self, name: str) -> Any:
        return self.bound[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return self._sizes.shape(self.bound[name].meta["val"])

    def size(self, name: str, dim: int) -> int:
        return self._sizes.size(self.bound[name].meta["val"].shape[dim])

    def count(self, name: str) -> int:
        """Number of tensors in a list argument."""
        return len(self._nodes(name))

    def numel(self, name: str) -> int:
        return sum(self._sizes.numel(n.meta["val"]) for n in self._nodes(name))

    def nbytes(self, name: str) -> int:
        return sum(self._sizes.nbytes(n.meta["val"]) for n in self._nodes(name))

    def itemsize(self, name: str) -> int:
        return self._nodes(name)[0].meta["val"].dtype.itemsize

    def out_bytes(self) -> int:
        return sum(self._sizes.nbytes(v) for v in _tensor_vals(self.node.meta.get("val")))

    def io_bytes(self) -> int:
        """Tensor inputs except caches, plus outputs."""
        total = self.out_bytes()
        for name, v in self.bound.items():
            if name in self.caches:
                continue
            for n in (v if isinstance(v, (list, tuple)) else [v]):
                if _is_tensor(n):
                    total += self._sizes.nbytes(n.meta["val"])
        return total


@dataclass(frozen=True)
class OpRule:
    """How one k3 op places its outputs (``propagate``) and what it costs (``cost``)."""

    #: "elementwise" | "rowwise" | "split" | "replicated" | "rank_local" | "group_complete" | "shard_into_partial"
    kind: str
    propagate: Callable[[Node, dict[str, Any]], PlacementValue]
    caches: tuple[str, ...] = ()
    cache_placements: Mapping[str, Placement] = field(default_factory=dict)
    cost: Callable[[CostCall], Cost] | None = None
    primary: str | None = None  # operand whose numel ``flops_per_element`` scales
    flops_per_element: float = 1.0
    description: str = ""
    #: Args whose inputs hold this rank's own positions in the context-parallel layout
    #: (the MLA cache, block table, slot mapping): placed RankLocal there.
    context_split: tuple[str, ...] = ()

    def cost_of(self, call: CostCall) -> Cost:
        """The call's cost: the declared function's, or ``flops_per_element`` x the
        primary operand's numel; bytes default to :meth:`CostCall.io_bytes`."""
        if self.cost is not None:
            c = self.cost(call)
            return c if c.bytes is not None else Cost(c.flops, call.io_bytes())
        base = call.numel(self.primary) if self.primary else 0
        return Cost(int(self.flops_per_element * base), call.io_bytes())


def _same_placement(node: Node, names: Sequence[str], pls: dict[str, Any], reduced_last: bool) -> Placement:
    ops = _flat(pls.get(n) for n in names)
    others = {k: v for k, v in pls.items() if k not in names}
    if not ops:
        _fail(node, f"none of {list(names)} is a tensor", pls)
    first = ops[0]
    if any(p != first for p in ops):
        _fail(node, f"{'/'.join(names)} must share one placement", pls)
    if isinstance(first, Partial):
        _fail(node, "nonlinear op on a Partial input (all-reduce it first)", pls)
    if any(p != R for p in _flat(others.values())):
        _fail(node, f"arguments other than {'/'.join(names)} must be Replicate", pls)
    if reduced_last and isinstance(first, Shard):
        ndims = [_ndim(x) for n in names for x in (_arg_nodes(node, n))]
        if first.dim == ndims[0] - 1:
            _fail(node, "the op reduces the last dim, which is sharded", pls)
    return first


def _arg_nodes(node: Node, name: str) -> list[Node]:
    v = _bind(node)[name]
    return [x for x in v if _is_tensor(x)] if isinstance(v, (list, tuple)) else ([v] if _is_tensor(v) else [])


def elementwise(*args: str, flops_per_element: float = 1.0, cost: Callable[[CostCall], Cost] | None = None) -> OpRule:
    """Pointwise in ``args`` (which share one placement: R or any Shard); other tensor args R."""

    def propagate(node: Node, pls: dict[str, Any]) -> PlacementValue:
        return _outputs(node, _same_placement(node, args, pls, reduced_last=False))

    return OpRule("elementwise", propagate, cost=cost, primary=args[0], flops_per_element=flops_per_element,
                  description=f"elementwise in {', '.join(args)}")


def rowwise(*args: str, flops_per_element: float = 1.0, cost: Callable[[CostCall], Cost] | None = None) -> OpRule:
    """Reduces the last dim of ``args`` (norms, routing): as elementwise, but S(last) fails."""

    def propagate(node: Node, pls: dict[str, Any]) -> PlacementValue:
        return _outputs(node, _same_placement(node, args, pls, reduced_last=True))

    return OpRule("rowwise", propagate, cost=cost, primary=args[0], flops_per_element=flops_per_element,
                  description=f"row-wise (last dim reduced) in {', '.join(args)}")


def _as_placement(p: int | Placement) -> Placement:
    return Shard(p) if isinstance(p, int) else p


def split(
    shard: Mapping[str, int],
    out: int | Placement | tuple,
    *,
    what: str = "split dim",
    caches: Sequence[str] = (),
    flops_per_element: float = 1.0,
    cost: Callable[[CostCall], Cost] | None = None,
    context_split: Sequence[str] = (),
) -> OpRule:
    """Independent per slice of one split dimension: all tensor args R -> R, or the args of
    ``shard`` ``Shard(dim)`` (all others R) -> ``out``."""
    shard = dict(shard)
    outs = tuple(_as_placement(o) for o in out) if isinstance(out, tuple) else _as_placement(out)
    expected_desc = ", ".join(f"{k}=S({d})" for k, d in shard.items())

    def propagate(node: Node, pls: dict[str, Any]) -> PlacementValue:
        flat = _flat(pls.values())
        if all(p == R for p in flat):
            return _outputs(node, R)
        for name, p in pls.items():
            want = Shard(shard[name]) if name in shard else R
            got = p if isinstance(p, list) else [p]
            for g in got:
                if g != want:
                    _fail(node, f"expected all Replicate, or the {what} split ({expected_desc}, others R)", pls)
        if isinstance(outs, tuple):
            if _num_outputs(node) != len(outs):
                _fail(node, f"rule declares {len(outs)} outputs, the node has {_num_outputs(node)}")
            return outs
        return _outputs(node, outs)

    cache_pl = {c: (Shard(shard[c]) if c in shard else R) for c in caches}
    return OpRule("split", propagate, caches=tuple(caches), cache_placements=cache_pl, cost=cost,
                  primary=next(iter(shard), None), flops_per_element=flops_per_element,
                  description=f"split by {what}: {expected_desc} -> {_fmt(outs)}",
                  context_split=tuple(context_split))


def replicated(
    *, caches: Sequence[str] = (), cost: Callable[[CostCall], Cost] | None = None, context_split: Sequence[str] = ()
) -> OpRule:
    """Every tensor arg must be Replicate; outputs Replicate."""

    def propagate(node: Node, pls: dict[str, Any]) -> PlacementValue:
        if any(p != R for p in _flat(pls.values())):
            _fail(node, "every tensor argument must be Replicate", pls)
        return _outputs(node, R)

    return OpRule("replicated", propagate, caches=tuple(caches), cache_placements={c: R for c in caches},
                  cost=cost, description="replicated only", context_split=tuple(context_split))


def rank_local(*, cost: Callable[[CostCall], Cost] | None = None, caches: Sequence[str] = (),
               context_split: Sequence[str] = ()) -> OpRule:
    """Outputs ``RankLocal`` from Replicate (or RankLocal) inputs: a value that depends on
    the rank (e.g. its share of each context length under context parallelism).
    ``caches`` / ``context_split``: as for :func:`split` (the MLA cache and block table a
    rank holds its positions in)."""

    def propagate(node: Node, pls: dict[str, Any]) -> PlacementValue:
        if any(not isinstance(p, (Replicate, RankLocal)) for p in _flat(pls.values())):
            _fail(node, "expects Replicate or RankLocal inputs", pls)
        return _outputs(node, RankLocal())

    return OpRule("rank_local", propagate, caches=tuple(caches), cache_placements={c: R for c in caches}, cost=cost,
                  description="per-rank value", context_split=tuple(context_split))


def _is_dcp_gather(node: Any) -> bool:
    """``node`` is the wait of an all-gather over the DCP group."""
    c10d = torch.ops._c10d_functional
    if not isinstance(node, Node) or node.target is not c10d.wait_tensor.default:
        return False
    gather = node.args[0]
    return (isinstance(gather, Node) and gather.target is c10d.all_gather_into_tensor.default
            and DCP_GROUP_NAME in gather.args)


def group_complete(*, cost: Callable[[CostCall], Cost] | None = None) -> OpRule:
    """Outputs Replicate from RankLocal inputs that hold every DCP member's part (a DCP
    all-gather's output): a function of the whole group's data, which every group holds,
    so the same on every rank (``dcp_history_order``)."""

    def propagate(node: Node, pls: dict[str, Any]) -> PlacementValue:
        if any(not isinstance(p, (Replicate, RankLocal)) for p in _flat(pls.values())):
            _fail(node, "expects a DCP group's gathered RankLocal parts", pls)
        if not _is_dcp_gather(node.args[0]):
            _fail(node, "its first input must be a DCP all-gather's output (wait_tensor of all_gather_into_tensor "
                        f"over {DCP_GROUP_NAME!r})", pls)
        return _outputs(node, R)

    return OpRule("group_complete", propagate, cost=cost, description="whole DCP group -> Replicate")


def shard_into_partial(acc: str, block: str, dim: str, *, flops_per_element: float = 1.0) -> OpRule:
    """``acc`` plus ``block`` placed at this rank's block of dim ``dim`` (zeros elsewhere):
    ``acc`` P with ``block`` S(dim) -> P (a zero-padded shard is a Partial whose sum over
    ranks is the whole tensor: DTensor's Shard -> Partial without communication). All
    Replicate (a mesh of one rank) -> R."""

    def propagate(node: Node, pls: dict[str, Any]) -> PlacementValue:
        flat = _flat(pls.values())
        if all(p == R for p in flat):
            return _outputs(node, R)
        bound = _bind(node)
        want = Shard(_norm_dim(bound[dim], _ndim(bound[block])))
        if pls.get(acc) != Partial() or pls.get(block) != want:
            _fail(node, f"expected {acc}=P and {block}={want} (others R)", pls)
        if any(p != R for k, p in pls.items() if k not in (acc, block)):
            _fail(node, f"arguments other than {acc}/{block} must be Replicate", pls)
        return _outputs(node, Partial())

    return OpRule("shard_into_partial", propagate, primary=block, flops_per_element=flops_per_element,
                  description=f"{acc} P + {block} S({dim}) at the rank's block -> P")


_K3_RULES: dict[str, OpRule] = {}


def register_op_rules(rules: Mapping[Any, OpRule]) -> None:
    """Declare the rules of custom ops (keys: the ``custom_op`` objects or ``"ns::name"``)."""
    for op, rule in rules.items():
        name = op if isinstance(op, str) else getattr(op, "_qualname", None)
        if not name or "::" not in name:
            raise TypeError(f"register_op_rules: cannot name op {op!r}")
        if not isinstance(rule, OpRule):
            raise TypeError(f"register_op_rules: rule for {name} is a {type(rule).__name__}, not an OpRule")
        _K3_RULES[name] = rule


def op_rule(target: Any) -> OpRule | None:
    """The declared rule of a custom op (``torch.ops.k3.<name>.default`` or ``"k3::<name>"``).

    The ``k3::`` ops' rules are registered when ``k3compile.placement`` is imported
    (:mod:`k3compile.placement.k3_rules`)."""
    name = target if isinstance(target, str) else target.name() if isinstance(target, torch._ops.OpOverload) else None
    return _K3_RULES.get(name) if name else None
