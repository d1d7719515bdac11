"""config.json reading: both layouts, every preset round-trips, every bad field is named.

Every test writes a real config.json into pytest's tmp_path and reads it back with
:func:`load_config`; nothing is mocked.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from k3compile.config import (
    PRESETS,
    ConfigError,
    K3Config,
    config_to_hf_dict,
    get_preset,
    load_config,
    with_layers,
)

# Every JSON key of the language-model config (text_config / the flat kimi_linear file).
TEXT_KEYS = [
    "hidden_size", "num_hidden_layers", "vocab_size", "rms_norm_eps", "tie_word_embeddings",
    "hidden_act", "activation_situ_beta", "activation_situ_linear_beta", "num_attention_heads",
    "num_key_value_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
    "v_head_dim", "mla_use_nope", "mla_use_output_gate", "intermediate_size", "first_k_dense_replace",
    "num_experts", "num_experts_per_token", "num_shared_experts", "moe_intermediate_size",
    "routed_expert_hidden_size", "latent_moe_use_norm", "routed_scaling_factor", "moe_renormalize",
    "moe_router_activation_func", "use_grouped_topk", "num_expert_group", "topk_group",
    "attn_res_block_size", "max_position_embeddings", "bos_token_id", "eos_token_id", "pad_token_id",
    "linear_attn_config",
]  # fmt: skip
KDA_KEYS = [
    "num_heads", "head_dim", "short_conv_kernel_size", "gate_lower_bound", "use_full_rank_gate",
    "full_attn_layers", "kda_layers",
]  # fmt: skip


def write_config(tmp_path: Path, content: Any, name: str = "model") -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(content if isinstance(content, str) else json.dumps(content))
    return d


def k3_dict(preset: str = "tiny") -> dict[str, Any]:
    """A kimi_k3 config.json as the real checkpoint lays it out (vision tower and all)."""
    d = copy.deepcopy(config_to_hf_dict(PRESETS[preset]))
    assert d["model_type"] == "kimi_k3"
    return d


def text(d: dict[str, Any]) -> dict[str, Any]:
    return d["text_config"] if d.get("model_type") == "kimi_k3" else d


def expect_error(tmp_path: Path, content: Any, field: str, name: str = "model") -> str:
    """load_config fails with a ConfigError naming ``field`` (quoted, full path) and the file."""
    d = write_config(tmp_path, content, name)
    with pytest.raises(ConfigError) as info:
        load_config(d)
    msg = str(info.value)
    assert f"'{field}'" in msg, msg
    assert str(d / "config.json") in msg, msg
    return msg


# ---------------------------------------------------------------------------
# Reading both layouts
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_round_trips_through_a_file(tmp_path, preset):
    cfg = PRESETS[preset]
    hf = config_to_hf_dict(cfg)
    assert hf["model_type"] == ("kimi_linear" if preset == "tiny-linear" else "kimi_k3")
    loaded = load_config(write_config(tmp_path, hf))
    assert loaded == cfg
    assert loaded.to_dict() == cfg.to_dict()
    assert isinstance(loaded.linear_attn.full_attn_layers, tuple)


def test_kimi_k3_nests_text_config_and_ignores_other_keys(tmp_path):
    d = k3_dict("tiny")
    d["architectures"] = ["KimiK3ForConditionalGeneration"]
    d["vision_config"] = {"model_type": "moonvit", "hidden_size": "not-an-int", "patch_size": 14, "depth": 27}
    d["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "mxfp4-pack-quantized",
        "ignore": ["re:.*self_attn.*", "lm_head", "re:vision_tower.*"],
    }
    d["mm_projector_type"] = "patchmerger"
    d["mm_hidden_size"] = 1152
    d["media_placeholder_token_id"] = 163605
    d["hidden_size"] = "top-level keys are not the text model's"  # read only under text_config
    d["tie_word_embeddings"] = True
    d["text_config"]["rope_theta"] = 50000.0  # unused keys inside text_config are fine too
    d["text_config"]["torch_dtype"] = "bfloat16"
    cfg = load_config(write_config(tmp_path, d))
    assert cfg == PRESETS["tiny"].replace(expert_format="mxfp4")  # quantization_config: mxfp4-pack-quantized
    assert cfg.checkpoint_prefix == "language_model."


def test_kimi_linear_flat_layout_has_no_prefix(tmp_path):
    d = config_to_hf_dict(PRESETS["tiny-linear"])
    assert d["model_type"] == "kimi_linear" and "text_config" not in d
    d["rope_theta"] = 50000.0
    d["vision_config"] = {"ignored": True}
    cfg = load_config(write_config(tmp_path, d))
    assert cfg.checkpoint_prefix == ""
    assert cfg == PRESETS["tiny-linear"]


def test_same_text_config_in_either_layout(tmp_path):
    """A flat kimi_linear file and the same fields under a kimi_k3 text_config give the same
    model; only the checkpoint prefix differs."""
    flat = config_to_hf_dict(PRESETS["tiny-linear"])
    nested = {"model_type": "kimi_k3", "text_config": flat, "vision_config": {}}
    a = load_config(write_config(tmp_path, flat, "flat"))
    b = load_config(write_config(tmp_path, nested, "nested"))
    assert (a.checkpoint_prefix, b.checkpoint_prefix) == ("", "language_model.")
    assert a.replace(checkpoint_prefix="language_model.") == b


def test_integer_valued_floats_are_accepted(tmp_path):
    d = k3_dict()
    d["text_config"]["routed_scaling_factor"] = 1  # JSON writers drop the ".0"
    d["text_config"]["linear_attn_config"]["gate_lower_bound"] = -5
    cfg = load_config(write_config(tmp_path, d))
    assert cfg.routed_scaling_factor == 1.0 and isinstance(cfg.routed_scaling_factor, float)
    assert cfg.linear_attn.gate_lower_bound == -5.0 and isinstance(cfg.linear_attn.gate_lower_bound, float)


# ---------------------------------------------------------------------------
# The real K3 and the tiny presets
# ---------------------------------------------------------------------------

# K3_ARCHITECTURE.md section 2, written out independently of the preset code.
K3_TEXT_CONFIG = {
    "model_type": "kimi_linear",
    "architectures": ["KimiLinearForCausalLM"],
    "hidden_size": 7168, "num_hidden_layers": 93, "num_attention_heads": 96, "num_key_value_heads": 96,
    "vocab_size": 163840, "max_position_embeddings": 1048576, "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False, "hidden_act": "situ", "activation_situ_beta": 4.0,
    "activation_situ_linear_beta": 25.0, "q_lora_rank": 1536, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "mla_use_nope": True,
    "mla_use_output_gate": True, "num_experts": 896, "num_experts_per_token": 16,
    "num_shared_experts": 2, "moe_intermediate_size": 3072, "intermediate_size": 33792,
    "first_k_dense_replace": 1, "routed_expert_hidden_size": 3584, "latent_moe_use_norm": True,
    "routed_scaling_factor": 1.0, "moe_renormalize": True, "moe_router_activation_func": "sigmoid",
    "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1, "attn_res_block_size": 12,
    "bos_token_id": 163584, "eos_token_id": 163586, "pad_token_id": 163839,
    "linear_attn_config": {
        "num_heads": 96, "head_dim": 128, "short_conv_kernel_size": 4, "gate_lower_bound": -5.0,
        "use_full_rank_gate": True,
        "full_attn_layers": [*range(4, 93, 4), 93],
        "kda_layers": [i for i in range(1, 94) if i % 4 and i != 93],
    },
}  # fmt: skip


def test_real_k3_config_json_matches_the_preset(tmp_path):
    d = {
        "model_type": "kimi_k3",
        "architectures": ["KimiK3ForConditionalGeneration"],
        "text_config": K3_TEXT_CONFIG,
        "vision_config": {"model_type": "moonvit", "hidden_size": 1152},
        "quantization_config": {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized"},
    }
    assert load_config(write_config(tmp_path, d)) == PRESETS["k3"]
    assert config_to_hf_dict(PRESETS["k3"])["text_config"]["linear_attn_config"] == K3_TEXT_CONFIG["linear_attn_config"]


def test_k3_preset_values():
    k3 = get_preset("k3")
    assert k3 is PRESETS["k3"]
    assert (k3.hidden_size, k3.num_hidden_layers, k3.vocab_size) == (7168, 93, 163840)
    assert (k3.num_attention_heads, k3.num_key_value_heads) == (96, 96)
    assert k3.max_position_embeddings == 1048576 and k3.rms_norm_eps == 1e-5
    assert k3.tie_word_embeddings is False and k3.hidden_act == "situ"
    assert (k3.situ_beta, k3.situ_linear_beta) == (4.0, 25.0)
    assert (k3.q_lora_rank, k3.kv_lora_rank) == (1536, 512)
    assert (k3.qk_nope_head_dim, k3.qk_rope_head_dim, k3.v_head_dim) == (128, 64, 128)
    assert k3.mla_use_nope and k3.mla_use_output_gate
    assert (k3.num_experts, k3.num_experts_per_token, k3.num_shared_experts) == (896, 16, 2)
    assert (k3.moe_intermediate_size, k3.intermediate_size, k3.first_k_dense_replace) == (3072, 33792, 1)
    assert k3.routed_expert_hidden_size == 3584 and k3.latent_moe_use_norm
    assert k3.routed_scaling_factor == 1.0 and k3.moe_renormalize
    assert k3.moe_router_activation_func == "sigmoid"
    assert (k3.use_grouped_topk, k3.num_expert_group, k3.topk_group) == (True, 1, 1)
    assert k3.attn_res_block_size == 12
    assert (k3.bos_token_id, k3.eos_token_id, k3.pad_token_id) == (163584, 163586, 163839)
    assert k3.checkpoint_prefix == "language_model."
    lin = k3.linear_attn
    assert (lin.num_heads, lin.head_dim, lin.short_conv_kernel_size) == (96, 128, 4)
    assert lin.gate_lower_bound == -5.0 and lin.use_full_rank_gate
    # 1-based lists as in config.json: [4, 8, ..., 92, 93].
    assert lin.full_attn_layers == (*range(4, 93, 4), 93)
    assert len(lin.full_attn_layers) == 24 and len(lin.kda_layers) == 69
    # 0-based: MLA at 3, 7, ..., 91 and 92; the rest (layer 0 included) KDA.
    kinds = k3.layer_kinds
    assert len(kinds) == 93
    assert [i for i, k in enumerate(kinds) if k == "mla"] == [*range(3, 92, 4), 92]
    assert kinds[0] == "kda" and kinds[90] == "kda" and kinds[91] == kinds[92] == "mla"
    assert not k3.is_moe_layer(0) and sum(map(k3.is_moe_layer, range(93))) == 92
    # Derived widths.
    assert k3.qk_head_dim == 192 and k3.mla_cache_width == 576
    assert k3.shared_intermediate_size == 6144
    assert k3.mla_softmax_scale == pytest.approx(192**-0.5)


@pytest.mark.parametrize("preset", ["tiny", "tiny-h24", "tiny-linear"])
def test_tiny_presets_keep_the_structure(preset):
    cfg = PRESETS[preset]
    kinds = cfg.layer_kinds
    n = cfg.num_hidden_layers
    assert kinds[-2:] == ("mla", "mla")  # two MLA layers in a row at the tail, as K3's 91, 92
    assert kinds[0] == "kda" and not cfg.is_moe_layer(0)  # dense layer 0 is KDA
    assert all(cfg.is_moe_layer(i) for i in range(1, n))
    assert cfg.first_k_dense_replace == 1
    # An AttnRes block boundary strictly inside the model (not only layer 0).
    assert any(i % cfg.attn_res_block_size == 0 for i in range(1, n))
    assert cfg.attn_res_block_size < n
    assert cfg.linear_attn.short_conv_kernel_size == 4 and cfg.num_shared_experts == 2
    assert cfg.checkpoint_prefix == ("" if preset == "tiny-linear" else "language_model.")


def test_tiny_preset_layouts():
    tiny = PRESETS["tiny"]
    assert tiny.layer_kinds == ("kda", "kda", "mla", "kda", "kda", "mla", "mla")
    assert [i for i in range(7) if i % tiny.attn_res_block_size == 0] == [0, 3, 6]
    h24 = PRESETS["tiny-h24"]
    assert h24.num_attention_heads == 24 and h24.num_key_value_heads == 24
    assert h24.linear_attn.num_heads == 24
    assert h24.num_attention_heads // 2 == 12  # TP2 leaves K3's TP8 per-rank head count


def test_k3_tp8_rank_preset_values():
    """One TP8 rank of K3 at TP1: the per-rank widths of K3_ARCHITECTURE.md section 5."""
    r, k3 = get_preset("k3-tp8-rank"), PRESETS["k3"]
    assert (r.hidden_size, r.num_hidden_layers, r.vocab_size) == (7168, 4, 163840 // 8)
    assert r.num_attention_heads == r.num_key_value_heads == r.linear_attn.num_heads == 96 // 8
    assert r.linear_attn.head_dim == 128
    assert (r.q_lora_rank, r.kv_lora_rank, r.qk_nope_head_dim, r.qk_rope_head_dim) == (1536, 512, 128, 64)
    assert r.intermediate_size == 33792 // 8 == 4224
    assert (r.num_experts, r.num_experts_per_token, r.routed_expert_hidden_size) == (896, 16, 3584)
    assert r.moe_intermediate_size == 3072 // 8 and r.shared_intermediate_size == 6144 // 8
    assert r.attn_res_block_size == 12 and r.max_position_embeddings == 1048576
    assert r.expert_format == k3.expert_format == "mxfp4"
    assert r.checkpoint_prefix == "language_model."
    assert r.layer_kinds == ("kda", "kda", "kda", "mla") and not r.is_moe_layer(0)
    assert all(r.is_moe_layer(i) for i in (1, 2, 3))
    # Everything that is not a width is K3's.
    same = ("rms_norm_eps", "situ_beta", "situ_linear_beta", "first_k_dense_replace", "num_shared_experts",
            "routed_scaling_factor", "moe_renormalize", "moe_router_activation_func", "use_grouped_topk",
            "mla_use_nope", "mla_use_output_gate", "latent_moe_use_norm", "moe_layer_freq")
    assert all(getattr(r, f) == getattr(k3, f) for f in same)
    assert r.linear_attn.gate_lower_bound == k3.linear_attn.gate_lower_bound


def test_k3_tp8_rank_has_the_local_shapes_of_a_k3_tp8_rank():
    """Every parameter of the rank slice (built at TP1) has the shape and dtype of the same
    parameter on a rank of the real model at TP8. A slice layer is compared with a K3 layer of
    the same kind (KDA/MLA) and MLP (dense/MoE): with 6 layers the slice's layer 5 is MLA (the
    last layer), K3's layer 5 is KDA. The vocab-parallel embedding and lm_head match too
    (163840 / 8 = 20480 rows); what differs is the rank constant ``vocab_start`` (rank r's
    first vocab id, 0 at TP1), a buffer, not a parameter."""
    import torch

    from k3compile.model import K3ForCausalLM
    from k3compile.sharding import ParallelPlan, shard_specs

    k3, plan8 = PRESETS["k3"], ParallelPlan(tp=8, rank=5)
    rank = with_layers(PRESETS["k3-tp8-rank"], 6)
    with torch.device("meta"):
        full = K3ForCausalLM(k3, plan8)
        local = K3ForCausalLM(rank)
    full_params, local_params = dict(full.named_parameters()), dict(local.named_parameters())
    full_specs, local_specs = shard_specs(full), shard_specs(local)

    def k3_layer(i: int) -> int:
        kind, moe = rank.layer_kinds[i], rank.is_moe_layer(i)
        return next(j for j, k in enumerate(k3.layer_kinds) if k == kind and k3.is_moe_layer(j) == moe)

    assert [k3_layer(i) for i in range(6)] == [0, 1, 1, 3, 1, 3]
    compared = set()
    for name, p in local_params.items():
        parts = name.split(".")
        if parts[:2] == ["model", "layers"]:
            parts[2] = str(k3_layer(int(parts[2])))
        k3_name = ".".join(parts)
        q = full_params[k3_name]
        assert p.shape == q.shape and p.dtype == q.dtype, (name, tuple(p.shape), tuple(q.shape))
        assert local_specs[name].local_shape(ParallelPlan()) == full_specs[k3_name].local_shape(plan8), name
        compared.add(k3_name)
    # Every parameter of the compared K3 layers (and every global one) has a counterpart.
    layers = {f"model.layers.{j}." for j in (0, 1, 3)}
    assert compared == {n for n in full_params if not n.startswith("model.layers.") or n[: n.index(".", 13) + 1] in layers}
    assert local.lm_head.weight.shape == full.lm_head.weight.shape == (20480, 7168)
    buffers = dict(full.named_buffers())
    assert int(buffers["model.embed_tokens.vocab_start"]) == 5 * 20480
    assert int(dict(local.named_buffers())["model.embed_tokens.vocab_start"]) == 0


def test_k3_tp8_rank_x2_at_tp2_has_the_rank_slices_shapes():
    """k3-tp8-rank-x2 compiled at TP2: every parameter of either rank has the shape and dtype
    of the same parameter of k3-tp8-rank at TP1 (one TP8 rank of K3), so two GPUs run one TP8
    rank's per-GPU shapes with real collectives between them."""
    import torch

    from k3compile.model import K3ForCausalLM
    from k3compile.sharding import ParallelPlan

    with torch.device("meta"):
        slice_ = dict(K3ForCausalLM(PRESETS["k3-tp8-rank"]).named_parameters())
        for rank in (0, 1):
            pair = dict(K3ForCausalLM(PRESETS["k3-tp8-rank-x2"], ParallelPlan(tp=2, rank=rank)).named_parameters())
            assert pair.keys() == slice_.keys()
            for name, p in pair.items():
                assert (p.shape, p.dtype) == (slice_[name].shape, slice_[name].dtype), name


