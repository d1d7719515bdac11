"""Propagation: placing every node of a captured program, from its placeholders on.

``propagate_placements`` sets ``node.meta["placement"]`` on every node: a placement for a
tensor, ``Replicate()`` for a symbolic or Python scalar (sizes are the same on every rank:
splits are even), a tuple for multi-output nodes (``getitem`` picks one), ``None`` for
nodes without a value (``k3::mla_cache_write``, asserts), and the tuple of the returned
values' placements on the ``output`` node. At ``tp == 1`` a mesh of one rank makes every
Shard and Partial a Replicate: every node is ``Replicate()``. Each op node is placed by
its rule: an aten or collective op by :data:`~k3compile.placement.aten_rules.ATEN_RULES`,
a custom op by the rule it registered (:func:`~k3compile.placement.rules.op_rule`); any
op with a RankLocal input gives RankLocal outputs (with a Partial input it fails), except
the collectives, which have their own RankLocal rules. ``torch.cond`` places both branch
subgraphs, which must agree.

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
- in a program in the context-parallel layout (``gm.meta["context_parallel"]``), the user
  inputs that op rules list as ``context_split`` (the MLA cache, block table and slot
  mapping of the rank's own positions): RankLocal.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Container, Iterator, Mapping
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind
from torch.fx import GraphModule, Node

from k3compile.context_parallel import program_layout
from k3compile.placement.aten_rules import ATEN_RULES
from k3compile.placement.nodes import (
    R,
    PlacementError,
    PlacementValue,
    _bind,
    _fail,
    _flat,
    _fmt,
    _input_placements,
    _is_tensor,
    _op_name,
    _outputs,
    _placement,
    _tensor_vals,
)
from k3compile.placement.rules import OpRule, op_rule
from k3compile.sharding import ParallelPlan, Partial, Placement, RankLocal, Shard, ShardSpec

__all__ = ["propagate_placements"]

_SCALAR_VALS = (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool)
_UNPLACED = object()


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
        custom = target.namespace not in ("aten", "_c10d_functional", "prims")
        # RankLocal in, RankLocal out; but collectives, and ops that read a whole DCP group's
        # gathered parts (group_complete), have rules of their own for it
        if (target.namespace != "_c10d_functional" and _has_rank_local(node, bound)
                and not (custom and getattr(op_rule(target), "kind", None) == "group_complete")):
            return _outputs(node, RankLocal())
        if custom:
            rule = op_rule(target)
            if rule is None:
                _fail(node, f"custom op {target.name()} declares no placement rule (register_op_rules; "
                            "the k3 ops' rules are in k3compile/placement/k3_rules.py)", _input_placements(bound))
            return rule.propagate(node, _input_placements(bound))
        entry = ATEN_RULES.get(target.overloadpacket)
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


def _propagate_graph(graph: torch.fx.Graph, placeholder: Callable[[Node], PlacementValue],
                     only: Container[Node] | None = None) -> None:
    """Place every node of ``graph``; ``placeholder(node)`` gives the inputs' placements.
    With ``only``, a node outside it that is placed already keeps its placement unless an
    input's placement changed."""
    changed: set[Node] = set()
    for node in graph.nodes:
        old = node.meta.get("placement", _UNPLACED)
        if (only is not None and node.op != "placeholder" and node not in only and old is not _UNPLACED
                and not any(i in changed for i in node.all_input_nodes)):
            continue
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
        if old is _UNPLACED or p != old:
            changed.add(node)


def propagate_placements(
    gm: GraphModule, program: ExportedProgram, specs: dict[str, ShardSpec], plan: ParallelPlan,
    only: Container[Node] | None = None,
) -> None:
    """Set ``node.meta["placement"]`` on every node of ``gm`` (the graph of ``program``)
    and of the branch subgraphs of its ``torch.cond`` nodes.

    ``only`` (after a pass: the nodes it added or rewired and those whose value changed)
    limits the work to those nodes, the placeholders (specs and the cache layout may have
    changed) and the nodes whose inputs got another placement; every other placement is
    what a full propagation would give again."""
    sig = {s.arg.name: s for s in program.graph_signature.input_specs if hasattr(s.arg, "name")}
    user_inputs = {n for n, s in sig.items() if s.kind == InputKind.USER_INPUT}
    caches = _cache_placements(gm, user_inputs, plan)
    _propagate_graph(gm.graph, lambda node: _placeholder(node, sig, specs, plan, caches), only)
    if plan.tp == 1:
        for node in gm.graph.nodes:
            p = node.meta["placement"]
            if any(q != R for q in _flat([p] if not isinstance(p, tuple) else list(p))):
                _fail(node, f"placement {_fmt(p)} at tp=1")
    gm.meta["placement_plan"] = plan
