"""Translation validation against deliberately wrong passes.

Each pass here is wrong in one place that a weaker check would miss: it corrupts only a
cache write (the step's logits stay bit-identical), it is wrong only on rank 1, or it is
wrong only on the GEMM dispatch's >= 16-token branch. Each must fail the pipeline with a
``PassError`` that names the pass, the phase, the tensor and rank of the worst error and
its size. The controls run the same passes with the exact factor 1.0 (the same graph
edits, no numeric change): they validate to zero error, so the negatives fail for the
corruption and not for the edit. The passes are registered only inside the tests.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch
from torch.fx import GraphModule

from k3compile.batch import CacheShape, allocate_caches, flatten_caches
from k3compile.capture import CapturedModel, capture
from k3compile.config import PRESETS, K3Config
from k3compile.model.gemm import FAST_MIN_TOKENS
from k3compile.pipeline import (
    PASSES,
    GraphPass,
    PassContext,
    PassError,
    PassResult,
    PipelineOptions,
    PipelineResult,
    add_rank_constant,
    default_pass_names,
    register_pass,
    run_pipeline,
)
from k3compile.sharding import ParallelPlan, ShardOffset
from k3compile.targets import get_target
from k3compile.validation import VALIDATION_TOKENS, TranslationValidator

aten = torch.ops.aten
k3 = torch.ops.k3
COND = torch.ops.higher_order.cond
WRONG = 1.01  # what a negative scales; its error is 0.01 of the tensor it scales
SECOND = f"@{VALIDATION_TOKENS[1]}"  # the suffix of the second (>= 16-token) step's tensors


@dataclass(frozen=True)
class Factor:
    """How much the pass scales what it corrupts: ``WRONG``, or 1.0 for the control."""

    factor: float = WRONG


class ScalingPass(GraphPass):
    """A pass that scales something by ``config.factor``; ``edit`` says what."""

    Config = Factor

    def run(self, gm: GraphModule, ctx: PassContext) -> PassResult:
        return PassResult(changed=True, matches=self.edit(gm, ctx, self.config.factor))

    def edit(self, gm: GraphModule, ctx: PassContext, factor: float) -> int:
        raise NotImplementedError


class CorruptKDAStateWrite(ScalingPass):
    """After each KDA recurrent step, scales the state it wrote: the step's output (and so
    its logits) is already computed, only the cache is wrong."""

    name = "corrupt_kda_state_write"

    def edit(self, gm: GraphModule, ctx: PassContext, factor: float) -> int:
        steps = [n for n in gm.graph.nodes if n.target in (k3.kda_decode.default, k3.kda_prefill.default)]
        for node in steps:
            state = node.args[5]
            with gm.graph.inserting_after(node):
                scaled = gm.graph.call_function(aten.mul.Tensor, (state, factor))
            with gm.graph.inserting_after(scaled):
                gm.graph.call_function(aten.copy_.default, (state, scaled))
        return len(steps)


class WrongOnRank1(ScalingPass):
    """Scales the logits by ``1 + (factor - 1) * rank`` through a per-rank constant (the
    rank's index): exact on rank 0, wrong on rank 1, as a pass that treats a per-rank
    value as the same everywhere."""

    name = "wrong_on_rank_1"

    def edit(self, gm: GraphModule, ctx: PassContext, factor: float) -> int:
        rank = add_rank_constant(ctx, "negatives.rank", ShardOffset(ctx.plan.tp))  # rank r: r
        out = next(n for n in gm.graph.nodes if n.op == "output")
        with gm.graph.inserting_before(out):
            step = gm.graph.call_function(aten.mul.Tensor, (rank, factor - 1.0))
            scale = gm.graph.call_function(aten.add.Tensor, (step, 1.0))
            logits = gm.graph.call_function(aten.mul.Tensor, (out.args[0][0], scale))
        out.args = ((logits,),)
        return 1


class WrongOnFastBranch(ScalingPass):
    """Scales the result of every GEMM dispatch's tiled branch (the ``cond``'s true branch,
    taken at >= 16 tokens); the GEMV branch of fewer tokens stays exact."""

    name = "wrong_on_fast_branch"

    def edit(self, gm: GraphModule, ctx: PassContext, factor: float) -> int:
        conds = [n for n in gm.graph.nodes if n.target is COND]
        for node in conds:
            branch = getattr(gm, node.args[1].target)  # true: tokens >= FAST_MIN_TOKENS
            out = next(n for n in branch.graph.nodes if n.op == "output")
            value = out.args[0][0]
            with branch.graph.inserting_before(out):
                scaled = branch.graph.call_function(aten.mul.Tensor, (value, factor))
            scaled.meta = dict(value.meta)  # the same shape and placement (branch values are not re-propagated)
            out.args = ((scaled,),)
            branch.recompile()
        return len(conds)


@pytest.fixture(scope="module")
def tiny_tp1() -> CapturedModel:
    return capture(PRESETS["tiny"], ParallelPlan(), torch.float32)


def _validate(captured: CapturedModel, graph_pass: type[ScalingPass], factor: float,
              validator: TranslationValidator, monkeypatch: pytest.MonkeyPatch) -> PipelineResult:
    """Register ``graph_pass`` for this test and run it alone, validated, with ``factor``
    on a copy of the captured programs."""
    monkeypatch.setitem(PASSES, graph_pass.name, graph_pass)  # removed again after the test
    register_pass(graph_pass)  # its declarations are checked
    options = PipelineOptions(target="cpu", enable=(graph_pass.name,), disable=default_pass_names(get_target("cpu")),
                              validate=True, pass_configs={graph_pass.name: {"factor": factor}})
    return run_pipeline(copy.deepcopy(captured.programs), captured.config, captured.plan, dict(captured.specs),
                        options, validator=validator)


def _caught(captured: CapturedModel, graph_pass: type[ScalingPass], validator: TranslationValidator,
            monkeypatch: pytest.MonkeyPatch) -> PassError:
    """The error that validation raises for ``graph_pass`` at ``WRONG``, after checking that
    the control (factor 1.0) validates every phase to zero error with the same edits."""
    control = _validate(captured, graph_pass, 1.0, validator, monkeypatch)
    assert [r.phase for r in control.records] == list(captured.programs)
    for record in control.records:
        assert record.result.matches > 0 and record.report.ok and record.report.max_error == 0.0, record
    with pytest.raises(PassError) as caught:
        _validate(captured, graph_pass, WRONG, validator, monkeypatch)
    report = caught.value.report
    assert str(caught.value) == (f"pass {graph_pass.name} changed the decode graph's numerics: max error "
                                 f"{report.max_error:.3e} ({report.worst} on rank {report.rank}) exceeds tolerance "
                                 "1.000e-04")
    assert report.max_error == report.errors[report.worst] and not report.ok
    return caught.value


def _kda_states(cfg: K3Config) -> set[int]:
    """Flat indices of the KDA recurrent states among the caches (the only 4-D ones)."""
    caches = flatten_caches(allocate_caches(cfg, ParallelPlan(), CacheShape(1, 1, 16), torch.float32, "meta"))
    return {i for i, t in enumerate(caches) if t.dim() == 4}


def test_a_corrupted_cache_write_is_caught_with_the_logits_unchanged(tiny_tp1, monkeypatch):
    """The logits of both steps are bit-identical; each KDA state is off by exactly 1%,
    every other cache not at all: validation compares every cache the step wrote."""
    error = _caught(tiny_tp1, CorruptKDAStateWrite, TranslationValidator(constants=tiny_tp1.constants), monkeypatch)
    states = _kda_states(tiny_tp1.config)
    assert len(states) == 4
    errors = error.report.errors
    for key, value in errors.items():
        tensor = key.partition("@")[0]
        if tensor.startswith("cache") and int(tensor.removeprefix("cache")) in states:
            assert value == pytest.approx(0.01, rel=1e-4), key
        else:
            assert value == 0.0, key
    assert errors["output0"] == errors["output0" + SECOND] == 0.0
    assert error.report.worst.partition("@")[0] in {f"cache{i}" for i in states} and error.report.rank == 0


def test_a_branch_wrong_only_at_16_tokens_or_more_is_caught_on_the_second_step(tiny_tp1, monkeypatch):
    """The first step (fewer than 16 tokens) takes the exact GEMV branch: none of its
    tensors differs. The second takes the scaled tiled branch: its logits and the caches
    written after the first KDA output projection are off."""
    assert VALIDATION_TOKENS[0] < FAST_MIN_TOKENS <= VALIDATION_TOKENS[1]
    error = _caught(tiny_tp1, WrongOnFastBranch, TranslationValidator(constants=tiny_tp1.constants), monkeypatch)
    errors = error.report.errors
    first = {k: v for k, v in errors.items() if "@" not in k}
    assert first and set(first.values()) == {0.0}
    assert error.report.worst.endswith(SECOND) and error.report.max_error > 1e-3
    assert 1e-3 < errors["output0" + SECOND] < 0.1  # four projections each 1% off, through the layers after them
    first_state = min(_kda_states(tiny_tp1.config))  # layer 0's, written before its output projection
    assert errors[f"cache{first_state}{SECOND}"] == 0.0


@pytest.mark.slow
def test_a_pass_wrong_only_on_rank_1_is_caught_on_gloo_ranks(monkeypatch, rank_pools):
    """At TP2 the programs run on two gloo ranks; the logits are off by 1% on rank 1 only
    and the report names that rank."""
    tp2 = capture(PRESETS["tiny"], ParallelPlan(tp=2, rank=0), torch.float32, phases=("decode",))
    error = _caught(tp2, WrongOnRank1, TranslationValidator(constants=tp2.constants, ranks=rank_pools), monkeypatch)
    errors = error.report.errors
    assert error.report.rank == 1 and error.report.worst in ("output0", "output0" + SECOND)
    assert errors["output0"] == pytest.approx(0.01, rel=1e-4)
    assert errors["output0" + SECOND] == pytest.approx(0.01, rel=1e-4)
    assert {v for k, v in errors.items() if k.startswith("cache")} == {0.0}
