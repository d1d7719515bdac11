"""The dedup pass: rank r computes its rows of the replicated routed-expert up-projection
and adds them into the shared-expert partial before the existing all-reduce.

Checked end to end at TP2 and TP4 on real gloo ranks: translation validation in the
pipeline, then the runtime on the optimized and on the unoptimized artifact (same
logits, same greedy tokens), the collectives in the graphs, each rank's parameter rows
and the checkpoint bytes it reads."""

from __future__ import annotations

import pytest
import torch

from k3compile import runtime
from k3compile.artifact import load_artifact
from k3compile.capture import capture
from k3compile.compiler import CompileOptions
from k3compile.config import get_preset
from k3compile.passes.dedup_replicated_linear import DedupReplicatedLinear
from k3compile.pipeline import PassContext
from k3compile.placement import propagate_placements
from k3compile.sharding import ParallelPlan
from k3compile.targets import get_target

PROMPTS = [[5, 9, 100, 7, 3, 44, 21], [17, 4], [300]]
NEW_TOKENS = 16
UP_PROJ = "routed_expert_up_proj.weight"


def _collectives(program) -> int:
    return sum(1 for n in program.graph.nodes if str(n.target).startswith("_c10d_functional.all_"))


def _rank_run(rank: int, world: int, out):
    torch.set_num_threads(1)
    rt = runtime.load(out, rank=rank, world_size=world, options=runtime.RuntimeOptions(max_sequences=3, max_context=32))
    _, logits = rt.prefill(PROMPTS)
    for seq in range(len(PROMPTS)):
        rt.release(seq)
    tokens = rt.generate(PROMPTS, NEW_TOKENS)
    rows = {k: v.shape[0] for k, v in rt.weights.items() if k.endswith(UP_PROJ)}
    return logits, tokens, rows, rt.load_report.bytes_read


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, pytest.param(4, marks=pytest.mark.sweep)])
def test_dedup_matches_unoptimized_on_gloo_ranks(model_dirs, tmp_path, tp, rank_pools, optimize_shared):
    model_dir = model_dirs("tiny", "mxfp4")
    plain, deduped = tmp_path / "plain", tmp_path / "dedup"
    others = ("remove_noops", "mxfp4_experts", "sink_copies")
    optimize_shared(model_dir, plain, CompileOptions(tp=tp, dtype="float32",
                                                     disable=(*others, "dedup_replicated_linear")))
    result = optimize_shared(model_dir, deduped, CompileOptions(tp=tp, dtype="float32", validate=True, disable=others))

    cfg = result.captured.config
    moe_layers = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
    records = [r for r in result.pipeline.records if r.pass_name == "dedup_replicated_linear"]
    assert [r.result.matches for r in records] == [len(moe_layers)] * 2  # decode and prefill
    assert all(r.report.ok and r.report.max_error < 1e-5 for r in records)  # validated on tp gloo ranks
    N, K = cfg.hidden_size, cfg.routed_expert_hidden_size
    assert records[0].result.stats["weight_bytes_removed"] == len(moe_layers) * N * K * 4 * (tp - 1) // tp
    assert records[0].result.stats["flops_removed_per_token"] == len(moe_layers) * 2 * N * K * (tp - 1) // tp

    before, after = load_artifact(plain), load_artifact(deduped)
    for phase in ("decode", "prefill"):  # no collective added
        assert _collectives(after.programs[phase]) == _collectives(before.programs[phase])
    # no bias and nothing between the up-projection and the add: the rows GEMV and the add
    # are one op, and no separate add_rank_block remains
    targets = [str(n.target) for n in after.programs["decode"].graph.nodes]
    assert targets.count("k3.add_rank_block_linear.default") == len(moe_layers)
    assert sum(1 for t in targets if "add_rank_block" in t) == len(moe_layers)

    ranks = rank_pools.get(tp)
    base, opt = ranks.run(_rank_run, plain), ranks.run(_rank_run, deduped)
    for (logits_b, tokens_b, rows_b, read_b), (logits_o, tokens_o, rows_o, read_o) in zip(base, opt):
        torch.testing.assert_close(logits_o, logits_b, rtol=1e-5, atol=1e-5 * logits_b.abs().max().item())
        assert tokens_o == tokens_b and all(len(t) == NEW_TOKENS for t in tokens_o)
        assert len(rows_o) == len(moe_layers)
        assert set(rows_b.values()) == {N} and set(rows_o.values()) == {N // tp}
        # bf16 up-projections in the checkpoint: (tp-1)/tp of them is never read
        assert read_b - read_o == len(moe_layers) * N * K * 2 * (tp - 1) // tp


def _tp2_decode_context():
    cfg = get_preset("tiny")
    captured = capture(cfg, ParallelPlan(2, 0), torch.float32, phases=("decode",))
    program = captured.programs["decode"]
    propagate_placements(program.graph_module, program, captured.specs, captured.plan)
    ctx = PassContext(cfg, captured.plan, get_target("cpu"), "decode", program, captured.specs, captured.constants)
    return captured, program, ctx


def test_dedup_reports_why_it_skips():
    captured, program, ctx = _tp2_decode_context()
    result = DedupReplicatedLinear().run(program.graph_module, ctx)
    reasons = {s.reason for s in result.skipped}
    # The latent down-projection feeds the experts: not a sum with an all-reduced partial.
    # (The router is k3.router_logits, not a linear: no candidate.)
    assert any("k3.moe_experts" in r and "new collective" in r for r in reasons)
    assert result.matches == 6 and all("-> 32 rows per rank" in r.detail for r in result.rewrites)
    assert all("k3.add_rank_block_linear" in r.detail for r in result.rewrites)
    targets = [n.target for n in program.graph.nodes]
    assert targets.count(torch.ops.k3.add_rank_block_linear.default) == 6
    assert torch.ops.k3.add_rank_block.default not in targets
    # The per-rank row offset is a buffer, filled per rank (never baked into the graph).
    starts = {k: v for k, v in captured.constants.items() if k.endswith("row_start")}
    assert len(starts) == 6 and {v.value(ParallelPlan(2, 1)) for v in starts.values()} == {32}


def test_dedup_skips_rows_that_do_not_divide_and_tp1():
    captured, program, ctx = _tp2_decode_context()
    params = {s.arg.name: s.target for s in program.graph_signature.input_specs if s.target}
    up = next(n for n in program.graph.nodes if n.target is torch.ops.aten.linear.default
              and params.get(n.args[1].name, "").endswith(UP_PROJ))
    match, reason = DedupReplicatedLinear()._match(up, params, tp=3)
    assert match is None and reason == "64 output rows do not divide by tp=3"
    weight = up.args[1].name  # a weight the graph computes (e.g. a cast) is no parameter to slice
    match, reason = DedupReplicatedLinear()._match(up, {k: v for k, v in params.items() if k != weight}, tp=2)
    assert match is None and reason == f"{weight} is computed in the graph, not a parameter the loader can slice by rows"

    cfg = get_preset("tiny")
    tp1 = capture(cfg, ParallelPlan(), torch.float32, phases=("decode",))
    p1 = tp1.programs["decode"]
    propagate_placements(p1.graph_module, p1, tp1.specs, tp1.plan)
    ctx1 = PassContext(cfg, tp1.plan, get_target("cpu"), "decode", p1, tp1.specs, tp1.constants)
    result = DedupReplicatedLinear().run(p1.graph_module, ctx1)
    assert not result.changed and result.skipped[0].reason.startswith("tp=1")
