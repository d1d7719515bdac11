"""The command line: the real CLI in a subprocess, and in-process through typer's CliRunner."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

import k3compile
from k3compile.batch import CacheShape
from k3compile.cli import app, parse_size
from k3compile.config import PRESETS, config_to_hf_dict, load_config, with_layers
from k3compile.model import K3ForCausalLM
from k3compile.reference import ReferenceEngine, load_reference

COMMANDS = ("init-model", "presets", "generate")
GEN_ARGS = ["--prompt", "1 2 3", "--prompt", "40 50 60 70 80", "--max-new-tokens", "3", "--threads", "1"]


def run_cli(*args: str, console_script: bool = False) -> subprocess.CompletedProcess:
    """The real CLI in a fresh interpreter: ``python -m k3compile`` or the ``k3compile`` script."""
    if console_script:
        cmd = [str(Path(sys.executable).parent / "k3compile"), *args]
    else:
        cmd = [sys.executable, "-m", "k3compile", *args]
    env = {**os.environ, "COLUMNS": "120"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)


def invoke(*args: str):
    return CliRunner().invoke(app, list(args), catch_exceptions=False)


def new_tokens(stdout: str) -> list[list[int]]:
    return [[int(t) for t in m.split()] for m in re.findall(r"new tokens: ([\d ]+)", stdout)]


def params(cfg) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in K3ForCausalLM(cfg).parameters())


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    """generate --threads sets torch's thread count in-process; restore it for other tests."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> tuple[Path, str]:
    """The tiny preset with mxfp4 experts, written by the CLI (in-process)."""
    out = tmp_path_factory.mktemp("cli") / "tiny-mxfp4"
    result = invoke("init-model", str(out), "--preset", "tiny", "--experts", "mxfp4", "--seed", "5",
                    "--shard-size", "500KB")
    assert result.exit_code == 0, result.output
    return out, result.stdout


# ----- help, version, presets --------------------------------------------------


def test_help_lists_every_command():
    result = invoke("--help")
    assert result.exit_code == 0
    for command, description in [
        ("init-model", "seeded random weights"),
        ("presets", "built-in model configurations"),
        ("generate", "Generate tokens greedily"),
    ]:
        assert re.search(rf"{command} .*{description}", result.stdout), result.stdout
    assert "--version" in result.stdout


@pytest.mark.parametrize("command", COMMANDS)
def test_command_help_has_examples(command):
    result = invoke(command, "--help")
    assert result.exit_code == 0
    assert f"Example: k3compile {command}" in result.stdout


def test_version():
    result = invoke("--version")
    assert result.exit_code == 0
    assert result.stdout.strip() == f"k3compile {k3compile.__version__}"


def test_presets_table():
    result = invoke("presets")
    assert result.exit_code == 0, result.output
    rows = {line.split()[1]: line for line in result.stdout.splitlines() if line.startswith("│")}
    assert set(PRESETS) <= set(rows)
    k3 = rows["k3"]
    assert "2.78T" in k3 and params(PRESETS["k3"]) == pytest.approx(2.8e12, rel=0.01)
    assert "7168" in k3 and "896 (16)" in k3 and "93 (69+24)" in k3
    assert "1.16M" in rows["tiny"] and params(PRESETS["tiny"]) == 1_160_256


# ----- init-model ----------------------------------------------------------------


def test_init_model_tiny_mxfp4(tiny_dir):
    out, stdout = tiny_dir
    cfg = PRESETS["tiny"]
    assert f"{params(cfg):,}" in stdout
    assert re.search(r"layers\s+7\b", stdout) and "4 KDA + 3 MLA" in stdout

    hf = json.loads((out / "config.json").read_text())
    assert hf["model_type"] == "kimi_k3"
    assert hf["quantization_config"]["format"] == "mxfp4-pack-quantized"
    assert hf["k3compile_generated"] == {"seed": 5, "experts": "mxfp4"}
    assert load_config(out) == cfg.replace(expert_format="mxfp4")  # --experts overrides the preset's bf16

    index = json.loads((out / "model.safetensors.index.json").read_text())
    weight_map = index["weight_map"]
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 1  # --shard-size 500KB splits the 1.5 MB checkpoint
    assert shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    assert sorted(set(weight_map.values())) == shards
    assert all(name.startswith("language_model.") for name in weight_map)
    expert = "language_model.model.layers.1.block_sparse_moe.experts.0.w1"
    assert f"{expert}.weight_packed" in weight_map and f"{expert}.weight_scale" in weight_map
    assert f"{expert}.weight" not in weight_map
    assert "language_model.lm_head.weight" in weight_map

    # The index names exactly the tensors in the shards, and total_size is their byte count.
    found, nbytes = {}, 0
    for shard in shards:
        with safe_open(str(out / shard), "pt") as f:
            for key in f.keys():
                found[key] = shard
                t = f.get_tensor(key)
                nbytes += t.numel() * t.element_size()
    assert found == weight_map
    assert index["metadata"]["total_size"] == nbytes
    total_on_disk = sum(p.stat().st_size for p in out.iterdir())
    assert f"{total_on_disk:,}" in stdout and f"{len(shards)} shards" in stdout


