"""Passes may reshard parameters: the loader, the validator across ranks and the runtime
follow the new specs. Exercised with a test pass that computes the MoE up-projection's
rows per rank and all-gathers them (correct, though it adds a collective)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.fx import GraphModule

from k3compile import runtime
from k3compile.batch import CacheShape
from k3compile.compiler import CompileOptions
from k3compile.pipeline import GraphPass, PassContext, PassResult, reshard_parameter
from k3compile.reference import ReferenceEngine, load_reference

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
PROMPTS = [[5, 9, 100, 7, 3], [17, 4]]


class GatherUpProjectionRows(GraphPass):
    """linear(y, W_up) -> all_gather(linear(y, W_up[rank rows])) laid out along the last dim."""

    name = "gather_up_projection_rows"

    def run(self, gm: GraphModule, ctx: PassContext) -> PassResult:
        result = PassResult(changed=False)
        tp = ctx.plan.tp
        weights = {s.arg.name: s.target for s in ctx.program.graph_signature.input_specs
                   if s.target and s.target.endswith("routed_expert_up_proj.weight")}
        for node in list(gm.graph.nodes):
            if node.target is not aten.linear.default or node.args[1].name not in weights:
                continue
            name = weights[node.args[1].name]
            reshard_parameter(ctx, name, dataclasses.replace(ctx.specs[name], dim=0))
            users = list(node.users)
            with gm.graph.inserting_after(node):
                gathered = gm.graph.call_function(c10d.all_gather_into_tensor.default, (node, tp, "0"))
            with gm.graph.inserting_after(gathered):
                waited = gm.graph.call_function(c10d.wait_tensor.default, (gathered,))
            with gm.graph.inserting_after(waited):
                ranks = gm.graph.call_function(aten.unflatten.int, (waited, 0, [tp, -1]))
            with gm.graph.inserting_after(ranks):
                moved = gm.graph.call_function(aten.movedim.int, (ranks, 0, 1))
            with gm.graph.inserting_after(moved):
                full = gm.graph.call_function(aten.flatten.using_ints, (moved, 1, 2))
            for user in users:
                user.replace_input_with(node, full)
            result.matches += 1
        result.changed = result.matches > 0
        return result


@pytest.fixture
def with_test_pass(monkeypatch):
    import k3compile.passes as passes

    monkeypatch.setitem(passes.ALL_PASSES, GatherUpProjectionRows.name, GatherUpProjectionRows)


def _rank_logits(rank: int, world: int, out):
    torch.set_num_threads(1)
    rt = runtime.load(out, rank=rank, world_size=world, options=runtime.RuntimeOptions(max_sequences=2, max_context=32))
    _, logits = rt.prefill(PROMPTS)
    weight = next(v for k, v in rt.weights.items() if k.endswith("layers.1.mlp.routed_expert_up_proj.weight"))
    return logits, weight.shape[0], rt.load_report.bytes_read


@pytest.mark.slow
def test_resharded_parameter_validates_loads_and_runs_at_tp2(model_dirs, tmp_path, with_test_pass, rank_pools,
                                                             optimize_shared):
    model_dir = model_dirs("tiny")
    out = tmp_path / "resharded"
    # Only the test pass: the dedup pass would already have split the same weight.
    only = ("remove_noops", "mxfp4_experts", "dedup_replicated_linear", "sink_copies")
    result = optimize_shared(model_dir, out, CompileOptions(tp=2, dtype="float32", validate=True,
                                                            enable=("gather_up_projection_rows",), disable=only))
    records = [r for r in result.pipeline.records if r.pass_name == "gather_up_projection_rows"]
    cfg = result.captured.config
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    assert [r.result.matches for r in records] == [moe_layers, moe_layers]
    assert all(r.report is not None and r.report.max_error < 1e-6 for r in records)  # checked on 2 gloo ranks
    plain = tmp_path / "plain"
    optimize_shared(model_dir, plain, CompileOptions(tp=2, dtype="float32", disable=only))

    reference = ReferenceEngine(load_reference(model_dir), CacheShape(4, 16, 16)).prefill(PROMPTS)[1]
    ranks = rank_pools.get(2)
    resharded, baseline = ranks.run(_rank_logits, out), ranks.run(_rank_logits, plain)
    for (logits, rows, read), (_, full_rows, base_read) in zip(resharded, baseline):
        torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-4 * reference.abs().max().item())
        assert rows * 2 == full_rows == cfg.hidden_size  # each rank holds half of the rows...
        up_bytes = moe_layers * cfg.hidden_size * cfg.routed_expert_hidden_size * 2  # bf16 in the checkpoint
        assert base_read - read == up_bytes // 2  # ...and reads only them from the checkpoint
