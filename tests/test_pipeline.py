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
from k3compile.rank_program import RankProgram
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
    program = RankProgram.of(program)
    params = random_parameters(captured.config, program, captured.specs, captured.plan, constants=captured.constants)
    inputs = random_step_inputs(captured.config, captured.plan, "prefill", torch.float32, 16, seed=3)
    (logits,) = run_graph(program, params, inputs)
    assert logits.shape == (inputs[0].shape[0], captured.config.vocab_size)
    assert torch.isfinite(logits).all() and logits.std() > 0.1


def test_validation_steps_take_both_branches_of_the_gemm_dispatch():
    """Per phase, one validation step below the dispatch's 16 tokens and one at or above it
    (a decode step has a token per sequence; a prefill step three sequences)."""
    from k3compile.model.gemm import FAST_MIN_TOKENS
    from k3compile.validation import PREFILL_SEQS, VALIDATION_TOKENS

    cfg, plan = PRESETS["tiny"], ParallelPlan()
    for phase in ("decode", "prefill"):
        counts = []
        for tokens in VALIDATION_TOKENS:
            seqs = tokens if phase == "decode" else PREFILL_SEQS
            inputs = random_step_inputs(cfg, plan, phase, torch.float32, 16, num_seqs=seqs, min_tokens=tokens)
            counts.append(inputs[0].shape[0])
            assert inputs[0].shape[0] >= tokens and inputs[1][-1] == inputs[0].shape[0]
        assert min(counts) < FAST_MIN_TOKENS <= max(counts), (phase, counts)


def test_incremental_propagation_gives_what_a_full_one_gives():
    """After every pass of the h200 pipeline at TP2 / DCP2 on MXFP4 experts (all eleven
    change the graph), the values and placements the pipeline recomputed only where a pass
    changed something are those a propagation over the whole graph computes."""
    from k3compile.pipeline import propagate_shapes
    from k3compile.placement import propagate_placements

    def meta(value):
        if isinstance(value, torch.Tensor):
            return str(value.shape), str(value.stride()), value.dtype
        return tuple(map(meta, value)) if isinstance(value, (tuple, list)) else str(value)

    plan = ParallelPlan(tp=2, dcp=2)
    captured = capture(PRESETS["tiny"].replace(expert_format="mxfp4"), plan, torch.float32)
    result = run_pipeline(captured.programs, captured.config, plan, captured.specs, PipelineOptions(target="h200"),
                          constants=captured.constants)
    assert len({r.pass_name for r in result.records if r.result.changed}) == 11
    for program in captured.programs.values():
        gm = program.graph_module
        incremental = [(n.name, meta(n.meta.get("val")), n.meta.get("placement")) for n in gm.graph.nodes]
        propagate_shapes(gm)
        propagate_placements(gm, program, captured.specs, plan)
        assert incremental == [(n.name, meta(n.meta.get("val")), n.meta.get("placement")) for n in gm.graph.nodes]


def test_resolve_passes_order_and_errors():
    target = get_target("mi355x")
    assert [p.name for p in resolve_passes(target, PipelineOptions(target="mi355x"))] == [
        "remove_noops", "mxfp4_experts", "dedup_replicated_linear", "sink_copies", "fuse_kda_decode",
        "fuse_attn_res_norm", "merge_glu_projections", "merge_mla_projections", "merge_moe_input",
        "pad_attention_heads"]
    off = PipelineOptions(target="mi355x", disable=("remove_noops", "mxfp4_experts", "dedup_replicated_linear", "sink_copies",
                                                    "fuse_kda_decode", "fuse_attn_res_norm", "merge_glu_projections",
                                                    "merge_mla_projections", "merge_moe_input",
                                                    "pad_attention_heads"))
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
def test_validation_runs_across_ranks_at_tp2(monkeypatch, rank_pools):
    """At TP2 the graphs run on two gloo ranks: an exact pass validates to zero error and
    a wrong one is caught."""
    import k3compile.passes as passes

    tp2 = capture(PRESETS["tiny"], ParallelPlan(tp=2, rank=0), torch.float32, phases=("decode",))
    validator = TranslationValidator(constants=tp2.constants, ranks=rank_pools)
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


# ---------------------------------------------------------------------------
# The registry: passes declare themselves, the pipeline selects and orders from that
# ---------------------------------------------------------------------------


@pytest.fixture
def registry():
    """The pass registry, restored after the test."""
    from k3compile.pipeline import PASSES, registered_passes

    saved = dict(registered_passes())
    yield PASSES
    PASSES.clear()
    PASSES.update(saved)


def _declared(name: str, **declarations) -> type[GraphPass]:
    """A do-nothing pass class with the given declarations (not yet registered)."""

    def run(self, gm, ctx):
        return PassResult(changed=False)

    return type(name.title().replace("_", ""), (GraphPass,), {"name": name, "run": run, **declarations})


def test_default_pipelines_and_order_come_from_the_declarations():
    from k3compile.passes import ALL_PASSES
    from k3compile.pipeline import default_pass_names, pipeline_order

    common = ("remove_noops", "mxfp4_experts", "dedup_replicated_linear", "sink_copies")
    assert default_pass_names(get_target("cpu")) == common
    for gpu in ("h200", "mi355x", "mi300x"):
        assert default_pass_names(get_target(gpu)) == (*common, "fuse_kda_decode", "fuse_attn_res_norm",
                                                       "merge_glu_projections", "merge_mla_projections",
                                                       "merge_moe_input", "pad_attention_heads")
    # The registration order agrees with every after/before relation.
    assert pipeline_order() == list(ALL_PASSES)
    assert pipeline_order(["pad_attention_heads", "split_mla_context"]) == ["split_mla_context", "pad_attention_heads"]


