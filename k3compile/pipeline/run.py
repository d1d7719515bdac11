"""Running the passes: every selected pass over every phase, each followed by checks and
a record.

After each pass that changed the graph: graph lint, the program's output signature
re-synced with the graph, shape re-propagation (fake tensors with the programs' symbolic
sizes), the FP8 MLA cache invariant (:mod:`.mla_cache_check`, also checked before the
first pass) and placement re-propagation, both only where the pass changed something (a
:class:`GraphState` taken before the pass tells), optionally translation validation (the
program before and after, run on identical random inputs), and a
:class:`~k3compile.records.PassRecord` for notebooks and the CLI. Before a pass, the graph
facts it ``needs`` that are missing are computed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.fx import GraphModule, Node
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from k3compile.config import K3Config
from k3compile.pipeline.interface import GraphPass, PassContext, PassError
from k3compile.pipeline.mla_cache_check import check_mla_cache_use
from k3compile.pipeline.selection import PipelineOptions, resolve_passes
from k3compile.placement import propagate_placements
from k3compile.records import GraphSnapshot, PassRecord, pipeline_summary_html, snapshot
from k3compile.sharding import ParallelPlan, ShardOffset, ShardSpec
from k3compile.targets import get_target


def lint_graph(gm: GraphModule, recompile: bool = True) -> None:
    """FX's structural lint plus the invariants our programs keep, then the module's code
    regenerated (``recompile=False``: left to the caller, as the pipeline does once per
    program instead of after every pass: a second for the full model's graph)."""
    try:
        gm.graph.lint()
    except Exception as e:  # lint raises plain RuntimeError/AssertionError
        raise PassError(f"graph lint failed: {e}") from e
    outputs = [n for n in gm.graph.nodes if n.op == "output"]
    if len(outputs) != 1:
        raise PassError(f"graph must have exactly one output node, has {len(outputs)}")
    if recompile:
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


@dataclass(frozen=True)
class GraphState:
    """Each node's target, arguments and value as a pass found them, and the nodes of
    every branch subgraph: enough to tell what the pass changed (:meth:`changed`) and
    which values :func:`propagate_shapes` must recompute."""

    nodes: dict[Node, tuple[Any, ...]]  # node -> (op, target, args, kwargs)
    values: dict[Node, Any]  # node -> its value (compared by identity)
    branches: dict[str, tuple[Any, ...]]

    @classmethod
    def of(cls, gm: GraphModule) -> GraphState:
        nodes = {n: _wiring(n) for n in gm.graph.nodes}
        return cls(nodes, {n: n.meta.get("val") for n in nodes}, _branch_states(gm))

    def rewired(self, node: Node) -> bool:
        """Whether ``node`` is new or its op, target or arguments changed."""
        return self.nodes.get(node) != _wiring(node)

    def revalued(self, node: Node) -> bool:
        """Whether ``node`` is new or got another value object."""
        return node not in self.values or self.values[node] is not node.meta.get("val")

    def changed(self, gm: GraphModule) -> bool:
        """Whether ``gm`` differs from this state: a node added, removed or rewired, a
        value replaced, a branch subgraph edited."""
        if len(self.nodes) != len(gm.graph.nodes) or self.branches != _branch_states(gm):
            return True
        return any(self.rewired(n) or self.revalued(n) for n in gm.graph.nodes)


def _wiring(node: Node) -> tuple[Any, ...]:
    return node.op, node.target, node.args, node.kwargs


def _branch_states(gm: GraphModule) -> dict[str, tuple[Any, ...]]:
    return {name: tuple((n.op, n.target, n.args, n.kwargs) for n in sub.graph.nodes)
            for name, sub in gm.named_children() if isinstance(sub, GraphModule)}


def _expr(x: Any) -> Any:
    return x.node.expr if isinstance(x, (torch.SymInt, torch.SymBool, torch.SymFloat)) else x


def _same_value(a: Any, b: Any) -> bool:
    """Whether two fake values have the same metadata (sizes compared as expressions: an
    ``==`` on symbolic sizes would add guards)."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if (a.dtype, a.device, a.layout) != (b.dtype, b.device, b.layout) or a.layout != torch.strided:
            return False  # (sparse values: assumed different)
        return [_expr(d) for d in (*a.shape, *a.stride(), a.storage_offset())] == [
            _expr(d) for d in (*b.shape, *b.stride(), b.storage_offset())]
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    return type(a) is type(b) and _expr(a) == _expr(b)


def propagate_shapes(gm: GraphModule, since: GraphState | None = None) -> int:
    """Recompute ``node.meta['val']`` from the placeholders' fake values, keeping the
    programs' symbolic sizes; returns how many nodes were recomputed.

    With ``since`` (the graph before a pass) only the nodes the pass added or rewired,
    those reading an edited branch subgraph, and those whose inputs got a different value
    are recomputed (and the output node): every other value is what a full propagation
    would compute again. Each recomputation costs milliseconds with symbolic sizes, and
    a pass typically touches a few hundred of the full model's 8,000 nodes."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    fake_mode = torch._guards.detect_fake_mode([n.meta.get("val") for n in placeholders])
    if fake_mode is None:
        raise PassError("placeholders carry no fake values to propagate shapes from")
    prop = FakeTensorProp(gm, mode=fake_mode)
    try:
        if since is None:
            prop.propagate_dont_convert_inputs(*(n.meta.get("val") for n in placeholders))
            return len(gm.graph.nodes)
        return _propagate_changed(gm, since, prop, fake_mode)
    except PassError:
        raise
    except Exception as e:
        raise PassError(f"shape propagation failed: {e}") from e


def _propagate_changed(gm: GraphModule, since: GraphState, prop: FakeTensorProp, fake_mode: Any) -> int:
    edited = {name for name, state in _branch_states(gm).items() if since.branches.get(name) != state}
    updated: set[Node] = set()  # nodes whose value differs from before the pass
    count = 0
    with fake_mode:
        for node in gm.graph.nodes:
            if node.op in ("placeholder", "get_attr"):
                if since.rewired(node) or since.revalued(node) or node.target in edited:
                    updated.add(node)
                continue
            if since.rewired(node):
                if node.op != "output" and _same_inputs(node, since, edited):
                    continue  # the same op on inputs of the same metadata: the same value
            elif node.op != "output" and not any(i in updated for i in node.all_input_nodes):
                continue
            for i in node.all_input_nodes:
                if i not in prop.env:
                    prop.env[i] = prop.fetch_attr(i.target) if i.op == "get_attr" else i.meta.get("val")
            before = node.meta.get("val")
            prop.env[node] = prop.run_node(node)
            count += 1
            if not _same_value(before, node.meta.get("val")):
                updated.add(node)
    return count


def _leaves(args: Any) -> tuple[list[Any], Any]:
    """(leaves, structure) of a node's arguments."""
    if isinstance(args, (list, tuple)):
        pairs = [_leaves(a) for a in args]
        return [x for leaves, _ in pairs for x in leaves], (type(args).__name__, tuple(t for _, t in pairs))
    if isinstance(args, dict):
        pairs = [_leaves(v) for v in args.values()]
        return [x for leaves, _ in pairs for x in leaves], ("dict", tuple(args), tuple(t for _, t in pairs))
    return [args], None


def _same_inputs(node: Node, since: GraphState, edited: set[str]) -> bool:
    """Whether a rewired node still applies the same op to inputs whose values have the
    metadata its old inputs had (a value is a function of those): e.g. a pass that
    reroutes a tensor through an equal-shaped one."""
    op, target, args, kwargs = since.nodes.get(node, (None, None, None, None))
    if (op, target) != (node.op, node.target):
        return False
    old, old_structure = _leaves((args, kwargs))
    new, structure = _leaves((node.args, node.kwargs))
    if structure != old_structure:
        return False
    for a, b in zip(old, new):
        if isinstance(a, Node) != isinstance(b, Node):
            return False
        if isinstance(b, Node) and b.op == "get_attr":
            if a is not b or b.target in edited:
                return False
        elif isinstance(b, Node):
            if not _same_value(since.values.get(a), b.meta.get("val")):
                return False
        elif not _same_value(a, b):
            return False
    return True


def count_ops(gm: GraphModule) -> dict[str, int]:
    """Op (``str(node.target)``) -> number of ``call_function`` nodes of the top-level graph."""
    counts: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function":
            key = str(node.target)
            counts[key] = counts.get(key, 0) + 1
    return counts


def _provide_needs(graph_pass: GraphPass, gm: GraphModule, program: ExportedProgram, specs: dict[str, ShardSpec],
                   plan: ParallelPlan) -> bool:
    """Compute the graph facts ``graph_pass`` declares in ``needs`` that ``gm`` lacks;
    whether any was computed."""
    if "placements" in graph_pass.needs and any("placement" not in n.meta for n in gm.graph.nodes):
        propagate_placements(gm, program, specs, plan)
        return True
    return False


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
    validator: Any = None,
    on_pass: Callable[[str, str], None] | None = None,
    constants: dict[str, ShardOffset] | None = None,
    passes: list[GraphPass] | None = None,
    record: bool = True,
    after_pass: Callable[[GraphPass], None] | None = None,
) -> PipelineResult:
    """Run the passes over every phase's program in place and record each step.

    ``validator`` (a :class:`~k3compile.validation.TranslationValidator`) checks every pass
    that changes a program: ``run(phase, program, specs, ctx)`` runs a program on random
    steps, ``compare(before, after, ctx)`` returns a report with ``max_error`` and ``ok``;
    a failing report raises :class:`PassError`. The run after one pass is the reference
    for the next, so each version of a program runs once and none is copied. ``constants``
    (the per-rank constant buffers, shared by all phases) is updated in place by passes
    that add one. ``passes`` overrides the pass list (default: :func:`resolve_passes` for
    the options' target and ``plan``). With ``record=False`` the records keep no graph
    snapshots (the memory plan reads only the programs); ``after_pass(graph_pass)`` is
    called when a pass has run on every phase."""
    target = get_target(options.target)
    records: list[PassRecord] = []
    constants = constants if constants is not None else {}
    validating = options.validate and validator is not None
    latest: dict[str, GraphSnapshot] = {}  # each phase's graph as the last pass left it
    runs: dict[str, Any] = {}  # each phase's program as the last pass left it, run by the validator
    waiting: dict[str, float] = {}  # seconds of runs no report has counted yet
    stale: set[str] = set()  # phases whose module code is older than their graph
    take = snapshot if record else lambda _gm: GraphSnapshot.from_lines([])
    for program in programs.values():
        check_mla_cache_use(program.graph_module)
    for graph_pass in passes if passes is not None else resolve_passes(target, options, plan):
        for phase, program in programs.items() if validating else ():
            if phase not in runs:  # before the pass changes any phase's program or the shared specs
                waiting[phase] = waiting.get(phase, 0.0) - time.perf_counter()
                ctx = PassContext(config, plan, target, phase, program, specs, constants)
                runs[phase] = validator.run(phase, program, specs, ctx)
                waiting[phase] += time.perf_counter()
        for phase, program in programs.items():
            if on_pass:
                on_pass(graph_pass.name, phase)
            gm = program.graph_module
            ctx = PassContext(config, plan, target, phase, program, specs, constants)
            if _provide_needs(graph_pass, gm, program, specs, plan) or phase not in latest:
                latest[phase] = take(gm)
            before, state = latest[phase], GraphState.of(gm)
            start = time.perf_counter()
            result = graph_pass.run(gm, ctx)
            changed = result.changed or state.changed(gm)
            if changed:  # else every node's metadata is still right
                lint_graph(gm, recompile=False)
                stale.add(phase)
                sync_signature(program)
                propagate_shapes(gm, state)
                check_mla_cache_use(gm)
                propagate_placements(gm, program, specs, plan,
                                     only={n for n in gm.graph.nodes if state.rewired(n) or state.revalued(n)})
                latest[phase] = take(gm)
            seconds = time.perf_counter() - start
            report = None
            if validating and changed:
                waiting[phase] -= time.perf_counter()
                gm.recompile()
                stale.discard(phase)
                reference, runs[phase] = runs[phase], validator.run(phase, program, specs, ctx)
                if result.changed:
                    report = validator.compare(reference, runs[phase], ctx)
                waiting[phase] += time.perf_counter()
            if report is not None:
                report.seconds, waiting[phase] = waiting[phase], 0.0
                if not report.ok:
                    raise PassError(
                        f"pass {graph_pass.name} changed the {phase} graph's numerics: max error "
                        f"{report.max_error:.3e} ({report.where()}) exceeds tolerance {report.tolerance:.3e}",
                        report=report,
                    )
            records.append(PassRecord(graph_pass.name, phase, before, latest[phase], result, report, seconds))
        if after_pass:
            after_pass(graph_pass)
    for phase in stale:
        programs[phase].graph_module.recompile()
    return PipelineResult(records)