def test_with_layers_follows_the_presets_own_rule():
    for name, cfg in PRESETS.items():
        assert with_layers(cfg, cfg.num_hidden_layers) == cfg, name  # the rule that built the preset
    k3 = PRESETS["k3"]
    eight = with_layers(k3, 8)
    assert eight.num_hidden_layers == 8 and eight.linear_attn.full_attn_layers == (4, 8)
    assert eight.layer_kinds == ("kda",) * 3 + ("mla",) + ("kda",) * 3 + ("mla",)
    assert eight.replace(num_hidden_layers=93, linear_attn=k3.linear_attn) == k3  # nothing else changed
    ten = with_layers(k3, 10)
    assert ten.linear_attn.full_attn_layers == (4, 8, 10) and ten.linear_attn.kda_layers == (1, 2, 3, 5, 6, 7, 9)
    assert with_layers(PRESETS["tiny"], 10).linear_attn.full_attn_layers == (3, 6, 9, 10)  # tiny: every 3rd
    one = with_layers(PRESETS["k3-tp8-rank"], 1)
    assert one.layer_kinds == ("mla",) and not one.is_moe_layer(0)  # the last layer is MLA; dense layer 0
    assert one.expert_format == "mxfp4"
    assert with_layers(PRESETS["k3-tp8-rank"], 93).replace(
        num_attention_heads=96, num_key_value_heads=96, vocab_size=163840, intermediate_size=33792,
        moe_intermediate_size=3072, linear_attn=dataclasses.replace(k3.linear_attn),
        bos_token_id=163584, eos_token_id=163586, pad_token_id=163839,
    ) == k3
    for bad in (0, -1):
        with pytest.raises(ConfigError, match="positive integer"):
            with_layers(k3, bad)
    all_kda = dataclasses.replace(k3.linear_attn, full_attn_layers=(), kda_layers=tuple(range(1, 94)))
    with pytest.raises(ConfigError, match="no MLA layer"):
        with_layers(dataclasses.replace(k3, linear_attn=all_kda), 4)


