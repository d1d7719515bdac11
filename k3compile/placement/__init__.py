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

:func:`propagate_placements` sets ``node.meta["placement"]`` on every node, from the
parameters' :class:`~k3compile.sharding.ShardSpec` s, Replicate user inputs, and caches
placed as the ops that update them declare. An input combination an op's rule does not
list is a :class:`PlacementError` that names the node and its input placements; an op
with no rule fails too. :func:`redundant_work` then reports the FLOPs and bytes per rank
of the nodes every rank computes identically (all inputs Replicate), which passes use.

Example (layer 0 of the ``tiny`` preset, TP2 decode: the KDA attention output)::

    linear_7      = aten.linear(reshape, o_proj_weight)           S(1) x S(1) -> P
    all_reduce_1  = _c10d_functional.all_reduce(linear_7, "sum")  P           -> R
    wait_tensor_1 = _c10d_functional.wait_tensor(all_reduce_1)    R           -> R
    attn_res_mix  = k3.attn_res_mix(wait_tensor_1, [...], ...)    rowwise: R  -> R

and its column-parallel input ``linear = aten.linear(rms_norm R, q_proj_weight S(0)) ->
S(1)``, viewed ``[T, 2*16] -> [T, 2, 16]`` as S(1) (the heads).

Modules:

- :mod:`~k3compile.placement.nodes`: :class:`PlacementError` and the node helpers rules use.
- :mod:`~k3compile.placement.rules`: the k3 op rule vocabulary (:func:`elementwise`,
  :func:`rowwise`, :func:`split`, ...), :class:`Cost`/:class:`CostCall`, the registry.
- :mod:`~k3compile.placement.k3_rules`: the rules and costs of every ``k3::`` op.
- :mod:`~k3compile.placement.aten_rules`: pointwise, contraction, reduction rules and the
  aten registry; :mod:`~k3compile.placement.aten_views`: views, data movement, gathers;
  :mod:`~k3compile.placement.collectives`: the functional collectives.
- :mod:`~k3compile.placement.propagate`: propagation through a program.
- :mod:`~k3compile.placement.sizes` and :mod:`~k3compile.placement.redundancy`: the cost
  model at concrete sizes, and the redundant-work report.

Importing this package registers every rule (aten, collectives, and the ``k3::`` ops);
the op library itself does not import it.
"""

from __future__ import annotations

# Rule modules that register on import (aten_rules is imported by propagate).
from k3compile.placement import aten_views, collectives, k3_rules  # noqa: F401
from k3compile.placement.nodes import PlacementError, PlacementValue
from k3compile.placement.propagate import propagate_placements
from k3compile.placement.redundancy import GROUPS, OpWork, RedundancyReport, redundant_work
from k3compile.placement.rules import (
    Cost,
    CostCall,
    OpRule,
    elementwise,
    op_rule,
    rank_local,
    register_op_rules,
    replicated,
    rowwise,
    shard_into_partial,
    split,
)

__all__ = [
    "GROUPS",
    "Cost",
    "CostCall",
    "OpRule",
    "OpWork",
    "PlacementError",
    "PlacementValue",
    "RedundancyReport",
    "elementwise",
    "op_rule",
    "propagate_placements",
    "rank_local",
    "redundant_work",
    "register_op_rules",
    "replicated",
    "rowwise",
    "shard_into_partial",
    "split",
]
