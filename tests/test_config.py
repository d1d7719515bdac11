"""config.json reading: both layouts, every preset round-trips, every bad field is named.

Every test writes a real config.json into pytest's tmp_path and reads it back with
:func:`load_config`; nothing is mocked.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from k3compile.config import (
    PRESETS,
    ConfigError,
    K3Config,
    config_to_hf_dict,
    load_config,
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
# The real K3's config.json
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