@pytest.mark.parametrize("preset", ["tiny", "tiny-linear"])  # kimi_k3 and kimi_linear layouts
def test_init_model_from_config_file(tmp_path, preset):
    cfg_file = tmp_path / "configs" / "my-config.json"
    cfg_file.parent.mkdir()
    cfg_file.write_text(json.dumps(config_to_hf_dict(PRESETS[preset])))
    out = tmp_path / "model"
    result = invoke("init-model", str(out), "--config", str(cfg_file))
    assert result.exit_code == 0, result.output
    assert f"config {cfg_file}" in result.stdout
    assert load_config(out) == PRESETS[preset]
    assert (out / "model-00001-of-00001.safetensors").is_file()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    prefix = PRESETS[preset].checkpoint_prefix
    assert f"{prefix}model.embed_tokens.weight" in index["weight_map"]


def _bad_config(path: Path) -> Path:
    d = config_to_hf_dict(PRESETS["tiny-linear"])
    d["hidden_act"] = "gelu"
    path.write_text(json.dumps(d))
    return path


@pytest.mark.parametrize(
    "args, message",
    [
        (["--preset", "huge"], "unknown preset 'huge'"),
        ([], "exactly one of --preset NAME or --config FILE"),
        (["--preset", "tiny", "--config", "{cfg}"], "exactly one of --preset NAME or --config FILE (got both)"),
        (["--config", "{tmp}/missing.json"], "missing.json does not exist"),
        (["--config", "{bad}"], "bad.json: field 'hidden_act' must be 'situ'"),
        (["--preset", "tiny", "--shard-size", "lots"], "--shard-size: cannot read 'lots'"),
        (["--preset", "tiny", "--layers", "0"], "--layers must be at least 1, got 0"),
    ],
    ids=["unknown-preset", "neither", "both", "missing-config", "invalid-config", "bad-shard-size", "zero-layers"],
)
def test_init_model_errors(tmp_path, args, message):
    good = tmp_path / "good.json"
    good.write_text(json.dumps(config_to_hf_dict(PRESETS["tiny"])))
    bad = _bad_config(tmp_path / "bad.json")
    args = [a.format(cfg=good, bad=bad, tmp=tmp_path) for a in args]
    before = sorted(tmp_path.iterdir())
    result = invoke("init-model", str(tmp_path / "out"), *args)
    assert result.exit_code == 2
    assert message in result.stderr
    assert result.stdout == "" and "Traceback" not in result.output
    assert len(result.stderr.strip().splitlines()) == 1
    assert sorted(tmp_path.iterdir()) == before  # nothing written, no temp dir left


def test_init_model_layers_and_the_configs_expert_format(tmp_path):
    """--layers re-lays any preset or config by its own rule; without --experts the config's
    format is written (mxfp4 here, from quantization_config)."""
    mx = PRESETS["tiny-linear"].replace(expert_format="mxfp4")
    cfg_file = tmp_path / "config.json"
    cfg_file.write_text(json.dumps(config_to_hf_dict(mx)))
    out = tmp_path / "model"
    result = invoke("init-model", str(out), "--config", str(cfg_file), "--layers", "3", "--seed", "2")
    assert result.exit_code == 0, result.output
    assert "experts mxfp4" in result.stdout and re.search(r"layers\s+3\b", result.stdout)
    assert re.search(r"time\s+[\d.]+ s \(drawing values [\d.]+ s, writing files [\d.]+ s\)", result.stdout)
    assert load_config(out) == with_layers(mx, 3)
    assert load_config(out).layer_kinds == ("kda", "kda", "mla")
    hf = json.loads((out / "config.json").read_text())
    assert hf["k3compile_generated"] == {"seed": 2, "experts": "mxfp4"}
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.2.block_sparse_moe.experts.0.w2.weight_packed" in weight_map
    assert not any(k.startswith("model.layers.3.") for k in weight_map)


