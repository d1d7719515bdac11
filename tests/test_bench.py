"""``k3compile bench`` and :mod:`k3compile.bench`: the floor it divides by, what it
reports, its refusals, and a TP2 run under torchrun (gloo)."""

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

from cli_runs import assert_one_line_error, invoke
from k3compile import runtime
from k3compile.bench import BenchOptions, run_bench, start_sequences, step_floor
from k3compile.checkpoint.loader import load_checkpoint_config
from k3compile.placement.groups import GROUPS

pytestmark = pytest.mark.usefixtures("outside_torchrun")  # the CLI reads torchrun's environment

BENCH_ARGS = ["--batch", "1,3", "--context", "40", "--prompt-len", "8,20", "--steps", "2", "--warmup", "1"]


@pytest.fixture(scope="module")
def artifact(compile_once) -> Path:
    return compile_once("tiny", "mxfp4", dtype="float32").out_dir


def checkpoint_bytes(model_dir: Path, dtype_bytes: int) -> tuple[int, int]:
    """(bytes of the non-expert tensors at ``dtype_bytes`` per value, bytes of the packed
    expert tensors as stored), read from the safetensors files."""
    dense = experts = 0
    for shard in sorted(model_dir.glob("*.safetensors")):
        with safe_open(shard, "pt") as f:
            for name in f.keys():
                t = f.get_slice(name)
                numel = torch.Size(t.get_shape()).numel()
                if re.search(r"\.experts\.\d+\.", name):  # routed experts, not shared_experts
                    experts += numel * {"U8": 1, "I8": 1, "F8_E8M0": 1, "BF16": 2, "F32": 4}[t.get_dtype()]
                else:
                    dense += numel * dtype_bytes
    return dense, experts


def test_step_floor_counts_weights_experts_and_caches(artifact, model_dirs):
    cfg = load_checkpoint_config(model_dirs("tiny", "mxfp4"))
    rt = runtime.load(artifact, 0, 1, runtime.RuntimeOptions(max_sequences=4, max_context=128, device="cpu"))
    floor = step_floor(rt, batch=3, context=100)

    E, k = cfg.num_experts, cfg.num_experts_per_token
    distinct = E * (1 - (1 - k / E) ** 3)
    assert floor.distinct_experts_per_layer == pytest.approx(distinct)
    # MXFP4 experts as stored: per matrix I x D codes of half a byte and one E8M0 scale per 32 values
    I, D = cfg.moe_intermediate_size, cfg.routed_expert_hidden_size
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    assert floor.routed_experts == pytest.approx(moe_layers * distinct * 3 * I * D * (1 / 2 + 1 / 32))
    dense, experts = checkpoint_bytes(model_dirs("tiny", "mxfp4"), 4)
    assert experts == pytest.approx(moe_layers * E * 3 * I * D * (1 / 2 + 1 / 32))
    # float32 at TP1: every stored non-expert value once, but of the embedding table only the
    # batch's 3 rows; within what passes add or fold away
    unread = (cfg.vocab_size - 3) * cfg.hidden_size * 4
    assert floor.dense_weights == pytest.approx(dense - unread, rel=0.01)
    mla_layers = cfg.layer_kinds.count("mla")
    assert floor.mla_history == 3 * 100 * cfg.mla_cache_width * 4 * mla_layers
    lin = cfg.linear_attn
    state = lin.num_heads * lin.head_dim**2 * 4
    conv = 3 * lin.num_heads * lin.head_dim * (lin.short_conv_kernel_size - 1) * 4
    assert floor.kda_state == 2 * 3 * (state + conv) * cfg.layer_kinds.count("kda")


def test_bench_options_refuse_bad_values_and_runtimes_too_small(artifact):
    with pytest.raises(ValueError, match="batches"):
        BenchOptions(batches=(0,))
    with pytest.raises(ValueError, match="steps"):
        BenchOptions(steps=0)
    options = BenchOptions(batches=(2,), contexts=(60,), prompt_lens=())
    assert options.capacity() == (2, 60 + 3 + 2 * 20 + 3)
    rt = runtime.load(artifact, 0, 1, runtime.RuntimeOptions(max_sequences=2, max_context=64, device="cpu"))
    with pytest.raises(ValueError, match="holds 2 sequences of 64 tokens; these measurements need 2 of 106"):
        run_bench(rt, options)
    start_sequences(rt, 1, 10)
    with pytest.raises(ValueError, match="already holds 1 sequences"):
        run_bench(rt, BenchOptions(batches=(1,), contexts=(8,), prompt_lens=(), steps=1))


