"""Placement analysis: which value each rank holds, for every node of a captured program.

Semantics (DTensor / GSPMD, one tensor-parallel mesh dimension of size ``tp``). The
graph is rank-local (SPMD: every rank runs the same graph on its own tensors), and each
tensor node is the local part of a logical tensor:

- ``Replicate()`` (R): every rank holds the whole logical tensor, the same values.
- ``Shard(d)`` (S(d)): rank r holds the r-th equal block along dim ``d`` (always stored
  non-negative: ``Shard(-1)`` of a 2-D tensor is ``Shard(1)``).
- ``Partial("sum")`` (P): the logical tensor is the sum over ranks of the local tensors
  (``Partial("max")``/``("avg")`` come from reductions over a sharded dim).
- ``RankLocal()`` (L): a value of this rank alone (decode context parallelism: the MLA
  cache, block table and slot mapping of the rank's own positions, and attention over
  them). In a program in the context-parallel layout (``gm.meta["context_parallel"]``)
  the user inputs that op rules list as ``context_split`` are L; any op with an L input
  gives L outputs (with a Partial input it fails); the collectives over the DCP group
  (``k3compile.context_parallel.DCP_GROUP_NAME``) turn an all-gather into L and a
  ``sum`` reduce-scatter of L into ``Shard(0)`` (the merge hands each rank its heads).

``propagate_placements`` sets ``node.meta["placement"]`` on every node: a placement for a
tensor, ``Replicate()`` for a symbolic or Python scalar (sizes are the same on every rank:
splits are even), a tuple for multi-output nodes (``getitem`` picks one), ``None`` for
nodes without a value (``k3::mla_cache_write``, asserts), and the tuple of the returned
values' placements on the ``output`` node. At ``tp == 1`` a mesh of one rank makes every
Shard and Partial a Replicate: every node is ``Replicate()``.

Sources of placements (placeholders):

- parameters: their :class:`~k3compile.sharding.ShardSpec` (``spec.placement``);
  registered buffers with no spec and lifted constants: Replicate (the model registers no
  sharded buffer; one would need a spec).
- user inputs (token ids, batch metadata): Replicate.
- caches are rank-local state, placed as the op that updates them declares (the
  ``caches`` of its rule): the KDA conv and recurrent states are split like the heads
  they belong to (``Shard(1)``: channel dim of ``[S, C, K-1]``, head dim of
  ``[S, H, D, Dv]``); the MLA latent cache is Replicate (q_a/kv_a are replicated, so every
  rank caches the full latent of every token; a DCP split by context would change this).
  A cache is recognised only where a placeholder is passed straight to such an op; a
  cache reached through a view would be Replicate and then fail the op's rule, loudly.

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
- collectives: ``all_reduce`` P(op) -> R (op must match; R or S inputs fail);
  ``all_gather_into_tensor`` S(d) -> R (the ranks' blocks stacked along dim 0, identical
  on every rank; R -> R; P fails); ``reduce_scatter_tensor`` P -> S(0); ``wait_tensor`` is
  the identity. Over the DCP group: ``all_gather_into_tensor`` -> RankLocal,
  ``reduce_scatter_tensor`` and ``all_to_all_single`` of RankLocal partials -> the heads'
  TP split (S(0) of the heads-first terms, S(2) of ``k3.dcp_pack``'s rows).
- ``k3::`` custom ops declare their rule next to their definition
  (``register_op_rules`` in ``k3compile/ops/*.py``), from a small vocabulary:

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
  ``shard_into_partial(acc, block, dim)``  ``acc`` P plus ``block`` S(dim) written at the
                          rank's block (zeros elsewhere) -> P (``add_rank_block``).

  Each takes ``caches=`` (args that are rank-local cache state, see above) and a cost
  (``flops_per_element`` of the rule's first listed arg, or a ``cost`` function).

Example (layer 0 of the ``tiny`` preset, TP2 decode: the KDA attention output)::

    linear_7      = aten.linear(reshape, o_proj_weight)           S(1) x S(1) -> P
    all_reduce_1  = _c10d_functional.all_reduce(linear_7, "sum")  P           -> R
    wait_tensor_1 = _c10d_functional.wait_tensor(all_reduce_1)    R           -> R
    attn_res_mix  = k3.attn_res_mix(wait_tensor_1, [...], ...)    rowwise: R  -> R

and its column-parallel input ``linear = aten.linear(rms_norm R, q_proj_weight S(0)) ->
S(1)``, viewed ``[T, 2*16] -> [T, 2, 16]`` as S(1) (the heads).

Redundant work (:func:`redundant_work`). A node whose tensor inputs are all Replicate
computes the same thing on every rank: its cost is paid ``tp`` times for one result. The
report gives, per rank, the FLOPs and bytes of those nodes (and of all nodes, for
scale), grouped by layer type (kda / mla / moe / dense_mlp / attn_res / embedding / head
/ other, read from ``nn_module_stack``: the pre-norms count with the sub-layer they feed,
the residual adds of a decoder layer with attn_res, the final norm and the
``logit_indices`` gather with head), with per-op detail. Cost model, per rank:

- contractions: 2 x the product of all index sizes (``linear``: 2*M*N*K, + bias numel).
- pointwise ops: 1 FLOP per output element (transcendentals count 1); reductions: 1 per
  input element; softmax: 5 per element; casts, copies, ``cat``: 0 FLOPs.
- bytes: tensor inputs read + outputs written; views, ``getitem``, ``wait_tensor`` and
  size queries are free; gathers (``embedding``, ``index``) read only the rows they return.
- collectives: not counted (communication, not compute).
- ``k3::`` ops: the cost they declare next to their rule: ``flops_per_element`` of their
  main operand (``rms_norm`` 4, ``situ_and_mul`` 9, ``sigmoid_topk_route`` 4 per logit,
  ``kda_gate`` 5, ``gated_rms_norm`` 6), or a function: ``moe_experts`` 2*3*T*top_k*I*D (I
  the local intermediate size), attention ops per head and context, with the context of
  ``mla_*`` bounded by the block table width x block size; cache arguments are not
  counted as read whole, the ops declare the cache traffic they do.

Symbolic sizes in ``node.meta["val"]`` are evaluated with the ``sizes`` given by name:
a dimension's ``torch.export.Dim`` name (``batch``, ``tokens``, ``seqs``, ``logits``,
``max_blocks``, ...), its symbol (``s37``), or ``<input>.<dim>`` (``logit_indices.0``).
An unknown name or a symbol with no size is an error listing what is needed.
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn, Union

import sympy
import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind
from torch.fx import GraphModule, Node

from k3compile.context_parallel import DCP_GROUP_NAME, program_layout
from k3compile.sharding import ParallelPlan, Partial, Placement, RankLocal, Replicate, Shard, ShardSpec

__all__ = [
    "OpRule",
    "OpWork",
    "PlacementError",
    "RedundancyReport",
    "Cost",
    "CostCall",
    "elementwise",
    "op_rule",
    "propagate_placements",
    "redundant_work",
    "register_op_rules",
    "replicated",
    "rowwise",
    "shard_into_partial",
    "split",
]

aten = torch.ops.aten
R = Replicate()

#: A node's placement: one placement, a tuple (multi-output), or None (no value).
PlacementValue = Union[Placement, tuple, None]


class PlacementError(RuntimeError):
    """A node's inputs have placements its op cannot take (or the op has no rule)."""


