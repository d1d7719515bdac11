"""The fuse_attn_res_norm pass: each AttnRes mix and the RMSNorm that reads it become one
k3.attn_res_mix_norm.

The tiny K3 (7 layers) is compiled in fp32 with and without the pass: translation
validation of both phases (exact: on the CPU the fused op runs the same two ops), the ops
left (the final mix's norm moved before its row selection), and the runtime's logits and
greedy tokens.
A hand-edited graph (a mix with a second user) is skipped with the reason. The op goes
through torch.library.opcheck. Its Triton kernel: tests/test_kernel_attn_res.py, and end
to end under the interpreter in tests/test_triton_cpu.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
from k3compile.passes.fuse_attn_res_norm import FuseAttnResNorm

from k3compile import runtime
from k3compile.compiler import CompileOptions
from k3compile.pipeline import PassContext, count_ops, lint_graph
from k3compile.targets import get_target

k3 = torch.ops.k3
aten = torch.ops.aten
PROMPTS = [[5, 9, 100, 7, 3], [17, 4], [300]]


@pytest.fixture(scope="module")
def compiled(model_dirs, compile_once, optimize_shared, tmp_path_factory):
    """(plain, fused) CompileResults of tiny in fp32 (target cpu, where the pass is not on by
    default); the fused one validated."""
    root = tmp_path_factory.mktemp("fuse_attn_res")
    plain = compile_once("tiny", dtype="float32")
    fused = optimize_shared(model_dirs("tiny"), root / "fused",
                            CompileOptions(dtype="float32", validate=True, enable=(FuseAttnResNorm.name,)))
    return plain, fused


def test_every_mix_is_fused_with_its_norm(compiled):
    plain, fused = compiled
    layers = fused.captured.config.num_hidden_layers
    assert layers == 7
    # Layer 0's first mix does not exist (no block yet): 2 per layer - 1, plus the final mix.
    mixes = 2 * layers - 1 + 1
    records = [r for r in fused.pipeline.records if r.pass_name == FuseAttnResNorm.name]
    assert [r.phase for r in records] == ["decode", "prefill"]
    for record in records:
        result = record.result
        assert result.matches == mixes and result.stats["launches_removed"] == mixes and not result.skipped
        assert record.report.ok and record.report.max_error == 0.0
        assert result.stats["bytes_removed"] == 2 * mixes * 64 * 4  # one fp32 row of 64 written + read
        before = count_ops(plain.captured.programs[record.phase].graph_module)
        after = count_ops(fused.captured.programs[record.phase].graph_module)
        assert before["k3.attn_res_mix.default"] == mixes and "k3.attn_res_mix_norm.default" not in before
        assert "k3.attn_res_mix.default" not in after and after["k3.attn_res_mix_norm.default"] == mixes
        assert after["k3.rms_norm.default"] == before["k3.rms_norm.default"] - mixes
        assert after["aten.index.Tensor"] == before["aten.index.Tensor"]  # the row selection stays
        details = [r.detail for r in result.rewrites]
        assert details[0] == "layer 0: k3.attn_res_mix (2 candidates) + k3.rms_norm -> k3.attn_res_mix_norm"
        assert details[-1] == ("layer -: k3.attn_res_mix (4 candidates) + (row selection) k3.rms_norm -> "
                               "k3.attn_res_mix_norm, then the row selection")
    gm = fused.captured.programs["prefill"].graph_module
    final = next(n for n in gm.graph.nodes if n.target is aten.index.Tensor
                 and n.args[0].target is k3.attn_res_mix_norm.default)
    assert final.args[1][0].name == "logit_indices"


def _generate(out):
    """On the CPU, where the fused op runs the same two ops (a GPU runs the kernel: not
    bit-identical to the reference and norm kernel, tests/test_kernel_attn_res.py)."""
    rt = runtime.load(out, options=runtime.RuntimeOptions(max_sequences=len(PROMPTS), max_context=32, device="cpu"))
    seqs, logits = rt.prefill(PROMPTS)
    step = rt.decode(seqs, logits.argmax(-1).tolist())
    for seq in seqs:
        rt.release(seq)
    return logits, step, rt.generate(PROMPTS, 8)


def test_runtime_logits_and_tokens_unchanged(compiled):
    plain, fused = compiled
    for got, want in zip(_generate(fused.out_dir), _generate(plain.out_dir), strict=True):
        if isinstance(want, torch.Tensor):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        else:
            assert got == want


def test_mix_with_another_user_is_skipped(compiled):
    plain, _ = compiled
    program = copy.deepcopy(plain.captured.programs["decode"])
    gm = program.graph_module
    mix = next(n for n in gm.graph.nodes if n.target is k3.attn_res_mix.default)
    norm = next(iter(mix.users))
    with gm.graph.inserting_after(norm):
        bumped = gm.graph.call_function(aten.add.Tensor, (norm, mix))  # the output also reads the raw mix
    norm.replace_all_uses_with(bumped, delete_user_cb=lambda user: user is not bumped)
    lint_graph(gm)

    ctx = PassContext(plain.captured.config, plain.captured.plan, get_target("cpu"), "decode", program,
                      plain.captured.specs)
    result = FuseAttnResNorm().run(gm, ctx)
    lint_graph(gm)
    reasons = {s.node: s.reason for s in result.skipped}
    assert reasons[mix.name] == f"{mix.name} has 2 users ({norm.name}, {bumped.name}), not one norm"
    assert result.matches == 2 * 7 - 1
    assert mix in bumped.args and norm.args[0] is mix  # left alone


def test_op_schema_and_fake():
    g = torch.Generator().manual_seed(0)
    p, b0, b1 = (torch.randn(3, 16, generator=g) for _ in range(3))
    args = (p, [b0, b1], torch.randn(1, 16, generator=g), torch.rand(16, generator=g), 1e-5,
            torch.rand(16, generator=g), 1e-6)
    torch.library.opcheck(k3.attn_res_mix_norm.default, args, test_utils=("test_schema", "test_faketensor"))
    want = k3.rms_norm(k3.attn_res_mix(*args[:5]), args[5], args[6])
    torch.testing.assert_close(k3.attn_res_mix_norm(*args), want, rtol=0, atol=0)
