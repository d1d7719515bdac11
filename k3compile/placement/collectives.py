"""Placement rules of the functional collectives (``torch.ops._c10d_functional``).

``all_reduce`` P(op) -> R (op must match; R or S inputs fail); ``all_gather_into_tensor``
S(d) -> R (the ranks' blocks stacked along dim 0, identical on every rank; R -> R; P
fails); ``reduce_scatter_tensor`` P -> S(0); ``wait_tensor`` is the identity. Over the
DCP group (``k3compile.context_parallel.DCP_GROUP_NAME``): ``all_gather_into_tensor`` ->
RankLocal, ``reduce_scatter_tensor`` and ``all_to_all_single`` of RankLocal partials ->
the heads' TP split (S(0) of the heads-first terms, S(2) of ``k3.dcp_pack``'s rows).
Collectives cost nothing in the compute model (communication, not compute).

Registered into :data:`k3compile.placement.aten_rules.ATEN_RULES` on import.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import Node

from k3compile.context_parallel import DCP_GROUP_NAME
from k3compile.placement.aten_rules import ATEN_RULES, AtenRule
from k3compile.placement.nodes import R, PlacementValue, _fail, _input_placements
from k3compile.sharding import Partial, RankLocal, Shard

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
        ATEN_RULES[getattr(_c10d, _name)] = AtenRule(_fn, "collective")
ATEN_RULES[_c10d.wait_tensor] = AtenRule(_wait, "free")