def _fmt(p: Any) -> str:
    if p is None:
        return "-"
    if isinstance(p, (list, tuple)):
        return "[" + ", ".join(_fmt(x) for x in p) + "]"
    if isinstance(p, Partial) and p.reduce_op != "sum":
        return f"P({p.reduce_op})"
    return str(p)


def _op_name(node: Node) -> str:
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        return f"{t.namespace}.{t._schema.name.split('::')[-1]}.{t._overloadname}"
    return getattr(t, "__name__", str(t))


def _fail(node: Node, msg: str, inputs: Mapping[str, Any] | None = None) -> NoReturn:
    where = f"node {node.name!r} ({_op_name(node)})"
    if inputs:
        desc = ", ".join(f"{k}={_fmt(v)}" for k, v in inputs.items() if v is not None)
        raise PlacementError(f"{where}: {msg}; input placements: {desc or 'none'}")
    raise PlacementError(f"{where}: {msg}")


# ---------------------------------------------------------------------------
# Node helpers
# ---------------------------------------------------------------------------


def _is_tensor(v: Any) -> bool:
    return isinstance(v, Node) and isinstance(v.meta.get("val"), torch.Tensor)


def _ndim(node: Node) -> int:
    return node.meta["val"].dim()


def _shape(node: Node) -> tuple:
    return tuple(node.meta["val"].shape)


def _expr(s: Any) -> sympy.Expr:
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
    return {k: p for k, v in bound.items() if (p := _placement(v)) is not None}


def _flat(pls: Iterable[Any]) -> list[Placement]:
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


# ---------------------------------------------------------------------------
# k3:: op rules (declared by the op modules)
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Cost:
    flops: int
    bytes: int | None = None  # None: tensor inputs (caches excepted) + outputs


