"""The pass pipeline: contract, per-target order, enable/disable, lint, validation."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.fx import GraphModule

from k3compile.capture import capture
from k3compile.config import PRESETS
from k3compile.pipeline import (
    GraphPass,
    PassContext,
    PassError,
    PassResult,
    PipelineOptions,
    count_ops,
    resolve_passes,
    run_pipeline,
)
from k3compile.sharding import ParallelPlan
from k3compile.targets import get_target
from k3compile.validation import TranslationValidator, random_parameters, random_step_inputs, run_graph

aten = torch.ops.aten


@pytest.fixture(scope="module")
def tiny_capture():
    return capture(PRESETS["tiny"], ParallelPlan(), torch.float32)


@pytest.fixture
def captured(tiny_capture):
    return copy.deepcopy(tiny_capture)


class ScaleLogits(GraphPass):
    """A deliberately wrong pass: multiplies the output by 1.01."""

    name = "scale_logits"

    def run(self, gm: GraphModule, ctx: PassContext) -> PassResult:
        out = next(n for n in gm.graph.nodes if n.op == "output")
        value = out.args[0][0]
        with gm.graph.inserting_before(out):
            scaled = gm.graph.call_function(aten.mul.Tensor, (value, 1.01))
        out.args = ((scaled,),)
        return PassResult(changed=True, matches=1)


def test_remove_noops_is_exact_and_shrinks_the_graph(captured):
    before = {p: count_ops(ep.graph_module) for p, ep in captured.programs.items()}
    options = PipelineOptions(target="cpu", validate=True,
                              disable=("mxfp4_experts", "dedup_replicated_linear", "sink_copies"))
    result = run_pipeline(captured.programs, captured.config, captured.plan, captured.specs, options,
                          validator=TranslationValidator(constants=captured.constants))
    assert [r.pass_name for r in result.records] == ["remove_noops", "remove_noops"]
    for record in result.records:
        assert record.result.changed and record.result.stats["nodes_removed"] > 0
        assert record.report is not None and record.report.max_error == 0.0  # same ops, same order
        after = count_ops(captured.programs[record.phase].graph_module)
        # In an fp32 model every .float() is a same-dtype cast: all of them go.
        assert after.get("aten.to.dtype", 0) == 0 < before[record.phase]["aten.to.dtype"]
        assert sum(before[record.phase].values()) - sum(after.values()) == record.result.stats["nodes_removed"]


def test_validation_catches_a_wrong_pass(captured, monkeypatch):
    import k3compile.passes as passes

    monkeypatch.setitem(passes.ALL_PASSES, ScaleLogits.name, ScaleLogits)
    options = PipelineOptions(target="cpu", enable=("scale_logits",), disable=("remove_noops",), validate=True)
    with pytest.raises(PassError, match="scale_logits changed the decode graph's numerics"):
        run_pipeline(captured.programs, captured.config, captured.plan, captured.specs, options,
                     validator=TranslationValidator(constants=captured.constants))


def test_validator_measures_the_error_of_a_wrong_pass(captured):
    program = captured.programs["decode"]
    before = copy.deepcopy(program)
    ctx = PassContext(captured.config, captured.plan, get_target("cpu"), "decode", program, captured.specs)
    ScaleLogits().run(program.graph_module, ctx)
    program.graph_module.recompile()
    report = TranslationValidator(constants=captured.constants)("decode", before, captured.specs, program, ctx)
    assert not report.ok and report.errors["output0"] == pytest.approx(0.01 / 1.01, rel=0.02)


def test_random_step_inputs_are_valid_steps(captured):
    """The validation inputs run through the graph and give finite, non-trivial logits."""
    program = captured.programs["prefill"]
    params = random_parameters(captured.config, program, captured.specs, captured.plan, constants=captured.constants)
    inputs = random_step_inputs(captured.config, captured.plan, "prefill", torch.float32, 16, seed=3)
    (logits,) = run_graph(program.graph_module, program, params, inputs)
    assert logits.shape == (inputs[0].shape[0], captured.config.vocab_size)
    assert torch.isfinite(logits).all() and logits.std() > 0.1


def test_resolve_passes_order_and_errors():
    target = get_target("mi355x")
    assert [p.name for p in resolve_passes(target, PipelineOptions(target="mi355x"))] == [
        "remove_noops", "mxfp4_experts", "dedup_replicated_linear", "sink_copies", "fuse_kda_decode",
        "pad_attention_heads"]
    off = PipelineOptions(target="mi355x", disable=("remove_noops", "mxfp4_experts", "dedup_replicated_linear", "sink_copies",
                                                    "fuse_kda_decode", "pad_attention_heads"))
    assert resolve_passes(target, off) == []
    with pytest.raises(ValueError, match="unknown pass 'nope'"):
        resolve_passes(target, PipelineOptions(enable=("nope",)))
    with pytest.raises(ValueError, match="unknown target"):
        get_target("tpu")


def test_pass_config_type_is_checked():
    from k3compile.passes import RemoveNoops

    with pytest.raises(TypeError, match="config must be NoConfig"):
        RemoveNoops(config=3)


def test_shape_check_rejects_a_broken_graph(captured, monkeypatch):
    class BadMatmul(GraphPass):
        """Returns logits @ logits: [T, V] x [T, V] does not type-check."""

        name = "bad_matmul"

        def run(self, gm, ctx):
            out = next(n for n in gm.graph.nodes if n.op == "output")
            value = out.args[0][0]
            with gm.graph.inserting_before(out):
                out.args = ((gm.graph.call_function(aten.mm.default, (value, value)),),)
            return PassResult(changed=True)

    import k3compile.passes as passes

    monkeypatch.setitem(passes.ALL_PASSES, BadMatmul.name, BadMatmul)
    with pytest.raises(PassError, match="shape propagation failed"):
        run_pipeline(captured.programs, captured.config, captured.plan, captured.specs,
                     PipelineOptions(enable=("bad_matmul",), disable=("remove_noops",)))


@pytest.mark.slow
def test_validation_runs_across_ranks_at_tp2(monkeypatch):
    """At TP2 the graphs run on two gloo ranks: an exact pass validates to zero error and
    a wrong one is caught."""
    import k3compile.passes as passes

    tp2 = capture(PRESETS["tiny"], ParallelPlan(tp=2, rank=0), torch.float32, phases=("decode",))
    validator = TranslationValidator(constants=tp2.constants)
    good = run_pipeline(copy.deepcopy(tp2.programs), tp2.config, tp2.plan, dict(tp2.specs),
                        PipelineOptions(validate=True, disable=("mxfp4_experts", "dedup_replicated_linear", "sink_copies")),
                        validator=validator)
    (record,) = good.records
    assert record.result.changed and record.report.max_error == 0.0
    assert set(record.report.errors) >= {"output0", "cache0"}

    monkeypatch.setitem(passes.ALL_PASSES, ScaleLogits.name, ScaleLogits)
    with pytest.raises(PassError, match="scale_logits changed the decode graph's numerics"):
        run_pipeline(tp2.programs, tp2.config, tp2.plan, dict(tp2.specs),
                     PipelineOptions(enable=("scale_logits",), disable=("remove_noops", "mxfp4_experts", "dedup_replicated_linear",
                                                                               "sink_copies"),
                                     validate=True),
                     validator=validator)
