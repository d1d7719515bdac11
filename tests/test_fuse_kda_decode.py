"""The fuse_kda_decode pass: each KDA layer's decode chain, with the seven projections it
reads, becomes one k3.kda_decode_fused_proj (k3.kda_decode_fused where a projection has
another reader).

The tiny K3 (4 KDA layers) is compiled with and without the pass: translation validation
of the decode graph, the ops left in both graphs, prefill untouched, and the runtime's
logits and greedy tokens on the CPU (where the fused op runs the same k3 ops, so they
match exactly). At TP2 the pass is validated on real gloo ranks. A hand-edited graph (an
intermediate with another user) is skipped with the reason. The op itself goes through
torch.library.opcheck (schema, mutations, fake)."""

from __future__ import annotations

import copy

import pytest
import torch
from graph_edits import read_also
from k3compile.passes.fuse_kda_decode import FuseKDADecode

from k3compile import runtime
from k3compile.compiler import CompileOptions
from k3compile.pipeline import PassContext, count_ops, lint_graph
from k3compile.targets import get_target

k3 = torch.ops.k3
aten = torch.ops.aten
FUSED = "k3.kda_decode_fused_proj.default"
REPLACED = ("k3.kda_decode.default", "k3.short_conv_decode.default", "k3.gated_rms_norm.default",
            "k3.kda_gate.default")
PROMPTS = [[5, 9, 100, 7, 3], [17, 4], [300]]
NEW_TOKENS = 8

@pytest.fixture(scope="module")
def compiled(model_dirs, compile_once, optimize_shared, tmp_path_factory):
    """(plain, fused) CompileResults of tiny in fp32 (target cpu, where the pass is not on by
    default); the fused one validated."""
    model_dir = model_dirs("tiny")
    root = tmp_path_factory.mktemp("fuse_kda")
    plain = compile_once("tiny", dtype="float32")
    fused = optimize_shared(model_dir, root / "fused", CompileOptions(dtype="float32", validate=True,
                                                                enable=(FuseKDADecode.name,)))
    return plain, fused


def _kda_layers(result) -> int:
    return sum(k == "kda" for k in result.captured.config.layer_kinds)


def test_decode_chain_is_fused_and_validated(compiled):
    plain, fused = compiled
    n = _kda_layers(fused)
    assert n == 4
    decode, prefill = (r for r in fused.pipeline.records if r.pass_name == FuseKDADecode.name)
    assert decode.phase == "decode" and prefill.phase == "prefill"
    assert decode.result.matches == n and not decode.result.skipped
    assert decode.report.ok and decode.report.max_error == 0.0  # the same ops, the same order of math
    # fp32: remove_noops already dropped beta's .float(), so 7 compute ops and 7 projections
    # (q, k, v, g, b, f_a, f_b) -> one GEMM over x, f_b's and the kernel per layer
    assert decode.result.stats["launches_removed"] == 11 * n
    assert decode.result.stats["nodes_added"] == n
    assert all("aten.linear x7, k3.short_conv_decode x3" in r.detail and "one GEMM over the six weights" in r.detail
               for r in decode.result.rewrites)

    ops = count_ops(fused.captured.programs["decode"].graph_module)
    assert ops.get(FUSED) == n
    assert not any(ops.get(name) for name in REPLACED)
    plain_ops = count_ops(plain.captured.programs["decode"].graph_module)
    assert plain_ops["k3.kda_decode.default"] == n
    assert ops["aten.linear.default"] == plain_ops["aten.linear.default"] - 7 * n
    # Inputs keep their symbolic sizes (a pass must not specialise e.g. the cache slot count).
    inputs = [[str(n.meta["val"].shape) for n in r.captured.programs["decode"].graph.nodes if n.op == "placeholder"]
              for r in (plain, fused)]
    assert inputs[0] == inputs[1]

    assert not prefill.result.changed and prefill.report is None
    assert prefill.result.skipped[0].reason.startswith("prefill:")
    assert count_ops(fused.captured.programs["prefill"].graph_module) == count_ops(
        plain.captured.programs["prefill"].graph_module)