class CostCall:
    """Concrete shapes of one k3 op call, for the op's declared cost function."""

    def __init__(self, node: Node, bound: Mapping[str, Any], sizes: "_SizeEvaluator", caches: Sequence[str]):
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

    kind: str  # "elementwise" | "rowwise" | "split" | "replicated"
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
        if self.cost is not None:
            c = self.cost(call)
            return c if c.bytes is not None else Cost(c.flops, call.io_bytes())
        base = call.numel(self.primary) if self.primary else 0
        return Cost(int(self.flops_per_element * base), call.io_bytes())


def _outputs(node: Node, p: PlacementValue) -> PlacementValue:
    n = _num_outputs(node)
    if n == 0:
        return None
    if n is None:
        return p
    return tuple(p for _ in range(n))


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


def rank_local(*, cost: Callable[[CostCall], Cost] | None = None) -> OpRule:
    """Outputs ``RankLocal`` from Replicate (or RankLocal) inputs: a value that depends on
    the rank (e.g. its share of each context length under context parallelism)."""

    def propagate(node: Node, pls: dict[str, Any]) -> PlacementValue:
        if any(not isinstance(p, (Replicate, RankLocal)) for p in _flat(pls.values())):
            _fail(node, "expects Replicate or RankLocal inputs", pls)
        return _outputs(node, RankLocal())

    return OpRule("rank_local", propagate, cost=cost, description="per-rank value")


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
    """The declared rule of a custom op (``torch.ops.k3.<name>.default`` or ``"k3::<name>"``)."""
    import k3compile.ops  # noqa: F401  (the op modules register their rules)

    name = target if isinstance(target, str) else target.name() if isinstance(target, torch._ops.OpOverload) else None
    return _K3_RULES.get(name) if name else None


# ---------------------------------------------------------------------------
# aten / collective rules
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _AtenRule:
    propagate: Callable[[Node, dict[str, Any]], PlacementValue]
    cost: str  # see _aten_cost


_ATEN: dict[Any, _AtenRule] = {}


def _register(packets: Iterable[Any], cost: str):
    def deco(fn):
        for p in packets:
            _ATEN[p] = _AtenRule(fn, cost)
        return fn

    return deco


def _p(name: str) -> Any | None:
    return getattr(aten, name, None)


def _packets(*names: str) -> list[Any]:
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


# --- views and data movement ------------------------------------------------


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


# --- functional collectives --------------------------------------------------

_c10d = torch.ops._c10d_functional


def _all_reduce(node: Node, bound: dict[str, Any]) -> PlacementValue:
    p = bound["input"].meta["placement"]
    op = str(bound["reduce_op"]).lower()
    if not isinstance(p, Partial) or p.reduce_op != op:
        _fail(node, f"all_reduce({op!r}) needs a Partial({op}) input", _input_placements(bound))
    return R


def _all_gather(node: Node, bound: dict[str, Any]) -> PlacementValue:
    p = bound["input"].meta["placement"]
    if isinstance(p, Partial):
        _fail(node, "all_gather of a Partial stacks unreduced sums (all-reduce instead)", _input_placements(bound))
    if bound["group_name"] == DCP_GROUP_NAME:
        return RankLocal()  # the blocks of this rank's DCP group only
    if isinstance(p, RankLocal):
        _fail(node, "all_gather of RankLocal values over the TP group has no placement", _input_placements(bound))
    return R  # the ranks' blocks stacked along dim 0: the same tensor on every rank


def _reduce_scatter(node: Node, bound: dict[str, Any]) -> PlacementValue:
    p = bound["input"].meta["placement"]
    op = str(bound["reduce_op"]).lower()
    if bound["group_name"] == DCP_GROUP_NAME:
        # The DCP merge (passes/split_mla_context.py): each member's LSE-rescaled partial
        # attention over all the group's heads, heads first in member order; the sum over
        # the group's positions is scattered back so that every rank gets its own heads,
        # which is the TP split of the heads: Shard(0).
        if not isinstance(p, RankLocal) or op != "sum":
            _fail(node, "a DCP reduce_scatter merges RankLocal partials with 'sum'", _input_placements(bound))
        return Shard(0)
    if not isinstance(p, Partial) or p.reduce_op != op:
        _fail(node, f"reduce_scatter({op!r}) needs a Partial({op}) input", _input_placements(bound))
    return Shard(0)


