"""The pass contract and the pass pipeline.

A pass is one class in one file of ``passes/``: a ``name``, a typed ``Config``
dataclass, and ``run(gm, ctx) -> PassResult``. It rewrites the graph of one phase in
place and reports what it did: whether it changed anything, how many candidates it
matched, named stats (the standard ones below, plus its own), and every candidate it
skipped with the reason.

The pipeline runs each pass over every phase, in the target's order (switch passes on
or off by name). After each pass: graph lint, shape re-propagation (fake tensors with
the programs' symbolic sizes), placement re-propagation, optionally translation
validation (the graph before and after, run on identical random inputs), and a
:class:`~k3compile.records.PassRecord` for notebooks and the CLI.
"""

from __future__ import annotations

import copy
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch.export import ExportedProgram
from torch.fx import GraphModule
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from k3compile.config import K3Config
from k3compile.sharding import ParallelPlan, ShardOffset, ShardSpec
from k3compile.targets import Target

#: Stats every pass may report (counts per rank per step of the phase it ran on).
STANDARD_STATS = ("nodes_removed", "nodes_added", "launches_removed", "bytes_removed", "flops_removed")


class PassError(RuntimeError):
    """A pass broke the graph (lint, shapes) or changed its numerics beyond tolerance."""


@dataclass(frozen=True)
class Skipped:
    """A candidate a pass looked at and left alone, and why."""

    node: str
    reason: str


@dataclass(frozen=True)
class Rewrite:
    """One candidate a pass rewrote: where, what it did, and its own stats (e.g. per layer)."""

    node: str
    detail: str
    stats: dict[str, float] = field(default_factory=dict)


@dataclass
class PassResult:
    changed: bool
    matches: int = 0
    stats: dict[str, float] = field(default_factory=dict)
    skipped: list[Skipped] = field(default_factory=list)
    rewrites: list[Rewrite] = field(default_factory=list)

    def add_rewrite(self, rewrite: Rewrite) -> None:
        """Record one rewritten candidate: a match whose stats add to the pass totals."""
        self.rewrites.append(rewrite)
        self.add_stats(rewrite.stats)
        self.matches += 1

    def add_stats(self, stats: dict[str, float]) -> None:
        """Accumulate per-rewrite stats into the pass totals."""
        for key, value in stats.items():
            self.stats[key] = self.stats.get(key, 0) + value


@dataclass(frozen=True)
class NoConfig:
    """For passes without options."""


@dataclass
class PassContext:
    """What a pass may read (and, for ``specs``, update) besides the graph."""

    config: K3Config
    plan: ParallelPlan
    target: Target
    phase: str
    program: ExportedProgram
    #: Parameter name -> shard spec, shared by all phases: a pass that reshards a
    #: parameter updates it here (and must do the same in every phase).
    specs: dict[str, ShardSpec]
    #: Per-rank constant buffers by name, shared by all phases (:func:`add_rank_constant`).
    constants: dict[str, ShardOffset] = field(default_factory=dict)


class GraphPass(ABC):
    """Base class of every pass: ``name``, ``Config`` and ``run``."""

    name: ClassVar[str]
    Config: ClassVar[type] = NoConfig

    def __init__(self, config: Any | None = None):
        self.config = config if config is not None else self.Config()
        if not isinstance(self.config, self.Config):
            raise TypeError(f"pass {self.name}: config must be {self.Config.__name__}, got {type(self.config).__name__}")

    @abstractmethod
    def run(self, gm: GraphModule, ctx: PassContext) -> PassResult: ...


