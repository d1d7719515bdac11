"""Capture: the stamped export of the layer stack is torch.export's program of the whole model."""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from k3compile.capture import (
    PHASES,
    StepModule,
    build_step_model,
    drop_device_asserts,
    example_inputs,
    tracing_process_group,
)
from k3compile.config import PRESETS
from k3compile.sharding import ParallelPlan
from k3compile.stamping import export_stacked, structure_key


def _value(v: object) -> object:
    if isinstance(v, torch.Tensor):
        return ("tensor", tuple(map(str, v.shape)), tuple(map(str, v.stride())), v.dtype)
    if isinstance(v, (tuple, list)):
        return tuple(_value(x) for x in v)
    return str(v)


def _arg(a: object) -> object:
    if isinstance(a, Node):
        return "%" + a.name
    if isinstance(a, (tuple, list)):
        return tuple(_arg(x) for x in a)
    if isinstance(a, dict):
        return {k: _arg(v) for k, v in a.items()}
    return a


def _graph(gm: GraphModule) -> list[object]:
    """Everything of a graph module a pass, a record or the artifact can see."""
    lines: list[object] = [gm.code]
    for n in gm.graph.nodes:
        meta = {k: _value(v) if k in ("val", "eager_input_vals") else v
                for k, v in n.meta.items() if k != "tensor_meta"}
        lines.append((n.op, n.name, str(n.target), _arg(n.args), _arg(n.kwargs), sorted(n.meta), meta))
    for name, child in gm.named_children():
        lines.append(name)
        lines += _graph(child)
    return lines


def _program(program: torch.export.ExportedProgram) -> list[object]:
    return [*_graph(program.graph_module), str(program.graph_signature), str(program.range_constraints),
            [(k, tuple(v.shape), v.dtype) for k, v in program.state_dict.items()]]


def test_stamped_export_is_the_export_of_the_whole_model():
    """Node for node, name for name, metadata included: the tiny TP2 model has seven layers
    of five structures (its two stamped layers read a longer list of AttnRes blocks than
    their templates), both phases."""
    cfg, plan = PRESETS["tiny"], ParallelPlan(tp=2)
    with tracing_process_group(plan.tp):
        model = build_step_model(cfg, plan, torch.float32)
        keys = [structure_key(layer) for layer in model.model.layers]
        assert len(set(keys)) < len(keys)  # something to stamp
        for phase in PHASES:
            step = StepModule(model, phase)
            args, dynamic = example_inputs(cfg, plan, phase, torch.float32)
            programs = [torch.export.export(step, args, dynamic_shapes=dynamic, strict=False),
                        export_stacked(step, args, dynamic, model.model.layers)]
            for program in programs:
                drop_device_asserts(program)
            full, stamped = (_program(p) for p in programs)
            assert len(full) == len(stamped)
            for a, b in zip(full, stamped):
                assert a == b
    assert not any("forward" in vars(layer) for layer in model.model.layers)  # the recorder is gone


def test_capture_cache_exports_once_and_hands_out_independent_copies():
    """A cached capture is the export node for node, metadata included; a pass rewriting
    one copy leaves the next one as exported."""
    from k3compile.capture import CaptureCache, capture

    cfg, plan = PRESETS["tiny"], ParallelPlan(2, 0)
    cache, said = CaptureCache(), []
    first = cache.get(cfg, plan, torch.float32, 16, said.append)
    second = cache.get(cfg, plan, torch.float32, 16, said.append)
    assert said == [*PHASES, "(cached)"]  # exported once
    exported = capture(cfg, plan, torch.float32, 16)
    for phase in PHASES:
        assert _program(first.programs[phase]) == _program(second.programs[phase]) == _program(exported.programs[phase])
    assert first.specs == second.specs == exported.specs and first.constants.keys() == exported.constants.keys()

    node = next(n for n in first.programs["decode"].graph.nodes if n.op == "call_function")
    node._rename("rewritten")
    first.specs.clear()
    third = cache.get(cfg, plan, torch.float32, 16)
    assert _program(third.programs["decode"]) == _program(exported.programs["decode"])
    assert third.specs == exported.specs