def _all_to_all(node: Node, bound: dict[str, Any]) -> PlacementValue:
    p = bound["input"].meta["placement"]
    if bound["group_name"] != DCP_GROUP_NAME:
        _fail(node, "all_to_all_single is placed only for the DCP merge", _input_placements(bound))
    # The DCP merge by all-to-all (passes/split_mla_context.py): the input is k3.dcp_pack's
    # [member, B, h, D+1], chunk k holding member k's heads; every member receives its own
    # heads from each member, which is the TP split of the heads: Shard(2).
    if not isinstance(p, RankLocal):
        _fail(node, "a DCP all_to_all exchanges RankLocal partials", _input_placements(bound))
    return Shard(2)


def _wait(node: Node, bound: dict[str, Any]) -> PlacementValue:
    return bound["tensor"].meta["placement"]


def _broadcast(node: Node, bound: dict[str, Any]) -> PlacementValue:
    return R


for _name, _fn in (("all_reduce", _all_reduce), ("all_gather_into_tensor", _all_gather),
                   ("reduce_scatter_tensor", _reduce_scatter), ("all_to_all_single", _all_to_all),
                   ("broadcast", _broadcast)):
    if hasattr(_c10d, _name):
        _ATEN[getattr(_c10d, _name)] = _AtenRule(_fn, "collective")
_ATEN[_c10d.wait_tensor] = _AtenRule(_wait, "free")


# ---------------------------------------------------------------------------
# Propagation
# ---------------------------------------------------------------------------

_SCALAR_VALS = (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool)


def _tensor_vals(v: Any) -> list[torch.Tensor]:
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, (list, tuple)):
        return [x for x in v if isinstance(x, torch.Tensor)]
    return []


def _declared_inputs(gm: GraphModule, user_inputs: set[str], field: str) -> Iterator[tuple[Node, OpRule, str, Node]]:
    """(op node, its rule, arg name, user-input placeholder) for every k3 op arg that the
    op's rule lists in ``field`` (``caches`` or ``context_split``) and that is passed a
    user input directly."""
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        rule = op_rule(node.target) if node.target.namespace != "aten" else None
        if rule is None or not getattr(rule, field):
            continue
        bound = _bind(node)
        for name in getattr(rule, field):
            v = bound.get(name)
            if isinstance(v, Node) and v.op == "placeholder" and v.name in user_inputs:
                yield node, rule, name, v


def _cache_placements(gm: GraphModule, user_inputs: set[str], plan: ParallelPlan) -> dict[str, Placement]:
    """Placements of user inputs that k3 ops declare as caches (rank-local state); in the
    context-parallel layout, the inputs ops declare as holding this rank's own positions
    (MLA cache, block table, slot mapping) are RankLocal."""
    out: dict[str, Placement] = {}
    origin: dict[str, str] = {}
    for node, rule, name, v in _declared_inputs(gm, user_inputs, "caches"):
        pl = rule.cache_placements[name] if plan.tp > 1 else R
        if v.name in out and out[v.name] != pl:
            raise PlacementError(
                f"cache input {v.name!r}: {node.name} declares {_fmt(pl)}, {origin[v.name]} "
                f"declared {_fmt(out[v.name])}"
            )
        out[v.name] = pl
        origin[v.name] = node.name
    if program_layout(gm) is not None:
        out.update({v.name: RankLocal() for *_, v in _declared_inputs(gm, user_inputs, "context_split")})
    return out


def _placeholder(node: Node, sig: Mapping[str, Any], specs: Mapping[str, ShardSpec], plan: ParallelPlan,
                 caches: Mapping[str, Placement]) -> PlacementValue:
    spec = sig.get(node.name)
    if spec is None:
        _fail(node, "placeholder is not in the program's graph signature")
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return R if isinstance(val, _SCALAR_VALS) else None
    if spec.kind == InputKind.PARAMETER:
        fqn = spec.target
        if fqn not in specs:
            _fail(node, f"parameter {fqn!r} has no ShardSpec")
        p = specs[fqn].placement if plan.tp > 1 else R
        if isinstance(p, Shard) and p.dim >= val.dim():
            _fail(node, f"spec placement {_fmt(p)} out of range for a {val.dim()}-D parameter")
        return p
    if spec.kind == InputKind.BUFFER:
        return specs[spec.target].placement if (plan.tp > 1 and spec.target in specs) else R
    if spec.kind == InputKind.USER_INPUT:
        return caches.get(node.name, R)
    if spec.kind == InputKind.CONSTANT_TENSOR:
        return R
    return None


