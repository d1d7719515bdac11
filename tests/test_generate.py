"""The model generator: the files it writes, routed experts drawn directly in MXFP4, and
atomic writes (``k3compile/checkpoint/generate.py``)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from checkpoint_files import P, SHARD_BYTES, headers, stored, weight_map
from k3compile.checkpoint.generate import (
    GenerateOptions,
    GenerateStats,
    checkpoint_tensors,
    generate_model_dir,
    mxfp4_nominal_exponent,
    random_mxfp4,
    random_tensor,
    stored_random_tensor,
)
from k3compile.checkpoint.loader import INDEX_FILE
from k3compile.checkpoint.mxfp4 import unpack_mxfp4
from k3compile.config import MXFP4_QUANTIZATION_CONFIG, PRESETS, ConfigError, K3Config, load_config, with_layers
from k3compile.sharding import ParallelPlan, ShardSpec

TINY = PRESETS["tiny"]


def expected_tensors(cfg: K3Config, experts: str = "bf16") -> dict[str, tuple[list[int], str]]:
    """K3_ARCHITECTURE.md section 4 for ``cfg``: name (no prefix) -> (shape, safetensors dtype)."""
    h, V = cfg.hidden_size, cfg.vocab_size
    lin = cfg.linear_attn
    H, D, K = lin.num_heads, lin.head_dim, lin.short_conv_kernel_size
    Hm, nope, rope, v = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    L, inter, E = cfg.routed_expert_hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    shared = cfg.num_shared_experts * inter
    bf, f32 = "BF16", "F32"
    t = {
        "model.embed_tokens.weight": ([V, h], bf),
        "lm_head.weight": ([V, h], bf),
        "model.norm.weight": ([h], bf),
        "model.output_attn_res_proj.weight": ([1, h], bf),
        "model.output_attn_res_norm.weight": ([h], bf),
    }
    for layer, kind in enumerate(cfg.layer_kinds):
        p = f"model.layers.{layer}."
        for n in ("input_layernorm", "post_attention_layernorm", "self_attention_res_norm", "mlp_res_norm"):
            t[f"{p}{n}.weight"] = ([h], bf)
        for n in ("self_attention_res_proj", "mlp_res_proj"):
            t[f"{p}{n}.weight"] = ([1, h], bf)
        a = p + "self_attn."
        if kind == "kda":
            for x in "qkv":
                t[f"{a}{x}_proj.weight"] = ([H * D, h], bf)
                t[f"{a}{x}_conv1d.weight"] = ([H * D, 1, K], f32)
            t[a + "f_a_proj.weight"] = ([D, h], bf)
            t[a + "f_b_proj.weight"] = ([H * D, D], bf)
            t[a + "b_proj.weight"] = ([H, h], bf)
            t[a + "g_proj.weight"] = ([H * D, h], bf)
            t[a + "A_log"] = ([max(D, H)], f32)  # head_dim entries (128 in K3), first H used
            t[a + "dt_bias"] = ([H * D], f32)
            t[a + "o_norm.weight"] = ([D], f32)
            t[a + "o_proj.weight"] = ([h, H * D], bf)
        else:
            t[a + "q_a_proj.weight"] = ([cfg.q_lora_rank, h], bf)
            t[a + "q_a_layernorm.weight"] = ([cfg.q_lora_rank], bf)
            t[a + "q_b_proj.weight"] = ([Hm * (nope + rope), cfg.q_lora_rank], bf)
            t[a + "kv_a_proj_with_mqa.weight"] = ([cfg.kv_lora_rank + rope, h], bf)
            t[a + "kv_a_layernorm.weight"] = ([cfg.kv_lora_rank], bf)
            t[a + "kv_b_proj.weight"] = ([Hm * (nope + v), cfg.kv_lora_rank], bf)
            t[a + "g_proj.weight"] = ([Hm * v, h], bf)
            t[a + "o_proj.weight"] = ([h, Hm * v], bf)
        if layer < cfg.first_k_dense_replace:
            m = p + "mlp."
            t[m + "gate_proj.weight"] = ([cfg.intermediate_size, h], bf)
            t[m + "up_proj.weight"] = ([cfg.intermediate_size, h], bf)
            t[m + "down_proj.weight"] = ([h, cfg.intermediate_size], bf)
            continue
        m = p + "block_sparse_moe."
        t[m + "gate.weight"] = ([E, h], bf)
        t[m + "gate.e_score_correction_bias"] = ([E], f32)
        t[m + "routed_expert_down_proj.weight"] = ([L, h], bf)
        t[m + "routed_expert_norm.weight"] = ([L], bf)
        t[m + "routed_expert_up_proj.weight"] = ([h, L], bf)
        for e in range(E):
            for proj, (rows, cols) in (("w1", (inter, L)), ("w3", (inter, L)), ("w2", (L, inter))):
                base = f"{m}experts.{e}.{proj}"
                if experts == "mxfp4":
                    t[base + ".weight_packed"] = ([rows, cols // 2], "U8")
                    t[base + ".weight_scale"] = ([rows, cols // 32], "U8")
                else:
                    t[base + ".weight"] = ([rows, cols], bf)
        t[m + "shared_experts.gate_proj.weight"] = ([shared, h], bf)
        t[m + "shared_experts.up_proj.weight"] = ([shared, h], bf)
        t[m + "shared_experts.down_proj.weight"] = ([h, shared], bf)
    return t


# ---------------------------------------------------------------------------
# What the generator writes
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("preset, experts", [("tiny", "bf16"), ("tiny", "mxfp4"), ("tiny-linear", "bf16")])
def test_index_lists_every_tensor_with_shape_and_dtype(ckpt, preset, experts):
    d = ckpt(preset, experts)
    cfg = PRESETS[preset]
    prefix = cfg.checkpoint_prefix
    want = {prefix + k: v for k, v in expected_tensors(cfg, experts).items()}
    index = json.loads((d / INDEX_FILE).read_text())
    wm = index["weight_map"]
    got = headers(d)
    assert set(wm) == set(want)
    assert set(got) == set(want)  # the shards hold exactly the indexed tensors
    for name, (shape, dtype) in want.items():
        assert got[name][:2] == (shape, dtype), name
        assert got[name][2] == wm[name], name  # and each where the index says
    shards = sorted(set(wm.values()))
    assert len(shards) >= 3
    assert shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    assert sorted(p.name for p in d.iterdir()) == sorted([*shards, INDEX_FILE, "config.json"])
    nbytes = {"BF16": 2, "F32": 4, "U8": 1}
    total = sum(torch.Size(s).numel() * nbytes[dt] for s, dt in want.values())
    assert index["metadata"]["total_size"] == total
    assert load_config(d) == cfg.replace(expert_format=experts)  # quantization_config follows the format written


def test_tensor_names_carry_the_language_model_prefix_for_kimi_k3(ckpt):
    k3 = weight_map(ckpt("tiny"))
    assert json.loads((ckpt("tiny") / "config.json").read_text())["model_type"] == "kimi_k3"
    assert all(k.startswith(P) for k in k3)
    assert P + "model.layers.2.self_attn.q_b_proj.weight" in k3 and P + "lm_head.weight" in k3

    flat = weight_map(ckpt("tiny-linear"))
    assert json.loads((ckpt("tiny-linear") / "config.json").read_text())["model_type"] == "kimi_linear"
    assert not any(k.startswith(P) for k in flat)
    assert "model.embed_tokens.weight" in flat and "lm_head.weight" in flat
    assert "model.layers.0.self_attn.A_log" in flat


def test_generation_is_deterministic_per_seed(ckpt):
    a = stored(ckpt("tiny", seed=7))
    b = stored(ckpt("tiny", seed=7, shard_bytes=1 << 20))  # other shard boundaries, same values
    shard_count = lambda d: len(set(weight_map(d).values()))  # noqa: E731
    assert shard_count(ckpt("tiny", seed=7)) > shard_count(ckpt("tiny", seed=7, shard_bytes=1 << 20)) > 1
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    c = stored(ckpt("tiny", seed=8))
    assert c.keys() == a.keys()
    assert all(not torch.equal(a[k], c[k]) for k in a)


def test_generated_values_are_plausible(ckpt):
    t = stored(ckpt("tiny"))
    q = t[P + "model.layers.0.self_attn.q_proj.weight"].float()
    assert abs(q.std().item() - TINY.hidden_size**-0.5) < 0.2 * TINY.hidden_size**-0.5
    a_log = t[P + "model.layers.0.self_attn.A_log"]
    assert torch.all((a_log.exp() >= 0.5 - 1e-6) & (a_log.exp() <= 4.0 + 1e-6))
    norm = t[P + "model.layers.0.input_layernorm.weight"].float()
    assert (norm - 1).abs().max() < 1.0 and norm.std() > 0
    for k, v in t.items():
        assert torch.isfinite(v.float()).all(), k


# ---------------------------------------------------------------------------
# Routed experts drawn directly in MXFP4
# ---------------------------------------------------------------------------

RANK = with_layers(PRESETS["k3-tp8-rank"], 2)  # one TP8 rank's real shapes; only specs and single draws
EXPERT = "model.layers.1.block_sparse_moe.experts.{e}.{proj}.weight"


def _rank_specs() -> dict[str, ShardSpec]:
    return dict(checkpoint_tensors(RANK))


def test_expert_draws_are_deterministic_per_seed_and_name():
    shape = (RANK.moe_intermediate_size, RANK.routed_expert_hidden_size)  # w1: [384, 3584]
    packed, scale = random_mxfp4(RANK, EXPERT.format(e=5, proj="w1"), shape, seed=3)
    assert packed.dtype == scale.dtype == torch.uint8
    assert packed.shape == (384, 3584 // 2) and scale.shape == (384, 3584 // 32)
    again = random_mxfp4(RANK, EXPERT.format(e=5, proj="w1"), shape, seed=3)
    assert torch.equal(again[0], packed) and torch.equal(again[1], scale)  # same bytes
    for other in (random_mxfp4(RANK, EXPERT.format(e=6, proj="w1"), shape, 3),  # another expert
                  random_mxfp4(RANK, EXPERT.format(e=5, proj="w3"), shape, 3),  # another projection
                  random_mxfp4(RANK, EXPERT.format(e=5, proj="w1"), shape, 4)):  # another seed
        assert (other[0] != packed).float().mean() > 0.9  # independent bytes agree 1/256 of the time
        assert not torch.equal(other[1], scale)


@pytest.mark.parametrize("proj", ["w1", "w2"])
def test_expert_draw_statistics(proj):
    """Uniform codes, scale bytes within +-1 of the nominal exponent (each about a third of the
    groups), and an rms within 2**0.5 of the linear-weight rule's std."""
    name = EXPERT.format(e=11, proj=proj)
    spec = _rank_specs()[name]
    rows, cols = spec.shape
    assert spec.shape == ((384, 3584) if proj == "w1" else (3584, 384))
    packed, scale = random_mxfp4(RANK, name, spec.shape, seed=0)
    std = cols**-0.5 / ((2 * RANK.num_hidden_layers) ** 0.5 if proj == "w2" else 1.0)
    nominal = 127 + mxfp4_nominal_exponent(std)
    # The power of two p with p * rms(random code) * rms(2**offset) = p * sqrt(8.5625 * 1.75)
    # nearest std: w1 std 3584**-0.5 = 0.0167 -> 2**-8; w2 std 384**-0.5 / 2 = 0.0255 -> 2**-7.
    assert nominal == {"w1": 127 - 8, "w2": 127 - 7}[proj]
    counts = torch.bincount(scale.flatten().long() - (nominal - 1), minlength=3)
    assert counts.numel() == 3 and torch.all(counts > 0.3 * scale.numel())  # only n-1, n, n+1
    # Every byte value (so every code in either nibble) about equally often: chi-square, 255 dof.
    byte_counts = torch.bincount(packed.flatten().long(), minlength=256).double()
    expected = packed.numel() / 256
    assert ((byte_counts - expected) ** 2 / expected).sum() < 400
    w = unpack_mxfp4(packed, scale, torch.float32)
    rms = w.pow(2).mean().sqrt().item()
    assert 2**-0.5 < rms / std < 2**0.5, (rms, std)
    # Groups use their own scales: nearly every group's largest magnitude is 6 x its scale
    # (no code 6 among 32 uniform ones: (7/8)**32 = 1.4%), so a kernel that reads a
    # neighbour's scale is off by 2x or 4x in two thirds of the groups.
    amax = w.view(rows, cols // 32, 32).abs().amax(-1)
    group_scale = torch.pow(2.0, scale.double() - 127).float()
    assert torch.all(amax <= 6 * group_scale) and (amax == 6 * group_scale).float().mean() > 0.95
    assert (scale[:, 1:] != scale[:, :-1]).float().mean() > 0.5


def test_random_tensor_of_an_expert_is_its_exact_dequantisation():
    specs = _rank_specs()
    name = EXPERT.format(e=2, proj="w2")
    w = random_tensor(RANK, name, specs[name], seed=1)
    assert w.dtype == torch.float32 and w.shape == specs[name].shape
    assert torch.equal(w, unpack_mxfp4(*random_mxfp4(RANK, name, specs[name].shape, 1), torch.float32))
    stored = stored_random_tensor(RANK, name, specs[name], seed=1)  # the spec says bf16
    assert stored.dtype == torch.bfloat16 and torch.equal(stored.float(), w)  # bf16 holds it exactly
    # Other tensors keep their rule (and are not affected by the expert draws).
    q = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(stored_random_tensor(RANK, q, specs[q], 1), random_tensor(RANK, q, specs[q], 1).bfloat16())


def test_stored_random_tensor_for_packed_and_scale_specs():
    """A u8 spec of packed codes / scales (as the compiler's mxfp4 pass declares them) gives
    the bytes of the logical weight's draw; a rank's slice is a slice of those bytes."""
    E, rows, cols = RANK.num_experts, RANK.routed_expert_hidden_size, RANK.moe_intermediate_size  # w2
    base = "model.layers.1.block_sparse_moe.experts.{e}.w2"
    packed_spec = ShardSpec(tuple(base.format(e=e) + ".weight_packed" for e in range(E)), (rows, cols // 2), "u8", dim=1)
    scale_spec = ShardSpec(tuple(base.format(e=e) + ".weight_scale" for e in range(E)), (rows, cols // 32), "u8", dim=1)
    want = random_mxfp4(RANK, base.format(e=7) + ".weight", (rows, cols), seed=2)
    packed = stored_random_tensor(RANK, packed_spec.names[7], packed_spec, seed=2)
    scale = stored_random_tensor(RANK, scale_spec.names[7], scale_spec, seed=2)
    assert torch.equal(packed, want[0]) and torch.equal(scale, want[1])
    plan = ParallelPlan(tp=2, rank=1)
    half = unpack_mxfp4(packed[packed_spec.local_index(plan)], scale[scale_spec.local_index(plan)], torch.float32)
    assert torch.equal(half, unpack_mxfp4(*want, torch.float32)[:, cols // 2 :])
    with pytest.raises(ValueError, match="2-D u8"):
        stored_random_tensor(RANK, packed_spec.names[0], dataclasses.replace(packed_spec, dtype="bf16"), 2)
    with pytest.raises(ValueError, match="weight_packed or .weight_scale"):
        stored_random_tensor(RANK, "model.norm.weight", ShardSpec(("model.norm.weight",), (7168,), "u8"), 2)
    with pytest.raises(ValueError, match="not a routed-expert weight"):
        stored_random_tensor(RANK, "model.layers.1.mlp.down_proj.weight_packed", packed_spec, 2)
    with pytest.raises(ValueError, match="stored_random_tensor"):
        random_tensor(RANK, packed_spec.names[0], packed_spec, 2)


def test_bf16_experts_need_no_whole_scale_groups():
    """A bf16 config may have an expert input dim that is not a multiple of 32: its weights are
    the first columns of the draw for the next multiple; MXFP4 refuses it."""
    cfg = dataclasses.replace(TINY, moe_intermediate_size=48)
    name = "model.layers.1.block_sparse_moe.experts.0.w2.weight"
    spec = dict(checkpoint_tensors(cfg))[name]
    assert spec.shape == (32, 48)
    w = random_tensor(cfg, name, spec, seed=0)
    assert w.shape == (32, 48)
    with pytest.raises(ValueError, match="not a multiple of 32"):
        random_mxfp4(cfg, name, spec.shape, seed=0)
    padded = dataclasses.replace(spec, shape=(32, 64))
    assert torch.equal(w, random_tensor(cfg, name, padded, 0)[:, :48])


@pytest.mark.parametrize("experts", ["bf16", "mxfp4"])
def test_every_stored_tensor_is_stored_random_tensor(ckpt, experts):
    """The writer writes exactly what stored_random_tensor gives (what the translation
    validator draws), packed codes and scales included."""
    d = ckpt("tiny", experts)
    t = stored(d)
    seen = set()
    for name, spec in checkpoint_tensors(TINY):
        base = name.removesuffix(".weight")
        if experts == "mxfp4" and spec.quantized:
            rows, cols = spec.shape
            for suffix, shape in ((".weight_packed", (rows, cols // 2)), (".weight_scale", (rows, cols // 32))):
                u8 = ShardSpec((base + suffix,), shape, "u8")
                assert torch.equal(t[P + base + suffix], stored_random_tensor(TINY, base + suffix, u8, 7)), base + suffix
                seen.add(P + base + suffix)
        else:
            want = stored_random_tensor(TINY, name, spec, 7)
            assert t[P + name].dtype == want.dtype and torch.equal(t[P + name], want), name
            seen.add(P + name)
    assert seen == set(t)


def test_expert_format_defaults_to_the_config_and_an_option_overrides_it(tmp_path):
    mx = TINY.replace(expert_format="mxfp4")
    stats = GenerateStats()
    a = generate_model_dir(mx, tmp_path / "a", GenerateOptions(shard_bytes=1 << 20), stats=stats)
    hf = json.loads((a / "config.json").read_text())
    assert hf["quantization_config"] == MXFP4_QUANTIZATION_CONFIG
    assert hf["k3compile_generated"] == {"seed": 0, "experts": "mxfp4"}
    assert any(k.endswith(".weight_packed") for k in weight_map(a))
    assert load_config(a) == mx
    assert stats.experts == "mxfp4" and stats.shards == len(set(weight_map(a).values()))
    assert stats.bytes == json.loads((a / INDEX_FILE).read_text())["metadata"]["total_size"]
    assert stats.tensors == len(weight_map(a)) and 0 < stats.draw_s + stats.write_s <= stats.total_s

    b = generate_model_dir(mx, tmp_path / "b", GenerateOptions("bf16", shard_bytes=1 << 20))
    hf = json.loads((b / "config.json").read_text())
    assert "quantization_config" not in hf and hf["k3compile_generated"] == {"seed": 0, "experts": "bf16"}
    assert not any(k.endswith(".weight_packed") for k in weight_map(b))
    assert load_config(b) == TINY


# ---------------------------------------------------------------------------
# generate_model_dir: refuses an existing dir, leaves nothing behind on failure
# ---------------------------------------------------------------------------


def test_generate_refuses_an_existing_directory(tmp_path):
    out = tmp_path / "model"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        generate_model_dir(TINY, out, GenerateOptions(shard_bytes=SHARD_BYTES))
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


@pytest.mark.parametrize(
    "cfg, opts, error",
    [
        # Shards are written, then config.json cannot be: no layout for this prefix.
        (dataclasses.replace(TINY, checkpoint_prefix="vision_tower."), GenerateOptions(shard_bytes=SHARD_BYTES), ConfigError),
        # w2's input dim 48 cannot be stored in MXFP4 groups of 32: refused before anything is written.
        (dataclasses.replace(TINY, moe_intermediate_size=48), GenerateOptions("mxfp4", shard_bytes=20_000), ConfigError),
        # Not an expert format: refused before anything is written.
        (TINY, GenerateOptions("fp8"), ValueError),  # type: ignore[arg-type]
    ],
)
def test_generate_leaves_nothing_behind_on_failure(tmp_path, cfg, opts, error):
    parent = tmp_path / "models"
    parent.mkdir()
    with pytest.raises(error):
        generate_model_dir(cfg, parent / "out", opts)
    assert list(parent.iterdir()) == []  # no OUT_DIR, no temporary dir


def test_generate_into_an_impossible_location(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(OSError):
        generate_model_dir(TINY, tmp_path / "file" / "out", GenerateOptions(shard_bytes=SHARD_BYTES))
    assert [p.name for p in tmp_path.iterdir()] == ["file"]