def test_init_model_existing_dir(tiny_dir):
    out, _ = tiny_dir
    before = sorted(out.iterdir())
    result = invoke("init-model", str(out), "--preset", "tiny")
    assert result.exit_code == 2
    assert f"{out} already exists" in result.stderr
    assert sorted(out.iterdir()) == before


def test_init_model_error_in_subprocess(tmp_path):
    """The installed `k3compile` script: one line on stderr, exit status 2, no traceback, nothing written."""
    proc = run_cli("init-model", str(tmp_path / "out"), "--preset", "nope", console_script=True)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: unknown preset 'nope'; choose one of " + ", ".join(PRESETS)
    assert proc.stdout == ""
    assert list(tmp_path.iterdir()) == []


def test_parse_size():
    assert parse_size("2GB") == 2 * 10**9
    assert parse_size("1.5MB") == 1_500_000
    assert parse_size("512MiB") == 512 * 2**20
    assert parse_size("1000") == 1000


# ----- generate --------------------------------------------------------------------


def test_generate_deterministic(tiny_dir, tmp_path):
    out, _ = tiny_dir
    proc = run_cli("generate", str(out), *GEN_ARGS)  # python -m k3compile
    assert proc.returncode == 0, proc.stderr
    tokens = new_tokens(proc.stdout)
    assert len(tokens) == 2 and all(len(t) == 3 for t in tokens)
    assert all(0 <= t < PRESETS["tiny"].vocab_size for seq in tokens for t in seq)
    assert re.search(r"prefill [\d.]+ ms .* decode [\d.]+ ms/token", proc.stdout)

    # Again, in-process, with the same prompts from a file (a trailing newline is fine).
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("1 2 3\n 40 50 60\t70 80 \n")
    again = invoke("generate", str(out), "--prompt-file", str(prompts), *GEN_ARGS[4:])
    assert again.exit_code == 0, again.output
    assert new_tokens(again.stdout) == tokens

    # The same tokens as the reference engine's own greedy generate.
    model = load_reference(out)
    engine = ReferenceEngine(model, CacheShape(num_slots=2, num_blocks=2, block_size=16))
    assert engine.generate([[1, 2, 3], [40, 50, 60, 70, 80]], 3) == tokens


def test_generate_default_prompt_bfloat16(tiny_dir):
    out, _ = tiny_dir
    result = invoke("generate", str(out), "--max-new-tokens", "2", "--dtype", "bfloat16", "--threads", "1")
    assert result.exit_code == 0, result.output
    assert "prompt 0 (8 tokens): 1 2 3 4 5 6 7 8" in result.stdout
    assert "bfloat16" in result.stdout
    assert [len(t) for t in new_tokens(result.stdout)] == [2]


@pytest.mark.parametrize(
    "args, lines, message",
    [
        (["--prompt", "1 2 512"], None, "--prompt #1: token id 512 is outside the vocabulary [0, 512)"),
        (["--prompt", "1 2", "--prompt", "-3"], None, "--prompt #2: token id -3 is outside the vocabulary"),
        (["--prompt", "1 two"], None, "'two' is not a token id"),
        (["--prompt", "  "], None, "--prompt #1 is empty"),
        ([], "1 2 3\n\n4 5\n", "prompts.txt line 2 is empty"),
        ([], "1 2 3\n4 999\n", "prompts.txt line 2: token id 999 is outside the vocabulary"),
        (["--prompt", "1"], "1 2\n", "not both"),
    ],
    ids=["out-of-vocab", "negative", "not-int", "empty-prompt", "empty-line", "file-out-of-vocab", "both"],
)
def test_generate_errors(tiny_dir, tmp_path, args, lines, message):
    out, _ = tiny_dir
    if lines is not None:
        (tmp_path / "prompts.txt").write_text(lines)
        args = [*args, "--prompt-file", str(tmp_path / "prompts.txt")]
    result = invoke("generate", str(out), *args)
    assert result.exit_code == 2
    assert message in result.stderr
    assert "Traceback" not in result.output and len(result.stderr.strip().splitlines()) == 1


def test_generate_missing_model_dir(tmp_path):
    result = invoke("generate", str(tmp_path / "nothing"))
    assert result.exit_code == 2
    assert "is not a directory" in result.stderr