def _run(out):
    rt = runtime.load(out, options=runtime.RuntimeOptions(max_sequences=len(PROMPTS), max_context=32, device="cpu"))
    seqs, logits = rt.prefill(PROMPTS)
    tokens = logits.argmax(-1).tolist()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step = rt.decode(seqs, tokens)
    fused_calls = sum(e.name == "k3::kda_decode_fused_proj" for e in prof.events())
    for seq in seqs:
        rt.release(seq)
    return step, fused_calls, rt.generate(PROMPTS, NEW_TOKENS), rt


def test_runtime_tokens_unchanged(compiled):
    plain, fused = compiled
    step_plain, calls_plain, tokens_plain, _ = _run(plain.out_dir)
    step_fused, calls_fused, tokens_fused, rt = _run(fused.out_dir)
    assert (calls_plain, calls_fused) == (0, _kda_layers(fused))  # one fused op per KDA layer per step
    torch.testing.assert_close(step_fused, step_plain, rtol=0, atol=1e-6)
    assert tokens_fused == tokens_plain
    # The runtime laid each layer's six weights that read x out as consecutive rows of one
    # buffer padded with zero rows to a multiple of ROW_ALIGN (tiny: 4 x 64 + 16 (f_a) + 4
    # heads -> 320), and the prefill program reads the same tensors.
    from k3compile.runtime.memory_budget import weight_bytes
    from k3compile.runtime.weight_layout import ROW_ALIGN, column_blocks, consecutive_rows, row_groups

    groups = row_groups(fused.captured.programs["decode"])
    assert len(groups) == _kda_layers(fused)
    for group in groups:
        assert [name.rsplit(".", 2)[-2] for name in group] == ["q_proj", "k_proj", "v_proj", "g_proj", "f_a_proj",
                                                                "b_proj"]
        weights = [rt.weights[name] for name in group]
        rows = consecutive_rows(weights)
        real = sum(w.shape[0] for w in weights)
        assert real == 276 and rows is not None and rows.shape[0] == 320 == -(-real // ROW_ALIGN) * ROW_ALIGN
        assert torch.equal(rows[:real], torch.cat(weights)) and not rows[real:].any()
        blocks = column_blocks(torch.eye(320), weights)
        assert [b.shape[1] for b in blocks] == [w.shape[0] for w in weights]
        assert torch.equal(blocks[-1], torch.eye(320)[:, 272:276])
        prefill = rt.graph_modules["prefill"].get_parameter(group[0])
        assert prefill.data_ptr() == rt.weights[group[0]].data_ptr()
    program = fused.captured.programs["decode"]
    params = [s.target for s in program.graph_signature.input_specs if s.kind.name == "PARAMETER"]
    padding = len(groups) * 44 * fused.captured.config.hidden_size * 4  # fp32 zero rows: the budget counts them
    assert weight_bytes(program) == sum(program.state_dict[name].numel() * 4 for name in params) + padding


def test_intermediate_with_another_user_is_skipped(compiled):
    plain, _ = compiled
    program = copy.deepcopy(plain.captured.programs["decode"])
    gm = program.graph_module
    gate = next(n for n in gm.graph.nodes if n.target is k3.kda_gate.default)
    norm = next(n for n in gm.graph.nodes if n.target is k3.gated_rms_norm.default)
    mean = read_also(gm, gate, norm)  # layer 0's output also reads the decay gate: y + mean(g)
    lint_graph(gm)

    cfg = plain.captured.config
    ctx = PassContext(cfg, plain.captured.plan, get_target("cpu"), "decode", program, plain.captured.specs)
    result = FuseKDADecode().run(gm, ctx)
    lint_graph(gm)
    assert result.matches == _kda_layers(plain) - 1
    (skipped,) = result.skipped
    assert skipped.node == "kda_decode"
    assert skipped.reason == f"g: {gate.name} has other users ({mean.name}): it would be computed anyway"
    assert gate in mean.args  # left alone
    assert count_ops(gm)["k3.kda_decode.default"] == 1


def test_a_projection_with_another_reader_keeps_the_projections_outside(compiled):
    """Layer 0's q projection also feeds the output: its chain still fuses, into
    k3.kda_decode_fused reading the five projections (they are computed anyway)."""
    plain, _ = compiled
    program = copy.deepcopy(plain.captured.programs["decode"])
    gm = program.graph_module
    norm = next(n for n in gm.graph.nodes if n.target is k3.gated_rms_norm.default)
    conv = next(n for n in gm.graph.nodes if n.target is k3.short_conv_decode.default)
    q = conv.args[0]
    mean = read_also(gm, q, norm)
    ctx = PassContext(plain.captured.config, plain.captured.plan, get_target("cpu"), "decode", program,
                      plain.captured.specs)
    result = FuseKDADecode().run(gm, ctx)
    lint_graph(gm)
    n = _kda_layers(plain)
    assert result.matches == n and not result.skipped
    ops = count_ops(gm)
    assert (ops["k3.kda_decode_fused.default"], ops[FUSED]) == (1, n - 1)
    assert q in mean.args and q.target is aten.linear.default


def test_op_schema_and_fake():
    """opcheck: the declared mutations are the real ones, the fake matches the reference."""
    B, S, H, D, DV, K = 3, 5, 2, 8, 16, 4
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g)

    args = (
        r(B, H * D), r(B, H * D), r(B, H * DV), r(H * D, K), r(H * D, K), r(H * DV, K),
        r(S, H * D, K - 1), r(S, H * D, K - 1), r(S, H * DV, K - 1),
        r(B, H * D), r(H), r(H * D), -5.0, r(B, H), r(S, H, D, DV), torch.tensor([4, 0, 2]),
        D**-0.5, r(B, H * DV), r(DV), 1e-5,
    )
    torch.library.opcheck(k3.kda_decode_fused.default, args, test_utils=("test_schema", "test_faketensor"))
    out = k3.kda_decode_fused(*copy.deepcopy(args))
    assert out.shape == (B, H, DV) and out.dtype == torch.float32
    # the proj variant: x [B, 8] and the q, k, v, g, b and f_a, f_b weights instead of the
    # projections and the forget gate's input a
    x = r(B, 8)
    weights = (r(H * D, 8), r(H * D, 8), r(H * DV, 8), r(H * DV, 8), r(H, 8), r(6, 8), r(H * D, 6))
    rest = [a for i, a in enumerate(args) if i not in (0, 1, 2, 9, 13, 17)]
    proj_args = (x, *weights, *rest)
    torch.library.opcheck(k3.kda_decode_fused_proj.default, proj_args, test_utils=("test_schema", "test_faketensor"))
    q, k, v, g, b, f_a = (torch.nn.functional.linear(x, w) for w in weights[:6])
    unfused = list(copy.deepcopy(args))
    unfused[0:3], unfused[9], unfused[13], unfused[17] = (q, k, v), torch.nn.functional.linear(f_a, weights[6]), b, g
    want = k3.kda_decode_fused(*unfused)
    assert torch.equal(k3.kda_decode_fused_proj(*copy.deepcopy(proj_args)), want)


@pytest.mark.slow
def test_fused_at_tp2_validates_on_gloo_ranks(model_dirs, tmp_path, optimize_shared):
    result = optimize_shared(model_dirs("tiny"), tmp_path / "tp2", CompileOptions(
        tp=2, dtype="float32", validate=True, enable=(FuseKDADecode.name,)))
    decode = next(r for r in result.pipeline.records if r.pass_name == FuseKDADecode.name)
    assert decode.result.matches == _kda_layers(result)
    assert decode.report.ok and decode.report.max_error == 0.0  # on 2 gloo ranks
    fused = next(n for n in result.captured.programs["decode"].graph.nodes
                 if n.target is k3.kda_decode_fused_proj.default)
    assert str(fused.meta["placement"]) == "S(1)"  # the heads, as kda_decode's output