def test_bench_cli_prints_and_writes_what_it_measured(artifact, tmp_path):
    out = tmp_path / "bench.json"
    result = invoke("bench", artifact, *BENCH_ARGS, "--json", out)
    assert result.exit_code == 0, result.output
    for heading in ("decode", "prefill", "one eager decode step by layer type", "one decode step by aten op"):
        assert heading in result.stdout
    data = json.loads(out.read_text())
    assert (data["device"], data["rank"], data["world_size"], data["cuda_graphs"]) == ("cpu", 0, 1, False)
    assert [(d["batch"], d["context"]) for d in data["decode"]] == [(1, 40), (3, 40)]
    bandwidth = data["copy_bandwidth"]
    assert bandwidth > 1e8
    for d in data["decode"]:
        assert d["step_ms"] > 0 and d["device_ms"] is None
        assert d["tokens_per_s"] == pytest.approx(d["batch"] / d["greedy_step_ms"] * 1e3)
        assert d["greedy_step_ms"] > 0 and d["greedy_over_device"] is None
        assert d["floor_ms"] == pytest.approx(d["floor"]["total"] / bandwidth * 1e3)
        assert d["step_over_floor"] == pytest.approx(d["step_ms"] / d["floor_ms"])
        # the tiny preset has every layer type; each runs ops in an eager step
        assert set(d["groups"]) - {"other"} == set(GROUPS) - {"other"}
        assert all(g["kernels"] >= 1 and g["ms"] > 0 for g in d["groups"].values())
        assert d["kernels"][0]["kernel"] == "(all)" and d["kernels"][0]["calls"] > 100
        assert d["kernels"][1] == {"kernel": "(collectives)", "ms": 0, "calls": 0}  # one rank: none
    assert data["memory_gib"] is None  # measured on GPUs only
    # more sequences pick more distinct experts and read more history
    small, large = (d["floor"] for d in data["decode"])
    assert large["routed_experts"] > small["routed_experts"] and large["mla_history"] == 3 * small["mla_history"]
    assert [p["prompt_len"] for p in data["prefill"]] == [8, 20]
    assert all(p["ttft_ms"] > 0 for p in data["prefill"])


def test_bench_cli_times_a_chunked_prefill(artifact, tmp_path):
    """--prefill-chunk 4: the 20-token prompt's time to first token over five prefill steps."""
    out = tmp_path / "c.json"
    result = invoke("bench", artifact, "--batch", "1", "--context", "16", "--prompt-len", "20", "--steps", "1",
                    "--no-profile", "--prefill-chunk", "4", "--json", out)
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    (p,) = data["prefill"]
    assert p["prompt_len"] == 20 and p["ttft_ms"] > 0
    assert data["prefill_chunk"] == 4 and "in chunks of 4 tokens" in result.stdout


def test_bench_cli_with_the_eager_peer_without_profile_or_prefill(artifact, tmp_path):
    out = tmp_path / "b.json"
    result = invoke("bench", artifact, "--batch", "2", "--context", "16", "--prompt-len", "", "--steps", "1",
                    "--no-profile", "--peers", "eager", "--json", out)
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    (d,) = data["decode"]
    assert data["prefill"] == [] and d["groups"] == {} and d["kernels"] == []
    assert "layer type" not in result.stdout and "eager ms, x this" in result.stdout
    assert set(d["peer_step_ms"]) == {"eager"} and d["peer_step_ms"]["eager"] > 0
    assert d["peer_over_this"]["eager"] == pytest.approx(d["peer_step_ms"]["eager"] / d["step_ms"])


@pytest.mark.parametrize("args, message", [
    (["--batch", "0"], "--batch: expected positive integers separated by commas (e.g. 1,16,64), got '0'"),
    (["--context", "1k"], "--context: expected positive integers"),
    (["--steps", "0"], "--steps must be at least 1"),
    (["--warmup", "-1"], "--warmup: at least 0, got -1"),
    (["--device", "tpu"], "--device: unknown device 'tpu'"),
    (["--peers", "eager,vllm"], "--peers: unknown peer 'vllm'; choose one of eager, compile"),
    (["--json", "/nonexistent-dir/b.json"], "--json: the folder /nonexistent-dir does not exist"),
    (["--prefill-chunk", "0"], "--prefill-chunk must be at least 1, got 0"),
])
def test_bench_cli_refuses_bad_options_before_loading(artifact, args, message):
    assert_one_line_error(invoke("bench", artifact, *args), message)


@pytest.mark.slow
def test_bench_under_torchrun_at_tp2(compile_once, artifact, tmp_path):
    """Two gloo ranks through torchrun: each measures its own shard; rank 0 reports."""
    tp2 = compile_once("tiny", "mxfp4", tp=2, dtype="float32").out_dir
    out = tmp_path / "tp2.json"
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "k3compile", "bench", str(tp2), "--batch", "2", "--context", "24", "--prompt-len", "8",
         "--steps", "2", "--warmup", "1", "--profile", "--json", str(out)],
        capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("copy bandwidth") == 1  # rank 0 prints, rank 1 does not
    data = json.loads(out.read_text())
    assert (data["rank"], data["world_size"]) == (0, 2)
    one = runtime.load(artifact, 0, 1, runtime.RuntimeOptions(max_sequences=2, max_context=64, device="cpu"))
    whole = step_floor(one, batch=2, context=24)
    half = data["decode"][0]["floor"]
    # each rank holds half the KDA heads and a shard of most weights
    assert half["mla_history"] == whole.mla_history  # the latent cache is replicated across TP ranks
    assert half["kda_state"] * 2 == whole.kda_state
    assert 0.5 * whole.dense_weights < half["dense_weights"] < 0.75 * whole.dense_weights
    # the step's collectives: the tiny preset's TP2 step all-reduces at least once a layer
    # (attention and MLP outputs) and all-gathers the vocab-parallel logits
    total, collectives, *kernels = data["decode"][0]["kernels"]
    assert collectives["kernel"] == "(collectives)" and collectives["calls"] >= 2 * one.cfg.num_hidden_layers
    assert 0 < collectives["ms"] < total["ms"]
    assert any(k["kernel"].startswith("_c10d_functional::") for k in kernels)
