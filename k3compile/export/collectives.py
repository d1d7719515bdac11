"""The collectives of a TP > 1 rank's program in an export.

A rank's program calls torch's functional collectives (``_c10d_functional.all_reduce``,
``all_gather_into_tensor``, and under decode context parallelism ``reduce_scatter_tensor``
and ``all_to_all_single``), each followed by ``wait_tensor``. An export keeps each
collective one node, over the group of ranks it runs on:

- ONNX: a node of the domain ``k3.collectives`` (version 1) named after the collective,
  with one input and one output. Attributes: ``group_size``, ``group_ranks`` (the ranks of
  the group, this rank among them), ``group_name`` (the program's name of the group:
  ``"0"`` the TP group, ``"k3_dcp"`` the DCP group), ``reduce_op`` (``all_reduce``,
  ``reduce_scatter_tensor``) and the split sizes (``all_to_all_single``).
  ``all_gather_into_tensor`` stacks the ranks' inputs along dim 0, ``reduce_scatter_tensor``
  scatters along dim 0: torch's semantics of the op of that name. :func:`register_onnx_schemas`
  registers each node's signature with ``onnx.defs``, so ``onnx.checker`` checks it.
- ``wait_tensor`` is the identity on the values (it orders the collective's completion on
  the host): the export drops it, and a node's output is the collective's result.
- MLIR (torch dialect): ``torch.operator "torch._c10d_functional.<name>"`` as torch-mlir's
  fx importer writes it, the group name a ``!torch.str`` operand; ``wait_tensor`` stays.

No ONNX runtime has kernels for the domain. :func:`reference_evaluator_ops` gives
``onnx.reference.ReferenceEvaluator`` ones that run each node with ``torch.distributed``'s
own collective, in a process that is a rank of an initialised process group: one process a
rank, as the runtime runs.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Mapping

import numpy as np
import torch

from k3compile.context_parallel import DCP_GROUP_NAME, dcp_groups
from k3compile.export.custom_ops import KeptSignature, bind_arguments, onnx_attribute, onnx_schema

#: the ONNX domain of the collectives, and its version
COLLECTIVES_DOMAIN = "k3.collectives"
COLLECTIVES_DOMAIN_VERSION = 1
_GROUP = (("group_size", "INT"), ("group_ranks", "INTS"), ("group_name", "STRING"))
#: each exported collective's attributes besides its group's, in the order of its torch arguments
_ATTRIBUTES = {
    "all_reduce": (("reduce_op", "STRING"),),
    "all_gather_into_tensor": (),
    "reduce_scatter_tensor": (("reduce_op", "STRING"),),
    "all_to_all_single": (("output_split_sizes", "INTS"), ("input_split_sizes", "INTS")),
}
#: the functional collectives an export keeps (``wait_tensor`` is dropped: module docstring)
COLLECTIVES = tuple(_ATTRIBUTES)
_c10d = torch.ops._c10d_functional


def _calls(gm: torch.fx.GraphModule) -> list[tuple[str, torch.fx.Node]]:
    """(name, node) of every functional collective that ``gm`` calls, ``wait_tensor`` aside."""
    calls = [(n.target._schema.name.split("::")[1], n) for n in gm.graph.nodes
             if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
             and n.target.namespace == "_c10d_functional"]
    return [(name, n) for name, n in calls if name != "wait_tensor"]


def program_collectives(gm: torch.fx.GraphModule) -> list[str]:
    """The name of every functional collective that ``gm`` calls (``wait_tensor`` aside),
    sorted, once each."""
    return sorted({name for name, _ in _calls(gm)})


def group_ranks(group_name: str, tp: int, dcp: int, rank: int) -> tuple[int, ...]:
    """The ranks of the group that a program of ``rank`` (of ``tp``, DCP ``dcp``) names
    ``group_name``: the rank's DCP group, or the TP group (the default process group,
    which the capture names ``"0"``)."""
    if group_name == DCP_GROUP_NAME:
        return tuple(next(g for g in dcp_groups(tp, dcp) if rank in g))
    return tuple(range(tp))


def collectives_metadata(gm: torch.fx.GraphModule, tp: int, dcp: int, rank: int) -> dict:
    """What an export of ``gm`` says of its collectives (``k3compile.collectives``): their
    domain, the parallel plan, the rank, the ranks of every group that they name (by the
    group's name) and their number of calls (by collective); empty for a program without
    collectives."""
    calls = _calls(gm)
    if not calls:
        return {}
    names = sorted({str(bind_arguments(n.target._schema, n.args, n.kwargs)["group_name"]) for _, n in calls})
    counts = Counter(name for name, _ in calls)
    return {"domain": COLLECTIVES_DOMAIN, "version": COLLECTIVES_DOMAIN_VERSION, "tp": tp, "dcp": dcp, "rank": rank,
            "groups": {n: list(group_ranks(n, tp, dcp, rank)) for n in names}, "calls": dict(sorted(counts.items()))}


@functools.cache
def collective_signature(name: str) -> KeptSignature:
    """The ONNX signature of collective ``name``: one input, one output, its attributes."""
    return KeptSignature(name, ("input",), None, (*_ATTRIBUTES[name], *_GROUP), ("output",), ())


def register_onnx_schemas() -> None:
    """Register the ONNX schema of every collective (domain ``k3.collectives``, version 1),
    once a process. A process that checks an exported file again must call this first."""
    import onnx.defs

    for name in COLLECTIVES:
        if not onnx.defs.has(name, COLLECTIVES_DOMAIN):
            onnx.defs.register_schema(onnx_schema(collective_signature(name), COLLECTIVES_DOMAIN,
                                                  COLLECTIVES_DOMAIN_VERSION, f"torch.ops._c10d_functional.{name}"))


def onnx_translation_table(metadata: Mapping) -> dict:
    """``torch.onnx.export``'s ``custom_translation_table`` entries for the collectives of a
    program (its :func:`collectives_metadata`): each collective one ``k3.collectives``
    node, ``wait_tensor`` dropped (its input is its output)."""
    register_onnx_schemas()
    groups = {n: tuple(r) for n, r in metadata["groups"].items()}
    return {_c10d.wait_tensor.default: lambda tensor: tensor,
            **{getattr(_c10d, name).default: _onnx_node(name, groups) for name in COLLECTIVES}}


def _onnx_node(name: str, groups: Mapping[str, tuple[int, ...]]):
    """The translation of a call of collective ``name`` into one ``k3.collectives`` node."""
    schema = getattr(_c10d, name).default._schema

    def translate(*args, **kwargs):
        import onnxscript

        bound = bind_arguments(schema, args, kwargs)
        ranks = groups[str(bound["group_name"])]
        if bound.get("group_size", len(ranks)) != len(ranks):
            raise ValueError(f"_c10d_functional.{name}: group size {bound['group_size']}, but group "
                             f"{bound['group_name']!r} of this rank has the ranks {list(ranks)}")
        named = {n: onnx_attribute(name, n, kind, bound[n]) for n, kind in _ATTRIBUTES[name]}
        named.update(group_size=len(ranks), group_ranks=list(ranks), group_name=str(bound["group_name"]))
        return getattr(onnxscript.values.Opset(COLLECTIVES_DOMAIN, COLLECTIVES_DOMAIN_VERSION), name)(
            bound["input"], **named)

    return translate


def reference_evaluator_ops(groups: Mapping[tuple[int, ...], str] | None = None) -> list[type]:
    """``new_ops`` for ``onnx.reference.ReferenceEvaluator``: each ``k3.collectives`` node
    runs torch's functional collective of its name, then waits for it, in this process, a
    rank of the default process group. A node's group is the default group when its
    ``group_ranks`` are all of the default group's ranks, else ``groups[group_ranks]`` (the
    name of a process group this process made, e.g. the DCP group)."""
    import torch.distributed as dist
    from onnx.reference.op_run import OpRun

    groups = dict(groups or {})

    def run(self, x: np.ndarray, **attributes) -> tuple[np.ndarray]:  # the node's attributes, by name
        name = type(self).__name__
        ranks = tuple(attributes["group_ranks"])
        if ranks == tuple(range(dist.get_world_size())):
            group = dist.group.WORLD.group_name
        elif ranks in groups:
            group = groups[ranks]
        else:
            raise ValueError(f"{COLLECTIVES_DOMAIN}.{name}: no process group given for the ranks {list(ranks)}")
        op = getattr(_c10d, name).default
        args = [group if a.name == "group_name" else attributes[a.name] for a in op._schema.arguments[1:]]
        out = _c10d.wait_tensor.default(op(torch.from_numpy(np.ascontiguousarray(x)), *args))
        return (out.numpy(),)

    return [type(name, (OpRun,), {"op_domain": COLLECTIVES_DOMAIN, "_run": run}) for name in COLLECTIVES]


def reference_evaluator(model, groups: Mapping[tuple[int, ...], str] | None = None):
    """``onnx.reference.ReferenceEvaluator`` of ``model`` (a path or a ModelProto) with the
    collectives of :func:`reference_evaluator_ops`, in a process that is a rank of the
    default process group; and ONNX's ``GatherElements`` along a negative axis, which the
    evaluator's own implementation reads wrongly (onnx 1.23)."""
    from onnx.reference import ReferenceEvaluator
    from onnx.reference.op_run import OpRun

    class GatherElements(OpRun):
        def _run(self, data, indices, axis=None):
            return (np.take_along_axis(data, indices.astype(np.int64), axis=axis),)

    return ReferenceEvaluator(model, new_ops=[*reference_evaluator_ops(groups), GatherElements])