def test_unknown_preset():
    with pytest.raises(ConfigError, match="tiny-h24"):
        get_preset("huge")


# ---------------------------------------------------------------------------
# Errors: each names the field (with its path) and the file
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("key", TEXT_KEYS)
def test_missing_text_field(tmp_path, key):
    d = k3_dict()
    del d["text_config"][key]
    msg = expect_error(tmp_path, d, f"text_config.{key}")
    assert "missing" in msg


@pytest.mark.parametrize("key", KDA_KEYS)
def test_missing_linear_attn_field(tmp_path, key):
    d = k3_dict()
    del d["text_config"]["linear_attn_config"][key]
    expect_error(tmp_path, d, f"text_config.linear_attn_config.{key}")


def test_missing_field_in_flat_layout_has_no_text_config_path(tmp_path):
    d = config_to_hf_dict(PRESETS["tiny-linear"])
    del d["num_experts"]
    msg = expect_error(tmp_path, d, "num_experts")
    assert "text_config." not in msg
    d = config_to_hf_dict(PRESETS["tiny-linear"])
    del d["linear_attn_config"]["kda_layers"]
    msg = expect_error(tmp_path, d, "linear_attn_config.kda_layers", "second")
    assert "text_config." not in msg


@pytest.mark.parametrize(
    "key, value",
    [
        ("hidden_size", "64"),  # string for int
        ("num_experts", True),  # bool for int
        ("num_hidden_layers", 7.0),  # float for int
        ("q_lora_rank", None),
        ("rms_norm_eps", "1e-5"),  # string for float
        ("routed_scaling_factor", False),  # bool for float
        ("mla_use_nope", 1),  # int for bool
        ("tie_word_embeddings", "false"),
        ("hidden_act", 1),  # int for str
        ("linear_attn_config", [1, 2]),  # list for object
    ],
)
def test_wrong_type_text_field(tmp_path, key, value):
    d = k3_dict()
    d["text_config"][key] = value
    expect_error(tmp_path, d, f"text_config.{key}")


