"""Redundant work: what every rank computes identically, as FLOPs and bytes per rank.

A node whose tensor inputs are all Replicate computes the same thing on every rank: its
cost is paid ``tp`` times for one result. :func:`redundant_work` (after
:func:`~k3compile.placement.propagate_placements`) gives, per rank, the FLOPs and bytes
of those nodes (and of all nodes, for scale), grouped by layer type (kda / mla / moe /
dense_mlp / attn_res / embedding / head / other: :mod:`k3compile.placement.groups`), with
per-op detail. Passes use it (dedup). Cost model, per rank:

- contractions: 2 x the product of all index sizes (``linear``: 2*M*N*K, + bias numel).
- pointwise ops: 1 FLOP per output element (transcendentals count 1); reductions: 1 per
  input element; softmax: 5 per element; casts, copies, ``cat``: 0 FLOPs.
- bytes: tensor inputs read + outputs written; views, ``getitem``, ``wait_tensor`` and
  size queries are free; gathers (``embedding``, ``index``) read only the rows they return.
- collectives: not counted (communication, not compute).
- ``k3::`` ops: the cost they declare with their rule (:mod:`k3compile.placement.k3_rules`):
  ``flops_per_element`` of their main operand (``rms_norm`` 4, ``situ_and_mul`` 9,
  ``sigmoid_topk_route`` 4 per logit, ``kda_gate`` 5, ``gated_rms_norm`` 6), or a
  function: ``moe_experts`` 2*3*T*top_k*I*D (I the local intermediate size), attention
  ops per head and context, with the context of ``mla_*`` bounded by the block table
  width x block size; cache arguments are not counted as read whole, the ops declare the
  cache traffic they do.

Symbolic sizes are evaluated at the concrete ``sizes`` given by name
(:mod:`k3compile.placement.sizes`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import sympy
import torch
from torch.export import ExportedProgram
from torch.fx import GraphModule, Node

from k3compile.placement.aten_rules import ATEN_RULES, _contraction
from k3compile.placement.groups import GROUPS, node_groups
from k3compile.placement.nodes import (
    R,
    PlacementError,
    _bind,
    _fail,
    _flat,
    _is_tensor,
    _op_name,
    _placement,
    _tensor_vals,
)
from k3compile.placement.rules import CostCall, op_rule
from k3compile.placement.sizes import MissingSizes, SizeEvaluator

__all__ = ["GROUPS", "OpWork", "RedundancyReport", "redundant_work"]


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


def _aten_cost(node: Node, kind: str, sizes: SizeEvaluator) -> tuple[int, int]:
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


def _node_cost(node: Node, sizes: SizeEvaluator) -> tuple[int, int]:
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return 0, 0
    if target.namespace in ("aten", "_c10d_functional", "prims"):
        entry = ATEN_RULES.get(target.overloadpacket)
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
    ev = SizeEvaluator(gm, program, sizes)
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    missing = [n.name for n in nodes if "placement" not in n.meta]
    if missing:
        raise PlacementError(f"nodes without a placement ({missing[:3]} ...): run propagate_placements first")
    groups = node_groups(nodes)
    ops: list[OpWork] = []
    total_flops = total_bytes = 0
    needed: dict[sympy.Symbol, str] = {}
    for n in nodes:
        try:
            flops, nbytes = _node_cost(n, ev)
        except MissingSizes as e:
            for sym in e.symbols:
                needed.setdefault(sym, n.name)
            continue
        total_flops += flops
        total_bytes += nbytes
        if not (flops or nbytes):
            continue
        ins = _flat(_placement(a) for a in list(n.args) + list(n.kwargs.values()))
        if all(p == R for p in ins):
            group, layer, module = groups[n]
            ops.append(OpWork(n.name, _op_name(n), group, layer, module, flops, nbytes))
    if needed:
        desc = "; ".join(f"{ev.describe(sym)}, needed by {node}" for sym, node in needed.items())
        raise ValueError(f"no size given for {desc}: pass them in sizes")
    plan = gm.meta.get("placement_plan")
    return RedundancyReport(dict(sizes), plan.tp if plan else None, ops, total_flops, total_bytes)