def _call(node: Node) -> PlacementValue:
    target = node.target
    if target is operator.getitem:
        src, idx = node.args
        sp = src.meta.get("placement") if isinstance(src, Node) else None
        if not isinstance(sp, (tuple, list)):
            if isinstance(src, Node) and not isinstance(src.meta.get("val"), (tuple, list)):
                _fail(node, f"getitem of a single value placed {_fmt(sp)}")
            _fail(node, f"getitem of {src} which has no tuple placement")
        return sp[idx]
    if target is torch.ops.higher_order.cond:
        return _cond(node)
    if isinstance(target, torch._ops.OpOverload):
        bound = _bind(node)
        if target.namespace != "_c10d_functional" and _has_rank_local(node, bound):
            return _outputs(node, RankLocal())  # collectives have their own RankLocal rules
        if target.namespace not in ("aten", "_c10d_functional", "prims"):
            rule = op_rule(target)
            if rule is None:
                _fail(node, f"custom op {target.name()} declares no placement rule "
                            "(register_op_rules next to its definition)", _input_placements(bound))
            return rule.propagate(node, _input_placements(bound))
        entry = _ATEN.get(target.overloadpacket)
        if entry is None:
            _fail(node, "no placement rule for this op", _input_placements(bound))
        return entry.propagate(node, bound)
    # Python-level scalar arithmetic on sizes (operator.mul, torch.sym_max, math.ceil ...).
    vals = list(node.args) + list(node.kwargs.values())
    if not any(_is_tensor(a) for a in vals) and not _tensor_vals(node.meta.get("val")):
        return R if node.meta.get("val") is not None else None
    _fail(node, "no placement rule for this callable", {f"arg{i}": _placement(a) for i, a in enumerate(vals)})


def _has_rank_local(node: Node, bound: dict[str, Any]) -> bool:
    """Whether an input is RankLocal: then every output is (a value computed from one
    rank's own values); otherwise the op's own rule applies. A Partial among them has no
    meaning."""
    pls = _input_placements(bound)
    flat = _flat(pls.values())
    if not any(isinstance(p, RankLocal) for p in flat):
        return False
    if any(isinstance(p, Partial) for p in flat):
        _fail(node, "RankLocal and Partial inputs together", pls)
    return True


def _branch(node: Node, index: int) -> GraphModule:
    """The subgraph module a higher-order op's argument ``index`` names (a get_attr)."""
    attr = node.args[index]
    return getattr(node.graph.owning_module, attr.target)


def _cond(node: Node) -> PlacementValue:
    """``torch.cond(pred, true_fn, false_fn, operands)``: each branch subgraph is placed
    from the operands' placements; both branches must return the same placements (the
    rank-local result must mean the same whichever branch ran). The predicate is a size
    or a replicated tensor, so every rank takes the same branch."""
    pred, operands = node.args[0], node.args[3]
    if _is_tensor(pred) and pred.meta["placement"] != R:
        _fail(node, f"predicate placed {_fmt(pred.meta['placement'])}: ranks could take different branches")
    placements = [_placement(o) if _is_tensor(o) else (R if isinstance(o, Node) else None) for o in operands]
    outs = []
    for index in (1, 2):
        branch = _branch(node, index)
        inputs = iter(placements)
        _propagate_graph(branch.graph, lambda _n: next(inputs))
        outs.append(next(n for n in branch.graph.nodes if n.op == "output").meta["placement"])
    if outs[0] != outs[1]:
        _fail(node, f"branches return different placements: {_fmt(outs[0])} vs {_fmt(outs[1])}")
    return outs[0]


def _propagate_graph(graph: torch.fx.Graph, placeholder: Callable[[Node], PlacementValue]) -> None:
    """Place every node of ``graph``; ``placeholder(node)`` gives the inputs' placements."""
    for node in graph.nodes:
        if node.op == "placeholder":
            p = placeholder(node)
        elif node.op == "call_function":
            try:
                p = _call(node)
            except PlacementError:
                raise
            except Exception as e:  # a rule met a shape it does not understand: name the node
                raise PlacementError(f"node {node.name!r} ({_op_name(node)}): placement rule failed: {e}") from e
        elif node.op == "get_attr":
            p = R  # module constants: the same on every rank
        elif node.op == "output":
            outs = node.args[0]
            p = tuple(_placement(o) if _is_tensor(o) else (R if isinstance(o, Node) else None)
                      for o in (outs if isinstance(outs, (list, tuple)) else [outs]))
        else:
            _fail(node, f"unsupported node kind {node.op!r}")
        node.meta["placement"] = p


