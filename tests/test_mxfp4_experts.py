"""The mxfp4_experts pass: routed experts held and run as the checkpoint's MXFP4 codes and
scales (passes/mxfp4_experts.py), and the split rules that come with it."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from typer.testing import CliRunner

from k3compile import runtime
from k3compile.artifact import ArtifactError
from k3compile.checkpoint.generate import GenerateOptions, generate_model_dir
from k3compile.cli import app
from k3compile.compiler import CompileOptions, optimize
from k3compile.config import get_preset
from k3compile.memory import MemoryOptions, plan_memory

PROMPTS = [[5, 9, 100, 7, 3, 44, 21, 8, 90, 11], [17], [300, 301, 302]]
OPTIONS = runtime.RuntimeOptions(max_sequences=4, max_context=64)


def _expert_params(program) -> dict[str, torch.Tensor]:
    return {n: t for n, t in program.state_dict.items() if ".experts." in n}


def test_pass_keeps_experts_packed_and_is_exact(compile_once):
    cfg = get_preset("tiny")
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    result = compile_once("tiny", "mxfp4", dtype="float32")  # validated
    records = [r for r in result.pipeline.records if r.pass_name == "mxfp4_experts"]
    assert [r.phase for r in records] == ["decode", "prefill"]
    for r in records:
        assert r.result.matches == moe_layers and r.result.skipped == []
        assert r.report.max_error == 0.0  # the reference dequantises exactly: bit-identical
    E, I, D = cfg.num_experts, cfg.moe_intermediate_size, cfg.routed_expert_hidden_size
    for program in result.captured.programs.values():
        params = _expert_params(program)
        assert params and all(t.dtype == torch.uint8 for t in params.values())
        assert params["k3.model.layers.1.mlp.experts.w1_packed"].shape == (E, I, D // 2)
        assert params["k3.model.layers.1.mlp.experts.w1_scale"].shape == (E, I, D // 32)
        assert params["k3.model.layers.1.mlp.experts.w2_packed"].shape == (E, D, I // 2)
        assert params["k3.model.layers.1.mlp.experts.w2_scale"].shape == (E, D, I // 32)
        assert not any(n.endswith(("w1", "w2", "w3")) for n in params)
        targets = {str(n.target) for n in program.graph.nodes}
        assert "k3.moe_experts_mxfp4.default" in targets and "k3.moe_experts.default" not in targets
    spec = result.captured.specs["k3.model.layers.1.mlp.experts.w2_scale"]
    assert spec.names[3] == "model.layers.1.block_sparse_moe.experts.3.w2.weight_scale"
    assert (spec.dtype, spec.dim) == ("u8", 1)
    # The pass saves the dense weights minus the packed bytes of every expert weight.
    saved = sum(r.result.stats["weight_bytes_removed"] for r in records[:1])
    assert saved == moe_layers * 3 * E * I * D * (4 - (0.5 + 1 / 32))


def test_runtime_holds_the_checkpoint_bytes(model_dirs, compile_once):
    model_dir = model_dirs("tiny", "mxfp4")
    rt = runtime.load(compile_once("tiny", "mxfp4", dtype="float32").out_dir, rank=0, world_size=1, options=OPTIONS)
    from safetensors import safe_open

    index = json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]
    name = "language_model.model.layers.2.block_sparse_moe.experts.5.w3.weight_packed"
    with safe_open(str(model_dir / index[name]), "pt") as f:
        stored = f.get_tensor(name)
    held = rt.weights["k3.model.layers.2.mlp.experts.w3_packed"][5]
    assert held.dtype == torch.uint8 and torch.equal(held, stored)


@pytest.mark.parametrize("preset", ["tiny", *(pytest.param(p, marks=pytest.mark.sweep) for p in ("tiny-h24", "tiny-linear"))])
def test_greedy_tokens_are_the_same_with_the_pass_on_and_off(model_dirs, compile_once, optimize_shared, tmp_path,
                                                             preset):
    off = tmp_path / "off"
    optimize_shared(model_dirs(preset, "mxfp4"), off, CompileOptions(dtype="float32", disable=("mxfp4_experts",)))
    tokens = {}
    for label, out in (("on", compile_once(preset, "mxfp4", dtype="float32").out_dir), ("off", off)):
        rt = runtime.load(out, rank=0, world_size=1, options=OPTIONS)
        tokens[label] = rt.generate(PROMPTS, 12)
        assert any(".experts.w1" in n for n in rt.weights)
    assert tokens["on"] == tokens["off"]


def test_bf16_checkpoint_is_left_dense_and_splits_anywhere(tmp_path):
    """A bf16 checkpoint keeps dense experts (the pass skips) and has no MXFP4 constraint:
    moe_intermediate_size 64 at TP4 gives each rank 16 intermediate values."""
    cfg = get_preset("tiny").replace(moe_intermediate_size=64, intermediate_size=64)
    model_dir = generate_model_dir(cfg, tmp_path / "m", GenerateOptions(experts="bf16", seed=3))
    result = optimize(model_dir, tmp_path / "a", CompileOptions(tp=4, dtype="float32"))
    records = [r for r in result.pipeline.records if r.pass_name == "mxfp4_experts"]
    assert all(not r.result.changed for r in records)
    assert {s.reason for r in records for s in r.result.skipped} == {"the checkpoint stores the routed experts in bf16"}
    w2 = result.captured.programs["decode"].state_dict["k3.model.layers.1.mlp.experts.w2"]
    assert w2.shape == (cfg.num_experts, cfg.routed_expert_hidden_size, 16) and w2.dtype == torch.float32


def test_mxfp4_split_that_cuts_scale_groups_names_tp_and_the_degrees_that_work(tmp_path):
    cfg = get_preset("tiny").replace(moe_intermediate_size=64, intermediate_size=64)
    model_dir = generate_model_dir(cfg, tmp_path / "m", GenerateOptions(experts="mxfp4", seed=3))
    result = CliRunner().invoke(app, ["optimize", str(model_dir), "-o", str(tmp_path / "a"), "--tp", "4"])
    assert result.exit_code == 2, result.output
    message = " ".join(result.stderr.split())
    assert "--tp 4:" in message and "MXFP4 scale groups of 32" in message
    assert "tensor-parallel degrees that keep whole groups: 1, 2" in message
    assert not (tmp_path / "a").exists()


def test_an_expert_width_that_cuts_mxfp4_groups_is_refused_before_anything_is_written(model_dirs, tmp_path):
    """An MXFP4 checkpoint whose config.json gives the routed experts an intermediate width
    of 48 (one and a half scale groups of 32): optimize and plan refuse it, naming the
    field, the rule and the value, and optimize leaves nothing behind (no OUT, no
    temporary sibling)."""
    import shutil

    model = shutil.copytree(model_dirs("tiny", "mxfp4"), tmp_path / "m")
    config = json.loads((model / "config.json").read_text())
    config["text_config"]["moe_intermediate_size"] = 48
    (model / "config.json").write_text(json.dumps(config))
    problem = ("field 'text_config.moe_intermediate_size' must be a multiple of 32 with mxfp4 experts "
               "(one scale per 32 values), got 48")
    for command in (["optimize", str(model), "-o", str(tmp_path / "a")], ["plan", str(model), "--tp", "1"]):
        result = CliRunner().invoke(app, command)
        assert result.exit_code == 2, result.output
        message = " ".join(result.stderr.split())
        assert problem in message and "config.json" in message, message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_plan_k3_tp8_fits_an_mi355x_with_mxfp4_experts():
    """One MoE layer shows the saving; the whole-model figure is in test_memory's K3 plan."""
    cfg = get_preset("k3")
    assert cfg.expert_format == "mxfp4"
    from k3compile.config import with_layers

    small = with_layers(cfg, 2)  # dense layer 0 + one MoE layer at K3's real widths
    plan = plan_memory(small, MemoryOptions(tp=8, target="mi355x", context=1024))
    before, after = plan.stages[0][1], plan.after("mxfp4_experts")
    per_layer_dense = 896 * 3 * 384 * 3584 * 2
    assert before.weights["routed experts"] == per_layer_dense
    assert after.weights["routed experts"] == 896 * 3 * 384 * 3584 * (0.5 + 1 / 32)


