"""Running the passes: every selected pass over every phase, each followed by checks and
a record.

After each pass: graph lint, the program's output signature re-synced with the graph,
shape re-propagation (fake tensors with the programs' symbolic sizes), placement
re-propagation, optionally translation validation (the graph before and after, run on
identical random inputs), and a :class:`~k3compile.records.PassRecord` for notebooks
and the CLI. Before a pass, the graph facts it ``needs`` that are missing are computed.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.fx import GraphModule
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from k3compile.config import K3Config
from k3compile.pipeline.interface import GraphPass, PassContext, PassError
from k3compile.pipeline.selection import PipelineOptions, resolve_passes
from k3compile.placement import propagate_placements
from k3compile.records import PassRecord, pipeline_summary_html, snapshot
from k3compile.sharding import ParallelPlan, ShardOffset, ShardSpec
from k3compile.targets import get_target


def lint_graph(gm: GraphModule) -> None:
    """FX's structural lint plus the invariants our programs keep."""
    try:
        gm.graph.lint()
    except Exception as e:  # lint raises plain RuntimeError/AssertionError
        raise PassError(f"graph lint failed: {e}") from e
    outputs = [n for n in gm.graph.nodes if n.op == "output"]
    if len(outputs) != 1:
        raise PassError(f"graph must have exactly one output node, has {len(outputs)}")
    gm.recompile()


def sync_signature(program: ExportedProgram) -> None:
    """Point the program's output specs at the graph's current output nodes (a pass may
    have replaced the node that produced an output)."""
    from torch.export.graph_signature import TensorArgument

    output = next(n for n in program.graph.nodes if n.op == "output")
    values = output.args[0] if isinstance(output.args[0], (list, tuple)) else [output.args[0]]
    specs = program.graph_signature.output_specs
    if len(values) != len(specs):
        raise PassError(f"graph has {len(values)} outputs, its signature {len(specs)}")
    for spec, value in zip(specs, values):
        if isinstance(spec.arg, TensorArgument):
            spec.arg.name = value.name
    placeholders = {n.name for n in program.graph.nodes if n.op == "placeholder"}
    missing = [s.arg.name for s in program.graph_signature.input_specs if s.arg.name not in placeholders]
    if missing:
        raise PassError(f"a pass removed graph inputs {missing[:3]}; inputs are part of the calling convention")


def propagate_shapes(gm: GraphModule) -> None:
    """Recompute ``node.meta['val']`` for every node from the placeholders' fake values,
    keeping the programs' symbolic sizes."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    vals = [n.meta.get("val") for n in placeholders]
    fake_mode = torch._guards.detect_fake_mode(vals)
    if fake_mode is None:
        raise PassError("placeholders carry no fake values to propagate shapes from")
    try:
        FakeTensorProp(gm, mode=fake_mode).propagate_dont_convert_inputs(*vals)
    except Exception as e:
        raise PassError(f"shape propagation failed: {e}") from e


def count_ops(gm: GraphModule) -> dict[str, int]:
    """Op (``str(node.target)``) -> number of ``call_function`` nodes of the top-level graph."""
    counts: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function":
            key = str(node.target)
            counts[key] = counts.get(key, 0) + 1
    return counts


def _provide_needs(graph_pass: GraphPass, gm: GraphModule, program: ExportedProgram, specs: dict[str, ShardSpec],
                   plan: ParallelPlan) -> None:
    """Compute the graph facts ``graph_pass`` declares in ``needs`` that ``gm`` lacks."""
    if "placements" in graph_pass.needs and any("placement" not in n.meta for n in gm.graph.nodes):
        propagate_placements(gm, program, specs, plan)


@dataclass
class PipelineResult:
    """The records of one pipeline run (one per pass and phase), in order."""

    records: list[PassRecord]

    def __repr__(self) -> str:
        return f"PipelineResult({len(self.records)} records: {', '.join(map(repr, self.records))})"

    def _repr_html_(self) -> str:
        return pipeline_summary_html(self.records)


def run_pipeline(
    programs: dict[str, ExportedProgram],
    config: K3Config,
    plan: ParallelPlan,
    specs: dict[str, ShardSpec],
    options: PipelineOptions,
    validator: Callable[[str, ExportedProgram, dict[str, ShardSpec], ExportedProgram, PassContext], Any]
    | None = None,
    on_pass: Callable[[str, str], None] | None = None,
    constants: dict[str, ShardOffset] | None = None,
    passes: list[GraphPass] | None = None,
) -> PipelineResult:
    """Run the passes over every phase's program in place and record each step.

    ``validator(phase, before, before_specs, after, ctx)`` runs translation validation on
    the program (and parameter specs) before the pass and the program after it, and
    returns a report with ``max_error`` and ``ok`` (see :mod:`k3compile.validation`); a
    failing report raises :class:`PassError`. ``constants`` (the per-rank constant buffers,
    shared by all phases) is updated in place by passes that add one. ``passes`` overrides
    the pass list (default: :func:`resolve_passes` for the options' target and ``plan``)."""
    target = get_target(options.target)
    records: list[PassRecord] = []
    constants = constants if constants is not None else {}
    validating = options.validate and validator is not None
    for graph_pass in passes if passes is not None else resolve_passes(target, options, plan):
        # The specs as the pass found them: a pass that reshards a parameter does so in
        # every phase, so later phases' "before" programs still match these.
        specs_before = copy.deepcopy(specs) if validating else None
        for phase, program in programs.items():
            if on_pass:
                on_pass(graph_pass.name, phase)
            gm = program.graph_module
            ctx = PassContext(config, plan, target, phase, program, specs, constants)
            _provide_needs(graph_pass, gm, program, specs, plan)
            before = snapshot(gm)
            reference = copy.deepcopy(program) if validating else None
            start = time.perf_counter()
            result = graph_pass.run(gm, ctx)
            lint_graph(gm)
            sync_signature(program)
            after = snapshot(gm)
            if result.changed or after != before:  # else every node's metadata is still right
                propagate_shapes(gm)
                propagate_placements(gm, program, specs, plan)
                after = snapshot(gm)
            seconds = time.perf_counter() - start
            report = None
            if reference is not None and result.changed:
                report = validator(phase, reference, specs_before, program, ctx)
                if not report.ok:
                    raise PassError(
                        f"pass {graph_pass.name} changed the {phase} graph's numerics: max error "
                        f"{report.max_error:.3e} exceeds tolerance {report.tolerance:.3e}"
                    )
            records.append(PassRecord(graph_pass.name, phase, before, after, result, report, seconds))
    return PipelineResult(records)
