"""The sink_copies pass: copies made for one branch of a torch.cond move into it.

Toy programs pin down each rule (moved, deleted, read by both, used outside, nested);
the tiny K3 checks the real case (the staged GEMM dispatch of the KDA output projection)
with translation validation on both predicate outcomes, and counts the copy kernels of
a decode step with torch.profiler before and after."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.export import Dim

from k3compile import runtime
from k3compile.compiler import CompileOptions
from k3compile.passes.sink_copies import COND, SinkCopies, copies_confined_to_one_branch

aten = torch.ops.aten


def _export(module: torch.nn.Module, rows: int = 5):
    t = Dim("t", min=1, max=1024)
    return torch.export.export(module, (torch.randn(rows, 4),), dynamic_shapes=({0: t},), strict=False)


def _run_pass(program):
    result = SinkCopies().run(program.graph_module, None)
    program.graph_module.graph.lint()
    program.graph_module.recompile()
    return result


class Staged(torch.nn.Module):
    """Fast path reads a padded staging copy; the fallback reads x."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 4))

    def forward(self, x):
        T = x.shape[0]
        staged = torch.slice_scatter(x.new_zeros(T + (-T) % 16, 4), x, 0, 0, T)
        fast = lambda s, x, w: F.linear(s, w)[: x.shape[0]]  # noqa: E731
        slow = lambda s, x, w: F.linear(x, w)  # noqa: E731
        return torch.cond(T >= 16, fast, slow, (staged, x, self.w))


def test_moves_a_staging_copy_into_the_branch_that_reads_it():
    program = _export(Staged())
    before = copy.deepcopy(program).module()  # branch modules are shared, not copied, by module()
    result = _run_pass(program)
    # the fallback spares the staging buffer's allocation and the copy into it
    assert result.stats == {"launches_removed_if_false": 2, "bytes_removed_if_false": 800, "copies_moved": 1}
    assert "moved into the true branch" in result.rewrites[0].detail
    top = [n.target for n in program.graph.nodes]
    assert aten.slice_scatter.default not in top and aten.new_zeros.default not in top
    inner = [n.target for n in program.graph_module.true_graph_0.graph.nodes]
    assert aten.slice_scatter.default in inner and aten.new_zeros.default in inner
    assert copies_confined_to_one_branch(program.graph_module) == []
    after = program.module()
    for rows in (5, 20):  # both predicate outcomes
        x = torch.randn(rows, 4)
        torch.testing.assert_close(after(x), before(x), rtol=0, atol=0)


def test_deletes_a_copy_no_branch_reads():
    """As after a pass that made the fast path read x directly: the copy is dead."""
    program = _export(Staged())
    true_graph = program.graph_module.true_graph_0
    cond = program.graph.find_nodes(op="call_function", target=COND)[0]
    names = [a.name for a in cond.args[3]]  # export orders the operands its own way
    inputs = [n for n in true_graph.graph.nodes if n.op == "placeholder"]
    inputs[names.index("slice_scatter")].replace_all_uses_with(inputs[names.index("x")])
    true_graph.recompile()
    result = _run_pass(program)
    assert result.stats["copies_deleted"] == 1 and "copies_moved" not in result.stats
    assert result.stats["launches_removed_if_true"] == result.stats["launches_removed_if_false"] == 2
    assert len(program.graph_module.graph.find_nodes(op="call_function", target=COND)[0].args[3]) == 2


class SharedCopies(torch.nn.Module):
    def forward(self, x):
        both = x.clone()
        outside = x.clone()
        fn = lambda b, o: b + o  # noqa: E731
        y = torch.cond(x.shape[0] >= 16, fn, lambda b, o: b - o, (both, outside))
        return y + outside


def test_leaves_copies_read_by_both_branches_or_used_outside():
    program = _export(SharedCopies())
    result = _run_pass(program)
    assert not result.matches
    reasons = sorted(s.reason for s in result.skipped)
    assert len(reasons) == 2
    assert reasons[0].startswith("also used outside the cond (add")
    assert reasons[1].startswith("read by both branches")


class Nested(torch.nn.Module):
    def forward(self, x):
        copy = x.clone()

        def outer_true(c, x):
            return torch.cond(x.shape[0] >= 32, lambda c, x: c * 2, lambda c, x: x * 3, (c, x))

        return torch.cond(x.shape[0] >= 16, outer_true, lambda c, x: x + 1, (copy, x))


def test_nested_conds_sink_to_the_innermost_reader():
    program = _export(Nested())
    before = copy.deepcopy(program).module()  # branch modules are shared, not copied, by module()
    result = _run_pass(program)
    assert result.stats["copies_moved"] == 2  # into the outer true branch, then its inner true branch
    outer = program.graph_module.true_graph_0
    inner = next(getattr(outer, n.args[1].target) for n in outer.graph.nodes if n.target is COND)
    assert aten.clone.default not in [n.target for n in outer.graph.nodes]
    assert aten.clone.default in [n.target for n in inner.graph.nodes]
    after = program.module()
    for rows in (5, 20, 40):
        x = torch.randn(rows, 4)
        torch.testing.assert_close(after(x), before(x), rtol=0, atol=0)


def _copy_kernels(rt: runtime.Runtime, batch: int) -> tuple[int, list[int]]:
    """Copy ops (staging allocation + copy) run by one decode step of ``batch`` new
    sequences, and its tokens (the sequences are released after)."""
    prompts = [[5 + i, 9, 100] for i in range(batch)]
    seqs, logits = rt.prefill(prompts)
    tokens = logits.argmax(-1).tolist()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step = rt.decode(seqs, tokens)
    for seq in seqs:
        rt.release(seq)
    names = [e.name for e in prof.events()]
    return sum(n in ("aten::new_zeros", "aten::slice_scatter") for n in names), step.argmax(-1).tolist()


@pytest.mark.slow
def test_tiny_k3_decode_step_loses_its_staging_copies(model_dirs, compile_once, optimize_shared, tmp_path):
    model_dir = model_dirs("tiny")
    plain = tmp_path / "plain"
    optimize_shared(model_dir, plain, CompileOptions(dtype="float32", disable=("sink_copies",)))
    result = compile_once("tiny", dtype="float32")  # validated: both outcomes
    records = [r for r in result.pipeline.records if r.pass_name == "sink_copies"]
    kda_layers = sum(k == "kda" for k in result.captured.config.layer_kinds)
    assert [r.result.stats["copies_moved"] for r in records] == [kda_layers] * 2
    assert all(r.report.ok and {"output0", "output0@17"} <= set(r.report.errors) for r in records)
    for program in result.captured.programs.values():
        assert copies_confined_to_one_branch(program.graph_module) == []
        assert sum(n.target is COND for n in program.graph.nodes) == kda_layers

    options = runtime.RuntimeOptions(max_sequences=17, max_context=32)
    before, after = runtime.load(plain, options=options), runtime.load(result.out_dir, options=options)
    for batch in (2, 17):  # the fallback (GEMV) and the fast path
        copies_before, tokens_before = _copy_kernels(before, batch)
        copies_after, tokens_after = _copy_kernels(after, batch)
        assert tokens_after == tokens_before
        assert copies_before == 2 * kda_layers  # new_zeros + slice_scatter per KDA layer
        assert copies_after == (0 if batch < 16 else 2 * kda_layers)