def test_a_nan_scale_byte_is_refused_at_load(model_dirs, tmp_path):
    """The runtime reads the scale bytes as they are: a 0xFF (NaN) scale would poison 32
    weights, so loading names the tensor and file instead."""
    import shutil

    from safetensors.torch import load_file, save_file

    from k3compile.checkpoint.loader import CheckpointError

    model_dir = tmp_path / "m"
    shutil.copytree(model_dirs("tiny", "mxfp4"), model_dir)
    optimize(model_dir, tmp_path / "a", CompileOptions(dtype="float32"))
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]
    name = "language_model.model.layers.4.block_sparse_moe.experts.6.w2.weight_scale"
    shard = model_dir / index[name]
    tensors = load_file(shard)
    tensors[name][3, 1] = 0xFF
    save_file(tensors, shard, metadata={"format": "pt"})
    # The artifact notices the edited shard first (checkpoint identity); past that check the
    # loader still names the bad scale.
    with pytest.raises(ArtifactError, match=rf"{shard.name}: its weights changed since compilation"):
        runtime.load(tmp_path / "a", rank=0, world_size=1, options=OPTIONS)
    with pytest.raises(CheckpointError, match=r"experts\.6\.w2\.weight_scale.*NaN scale bytes"):
        runtime.load(tmp_path / "a", rank=0, world_size=1, options=replace(OPTIONS, check_checkpoint=False))


