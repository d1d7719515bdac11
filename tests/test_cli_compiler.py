"""The compiler's command line: optimize -> inspect -> run on a generated tiny model.

Everything runs in-process through typer's CliRunner except one ``python -m k3compile
run`` in a subprocess. The tiny model is compiled once per module (float32, with
translation validation) and shared.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from k3compile.pipeline import default_pass_names
from k3compile.targets import get_target

from cli_runs import assert_one_line_error, invoke
from k3compile.artifact_manifest import MANIFEST
from k3compile.artifact_writer import write_manifest
from k3compile.batch import CacheShape
from k3compile.checkpoint.generate import GenerateOptions, generate_model_dir
from k3compile.config import PRESETS
from k3compile.reference import ReferenceEngine, load_reference

PROMPTS = ["1 2 3", "40 50 60 70 80"]
NEW_TOKENS = 4
pytestmark = pytest.mark.usefixtures("outside_torchrun")  # run reads torchrun's environment

PROMPT_ARGS = ["--prompt", PROMPTS[0], "--prompt", PROMPTS[1], "--max-new-tokens", str(NEW_TOKENS)]


def new_tokens(stdout: str) -> list[list[int]]:
    return [[int(t) for t in m.split()] for m in re.findall(r"new tokens: ([\d ]+)", stdout)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return generate_model_dir(PRESETS["tiny"], tmp_path_factory.mktemp("cc") / "tiny-model", GenerateOptions(seed=1))


@pytest.fixture(scope="module")
def compiled(model_dir) -> tuple[Path, str]:
    """(artifact dir, optimize's stdout) of the tiny model at tp 1, float32, validated."""
    out = model_dir.parent / "tiny.k3c"
    result = invoke("optimize", model_dir, "-o", out, "--dtype", "float32", "--validate")
    assert result.exit_code == 0, result.output
    return out, result.stdout


@pytest.fixture(scope="module")
def reference_tokens(model_dir) -> list[list[int]]:
    engine = ReferenceEngine(load_reference(model_dir), CacheShape(num_slots=2, num_blocks=4, block_size=16))
    return engine.generate([[int(t) for t in p.split()] for p in PROMPTS], NEW_TOKENS)


# ----- help ---------------------------------------------------------------------------


def test_help_lists_new_commands_and_flow():
    result = invoke("--help")
    assert result.exit_code == 0
    for command, description in [
        ("optimize", "Compile a model directory into an artifact"),
        ("inspect", "Verify an artifact"),
        ("run", "Load a compiled artifact with the runtime"),
    ]:
        assert re.search(rf"{command} .*{description}", result.stdout), result.stdout
    assert "init-model (or your own checkpoint) -> optimize -> inspect -> run" in result.stdout
    for command in ("optimize", "inspect", "run"):
        sub = invoke(command, "--help")
        assert sub.exit_code == 0
        assert f"Example: k3compile {command}" in sub.stdout
    assert "--dcp" in invoke("optimize", "--help").stdout and "split_mla_context" in invoke("optimize", "--help").stdout


# ----- optimize -----------------------------------------------------------------------


def test_optimize_writes_artifact(compiled, model_dir):
    out, stdout = compiled
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["parallel"]["tp"] == 1 and manifest["dtype"] == "float32" and manifest["target"] == "cpu"
    passes = default_pass_names(get_target("cpu"))
    assert [(p["pass"], p["phase"]) for p in manifest["passes"]] == [
        (name, phase) for name in passes for phase in ("decode", "prefill")]
    dedup = next(p for p in manifest["passes"] if p["pass"] == "dedup_replicated_linear")
    assert dedup["skipped_reasons"][0]["reason"].startswith("tp=1")
    # Progress: one line per finished step, in order.
    steps = re.findall(r"✓ (.+?)  ", stdout)
    assert steps == [
        "capture decode", "capture prefill", "check checkpoint",
        *(f"pass {name} ({phase})" for name in passes for phase in ("decode", "prefill")), "write artifact",
    ]
    # The pass table, the capture statistics and the artifact path.
    rows = [line for line in stdout.splitlines() if line.startswith("remove_noops")]
    assert len(rows) == 2 and "decode" in rows[0] and "prefill" in rows[1]
    assert all(re.search(r"\d\.\de[-+]\d+ ok", row) for row in rows)  # validated
    assert re.search(r"capture\s+decode [\d.]+ m?s \(\d+ nodes\), prefill .*peak memory [\d.]+ [MG]iB", stdout)
    assert str(out.absolute()) in stdout
    assert f"k3compile inspect {out}" in stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--enable", "fuse_everything"], "--enable: unknown pass 'fuse_everything'; known passes: remove_noops, mxfp4_experts, dedup_replicated_linear, sink_copies"),
        (["--disable", "remove_noops,nope"], "--disable: unknown pass 'nope'"),
        (["--target", "tpu"], "--target: unknown target 'tpu'; choose one of h200, mi355x, mi300x, cpu"),
        (["--dtype", "fp8"], "--dtype: unknown dtype 'fp8'; choose one of bfloat16, float32"),
        (["--dcp-merge", "gather"], "--dcp-merge: unknown merge 'gather'; choose one of reduce-scatter, all-to-all"),
        (["--dcp-prefill", "absorbed"], "--dcp-prefill: unknown prefill 'absorbed'; choose one of gathered, partial"),
        (["--tp", "3"], "--tp 3: num_attention_heads = 4 does not divide by tp = 3"),
        (["--model", "{tmp}/missing"], "missing is not a directory"),
        (["--model", "{tmp}/bad-model"], "bad-model/config.json: field 'model_type' must be 'kimi_k3' or 'kimi_linear'"),
        (["--out", "{artifact}"], "already exists; pass --overwrite to replace it"),
        (["--out", "{model}", "--overwrite"], "it is not a k3compile artifact"),
    ],
    ids=["unknown-pass", "unknown-pass-in-list", "unknown-target", "bad-dtype", "bad-dcp-merge", "bad-dcp-prefill", "tp-not-dividing",
         "missing-model-dir", "bad-config", "existing-out", "overwrite-non-artifact"],
)
def test_optimize_errors(compiled, model_dir, tmp_path, args, message):
    artifact, _ = compiled
    (tmp_path / "bad-model").mkdir()
    (tmp_path / "bad-model" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    fill = {"tmp": tmp_path, "artifact": artifact, "model": model_dir}
    args = [a.format(**fill) for a in args]
    model = model_dir
    if args[0] == "--model":
        model, args = Path(args[1]), args[2:]
    out = tmp_path / "out"
    if args[:1] == ["--out"]:
        out, args = Path(args[1]), args[2:]
    watched = [tmp_path, artifact, model_dir]
    before = {d: sorted(p.name for p in d.iterdir()) for d in watched}
    stamp = (artifact / MANIFEST).stat().st_mtime_ns
    result = invoke("optimize", model, "-o", out, *args)
    assert_one_line_error(result, message)
    assert {d: sorted(p.name for p in d.iterdir()) for d in watched} == before  # nothing written
    assert (artifact / MANIFEST).stat().st_mtime_ns == stamp


# ----- inspect ------------------------------------------------------------------------


def test_inspect(compiled, model_dir):
    out, _ = compiled
    result = invoke("inspect", out)
    assert result.exit_code == 0, result.output
    text = result.stdout
    assert "verified" in text
    assert re.search(r"^tp\s+1\s*$", text, re.M)
    assert re.search(r"^target\s+cpu\s*$", text, re.M)
    assert re.search(r"^dtype\s+float32\s*$", text, re.M)
    assert re.search(r"^block size\s+16 tokens", text, re.M)
    assert re.search(r"^model\s+preset tiny: 1.16M parameters, 7 layers", text, re.M)
    assert str(model_dir.resolve()) in text and "k3compile 0.1.0" in text
    rows = [line for line in text.splitlines() if line.startswith("remove_noops")]
    assert len(rows) == 2
    assert all(re.search(r"\byes\s+5\s+0\s+\d\.\de[-+]\d+ ok\b", row) for row in rows), rows
    assert "--diff" not in text and "notebook" not in text


def test_inspect_one_pass_with_diff_and_layer(compiled):
    out, _ = compiled
    result = invoke("inspect", out, "--pass", "remove_noops", "--phase", "decode", "--diff", "--layer", "2")
    assert result.exit_code == 0, result.output
    text = result.stdout
    assert re.findall(r"^remove_noops\s+(decode|prefill)\s", text, re.M) == ["decode"]
    assert "remove_noops [decode]: changed, 5 match(es)" in text
    assert re.search(r"validation: max error \S+ \(tolerance 1.0e-04\) ok", text)
    assert "ops:        aten.to.dtype -5" in text
    assert re.search(r"Layer 2 \(MLA\).*\n  decode: \d+ nodes; .*k3\.mla_decode x1", text)
    assert "prefill:" not in text
    # The manifest has no diff text: say so and show the notebook API, for layer 2.
    assert "not its graph diff" in text
    assert "from k3compile.compiler import CompileOptions, optimize" in text
    assert "rec.filter(layer=2).to_text()" in text


@pytest.mark.parametrize(
    "args, message",
    [
        (["--pass", "fuse_everything"], "--pass: pass 'fuse_everything' did not run for this artifact; passes that ran: remove_noops"),
        (["--phase", "verify"], "--phase: unknown phase 'verify'; this artifact has decode, prefill"),
        (["--layer", "7"], "--layer: 7 is outside [0, 7)"),
    ],
)
def test_inspect_bad_options(compiled, args, message):
    out, _ = compiled
    assert_one_line_error(invoke("inspect", out, *args), message)


def test_inspect_kernels_reports_the_planned_launches(compiled):
    """--kernels: both steps' launches on the chosen target, the programs of each as the
    report plans them for the artifact's model (a tiny one: every launch leaves CUs idle)."""
    import torch

    from k3compile.runtime.kernels.launch_report import StepShapes, planned_launches

    out, _ = compiled
    result = invoke("inspect", out, "--kernels", "--batch", "2", "--context", "256", "--target", "mi300x")
    assert result.exit_code == 0, result.output
    text = result.stdout
    assert "Decode step: 2 sequences at 256 positions on mi300x (gfx942, 304 compute units), one rank of TP1" in text
    assert "Prefill: 2 prompts of 256 tokens on mi300x" in text
    shapes = StepShapes.of_model(PRESETS["tiny"], 1, 1, 2, 256, torch.float32)
    decode_part, prefill_part = text.split("Prefill: ")
    for planned in planned_launches("gfx942", shapes):
        part = decode_part if planned.phase == "decode" else prefill_part
        row = re.search(rf"^│ {re.escape(planned.name)}\s+│.*?│\s+([\d,]+) │", part, re.M)
        assert row and int(row.group(1).replace(",", "")) == planned.programs, (planned.name, text)
    assert "kda decode (fused)" in text and "compute units idle" in text


@pytest.mark.parametrize(
    "args, message",
    [
        (["--batch", "0"], "--batch: at least 1 sequence, got 0"),
        (["--context", "0"], "--context: at least 1 token, got 0"),
        (["--target", "cpu"], "--target: unknown GPU target 'cpu'; choose one of h200, mi355x, mi300x"),
    ],
)
def test_inspect_kernels_bad_options(compiled, args, message):
    out, _ = compiled
    assert_one_line_error(invoke("inspect", out, "--kernels", *args), message)


def test_inspect_report_options_need_kernels(compiled):
    out, _ = compiled
    assert_one_line_error(invoke("inspect", out, "--batch", "4"), "--batch describes the kernel report: add --kernels")


# ----- run ----------------------------------------------------------------------------


def test_run_subprocess_matches_reference(compiled, reference_tokens):
    """`python -m k3compile run`: the greedy tokens of two prompts are the reference model's;
    with --temperature 0 the other sampling options change nothing."""
    out, _ = compiled
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    proc = subprocess.run(
        [sys.executable, "-m", "k3compile", "run", str(out), *PROMPT_ARGS,
         "--temperature", "0", "--top-k", "5", "--top-p", "0.5", "--seed", "3", "--max-context", "64"],
        capture_output=True, text=True, timeout=300, env={**env, "COLUMNS": "120"},
    )
    assert proc.returncode == 0, proc.stderr
    assert new_tokens(proc.stdout) == reference_tokens
    assert "prompt 1 (5 tokens): 40 50 60 70 80" in proc.stdout
    assert "greedy" in proc.stdout and "tp 1" in proc.stdout
    assert re.search(r"timing: load \d+ ms, prefill [\d.]+ ms \(8 tokens\), decode [\d.]+ ms/token \(3 steps, batch 2\)",
                     proc.stdout)


def test_run_prefill_in_chunks_matches_reference(compiled, reference_tokens):
    """--prefill-chunk 2: the 3- and 5-token prompts prefilled in chunks give the
    reference's greedy tokens too."""
    out, _ = compiled
    result = invoke("run", out, *PROMPT_ARGS, "--prefill-chunk", "2", "--max-context", "64", "--device", "cpu")
    assert result.exit_code == 0, result.output
    assert new_tokens(result.stdout) == reference_tokens


def test_run_seeded_sampling_is_reproducible(compiled, reference_tokens, tmp_path):
    out, _ = compiled
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    sampling = ["--max-new-tokens", NEW_TOKENS, "--temperature", "1.5", "--top-p", "0.99", "--seed", "7"]
    first = invoke("run", out, "--prompt", PROMPTS[0], "--prompt", PROMPTS[1], *sampling, "--device", "cpu")
    assert first.exit_code == 0, first.output
    assert "temperature 1.5, top-k 0, top-p 0.99, seed 7" in first.stdout
    again = invoke("run", out, "--prompt-file", prompts, *sampling)  # the same prompts, from a file
    assert again.exit_code == 0, again.output
    tokens = new_tokens(first.stdout)
    assert tokens == new_tokens(again.stdout)
    assert [len(t) for t in tokens] == [NEW_TOKENS] * 2 and tokens != reference_tokens  # it does sample


@pytest.mark.parametrize(
    "args, message",
    [
        (["--prompt", "1 512"], "--prompt #1: token id 512 is outside the vocabulary [0, 512)"),
        (["--temperature", "-1"], "--temperature must be 0 (greedy) or a finite number >= 1e-08, got -1.0"),
        (["--top-p", "0"], "--top-p must be in (0, 1]"),
        (["--max-context", "8", "--max-new-tokens", "2"], "prompt 0 has 8 tokens: with --max-new-tokens 2 it needs a context of 9"),
        (["--device", "tpu"], "--device: unknown device 'tpu'"),
        (["--prefill-chunk", "0"], "--prefill-chunk must be at least 1, got 0"),
    ],
    ids=["out-of-vocab", "temperature", "top-p", "context", "device", "prefill-chunk"],
)
def test_run_bad_requests(compiled, args, message):
    out, _ = compiled
    assert_one_line_error(invoke("run", out, *args), message)


def test_tampered_artifact(compiled, tmp_path):
    out, _ = compiled
    bad = tmp_path / "tampered.k3c"
    shutil.copytree(out, bad)
    program = bad / "decode.pt2"
    data = bytearray(program.read_bytes())
    data[len(data) // 2] ^= 0x01
    program.write_bytes(bytes(data))
    for command in ("inspect", "run"):
        result = invoke(command, bad)
        assert_one_line_error(result, "decode.pt2: sha256")
        assert "differs from manifest.json (the file was modified)" in result.stderr
        assert result.stdout == ""


def test_moved_checkpoint_warns_in_inspect_fails_in_run(compiled, tmp_path):
    out, _ = compiled
    moved = tmp_path / "moved.k3c"
    shutil.copytree(out, moved)
    manifest = json.loads((moved / MANIFEST).read_text())
    manifest["model_dir"] = str(tmp_path / "gone")
    write_manifest(moved, manifest)
    result = invoke("inspect", moved)
    assert result.exit_code == 0, result.output
    assert result.stderr.startswith("warning: ") and "missing checkpoint index" in result.stderr
    assert_one_line_error(invoke("run", moved), "missing checkpoint index")


def test_tp2_artifact_needs_torchrun(model_dir, tmp_path):
    out = tmp_path / "tiny-tp2.k3c"
    result = invoke("optimize", model_dir, "-o", out, "--tp", "2", "--dtype", "float32", "--disable", "remove_noops,mxfp4_experts,dedup_replicated_linear,sink_copies")
    assert result.exit_code == 0, result.output
    assert "remove_noops" not in result.stdout and "Passes: none ran" in result.stdout
    assert f"torchrun --nproc-per-node 2 -m k3compile run {out}" in result.stdout
    shown = invoke("inspect", out)
    assert re.search(r"^tp\s+2 \(run with: torchrun --nproc-per-node 2 -m k3compile run ", shown.stdout, re.M)
    assert_one_line_error(
        invoke("run", out, "--prompt", "1 2 3"),
        f"{out} was compiled for tp=2: start it on 2 processes with 'torchrun --nproc-per-node 2 -m k3compile run {out}'",
    )


def test_block_size_defaults_to_the_targets():
    """h200 takes 64-token MLA cache blocks (the split-KV kernel's descriptor tiles lie in
    one block), other targets 16; a given block size wins."""
    from k3compile.compiler import CompileOptions
    from k3compile.memory import MemoryOptions

    assert [CompileOptions(target=t).block_size for t in ("h200", "mi355x", "mi300x", "cpu")] == [64, 16, 16, 16]
    assert CompileOptions(target="h200", block_size=16).block_size == 16
    assert MemoryOptions(target="h200").block_size == 64 and MemoryOptions().block_size == 16


def test_report_reads_the_dcp_options_from_the_pass_records():
    """inspect --kernels: split_mla_context's prefill and merge options, as its records'
    op changes show them (the manifest does not store pass options)."""
    from k3compile.cli.kernels import dcp_merge, dcp_prefill

    decode = {"pass": "split_mla_context", "phase": "decode", "op_count_delta": {"k3.dcp_rescale.default": 2}}
    prefill = {"pass": "split_mla_context", "phase": "prefill", "op_count_delta": {"k3.mla_prefill_partial.default": 2}}
    assert (dcp_prefill([decode, prefill]), dcp_merge([decode, prefill])) == ("partial", "reduce-scatter")
    other = {"pass": "split_mla_context", "phase": "decode", "op_count_delta": {"k3.dcp_merge.default": 2}}
    assert (dcp_prefill([other]), dcp_merge([other])) == ("gathered", "all-to-all")
