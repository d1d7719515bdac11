"""Lowering the optimized decode program with Inductor at load (``CompileOptions.lowering``):
recorded in the artifact, overridable at run time, and computing what the op-by-op
program computes (tiny preset, float32: identical greedy tokens, logits within 1e-5; on a
GPU also bf16 for the h200 target: logits within a few bf16 roundings)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from typer.testing import CliRunner

from k3compile import runtime
from k3compile.cli import app
from k3compile.compiler import CompileOptions
from k3compile.runtime import RuntimeOptions

PROMPTS = [[5, 9, 100, 7, 3, 44, 21, 8, 90, 11], [17], [300, 301, 302]]
OPTIONS = RuntimeOptions(max_sequences=4, max_context=64)


@pytest.fixture(scope="module")
def inductor_artifact(compile_once):
    return compile_once("tiny", "mxfp4", dtype="float32", lowering="inductor", validate=False).out_dir


def test_lowering_defaults_to_the_targets_and_is_recorded(inductor_artifact):
    assert [CompileOptions(target=t).lowering for t in ("h200", "mi355x", "mi300x", "cpu")] == \
        ["inductor", "inductor", "inductor", "eager"]
    with pytest.raises(ValueError, match="lowering must be auto or one of inductor, eager, got 'aot'"):
        CompileOptions(lowering="aot")
    with pytest.raises(ValueError, match="RuntimeOptions.lowering: unknown choice 'jit'"):
        RuntimeOptions(lowering="jit")
    assert json.loads((inductor_artifact / "manifest.json").read_text())["lowering"] == "inductor"
    shown = CliRunner().invoke(app, ["inspect", str(inductor_artifact)])
    assert "Inductor (torch.compile at load)" in shown.stdout


def test_inductor_lowering_computes_what_the_eager_programs_compute(inductor_artifact):
    lowered = runtime.load(inductor_artifact, rank=0, world_size=1, options=replace(OPTIONS, lowering="inductor"))
    eager = runtime.load(inductor_artifact, rank=0, world_size=1, options=replace(OPTIONS, lowering="eager"))
    # Without a choice the artifact's lowering applies on a GPU; the CPU runs op by op.
    default = runtime.load(inductor_artifact, rank=0, world_size=1, options=OPTIONS)
    assert default.lowering == ("inductor" if default.device.type == "cuda" else "eager")
    assert (lowered.lowering, eager.lowering) == ("inductor", "eager")
    assert isinstance(eager.modules["decode"], torch.fx.GraphModule)
    assert not isinstance(lowered.modules["decode"], torch.fx.GraphModule)  # an Inductor-compiled callable
    assert isinstance(lowered.modules["prefill"], torch.fx.GraphModule)  # prefill stays op by op (measured)
    ids, want = eager.prefill(PROMPTS)
    ids2, got = lowered.prefill(PROMPTS)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    tokens = want.argmax(-1).tolist()
    for _ in range(3):  # decode steps at batch 3 through the compiled decode program
        want = eager.decode(ids, tokens)
        got = lowered.decode(ids2, tokens)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
        tokens = want.argmax(-1).tolist()
    for s in ids:
        eager.release(s)
    for s in ids2:
        lowered.release(s)
    assert lowered.generate(PROMPTS, 8) == eager.generate(PROMPTS, 8)


#: bf16 logits of one decode step, lowered against op by op from the same caches, per
#: sequence: Inductor keeps the values it fuses in fp32 where the op-by-op program rounds
#: each op's output to bf16, so most rows differ by a few bf16 roundings (median ~3 u of the
#: row's max |logit|, seen on the CPU and an H200). A few rows differ by 15-100%: never in
#: between, the mark of a discrete choice (a top-k routing pick among the tiny model's
#: near-tied random router scores) flipping on a rounding. So: at least BF16_ROWS_WITHIN
#: of the rows within BF16_LOGITS roundings, and the median within BF16_MEDIAN; a lowering
#: that computed something else would fail both. fp32 compares whole generations (above).
BF16_LOGITS, BF16_MEDIAN, BF16_ROWS_WITHIN = 8, 5, 0.75


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bf16_gpu_artifact_lowered_and_op_by_op_agree(compile_once):
    """The h200 target in bf16 (every GPU pass, the Triton kernels, decode under CUDA
    graphs): 12 decode steps at batch 3, each run by both from the op-by-op run's caches."""
    out = compile_once("tiny", "mxfp4", target="h200", validate=False).out_dir
    options = replace(OPTIONS, device="cuda")
    lowered = runtime.load(out, rank=0, world_size=1, options=replace(options, lowering="inductor"))
    eager = runtime.load(out, rank=0, world_size=1, options=replace(options, lowering="eager"))
    ids, want = eager.prefill(PROMPTS)
    ids2, _ = lowered.prefill(PROMPTS)
    tokens = want.argmax(-1).tolist()
    errors = []
    for _ in range(12):
        for mine, theirs in zip(lowered.cache_tensors, eager.cache_tensors, strict=True):
            mine.copy_(theirs)
        want = eager.decode(ids, tokens).float()
        got = lowered.decode(ids2, tokens).float()
        errors += ((got - want).abs().amax(-1) / want.abs().amax(-1) / 2.0**-8).tolist()  # in units of u(bf16)
        tokens = want.argmax(-1).tolist()
    errors = torch.tensor(errors)
    within = float((errors <= BF16_LOGITS).float().mean())
    assert within >= BF16_ROWS_WITHIN and errors.median() <= BF16_MEDIAN, \
        f"rows within {BF16_LOGITS} u: {within:.0%}; errors in u(bf16): {[round(e, 1) for e in errors.tolist()]}"
