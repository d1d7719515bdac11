"""The merge_moe_input pass: a MoE layer's router (with its routing), latent down-projection
and shared-expert gate / up (with the SiTU-GLU) become one k3.moe_input_proj, so that the
runtime runs the four projections as one GEMM.

The tiny K3 is compiled with and without the pass (validated, both phases); the runtime's
tokens on the CPU (where the op runs the graph's ops) are the same, and the four weights are
consecutive rows of one buffer. Logits with another reader, and experts whose input is not
a linear, are skipped with the reason. The op goes through torch.library.opcheck. Its
kernels: tests/test_kernel_moe_input.py."""

from __future__ import annotations


import pytest
import torch
from graph_edits import read_also, run_on_edited_copy
from k3compile.passes.merge_glu_projections import MergeGluProjections
from k3compile.passes.merge_moe_input import MergeMoeInput

from k3compile import runtime
from k3compile.compiler import CompileOptions
from k3compile.pipeline import count_ops
from k3compile.runtime.weight_layout import consecutive_rows, row_groups

k3 = torch.ops.k3
PROMPTS = [[5, 9, 100, 7, 3], [17, 4]]
PASSES = (MergeGluProjections.name, MergeMoeInput.name)


@pytest.fixture(scope="module")
def compiled(model_dirs, compile_once, optimize_shared, tmp_path_factory):
    """(glu, merged) CompileResults of tiny in fp32 (target cpu: the passes enabled by name):
    merge_glu_projections alone, and with merge_moe_input."""
    out = tmp_path_factory.mktemp("moe_input")
    glu = optimize_shared(model_dirs("tiny"), out / "glu", CompileOptions(dtype="float32", enable=PASSES[:1]))
    merged = optimize_shared(model_dirs("tiny"), out / "merged",
                             CompileOptions(dtype="float32", validate=True, enable=PASSES))
    return glu, merged


def _moe_layers(result) -> int:
    cfg = result.captured.config
    return cfg.num_hidden_layers - cfg.first_k_dense_replace


def test_the_four_projections_go_into_one_op_in_both_phases(compiled):
    glu, merged = compiled
    n = _moe_layers(merged)
    assert n == 6
    records = [r for r in merged.pipeline.records if r.pass_name == MergeMoeInput.name]
    assert sorted(r.phase for r in records) == ["decode", "prefill"]
    for record in records:
        result = record.result
        assert result.matches == n and not result.skipped, record.phase
        assert record.report.ok and record.report.max_error == 0.0  # the graph's ops, in the op
        assert result.stats == {"launches_removed": 4 * n, "nodes_removed": 6 * n, "nodes_added": 5 * n}
        ops = count_ops(merged.captured.programs[record.phase].graph_module)
        before = count_ops(glu.captured.programs[record.phase].graph_module)
        assert ops["k3.moe_input_proj.default"] == n
        for op in ("k3.router_logits.default", "k3.sigmoid_topk_route.default"):
            assert before[op] == n and op not in ops, (record.phase, op)
        assert ops["k3.situ_and_mul_proj.default"] == before["k3.situ_and_mul_proj.default"] - n  # the dense MLP's stays
        assert ops["aten.linear.default"] == before["aten.linear.default"] - n


def test_runtime_tokens_unchanged_and_weights_consecutive(compiled):
    glu, merged = compiled
    options = runtime.RuntimeOptions(max_sequences=len(PROMPTS), max_context=32, device="cpu")
    rt_glu, rt_merged = (runtime.load(r.out_dir, options=options) for r in (glu, merged))
    assert rt_merged.generate(PROMPTS, 6) == rt_glu.generate(PROMPTS, 6)
    groups = [g for g in row_groups(merged.captured.programs["decode"]) if g[0].endswith("mlp.gate.weight")]
    assert len(groups) == _moe_layers(merged)
    for group in groups:
        layer = group[0].removesuffix("gate.weight")
        assert group == tuple(layer + s for s in ("gate.weight", "routed_expert_down_proj.weight",
                                                  "shared_experts.gate_proj.weight", "shared_experts.up_proj.weight"))
        assert consecutive_rows([rt_merged.weights[name] for name in group]) is not None


def _run_on_edited(glu, edit) -> tuple:
    """The pass on a copy of glu's decode program after ``edit(gm, the first experts node)``."""
    def edit_experts(gm):
        experts = next(n for n in gm.graph.nodes if n.target in (k3.moe_experts.default, k3.moe_experts_mxfp4.default))
        edit(gm, experts)
        return experts

    return run_on_edited_copy(glu, MergeMoeInput(), edit_experts)


def test_logits_with_another_reader_are_skipped(compiled):
    glu, _ = compiled

    def edit(gm, experts):
        route = experts.args[1].args[0]
        read_also(gm, route.args[0], experts)

    result, experts = _run_on_edited(glu, edit)
    assert result.matches == _moe_layers(glu) - 1
    (skipped,) = result.skipped
    logits = next(n for n in experts.graph.nodes if n.target is k3.router_logits.default)
    assert skipped.node == experts.name
    assert skipped.reason == f"the router logits {logits.name} have other readers: they are computed anyway"


def test_experts_whose_input_is_not_a_linear_are_skipped(compiled):
    glu, _ = compiled

    def edit(gm, experts):
        with gm.graph.inserting_before(experts):
            z = gm.graph.call_function(torch.ops.aten.neg.default, (experts.args[0],))
        z.meta["val"] = experts.args[0].meta["val"]
        experts.replace_input_with(experts.args[0], z)

    result, experts = _run_on_edited(glu, edit)
    assert result.matches == _moe_layers(glu) - 1
    (skipped,) = result.skipped
    assert skipped.reason == f"the experts' input {experts.args[0].name} is not a bias-free linear by a parameter"


def _op_args(dtype: torch.dtype = torch.float32) -> tuple:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 16, generator=g)
    weights = [torch.randn(n, 16, generator=g) * 0.3 for n in (8, 12, 20, 20)]  # router, down, gate, up
    bias = torch.randn(8, generator=g) * 0.1
    return (x.to(dtype), weights[0].to(dtype), bias, *(w.to(dtype) for w in weights[1:]), 2, True, 2.5, 4.0, 25.0)


def test_op_schema_fake_and_reference():
    args = _op_args()
    torch.library.opcheck(k3.moe_input_proj.default, args)
    x, wr, bias, wd, wg, wu, top_k, renorm, scaling, beta, lbeta = args
    want = (*k3.sigmoid_topk_route(k3.router_logits(x, wr), bias, top_k, renorm, scaling),
            torch.nn.functional.linear(x, wd), k3.situ_and_mul_proj(x, wg, wu, beta, lbeta))
    for got, ref in zip(k3.moe_input_proj(*args), want, strict=True):
        assert torch.equal(got, ref)
    bf16 = k3.moe_input_proj(*_op_args(torch.bfloat16))
    assert [t.dtype for t in bf16] == [torch.float32, torch.int64, torch.bfloat16, torch.bfloat16]
    assert [tuple(t.shape) for t in bf16] == [(3, 2), (3, 2), (3, 12), (3, 20)]