@pytest.mark.parametrize(
    "key, value",
    [
        ("num_heads", "4"),
        ("head_dim", True),
        ("gate_lower_bound", "-5"),
        ("use_full_rank_gate", 1),
        ("full_attn_layers", 3),  # not a list
        ("full_attn_layers", ["3", "6", "7"]),  # strings in the list
        ("kda_layers", [1, 2, 4, 5.0]),  # float in the list
        ("kda_layers", [True, 2, 4, 5]),  # bool in the list
    ],
)
def test_wrong_type_linear_attn_field(tmp_path, key, value):
    d = k3_dict()
    d["text_config"]["linear_attn_config"][key] = value
    expect_error(tmp_path, d, f"text_config.linear_attn_config.{key}")


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_float(tmp_path, value):
    d = k3_dict()
    d["text_config"]["rms_norm_eps"] = value  # json.dumps writes NaN / Infinity, json.loads reads them
    expect_error(tmp_path, d, "text_config.rms_norm_eps")


def test_zero_based_layer_lists_are_rejected(tmp_path):
    """Layer lists are 1-based; a 0-based list (layer 0 present) is an error, not a shift."""
    d = k3_dict()
    lin = d["text_config"]["linear_attn_config"]
    lin["full_attn_layers"] = [2, 5, 6]
    lin["kda_layers"] = [0, 1, 3, 4]
    msg = expect_error(tmp_path, d, "text_config.linear_attn_config.kda_layers")
    assert "1-based" in msg and "[0]" in msg