def propagate_placements(
    gm: GraphModule, program: ExportedProgram, specs: dict[str, ShardSpec], plan: ParallelPlan
) -> None:
    """Set ``node.meta["placement"]`` on every node of ``gm`` (the graph of ``program``)
    and of the branch subgraphs of its ``torch.cond`` nodes."""
    sig = {s.arg.name: s for s in program.graph_signature.input_specs if hasattr(s.arg, "name")}
    user_inputs = {n for n, s in sig.items() if s.kind == InputKind.USER_INPUT}
    caches = _cache_placements(gm, user_inputs, plan)
    _propagate_graph(gm.graph, lambda node: _placeholder(node, sig, specs, plan, caches))
    if plan.tp == 1:
        for node in gm.graph.nodes:
            p = node.meta["placement"]
            if any(q != R for q in _flat([p] if not isinstance(p, tuple) else list(p))):
                _fail(node, f"placement {_fmt(p)} at tp=1")
    gm.meta["placement_plan"] = plan


# ---------------------------------------------------------------------------
# Sizes
# ---------------------------------------------------------------------------


class _MissingSizes(Exception):
    def __init__(self, symbols: Sequence[sympy.Symbol]):
        super().__init__(", ".join(map(str, symbols)))
        self.symbols = list(symbols)


class _SizeEvaluator:
    """Evaluates symbolic sizes with sizes given by Dim name, symbol name or ``input.dim``."""

    def __init__(self, gm: GraphModule, program: ExportedProgram, sizes: Mapping[str, int]):
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        user = {s.arg.name for s in program.graph_signature.input_specs
                if s.kind == InputKind.USER_INPUT and hasattr(s.arg, "name")}
        dim_names: dict[sympy.Symbol, list[str]] = {}
        input_dims: dict[sympy.Symbol, list[str]] = {}
        for n in placeholders:
            val = n.meta.get("val")
            if n.name in user and isinstance(val, torch.Tensor):
                for d, s in enumerate(val.shape):
                    e = _expr(s)
                    if isinstance(e, sympy.Symbol):
                        input_dims.setdefault(e, []).append(f"{n.name}.{d}")
        # Dim names, from the shape environment export traced with.
        fake_mode = torch._guards.detect_fake_mode([n.meta.get("val") for n in placeholders])
        shape_env = getattr(fake_mode, "shape_env", None)
        if shape_env is not None:
            debug = getattr(shape_env, "source_name_to_debug_name", {}) or {}
            for sym, sources in getattr(shape_env, "var_to_sources", {}).items():
                for src in sources:
                    name = debug.get(src.name)
                    if name and name.isidentifier() and name not in dim_names.get(sym, []):
                        dim_names.setdefault(sym, []).append(name)
        #: every name a symbol answers to, the preferred (Dim name) first
        self.aliases: dict[sympy.Symbol, list[str]] = {
            sym: [*dim_names.get(sym, []), *input_dims.get(sym, []), str(sym)]
            for sym in {*dim_names, *input_dims}
        }
        known = {a for names in self.aliases.values() for a in names}
        unknown = sorted(set(sizes) - known)
        if unknown:
            dims = sorted({self.aliases[s][0] for s in input_dims})
            raise ValueError(f"sizes names unknown dims {unknown}; this program's dims: {', '.join(dims)}")
        self.values: dict[sympy.Symbol, int] = {}
        for sym, names in self.aliases.items():
            given = {n: int(sizes[n]) for n in names if n in sizes}
            if len(set(given.values())) > 1:
                raise ValueError(f"conflicting sizes for one dimension: {given}")
            if given:
                self.values[sym] = next(iter(given.values()))
        self._cache: dict[Any, int] = {}

    def describe(self, sym: sympy.Symbol) -> str:
        names = self.aliases.get(sym, [str(sym)])
        return f"{names[0]!r}" + (f" (also {', '.join(repr(a) for a in names[1:])})" if len(names) > 1 else "")

    def size(self, s: Any) -> int:
        if isinstance(s, int):
            return s
        e = _expr(s)
        if e in self._cache:
            return self._cache[e]
        missing = sorted((sym for sym in e.free_symbols if sym not in self.values), key=str)
        if missing:
            raise _MissingSizes(missing)
        v = int(e.subs(self.values))
        self._cache[e] = v
        return v

    def shape(self, val: torch.Tensor) -> tuple[int, ...]:
        return tuple(self.size(s) for s in val.shape)

    def numel(self, val: torch.Tensor) -> int:
        return math.prod(self.shape(val))

    def nbytes(self, val: torch.Tensor) -> int:
        return self.numel(val) * val.dtype.itemsize


# ---------------------------------------------------------------------------
# Redundant work
# ---------------------------------------------------------------------------

GROUPS = ("kda", "mla", "moe", "dense_mlp", "attn_res", "embedding", "head", "other")

#: Module classes (by class name) whose nodes form a group.
_MODULE_GROUPS = {
    "KDAAttention": "kda",
    "MLAAttention": "mla",
    "LatentMoE": "moe",
    "DenseMLP": "dense_mlp",
    "AttnResMix": "attn_res",
    "VocabParallelEmbedding": "embedding",
    "ParallelLMHead": "head",
}
_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


