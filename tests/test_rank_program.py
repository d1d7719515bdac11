"""RankProgram: what validation sends to its gloo ranks instead of a torch.export archive.
Unpacked, it is the same graph (the same generated code, every torch.cond branch
included) and computes the same values."""

from __future__ import annotations

import pytest
import torch
from torch.fx import Graph, GraphModule

from k3compile.rank_program import RankProgram
from k3compile.validation import random_parameters, random_step_inputs, run_graph


def _codes(gm: GraphModule) -> dict[str, str]:
    return {"": gm.code, **{name: m.code for name, m in gm.named_modules() if name and isinstance(m, GraphModule)}}


@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_unpacked_program_is_the_same_graph_and_gives_the_same_values(compile_once, phase):
    result = compile_once("tiny", "mxfp4", dtype="float32")  # every default pass applied
    program = RankProgram.of(result.captured.programs[phase])
    unpacked = RankProgram.unpack(program.pack())
    assert _codes(unpacked.graph_module) == _codes(program.graph_module)
    assert sum(1 for _ in unpacked.graph_module.named_modules()) > 2  # cond branches came along
    assert unpacked.inputs == program.inputs and unpacked.dtypes == program.dtypes

    captured = result.captured
    params = random_parameters(captured.config, program, captured.specs, captured.plan, constants=captured.constants)
    inputs = random_step_inputs(captured.config, captured.plan, phase, torch.float32, 16, seed=5)
    copies = random_step_inputs(captured.config, captured.plan, phase, torch.float32, 16, seed=5)
    with torch.no_grad():
        expected, got = run_graph(program, params, inputs), run_graph(unpacked, params, copies)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert all(torch.equal(a, b) for a, b in zip(copies[-1], inputs[-1]))  # the caches written alike


def test_tensor_attributes_travel_and_other_attributes_are_refused():
    root = torch.nn.Module()
    root.register_buffer("table", torch.arange(4.0))
    graph = Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(torch.ops.aten.add.Tensor, (x, graph.get_attr("table"))))
    gm = GraphModule(root, graph)
    program = RankProgram(gm, [], {})
    unpacked = RankProgram.unpack(program.pack())
    assert torch.equal(unpacked.graph_module(torch.ones(4)), torch.arange(1.0, 5.0))

    gm.scale = 2.0
    graph = Graph()
    graph.output(graph.get_attr("scale"))
    with pytest.raises(TypeError, match="get_attr 'scale' reads a float"):
        RankProgram(GraphModule(gm, graph), [], {}).pack()