def test_selection_follows_a_new_passes_declarations(registry):
    from k3compile.pipeline import register_pass

    register_pass(_declared("late", after=("sink_copies",), before=("fuse_kda_decode",)))  # opt-in only
    register_pass(_declared("early", default_on=frozenset({"cpu"}), before=("remove_noops",)))
    needs_tp2 = classmethod(lambda cls, plan: f"tp={plan.tp}" if plan.tp == 2 else None)
    register_pass(_declared("for_tp2", required_by=needs_tp2))
    cpu, gpu = get_target("cpu"), get_target("h200")
    names = lambda passes: [p.name for p in passes]  # noqa: E731
    assert names(resolve_passes(cpu, PipelineOptions())) == [
        "early", "remove_noops", "mxfp4_experts", "dedup_replicated_linear", "sink_copies"]
    assert "early" not in names(resolve_passes(gpu, PipelineOptions(target="h200")))
    assert names(resolve_passes(gpu, PipelineOptions(enable=("late",)))) == [
        "remove_noops", "mxfp4_experts", "dedup_replicated_linear", "sink_copies", "late", "fuse_kda_decode",
        "fuse_attn_res_norm", "merge_glu_projections", "merge_mla_projections", "merge_moe_input",
        "pad_attention_heads"]
    # Without a relation a pass keeps its registration place: here the last.
    register_pass(_declared("unrelated"))
    assert names(resolve_passes(cpu, PipelineOptions(enable=("unrelated",))))[-1] == "unrelated"
    assert "for_tp2" in names(resolve_passes(cpu, PipelineOptions(), ParallelPlan(tp=2)))
    assert "for_tp2" not in names(resolve_passes(cpu, PipelineOptions(), ParallelPlan(tp=1)))
    with pytest.raises(ValueError, match="tp=2 needs pass for_tp2; it cannot be disabled"):
        resolve_passes(cpu, PipelineOptions(disable=("for_tp2",)), ParallelPlan(tp=2))


def test_order_cycles_and_bad_declarations_fail(registry):
    from dataclasses import dataclass

    from k3compile.pipeline import pipeline_order, register_pass

    register_pass(_declared("first", after=("second",)))
    register_pass(_declared("second", after=("first",)))
    with pytest.raises(ValueError, match="form a cycle"):
        pipeline_order()
    registry.pop("first"), registry.pop("second")
    register_pass(_declared("typo", after=("remove_noop",)))
    with pytest.raises(ValueError, match="declares after='remove_noop', which is not a registered pass"):
        pipeline_order()
    registry.pop("typo")
    with pytest.raises(ValueError, match="default_on has \\['tpu'\\]"):
        register_pass(_declared("tpu_only", default_on=frozenset({"tpu"})))
    with pytest.raises(ValueError, match="already registered"):
        register_pass(_declared("remove_noops"))

    class NotADataclass:
        pass

    with pytest.raises(TypeError, match="Config must be a dataclass"):
        register_pass(_declared("odd", Config=NotADataclass))

    @dataclass(frozen=True)
    class Fine:
        pass

    register_pass(_declared("fine", Config=Fine))


def test_pass_configs_by_name_with_checked_choices():
    from k3compile.compiler import CompileOptions
    from k3compile.pipeline import config_choices, pass_config

    assert config_choices("split_mla_context", "merge") == ("reduce-scatter", "all-to-all")
    assert pass_config("split_mla_context").merge == "all-to-all"
    assert pass_config("split_mla_context", {"merge": "reduce-scatter"}).merge == "reduce-scatter"
    with pytest.raises(ValueError, match="split_mla_context: merge must be one of reduce-scatter, all-to-all, got 'x'"):
        pass_config("split_mla_context", {"merge": "x"})
    with pytest.raises(ValueError, match="pass split_mla_context has no option\\(s\\) merg"):
        pass_config("split_mla_context", {"merg": "x"})
    with pytest.raises(ValueError, match="unknown pass 'nope'"):
        CompileOptions(pass_configs={"nope": {}})
    with pytest.raises(ValueError, match="merge must be one of"):
        CompileOptions(pass_configs={"split_mla_context": {"merge": "gather"}})
    (split,) = resolve_passes(get_target("cpu"), PipelineOptions(
        enable=("split_mla_context",),
        disable=("remove_noops", "mxfp4_experts", "dedup_replicated_linear", "sink_copies"),
        pass_configs={"split_mla_context": {"merge": "reduce-scatter"}}))
    assert split.config.merge == "reduce-scatter"
    with pytest.raises(ValueError, match="config_choices|fixed choices"):
        config_choices("remove_noops", "anything")


def test_the_pipeline_provides_what_a_pass_needs(captured, registry):
    """A pass that declares ``needs={"placements"}`` finds them on every node, also on a
    graph captured without them."""
    from k3compile.pipeline import register_pass

    seen = []

    def run(self, gm, ctx):
        seen.append(all("placement" in n.meta for n in gm.graph.nodes))
        return PassResult(changed=False)

    register_pass(_declared("reads_placements", needs=frozenset({"placements"}), run=run))
    program = captured.programs["decode"]
    assert not any("placement" in n.meta for n in program.graph.nodes)
    run_pipeline({"decode": program}, captured.config, captured.plan, captured.specs,
                 PipelineOptions(enable=("reads_placements",), disable=("remove_noops", "mxfp4_experts",
                                                                      "dedup_replicated_linear", "sink_copies")))
    assert seen == [True]