def _stack(node: Node) -> list[tuple[str, str]]:
    stack = node.meta.get("nn_module_stack") or {}
    out = []
    for v in stack.values():
        path, cls = v[0], v[1]
        cls = cls if isinstance(cls, str) else getattr(cls, "__qualname__", str(cls))
        out.append((path, cls.rsplit(".", 1)[-1]))
    return out


def _layer_of(path: str) -> int | None:
    m = _LAYER_RE.search(path)
    return int(m.group(1)) if m else None


def _classify(node: Node, sublayer: Mapping[tuple[int, str], str]) -> tuple[str, int | None, str]:
    """(group, layer, module path) of a node."""
    stack = _stack(node)
    if not stack:
        return "other", None, ""
    inner = stack[-1][0]
    layer = _layer_of(inner)
    for path, cls in reversed(stack):
        if cls in _MODULE_GROUPS:
            return _MODULE_GROUPS[cls], layer, inner
    if layer is not None:
        if inner.endswith(".input_layernorm"):
            return sublayer.get((layer, "attn"), "other"), layer, inner
        if inner.endswith(".post_attention_layernorm"):
            return sublayer.get((layer, "mlp"), "other"), layer, inner
        if stack[-1][1] == "K3DecoderLayer":
            return "attn_res", layer, inner  # the residual (partial-sum) adds
    if inner.endswith("model.norm") or stack[-1][1] == "K3ForCausalLM":
        return "head", None, inner
    return "other", layer, inner


@dataclass(frozen=True)
class OpWork:
    """Cost of one node, per rank."""

    node: str
    op: str
    group: str
    layer: int | None
    module: str
    flops: int
    bytes: int