def test_zero_in_full_attn_layers(tmp_path):
    d = k3_dict()
    lin = d["text_config"]["linear_attn_config"]
    lin["full_attn_layers"] = [0, 3, 6, 7]
    lin["kda_layers"] = [1, 2, 4, 5]
    msg = expect_error(tmp_path, d, "text_config.linear_attn_config.full_attn_layers")
    assert "1-based" in msg


def test_layer_beyond_the_model(tmp_path):
    d = k3_dict()
    d["text_config"]["linear_attn_config"]["full_attn_layers"] = [3, 6, 7, 8]
    expect_error(tmp_path, d, "text_config.linear_attn_config.full_attn_layers")


def test_overlapping_layer_lists(tmp_path):
    d = k3_dict()
    d["text_config"]["linear_attn_config"]["kda_layers"] = [1, 2, 3, 4, 5]  # 3 is also MLA
    msg = expect_error(tmp_path, d, "text_config.linear_attn_config.kda_layers")
    assert "full_attn_layers" in msg and "[3]" in msg


def test_incomplete_layer_lists(tmp_path):
    d = k3_dict()
    d["text_config"]["linear_attn_config"]["kda_layers"] = [1, 2, 5]  # layer 4 in neither
    msg = expect_error(tmp_path, d, "text_config.linear_attn_config.kda_layers")
    assert "[4]" in msg