def reshard_parameter(ctx: PassContext, name: str, spec: ShardSpec) -> torch.fx.Node:
    """Give parameter ``name`` a new shard spec: this rank now holds ``spec``'s slice.

    Updates the shared specs (so the loader reads the new slice), the program's state
    dict entry and its placeholder's fake value (the new local shape). Returns the
    placeholder. A pass calls this in every phase it rewrites; the call is idempotent."""
    program = ctx.program
    placeholder_name = next(
        (s.arg.name for s in program.graph_signature.input_specs if s.target == name), None
    )
    if placeholder_name is None:
        raise PassError(f"{name} is not a parameter of the {ctx.phase} program")
    node = next(n for n in program.graph.nodes if n.op == "placeholder" and n.name == placeholder_name)
    old = program.state_dict[name]
    shape = spec.local_shape(ctx.plan)
    ctx.specs[name] = spec
    program.state_dict[name] = torch.nn.Parameter(
        torch.empty(shape, dtype=old.dtype, device=old.device), requires_grad=False
    )
    val = node.meta["val"]
    with torch._guards.detect_fake_mode([val]):
        node.meta["val"] = torch.empty(shape, dtype=val.dtype, device=val.device)
    return node


def _placeholder_of(program: ExportedProgram, name: str) -> torch.fx.Node | None:
    """The graph placeholder of lifted input ``name`` (a parameter or buffer), or None."""
    arg = next((s.arg.name for s in program.graph_signature.input_specs if s.target == name), None)
    return next((n for n in program.graph.nodes if n.op == "placeholder" and n.name == arg), None)


def add_parameter(ctx: PassContext, name: str, spec: ShardSpec, before: str) -> torch.fx.Node:
    """A new parameter ``name`` holding this rank's slice of ``spec`` (in the spec's storage
    dtype: MXFP4 codes stay bytes), placed in the signature just before parameter
    ``before``. Updates the shared specs, the program's state dict and signature, and
    gives the placeholder its fake value. Idempotent per program."""
    from torch.export.graph_signature import InputKind, InputSpec, TensorArgument

    program = ctx.program
    existing = _placeholder_of(program, name)
    if existing is not None:
        return existing
    anchor = _placeholder_of(program, before)
    if anchor is None:
        raise PassError(f"{before} is not a parameter of the {ctx.phase} program")
    dtype = spec.param_dtype(program.state_dict[before].dtype)
    shape = spec.local_shape(ctx.plan)
    with program.graph.inserting_before(anchor):
        node = program.graph.placeholder("p_" + name.replace(".", "_"))
    val = anchor.meta["val"]
    with torch._guards.detect_fake_mode([val]):
        node.meta["val"] = torch.empty(shape, dtype=dtype, device=val.device)
    specs = program.graph_signature.input_specs
    position = next(i for i, s in enumerate(specs) if s.target == before)
    specs.insert(position, InputSpec(InputKind.PARAMETER, TensorArgument(node.name), name, persistent=None))
    device = program.state_dict[before].device
    program.state_dict[name] = torch.nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
    ctx.specs[name] = spec
    return node


def remove_parameter(ctx: PassContext, name: str) -> None:
    """Drop parameter ``name``, which no node may use any more, from the graph, the
    signature, the state dict and the shared specs (a pass that replaced it calls this in
    every phase; the specs entry goes with the first)."""
    program = ctx.program
    node = _placeholder_of(program, name)
    if node is None:
        raise PassError(f"{name} is not a parameter of the {ctx.phase} program")
    if node.users:
        raise PassError(f"parameter {name} is still used by {[u.name for u in node.users][:3]}")
    program.graph.erase_node(node)
    specs = program.graph_signature.input_specs
    specs.pop(next(i for i, s in enumerate(specs) if s.target == name))
    del program.state_dict[name]
    ctx.specs.pop(name, None)


