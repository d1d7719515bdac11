"""The merge_mla_projections pass: an MLA layer's q_a, kv_a and g projections and their
consumers (the two RMSNorms, the latent / k_pe slices and their cat, the gate's sigmoid)
become one k3.mla_input_proj, so that the runtime runs the projections as one GEMM.

The tiny K3 is compiled with and without the pass (validated, both phases); the runtime's
tokens on the CPU (where the op runs the graph's ops) are the same, and its q_a / kv_a / g
weights are consecutive rows of one buffer. A projection or intermediate with another
reader, and a layer without a sigmoid gate, are skipped with the reason. The op goes through
torch.library.opcheck. Its kernel: tests/test_kernel_mla_input_proj.py."""

from __future__ import annotations


import pytest
import torch
from graph_edits import read_also, run_on_edited_copy
from k3compile.passes.merge_mla_projections import MergeMlaProjections

from k3compile import runtime
from k3compile.compiler import CompileOptions
from k3compile.pipeline import count_ops
from k3compile.runtime.weight_layout import consecutive_rows, row_groups

k3 = torch.ops.k3
aten = torch.ops.aten
PROMPTS = [[5, 9, 100, 7, 3], [17, 4]]


@pytest.fixture(scope="module")
def compiled(model_dirs, compile_once, optimize_shared, tmp_path_factory):
    """(plain, merged) CompileResults of tiny in fp32 (target cpu: the pass enabled by name)."""
    plain = compile_once("tiny", dtype="float32")
    merged = optimize_shared(model_dirs("tiny"), tmp_path_factory.mktemp("mla_proj") / "merged",
                             CompileOptions(dtype="float32", validate=True, enable=(MergeMlaProjections.name,)))
    return plain, merged


def _mla_layers(result) -> int:
    return result.captured.config.layer_kinds.count("mla")


def test_projections_go_into_one_op_in_both_phases(compiled):
    plain, merged = compiled
    n = _mla_layers(merged)
    assert n == 3
    records = [r for r in merged.pipeline.records if r.pass_name == MergeMlaProjections.name]
    assert sorted(r.phase for r in records) == ["decode", "prefill"]
    for record in records:
        result = record.result
        assert result.matches == n and not result.skipped, record.phase
        assert record.report.ok and record.report.max_error == 0.0  # the graph's ops, in the op
        assert result.stats == {"launches_removed": 4 * n, "nodes_removed": 9 * n, "nodes_added": 4 * n}
        ops = count_ops(merged.captured.programs[record.phase].graph_module)
        before = count_ops(plain.captured.programs[record.phase].graph_module)
        assert ops["k3.mla_input_proj.default"] == n and "k3.mla_input_proj.default" not in before
        for op, fewer in (("aten.linear.default", 3), ("k3.rms_norm.default", 2), ("aten.cat.default", 1),
                          ("aten.sigmoid.default", 1), ("aten.slice.Tensor", 2)):
            assert ops.get(op, 0) == before[op] - fewer * n, (record.phase, op)


def test_runtime_tokens_unchanged_and_weights_consecutive(compiled):
    plain, merged = compiled
    options = runtime.RuntimeOptions(max_sequences=len(PROMPTS), max_context=32, device="cpu")
    rt_plain, rt_merged = (runtime.load(r.out_dir, options=options) for r in (plain, merged))
    assert rt_merged.generate(PROMPTS, 6) == rt_plain.generate(PROMPTS, 6)
    groups = [g for g in row_groups(merged.captured.programs["decode"]) if g[0].endswith("q_a_proj.weight")]
    assert len(groups) == _mla_layers(merged)
    for q_a, kv_a, g in groups:
        assert (kv_a, g) == (q_a.replace("q_a_proj", "kv_a_proj_with_mqa"), q_a.replace("q_a_proj", "g_proj"))
        assert consecutive_rows([rt_merged.weights[name] for name in (q_a, kv_a, g)]) is not None


def _layer(gm) -> dict[str, torch.fx.Node]:
    """The first MLA layer's nodes by role (from its cached-latent cat)."""
    cat = next(n for n in gm.graph.nodes if n.target is aten.cat.default
               and n.args[0][0].target is k3.rms_norm.default)
    norm, k_pe = cat.args[0]
    latent = norm.args[0]
    x = latent.args[0].args[0]
    linears = [u for u in x.users if u.target is aten.linear.default]
    q = next(u for u in linears if next(iter(u.users)).target is k3.rms_norm.default)
    g = next(u for u in linears if next(iter(u.users)).target is aten.sigmoid.default)
    return {"cat": cat, "q_proj": q, "q_out": next(iter(q.users)), "kv_proj": latent.args[0], "latent": latent,
            "k_pe": k_pe, "gate_proj": g, "gate_out": next(iter(g.users))}


def _run_on_edited(plain, edit) -> tuple:
    """The pass on a copy of plain's decode program after ``edit(gm, nodes of the first MLA layer)``."""
    def edit_layer(gm):
        nodes = _layer(gm)
        edit(gm, nodes)
        return nodes

    return run_on_edited_copy(plain, MergeMlaProjections(), edit_layer)


@pytest.mark.parametrize(("role", "output"), [("q_proj", "q_out"), ("kv_proj", "cat"), ("latent", "cat"),
                                              ("gate_proj", "gate_out")])
def test_a_projection_or_intermediate_with_another_reader_is_skipped(compiled, role, output):
    plain, _ = compiled
    result, nodes = _run_on_edited(plain, lambda gm, nodes: read_also(gm, nodes[role], nodes[output]))
    assert result.matches == _mla_layers(plain) - 1
    (skipped,) = result.skipped
    assert skipped.node == nodes["cat"].name
    assert skipped.reason == f"{role} {nodes[role].name} has other readers: it is computed anyway"


def test_a_layer_without_a_sigmoid_gate_is_skipped(compiled):
    plain, _ = compiled

    def ungate(gm, nodes):
        nodes["gate_out"].target = aten.tanh.default  # the same graph, another gate nonlinearity

    result, nodes = _run_on_edited(plain, ungate)
    assert result.matches == _mla_layers(plain) - 1
    (skipped,) = result.skipped
    x = nodes["kv_proj"].args[0]
    assert skipped.reason == f"no linear of {x.name} by a parameter feeding a aten::sigmoid (gate)"


def _op_args(dtype: torch.dtype = torch.float32) -> tuple:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 16, generator=g)
    weights = [torch.randn(n, 16, generator=g) * 0.3 for n in (8, 12, 20)]  # q_a, kv_a (L 8 + R 4), g
    norms = [torch.rand(n, generator=g) + 0.5 for n in (8, 8)]
    return (*(t.to(dtype) for t in (x, *weights, *norms)), 1e-6, 1e-5, 8)


def test_op_schema_fake_and_reference():
    args = _op_args()
    torch.library.opcheck(k3.mla_input_proj.default, args)
    x, wq, wkv, wg, nq, nkv, q_eps, kv_eps, L = args
    c = torch.nn.functional.linear(x, wkv)
    want = (k3.rms_norm(torch.nn.functional.linear(x, wq), nq, q_eps),
            torch.cat([k3.rms_norm(c[:, :L], nkv, kv_eps), c[:, L:]], -1),
            torch.sigmoid(torch.nn.functional.linear(x, wg)))
    for got, ref in zip(k3.mla_input_proj(*args), want, strict=True):
        assert torch.equal(got, ref)
    bf16 = k3.mla_input_proj(*_op_args(torch.bfloat16))
    assert [t.dtype for t in bf16] == [torch.bfloat16] * 3 and [t.shape[1] for t in bf16] == [8, 12, 20]