def test_layer_listed_twice(tmp_path):
    d = k3_dict()
    d["text_config"]["linear_attn_config"]["full_attn_layers"] = [3, 6, 7, 7]
    expect_error(tmp_path, d, "text_config.linear_attn_config.full_attn_layers")


@pytest.mark.parametrize(
    "key, value",
    [
        ("hidden_act", "silu"),
        ("moe_router_activation_func", "softmax"),
        ("tie_word_embeddings", True),
        ("mla_use_nope", False),
        ("mla_use_output_gate", False),
        ("latent_moe_use_norm", False),
        ("num_key_value_heads", 1),
        ("v_head_dim", 32),
        ("num_expert_group", 4),
        ("num_experts_per_token", 9),  # more than num_experts
        ("hidden_size", 0),
        ("vocab_size", -1),
        ("rms_norm_eps", 0.0),
        ("pad_token_id", 512),  # == vocab_size
        ("first_k_dense_replace", 8),  # > num_hidden_layers
    ],
)
def test_unsupported_text_value(tmp_path, key, value):
    d = k3_dict()
    d["text_config"][key] = value
    expect_error(tmp_path, d, f"text_config.{key}")


@pytest.mark.parametrize("key", ["moe_intermediate_size", "routed_expert_hidden_size"])
def test_expert_dims_need_whole_mxfp4_groups_only_with_mxfp4_experts(tmp_path, key):
    d = k3_dict()
    d["text_config"][key] = 100  # not a multiple of the MXFP4 group of 32
    assert getattr(load_config(write_config(tmp_path, d, "bf16")), key) == 100  # bf16 experts split anywhere
    d["quantization_config"] = {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized"}
    expect_error(tmp_path, d, f"text_config.{key}", "mxfp4")


@pytest.mark.parametrize(
    "key, value",
    [("gate_lower_bound", 0.5), ("use_full_rank_gate", False), ("short_conv_kernel_size", 1), ("num_heads", 0)],
)
def test_unsupported_linear_attn_value(tmp_path, key, value):
    d = k3_dict()
    d["text_config"]["linear_attn_config"][key] = value
    expect_error(tmp_path, d, f"text_config.linear_attn_config.{key}")


def test_unsupported_value_in_flat_layout(tmp_path):
    d = config_to_hf_dict(PRESETS["tiny-linear"])
    d["hidden_act"] = "gelu"
    msg = expect_error(tmp_path, d, "hidden_act")
    assert "text_config." not in msg


def test_invalid_json(tmp_path):
    d = write_config(tmp_path, '{"model_type": "kimi_k3", "text_config": {')
    with pytest.raises(ConfigError, match="not valid JSON") as info:
        load_config(d)
    assert str(d / "config.json") in str(info.value)


def test_config_that_is_not_utf8(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_bytes(b'{"model_type": "\xff\xfe"}')
    with pytest.raises(ConfigError) as info:
        load_config(d)
    assert str(d / "config.json") in str(info.value)


def test_config_json_not_an_object(tmp_path):
    d = write_config(tmp_path, [1, 2, 3])
    with pytest.raises(ConfigError, match="object") as info:
        load_config(d)
    assert str(d / "config.json") in str(info.value)


def test_missing_config_json(tmp_path):
    with pytest.raises(ConfigError, match="no config.json") as info:
        load_config(tmp_path)
    assert str(tmp_path / "config.json") in str(info.value)
    with pytest.raises(ConfigError, match="no config.json"):
        load_config(tmp_path / "does-not-exist")


@pytest.mark.parametrize("model_type", ["deepseek_v3", "KimiK3", None, 3])
def test_unknown_model_type(tmp_path, model_type):
    d = k3_dict()
    if model_type is None:
        del d["model_type"]
    else:
        d["model_type"] = model_type
    msg = expect_error(tmp_path, d, "model_type")
    assert "kimi_k3" in msg and "kimi_linear" in msg


def test_kimi_k3_without_text_config(tmp_path):
    d = k3_dict()
    flat = d.pop("text_config")
    d.update({k: v for k, v in flat.items() if k != "model_type"})  # fields at the top level do not count
    expect_error(tmp_path, d, "text_config")


def test_text_config_not_an_object(tmp_path):
    d = k3_dict()
    d["text_config"] = "kimi_linear"
    expect_error(tmp_path, d, "text_config")


def test_config_objects_compare_by_value():
    """Round-trip equality above relies on frozen dataclass equality, tuples included."""
    tiny = PRESETS["tiny"]
    assert isinstance(tiny, K3Config)
    assert K3Config.from_dict(tiny.to_dict()) == tiny
    assert tiny.replace(vocab_size=1024) != tiny


def test_moe_layer_freq_is_optional_and_selects_moe_layers(tmp_path):
    d = k3_dict("tiny")
    del text(d)["moe_layer_freq"]
    assert load_config(write_config(tmp_path, d, "absent")).moe_layer_freq == 1
    text(d)["moe_layer_freq"] = 2
    cfg = load_config(write_config(tmp_path, d, "every-other"))
    assert [cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)] == [False, False, True, False, True, False, True]
    text(d)["moe_layer_freq"] = 0
    expect_error(tmp_path, d, "text_config.moe_layer_freq", "zero")