def add_rank_constant(ctx: PassContext, name: str, offset: ShardOffset) -> torch.fx.Node:
    """A per-rank constant buffer ``name`` (this rank's ``offset`` value) as a graph input.

    Programs are shared by all ranks, so a rank-dependent number (where this rank's block
    starts) must be an input filled per rank at load time, never a baked-in constant. The
    buffer joins the program's signature after the existing buffers, its state dict, and
    the shared ``ctx.constants`` (which the artifact writes per rank and the validator and
    runtime fill). Idempotent per program: a second call returns the same placeholder."""
    from torch.export.graph_signature import InputKind, InputSpec, TensorArgument

    program = ctx.program
    if ctx.constants.get(name, offset) != offset:
        raise PassError(f"rank constant {name} already exists with a different offset")
    existing = next((s.arg.name for s in program.graph_signature.input_specs if s.target == name), None)
    placeholders = [n for n in program.graph.nodes if n.op == "placeholder"]
    if existing is not None:
        return next(n for n in placeholders if n.name == existing)
    specs = program.graph_signature.input_specs
    lifted = (InputKind.PARAMETER, InputKind.BUFFER)
    position = sum(1 for s in specs if s.kind in lifted)  # after every parameter and buffer
    if any(s.kind in lifted for s in specs[position:]):
        raise PassError("program inputs are not ordered parameters, buffers, user inputs")
    value = offset.tensor(ctx.plan)
    with program.graph.inserting_before(placeholders[position]):
        node = program.graph.placeholder("b_" + name.replace(".", "_"))
    val = placeholders[0].meta["val"]
    with torch._guards.detect_fake_mode([val]):
        node.meta["val"] = torch.empty((), dtype=value.dtype, device=val.device)
    specs.insert(position, InputSpec(InputKind.BUFFER, TensorArgument(node.name), name, persistent=True))
    program.state_dict[name] = value
    ctx.constants[name] = offset
    return node


# ---------------------------------------------------------------------------
# After-pass checks
# ---------------------------------------------------------------------------


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
    counts: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function":
            key = str(node.target)
            counts[key] = counts.get(key, 0) + 1
    return counts


# ---------------------------------------------------------------------------
# The pipeline
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class PipelineOptions:
    """Which passes run and what is checked after each."""

    target: str = "cpu"
    enable: tuple[str, ...] = ()  # passes to add to the target's default list
    disable: tuple[str, ...] = ()  # passes to drop (by name)
    validate: bool = False  # translation validation after each pass
    rtol: float = 1e-4  # validation tolerance, relative to the output's max magnitude
    pass_configs: tuple[tuple[str, Any], ...] = ()  # (pass name, its Config instance)


#: Passes a parallel plan cannot run without: decode context parallelism lays the MLA
#: cache out by position, which only the rewritten attention reads correctly.
DCP_PASS = "split_mla_context"


def resolve_passes(target: Target, options: PipelineOptions, plan: ParallelPlan | None = None) -> list[GraphPass]:
    """The ordered pass instances for ``target`` after enable/disable (plus what ``plan``
    requires: ``split_mla_context`` when dcp > 1); unknown names fail."""
    from k3compile.passes import ALL_PASSES

    for name in (*options.enable, *options.disable, *(n for n, _ in options.pass_configs)):
        if name not in ALL_PASSES:
            raise ValueError(f"unknown pass {name!r}; known passes: {', '.join(sorted(ALL_PASSES))}")
    names = [n for n in target.default_passes if n not in options.disable]
    names += [n for n in options.enable if n not in names and n not in options.disable]
    if plan is not None and plan.dcp > 1:
        if DCP_PASS in options.disable:
            raise ValueError(f"dcp={plan.dcp} needs pass {DCP_PASS}; it cannot be disabled")
        if DCP_PASS not in names:
            names.append(DCP_PASS)
    # Keep the canonical order of ALL_PASSES for enabled extras.
    order = list(ALL_PASSES)
    names.sort(key=order.index)
    configs = dict(options.pass_configs)
    return [ALL_PASSES[n](configs.get(n)) for n in names]


@dataclass
class PipelineResult:
    """The records of one pipeline run (one per pass and phase), in order."""

    records: list[Any]  # k3compile.records.PassRecord

    def __repr__(self) -> str:
        return f"PipelineResult({len(self.records)} records: {', '.join(map(repr, self.records))})"

    def _repr_html_(self) -> str:
        from k3compile.records import pipeline_summary_html

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
    from k3compile.placement import propagate_placements
    from k3compile.records import PassRecord, snapshot
    from k3compile.targets import get_target

    target = get_target(options.target)
    records = []
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