@dataclass
class RedundancyReport:
    """Per-rank work of the nodes whose tensor inputs are all Replicate."""

    sizes: dict[str, int]
    tp: int | None
    ops: list[OpWork]  # the replicated nodes with a nonzero cost, in graph order
    total_flops: int  # every node, per rank (for scale)
    total_bytes: int

    @property
    def flops(self) -> int:
        return sum(o.flops for o in self.ops)

    @property
    def bytes(self) -> int:
        return sum(o.bytes for o in self.ops)

    def by_group(self) -> dict[str, dict[str, int]]:
        out = {g: {"flops": 0, "bytes": 0, "nodes": 0} for g in GROUPS}
        for o in self.ops:
            g = out.setdefault(o.group, {"flops": 0, "bytes": 0, "nodes": 0})
            g["flops"] += o.flops
            g["bytes"] += o.bytes
            g["nodes"] += 1
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "sizes": dict(self.sizes),
            "tp": self.tp,
            "replicated": {"flops": self.flops, "bytes": self.bytes, "nodes": len(self.ops)},
            "total": {"flops": self.total_flops, "bytes": self.total_bytes},
            "groups": self.by_group(),
            "ops": [o.__dict__.copy() for o in self.ops],
        }

    def format(self, detail: bool = True) -> str:
        def pct(a: int, b: int) -> str:
            return f"{100 * a / b:5.1f}%" if b else "    -"

        sizes = ", ".join(f"{k}={v}" for k, v in self.sizes.items())
        tp = f"tp={self.tp}" if self.tp else "tp=?"
        lines = [
            f"Replicated work per rank ({tp}; {sizes}): {self.flops:,} FLOPs ({pct(self.flops, self.total_flops)} "
            f"of {self.total_flops:,}), {self.bytes:,} bytes ({pct(self.bytes, self.total_bytes)} of "
            f"{self.total_bytes:,})",
            "",
            f"{'group':<10} {'nodes':>6} {'FLOPs':>16} {'share':>6} {'bytes':>16} {'share':>6}",
        ]
        for g, v in self.by_group().items():
            if v["nodes"]:
                lines.append(f"{g:<10} {v['nodes']:>6} {v['flops']:>16,} {pct(v['flops'], self.total_flops)} "
                             f"{v['bytes']:>16,} {pct(v['bytes'], self.total_bytes)}")
        lines.append(f"{'total':<10} {len(self.ops):>6} {self.flops:>16,} {pct(self.flops, self.total_flops)} "
                     f"{self.bytes:>16,} {pct(self.bytes, self.total_bytes)}")
        if detail and self.ops:
            w = max(len(o.node) for o in self.ops)
            wo = max(len(o.op) for o in self.ops)
            lines += ["", f"{'node':<{w}} {'op':<{wo}} {'group':<10} {'layer':>5} {'FLOPs':>14} {'bytes':>14}  module"]
            for o in self.ops:
                layer = "" if o.layer is None else str(o.layer)
                lines.append(f"{o.node:<{w}} {o.op:<{wo}} {o.group:<10} {layer:>5} {o.flops:>14,} {o.bytes:>14,}  "
                             f"{o.module}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()


def _aten_cost(node: Node, kind: str, sizes: _SizeEvaluator) -> tuple[int, int]:
    if kind in ("free", "collective"):
        return 0, 0
    out_vals = _tensor_vals(node.meta.get("val"))
    out_bytes = sum(sizes.nbytes(v) for v in out_vals)
    out_numel = sum(sizes.numel(v) for v in out_vals)
    in_vals = [a.meta["val"] for a in node.all_input_nodes if _is_tensor(a)]
    in_bytes = sum(sizes.nbytes(v) for v in in_vals)
    if kind == "create":
        return 0, out_bytes
    if kind == "gather":
        idx = [a for a in node.all_input_nodes if _is_tensor(a) and not a.meta["val"].is_floating_point()]
        return 0, 2 * out_bytes + sum(sizes.nbytes(a.meta["val"]) for a in idx)
    if kind == "copy":
        return 0, in_bytes + out_bytes
    if kind == "pointwise":
        return out_numel, in_bytes + out_bytes
    if kind == "reduce":
        return sum(sizes.numel(v) for v in in_vals[:1]), in_bytes + out_bytes
    if kind == "softmax":
        return 5 * out_numel, in_bytes + out_bytes
    if kind == "contract":
        operands, letters, _out, bias = _contraction(node)
        dims: dict[str, int] = {}
        for o, ls in zip(operands, letters):
            for c, s in zip(ls, sizes.shape(o.meta["val"])):
                dims[c] = max(dims.get(c, 1), s)
        flops = 2 * math.prod(dims.values())
        if isinstance(bias, Node):
            flops += out_numel
        return flops, in_bytes + out_bytes
    raise AssertionError(kind)


def _node_cost(node: Node, sizes: _SizeEvaluator) -> tuple[int, int]:
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return 0, 0
    if target.namespace in ("aten", "_c10d_functional", "prims"):
        entry = _ATEN.get(target.overloadpacket)
        if entry is None:
            _fail(node, "no cost model for this op")
        return _aten_cost(node, entry.cost, sizes)
    rule = op_rule(target)
    if rule is None:
        _fail(node, f"custom op {target.name()} declares no rule (and no cost)")
    c = rule.cost_of(CostCall(node, _bind(node), sizes, rule.caches))
    return int(c.flops), int(c.bytes)


def redundant_work(gm: GraphModule, program: ExportedProgram, sizes: dict[str, int]) -> RedundancyReport:
    """The per-rank work of nodes whose tensor inputs are all Replicate (run
    :func:`propagate_placements` first), at the concrete ``sizes``."""
    ev = _SizeEvaluator(gm, program, sizes)
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    missing = [n.name for n in nodes if "placement" not in n.meta]
    if missing:
        raise PlacementError(f"nodes without a placement ({missing[:3]} ...): run propagate_placements first")
    # Which attention / MLP kind each layer has, for its pre-norms.
    sublayer: dict[tuple[int, str], str] = {}
    for n in nodes:
        g, layer, _ = _classify(n, {})
        if layer is not None and g in ("kda", "mla"):
            sublayer[(layer, "attn")] = g
        elif layer is not None and g in ("moe", "dense_mlp"):
            sublayer[(layer, "mlp")] = g
    ops: list[OpWork] = []
    total_flops = total_bytes = 0
    needed: dict[sympy.Symbol, str] = {}
    for n in nodes:
        try:
            flops, nbytes = _node_cost(n, ev)
        except _MissingSizes as e:
            for sym in e.symbols:
                needed.setdefault(sym, n.name)
            continue
        total_flops += flops
        total_bytes += nbytes
        if not (flops or nbytes):
            continue
        ins = _flat(_placement(a) for a in list(n.args) + list(n.kwargs.values()))
        if all(p == R for p in ins):
            group, layer, module = _classify(n, sublayer)
            ops.append(OpWork(n.name, _op_name(n), group, layer, module, flops, nbytes))
    if needed:
        desc = "; ".join(f"{ev.describe(sym)}, needed by {node}" for sym, node in needed.items())
        raise ValueError(f"no size given for {desc}: pass them in sizes")
    plan = gm.meta.get("placement_plan")
    return RedundancyReport(dict(sizes), plan.tp if plan else None, ops, total_flops, total_bytes)
