"""The merge_glu_projections pass: an MLP's gate and up projections go into its SiTU-GLU
(k3.situ_and_mul_proj), so that the runtime runs them as one GEMM.

The tiny K3 is compiled with and without the pass (validated, both phases); the runtime's
tokens on the CPU (where the op runs the same linears) are the same, and its gate / up
weights are consecutive rows of one buffer. A projection with another reader is skipped
with the reason. The op goes through torch.library.opcheck."""

from __future__ import annotations


import pytest
import torch
from graph_edits import read_also, run_on_edited_copy
from k3compile.passes.merge_glu_projections import MergeGluProjections

from k3compile import runtime
from k3compile.compiler import CompileOptions
from k3compile.pipeline import count_ops
from k3compile.runtime.weight_layout import consecutive_rows, row_groups

k3 = torch.ops.k3
PROMPTS = [[5, 9, 100, 7, 3], [17, 4]]


@pytest.fixture(scope="module")
def compiled(model_dirs, compile_once, optimize_shared, tmp_path_factory):
    """(plain, merged) CompileResults of tiny in fp32 (target cpu: the pass enabled by name)."""
    plain = compile_once("tiny", dtype="float32")
    merged = optimize_shared(model_dirs("tiny"), tmp_path_factory.mktemp("glu") / "merged",
                             CompileOptions(dtype="float32", validate=True, enable=(MergeGluProjections.name,)))
    return plain, merged


def _mlps(result) -> int:
    """The dense MLP layers plus one shared expert per MoE layer."""
    return len(result.captured.config.layer_kinds)


def test_gate_and_up_go_into_the_activation_in_both_phases(compiled):
    plain, merged = compiled
    n = _mlps(merged)
    for record in (r for r in merged.pipeline.records if r.pass_name == MergeGluProjections.name):
        assert record.result.matches == n and not record.result.skipped, record.phase
        assert record.report.ok and record.report.max_error == 0.0  # the same linears, the same op
        assert record.result.stats["launches_removed"] == n
        ops = count_ops(merged.captured.programs[record.phase].graph_module)
        plain_ops = count_ops(plain.captured.programs[record.phase].graph_module)
        assert ops["k3.situ_and_mul_proj.default"] == n and not ops.get("k3.situ_and_mul.default")
        assert ops["aten.linear.default"] == plain_ops["aten.linear.default"] - 2 * n


def test_runtime_tokens_unchanged_and_weights_consecutive(compiled):
    plain, merged = compiled
    options = runtime.RuntimeOptions(max_sequences=len(PROMPTS), max_context=32, device="cpu")
    rt_plain, rt_merged = (runtime.load(r.out_dir, options=options) for r in (plain, merged))
    assert rt_merged.generate(PROMPTS, 6) == rt_plain.generate(PROMPTS, 6)
    groups = [g for g in row_groups(merged.captured.programs["decode"]) if g[0].endswith("gate_proj.weight")]
    assert len(groups) == _mlps(merged)
    for gate, up in groups:
        assert up == gate.replace("gate_proj", "up_proj")
        assert consecutive_rows([rt_merged.weights[gate], rt_merged.weights[up]]) is not None


def test_a_projection_with_another_reader_is_skipped(compiled):
    plain, _ = compiled

    def edit(gm):
        act = next(n for n in gm.graph.nodes if n.target is k3.situ_and_mul.default)
        read_also(gm, act.args[0], act)
        return act

    result, act = run_on_edited_copy(plain, MergeGluProjections(), edit)
    gate = act.args[0]
    assert result.matches == _mlps(plain) - 1
    (skipped,) = result.skipped
    assert skipped.node == act.name
    assert skipped.reason == f"gate's projection {gate.name} has other readers: it is computed anyway"


def test_op_schema_and_fake():
    g = torch.Generator().manual_seed(0)
    args = (torch.randn(3, 8, generator=g), torch.randn(16, 8, generator=g), torch.randn(16, 8, generator=g), 4.0, 25.0)
    torch.library.opcheck(k3.situ_and_mul_proj.default, args, test_utils=("test_schema", "test_faketensor"))
    x, wg, wu = args[:3]
    want = k3.situ_and_mul(torch.nn.functional.linear(x, wg), torch.nn.functional.linear(x, wu), 4.0, 25.0)
    assert torch.equal(k3.situ_and_mul_proj(*args), want)