def _generate_on_rank(rank: int, world: int, artifact) -> tuple[list[list[int]], dict[str, torch.Tensor]]:
    torch.set_num_threads(1)
    rt = runtime.load(artifact, rank=rank, world_size=world, options=OPTIONS)
    held = {n: t for n, t in rt.weights.items() if "layers.1.mlp.experts.w2" in n}
    return rt.generate(PROMPTS, 12), held


@pytest.mark.slow
def test_tp2_ranks_hold_their_slice_and_greedy_tokens_match_the_pass_off(model_dirs, compile_once, optimize_shared,
                                                                        tmp_path, rank_pools):
    """TP2 on gloo: the same tokens with the pass on and off, and each rank holds its half
    of w2's input dim as the checkpoint's bytes: codes and scale groups, nothing else."""
    from safetensors import safe_open

    model_dir = model_dirs("tiny", "mxfp4")
    runs = {}
    optimize_shared(model_dir, tmp_path / "off", CompileOptions(tp=2, dtype="float32", disable=("mxfp4_experts",)))
    ranks = rank_pools.get(2)
    runs["on"] = ranks.run(_generate_on_rank, compile_once("tiny", "mxfp4", tp=2, dtype="float32").out_dir)
    runs["off"] = ranks.run(_generate_on_rank, tmp_path / "off")
    assert runs["on"][0][0] == runs["on"][1][0] == runs["off"][0][0]
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]
    I = get_preset("tiny").moe_intermediate_size
    for rank, (_, held) in enumerate(runs["on"]):
        for suffix, per_byte in (("packed", 2), ("scale", 32)):
            name = f"language_model.model.layers.1.block_sparse_moe.experts.4.w2.weight_{suffix}"
            with safe_open(str(model_dir / index[name]), "pt") as f:
                full = f.get_tensor(name)
            half = I // 2 // per_byte
            assert torch.equal(held[f"k3.model.layers.1.mlp.experts.w2_{suffix}"][4], full[:, rank * half:(rank + 1) * half])
