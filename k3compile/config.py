"""The K3 text-model configuration: reading HF model dirs, validation, presets.

Two layouts are read:

* ``model_type: "kimi_k3"``: the language model is nested under ``text_config``; other
  top-level keys (the vision tower, processor settings) are ignored. Checkpoint tensors
  carry the prefix ``language_model.``.
* ``model_type: "kimi_linear"``: the flat layout of K3's predecessor, no tensor prefix.
  It must still describe a K3-style model (SiTU, latent MoE, AttnRes); a plain Kimi
  Linear config lacks those fields and is rejected naming the first one missing.

Every field the model uses is validated; a missing or bad field raises
:class:`ConfigError` naming the field and the file. Values the reference model does not
implement (e.g. a softmax router) are rejected rather than silently approximated.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

LayerKind = Literal["kda", "mla"]
ExpertFormat = Literal["bf16", "mxfp4"]
EXPERT_FORMATS: tuple[str, ...] = ("bf16", "mxfp4")

#: ``quantization_config`` of a checkpoint whose routed experts are MXFP4 (compressed-tensors'
#: ``mxfp4-pack-quantized``: E2M1 codes + one E8M0 scale per 32 input values).
MXFP4_QUANTIZATION_CONFIG: dict[str, Any] = {
    "quant_method": "compressed-tensors",
    "format": "mxfp4-pack-quantized",
    "config_groups": {
        "routed_experts": {
            "targets": ["re:.*block_sparse_moe\\.experts\\.\\d+\\.w[123]$"],
            "weights": {"num_bits": 4, "type": "float", "group_size": 32, "strategy": "group", "scale_dtype": "e8m0"},
        }
    },
}


class ConfigError(ValueError):
    """A model configuration is missing a field or holds a value k3compile cannot use."""


@dataclass(frozen=True)
class KDAConfig:
    """``linear_attn_config``: the Kimi Delta Attention layers."""

    num_heads: int
    head_dim: int
    short_conv_kernel_size: int
    gate_lower_bound: float
    use_full_rank_gate: bool
    full_attn_layers: tuple[int, ...]  # 1-based, as in config.json
    kda_layers: tuple[int, ...]  # 1-based, as in config.json


@dataclass(frozen=True)
class K3Config:
    """The language model of Kimi K3 (``text_config``), every field the model reads."""

    hidden_size: int
    num_hidden_layers: int
    vocab_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    # SiTU-GLU: gate' = b tanh(gate/b) sigmoid(gate), up' = bl tanh(up/bl)
    hidden_act: str
    situ_beta: float
    situ_linear_beta: float
    # Gated NoPE MLA
    num_attention_heads: int
    num_key_value_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    mla_use_nope: bool
    mla_use_output_gate: bool
    # Dense MLP (layers < first_k_dense_replace) and latent MoE
    intermediate_size: int
    first_k_dense_replace: int
    num_experts: int
    num_experts_per_token: int
    num_shared_experts: int
    moe_intermediate_size: int
    routed_expert_hidden_size: int
    latent_moe_use_norm: bool
    routed_scaling_factor: float
    moe_renormalize: bool
    moe_router_activation_func: str
    use_grouped_topk: bool
    num_expert_group: int
    topk_group: int
    # Attention Residuals
    attn_res_block_size: int
    # KDA
    linear_attn: KDAConfig
    # Bookkeeping
    max_position_embeddings: int
    bos_token_id: int
    eos_token_id: int
    pad_token_id: int
    checkpoint_prefix: str = ""  # "language_model." for kimi_k3 checkpoints
    moe_layer_freq: int = 1  # optional in config.json; K3 has 1 (every layer past the dense ones)
    #: How the checkpoint stores the routed experts: "mxfp4" (``quantization_config`` says
    #: ``mxfp4-pack-quantized``; the safetensors index has the last word, see
    #: k3compile.checkpoint.loader.stored_expert_format) or "bf16".
    expert_format: ExpertFormat = "bf16"

    # ----- derived quantities -------------------------------------------------
    @property
    def layer_kinds(self) -> tuple[LayerKind, ...]:
        full = set(self.linear_attn.full_attn_layers)
        return tuple("mla" if (i + 1) in full else "kda" for i in range(self.num_hidden_layers))

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def mla_cache_width(self) -> int:
        """Values cached per token per MLA layer: normalised latent and the shared k_pe."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def shared_intermediate_size(self) -> int:
        return self.num_shared_experts * self.moe_intermediate_size

    @property
    def mla_softmax_scale(self) -> float:
        return self.qk_head_dim**-0.5

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "K3Config":
        """Inverse of :meth:`to_dict` (used by artifacts; validated like a file)."""
        d = dict(d)
        lin = dict(d.pop("linear_attn"))
        lin["full_attn_layers"] = tuple(lin["full_attn_layers"])
        lin["kda_layers"] = tuple(lin["kda_layers"])
        cfg = cls(linear_attn=KDAConfig(**lin), **d)
        validate(cfg, "<dict>")
        return cfg

    def replace(self, **changes: Any) -> "K3Config":
        cfg = dataclasses.replace(self, **changes)
        validate(cfg, "<replace>")
        return cfg


# ---------------------------------------------------------------------------
# Reading config.json
# ---------------------------------------------------------------------------

# (attribute, json key, type). Types: int, float, bool, str.
_TEXT_FIELDS: tuple[tuple[str, str, type], ...] = (
    ("hidden_size", "hidden_size", int),
    ("num_hidden_layers", "num_hidden_layers", int),
    ("vocab_size", "vocab_size", int),
    ("rms_norm_eps", "rms_norm_eps", float),
    ("tie_word_embeddings", "tie_word_embeddings", bool),
    ("hidden_act", "hidden_act", str),
    ("situ_beta", "activation_situ_beta", float),
    ("situ_linear_beta", "activation_situ_linear_beta", float),
    ("num_attention_heads", "num_attention_heads", int),
    ("num_key_value_heads", "num_key_value_heads", int),
    ("q_lora_rank", "q_lora_rank", int),
    ("kv_lora_rank", "kv_lora_rank", int),
    ("qk_nope_head_dim", "qk_nope_head_dim", int),
    ("qk_rope_head_dim", "qk_rope_head_dim", int),
    ("v_head_dim", "v_head_dim", int),
    ("mla_use_nope", "mla_use_nope", bool),
    ("mla_use_output_gate", "mla_use_output_gate", bool),
    ("intermediate_size", "intermediate_size", int),
    ("first_k_dense_replace", "first_k_dense_replace", int),
    ("num_experts", "num_experts", int),
    ("num_experts_per_token", "num_experts_per_token", int),
    ("num_shared_experts", "num_shared_experts", int),
    ("moe_intermediate_size", "moe_intermediate_size", int),
    ("routed_expert_hidden_size", "routed_expert_hidden_size", int),
    ("latent_moe_use_norm", "latent_moe_use_norm", bool),
    ("routed_scaling_factor", "routed_scaling_factor", float),
    ("moe_renormalize", "moe_renormalize", bool),
    ("moe_router_activation_func", "moe_router_activation_func", str),
    ("use_grouped_topk", "use_grouped_topk", bool),
    ("num_expert_group", "num_expert_group", int),
    ("topk_group", "topk_group", int),
    ("attn_res_block_size", "attn_res_block_size", int),
    ("max_position_embeddings", "max_position_embeddings", int),
    ("bos_token_id", "bos_token_id", int),
    ("eos_token_id", "eos_token_id", int),
    ("pad_token_id", "pad_token_id", int),
)

_KDA_FIELDS: tuple[tuple[str, str, type], ...] = (
    ("num_heads", "num_heads", int),
    ("head_dim", "head_dim", int),
    ("short_conv_kernel_size", "short_conv_kernel_size", int),
    ("gate_lower_bound", "gate_lower_bound", float),
    ("use_full_rank_gate", "use_full_rank_gate", bool),
)


def _get(d: dict[str, Any], key: str, typ: type, where: str, path: str) -> Any:
    if key not in d:
        raise ConfigError(f"{path}: missing field '{where}{key}'")
    value = d[key]
    ok = {
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool),
        bool: isinstance(value, bool),
        str: isinstance(value, str),
    }[typ]
    if not ok:
        raise ConfigError(f"{path}: field '{where}{key}' must be {typ.__name__}, got {value!r}")
    return float(value) if typ is float else value


def _get_layer_list(d: dict[str, Any], key: str, where: str, path: str) -> tuple[int, ...]:
    if key not in d:
        raise ConfigError(f"{path}: missing field '{where}{key}'")
    value = d[key]
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ConfigError(f"{path}: field '{where}{key}' must be a list of 1-based layer numbers, got {value!r}")
    return tuple(value)


def parse_text_config(
    d: dict[str, Any], path: str, where: str = "", checkpoint_prefix: str = "", expert_format: ExpertFormat = "bf16"
) -> K3Config:
    """Build a validated :class:`K3Config` from the language-model part of config.json."""
    if not isinstance(d, dict):
        raise ConfigError(f"{path}: '{where.rstrip('.') or 'config'}' must be an object")
    values = {attr: _get(d, key, typ, where, path) for attr, key, typ in _TEXT_FIELDS}
    if "linear_attn_config" not in d or not isinstance(d["linear_attn_config"], dict):
        raise ConfigError(f"{path}: missing field '{where}linear_attn_config' (an object)")
    lin = d["linear_attn_config"]
    lwhere = f"{where}linear_attn_config."
    kda = KDAConfig(
        **{attr: _get(lin, key, typ, lwhere, path) for attr, key, typ in _KDA_FIELDS},
        full_attn_layers=_get_layer_list(lin, "full_attn_layers", lwhere, path),
        kda_layers=_get_layer_list(lin, "kda_layers", lwhere, path),
    )
    freq = _get(d, "moe_layer_freq", int, where, path) if "moe_layer_freq" in d else 1
    cfg = K3Config(linear_attn=kda, checkpoint_prefix=checkpoint_prefix, moe_layer_freq=freq,
                   expert_format=expert_format, **values)
    validate(cfg, path, where)
    return cfg


def _quantization_format(raw: dict[str, Any], path: str) -> ExpertFormat:
    """The routed experts' format declared by ``quantization_config`` (top level, or the
    text config's): "mxfp4" for compressed-tensors' ``mxfp4-pack-quantized``, else "bf16"."""
    for d in (raw, raw.get("text_config")):
        q = d.get("quantization_config") if isinstance(d, dict) else None
        if q is None:
            continue
        if not isinstance(q, dict):
            raise ConfigError(f"{path}: field 'quantization_config' must be an object")
        return "mxfp4" if q.get("format") == "mxfp4-pack-quantized" else "bf16"
    return "bf16"


def load_config(model_dir: str | Path) -> K3Config:
    """Read ``model_dir/config.json`` (``kimi_k3`` or ``kimi_linear``); ``model_dir`` may
    also be the config.json file itself (e.g. a config kept apart from its weights)."""
    path = Path(model_dir)
    if not path.is_file():
        path = path / "config.json"
        if not path.is_file():
            raise ConfigError(f"{path}: no config.json in model directory {model_dir}")
    try:
        raw = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level must be a JSON object")
    model_type = raw.get("model_type")
    if model_type == "kimi_k3":
        if "text_config" not in raw:
            raise ConfigError(f"{path}: missing field 'text_config' (model_type is kimi_k3)")
        return parse_text_config(raw["text_config"], str(path), "text_config.", "language_model.",
                                 _quantization_format(raw, str(path)))
    if model_type == "kimi_linear":
        return parse_text_config(raw, str(path), "", "", _quantization_format(raw, str(path)))
    raise ConfigError(f"{path}: field 'model_type' must be 'kimi_k3' or 'kimi_linear', got {model_type!r}")


def config_to_hf_dict(cfg: K3Config) -> dict[str, Any]:
    """The config.json content for ``cfg`` in the layout its checkpoint prefix implies."""
    text = {key: getattr(cfg, attr) for attr, key, _ in _TEXT_FIELDS}
    lin = {key: getattr(cfg.linear_attn, attr) for attr, key, _ in _KDA_FIELDS}
    lin["full_attn_layers"] = list(cfg.linear_attn.full_attn_layers)
    lin["kda_layers"] = list(cfg.linear_attn.kda_layers)
    text["linear_attn_config"] = lin
    text["moe_layer_freq"] = cfg.moe_layer_freq
    text["model_type"] = "kimi_linear"
    text["architectures"] = ["KimiLinearForCausalLM"]
    quantization = {"quantization_config": MXFP4_QUANTIZATION_CONFIG} if cfg.expert_format == "mxfp4" else {}
    if cfg.checkpoint_prefix == "language_model.":
        return {
            "model_type": "kimi_k3",
            "architectures": ["KimiK3ForConditionalGeneration"],
            "text_config": text,
            **quantization,
        }
    if cfg.checkpoint_prefix:
        raise ConfigError(f"unknown checkpoint prefix {cfg.checkpoint_prefix!r}")
    return {**text, **quantization}


# ---------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------


def validate(cfg: K3Config, path: str, where: str = "") -> None:
    """Raise :class:`ConfigError` for any value the reference model cannot run exactly.

    ``where`` is the JSON path of the text config in the file (``"text_config."`` for
    kimi_k3), so messages name fields as they appear in config.json."""

    def fail(name: str, msg: str) -> None:
        raise ConfigError(f"{path}: field '{where}{name}' {msg}")

    for attr, key, typ in _TEXT_FIELDS:
        value = getattr(cfg, attr)
        if typ is float and not math.isfinite(value):
            fail(key, f"must be a finite number, got {value}")
        if typ is int and key not in ("bos_token_id", "eos_token_id", "pad_token_id", "first_k_dense_replace"):
            if value <= 0:
                fail(key, f"must be positive, got {value}")
    if cfg.rms_norm_eps <= 0:
        fail("rms_norm_eps", f"must be positive, got {cfg.rms_norm_eps}")
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        tok = getattr(cfg, key)
        if not 0 <= tok < cfg.vocab_size:
            fail(key, f"must be a token id in [0, vocab_size={cfg.vocab_size}), got {tok}")
    if cfg.hidden_act != "situ":
        fail("hidden_act", f"must be 'situ' (SiTU-GLU), got {cfg.hidden_act!r}")
    if cfg.situ_beta <= 0:
        fail("activation_situ_beta", f"must be positive, got {cfg.situ_beta}")
    if cfg.situ_linear_beta <= 0:
        fail("activation_situ_linear_beta", f"must be positive, got {cfg.situ_linear_beta}")
    if cfg.tie_word_embeddings:
        fail("tie_word_embeddings", "must be false (K3 has a separate lm_head)")
    if not cfg.mla_use_nope:
        fail("mla_use_nope", "must be true: K3's MLA applies no rotary embedding")
    if not cfg.mla_use_output_gate:
        fail("mla_use_output_gate", "must be true (gated MLA)")
    if cfg.num_key_value_heads != cfg.num_attention_heads:
        fail("num_key_value_heads", f"must equal num_attention_heads for MLA, got {cfg.num_key_value_heads}")
    if cfg.v_head_dim != cfg.qk_nope_head_dim:
        # The absorbed decode form and kv_b_proj layout assume equal widths, as in K3.
        fail("v_head_dim", f"must equal qk_nope_head_dim ({cfg.qk_nope_head_dim}), got {cfg.v_head_dim}")
    if cfg.moe_router_activation_func != "sigmoid":
        fail("moe_router_activation_func", f"must be 'sigmoid', got {cfg.moe_router_activation_func!r}")
    for key in ("num_expert_group", "topk_group"):
        if cfg.use_grouped_topk and getattr(cfg, key) != 1:
            fail(key, f"must be 1 (group-limited routing is not implemented), got {getattr(cfg, key)}")
    if not cfg.latent_moe_use_norm:
        fail("latent_moe_use_norm", "must be true (routed_expert_norm is part of K3)")
    if cfg.num_experts_per_token > cfg.num_experts:
        fail("num_experts_per_token", f"must be <= num_experts ({cfg.num_experts})")
    if cfg.moe_layer_freq < 1:
        fail("moe_layer_freq", f"must be >= 1, got {cfg.moe_layer_freq}")
    if cfg.first_k_dense_replace < 0 or cfg.first_k_dense_replace > cfg.num_hidden_layers:
        fail("first_k_dense_replace", f"must be in [0, num_hidden_layers], got {cfg.first_k_dense_replace}")
    if cfg.expert_format not in EXPERT_FORMATS:
        raise ConfigError(f"{path}: expert format must be one of {', '.join(EXPERT_FORMATS)}, got {cfg.expert_format!r}")
    for key in ("routed_expert_hidden_size", "moe_intermediate_size"):
        if cfg.expert_format == "mxfp4" and getattr(cfg, key) % 32:
            # mxfp4 experts quantise in groups of 32 along each input dim.
            fail(key, f"must be a multiple of 32 with mxfp4 experts (one scale per 32 values), got {getattr(cfg, key)}")

    lin = cfg.linear_attn
    lw = "linear_attn_config."
    for key in ("num_heads", "head_dim", "short_conv_kernel_size"):
        if getattr(lin, key) <= 0:
            fail(lw + key, f"must be positive, got {getattr(lin, key)}")
    if lin.short_conv_kernel_size < 2:
        fail(lw + "short_conv_kernel_size", "must be >= 2")
    if not math.isfinite(lin.gate_lower_bound) or lin.gate_lower_bound >= 0:
        fail(lw + "gate_lower_bound", f"must be negative (log-space decay bound), got {lin.gate_lower_bound}")
    if not lin.use_full_rank_gate:
        fail(lw + "use_full_rank_gate", "must be true (K3 uses the full-rank output gate g_proj)")
    if lin.head_dim > 128 and lin.num_heads > 128:
        fail(lw + "num_heads", "is implausible")
    n = cfg.num_hidden_layers
    for key, layers in (("full_attn_layers", lin.full_attn_layers), ("kda_layers", lin.kda_layers)):
        bad = [x for x in layers if not 1 <= x <= n]
        if bad:
            fail(lw + key, f"holds layer numbers outside 1..{n} (the lists are 1-based): {bad}")
        if len(set(layers)) != len(layers):
            fail(lw + key, "holds a layer twice")
    both = set(lin.full_attn_layers) & set(lin.kda_layers)
    if both:
        fail(lw + "kda_layers", f"and full_attn_layers both name layers {sorted(both)}")
    missing = set(range(1, n + 1)) - set(lin.full_attn_layers) - set(lin.kda_layers)
    if missing:
        fail(lw + "kda_layers", f"and full_attn_layers together must cover 1..{n}; missing {sorted(missing)}")


# ---------------------------------------------------------------------------
# Presets
# ---------------------------------------------------------------------------


def _k3_layers(num_layers: int, every: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """1-based MLA layers every ``every`` layers plus the last one; the rest KDA."""
    full = sorted(set(range(every, num_layers + 1, every)) | {num_layers})
    kda = [i for i in range(1, num_layers + 1) if i not in full]
    return tuple(full), tuple(kda)


def _preset(
    *,
    hidden: int,
    layers: int,
    mla_every: int,
    heads: int,
    kda_heads: int,
    kda_head_dim: int,
    q_lora: int,
    kv_lora: int,
    nope: int,
    rope: int,
    vocab: int,
    dense_inter: int,
    experts: int,
    topk: int,
    moe_inter: int,
    latent: int,
    block: int,
    prefix: str = "language_model.",
    expert_format: ExpertFormat = "bf16",
    max_positions: int | None = None,
) -> K3Config:
    full, kda = _k3_layers(layers, mla_every)
    cfg = K3Config(
        hidden_size=hidden,
        num_hidden_layers=layers,
        vocab_size=vocab,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        hidden_act="situ",
        situ_beta=4.0,
        situ_linear_beta=25.0,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        q_lora_rank=q_lora,
        kv_lora_rank=kv_lora,
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=nope,
        mla_use_nope=True,
        mla_use_output_gate=True,
        intermediate_size=dense_inter,
        first_k_dense_replace=1,
        num_experts=experts,
        num_experts_per_token=topk,
        num_shared_experts=2,
        moe_intermediate_size=moe_inter,
        routed_expert_hidden_size=latent,
        latent_moe_use_norm=True,
        routed_scaling_factor=1.0,
        moe_renormalize=True,
        moe_router_activation_func="sigmoid",
        use_grouped_topk=True,
        num_expert_group=1,
        topk_group=1,
        attn_res_block_size=block,
        linear_attn=KDAConfig(
            num_heads=kda_heads,
            head_dim=kda_head_dim,
            short_conv_kernel_size=4,
            gate_lower_bound=-5.0,
            use_full_rank_gate=True,
            full_attn_layers=full,
            kda_layers=kda,
        ),
        max_position_embeddings=max_positions or (1048576 if vocab == 163840 else 4096),
        bos_token_id=vocab - 256 if vocab > 512 else 1,
        eos_token_id=vocab - 254 if vocab > 512 else 2,
        pad_token_id=vocab - 1,
        checkpoint_prefix=prefix,
        expert_format=expert_format,
    )
    validate(cfg, "<preset>")
    return cfg


#: The real Kimi K3 text backbone (K3_ARCHITECTURE.md section 2); its routed experts are MXFP4.
K3 = _preset(
    hidden=7168, layers=93, mla_every=4, heads=96, kda_heads=96, kda_head_dim=128,
    q_lora=1536, kv_lora=512, nope=128, rope=64, vocab=163840, dense_inter=33792,
    experts=896, topk=16, moe_inter=3072, latent=3584, block=12, expert_format="mxfp4",
)

PRESETS: dict[str, K3Config] = {
    "k3": K3,
    # 7 layers (0-based): KDA 0 (dense MLP) 1, MLA 2, KDA 3 4, MLA 5 6 (two MLA layers in
    # a row at the tail, as K3's 91, 92); AttnRes blocks of 3 put boundaries at 3 and 6.
    "tiny": _preset(
        hidden=64, layers=7, mla_every=3, heads=4, kda_heads=4, kda_head_dim=16,
        q_lora=32, kv_lora=32, nope=16, rope=8, vocab=512, dense_inter=128,
        experts=8, topk=2, moe_inter=128, latent=32, block=3,
    ),
    # 24 MLA and KDA heads: TP2 leaves 12 per rank, the per-rank head count of K3 at TP8.
    "tiny-h24": _preset(
        hidden=96, layers=5, mla_every=4, heads=24, kda_heads=24, kda_head_dim=8,
        q_lora=32, kv_lora=32, nope=8, rope=8, vocab=512, dense_inter=128,
        experts=8, topk=2, moe_inter=128, latent=32, block=2,
    ),
    # The flat Kimi Linear layout (no "language_model." prefix), same structure as tiny.
    "tiny-linear": _preset(
        hidden=64, layers=6, mla_every=5, heads=4, kda_heads=4, kda_head_dim=16,
        q_lora=32, kv_lora=32, nope=16, rope=8, vocab=512, dense_inter=128,
        experts=8, topk=2, moe_inter=128, latent=32, block=4, prefix="",
    ),
    # One TP8 rank of K3 at TP1: every parameter has the local shape it has on a rank of
    # PRESETS["k3"] at tp=8 (96/8 = 12 MLA and 12 KDA heads, dense 33792/8, experts and
    # shared experts 3072/8 and 6144/8, vocab 163840/8: the vocab-parallel rows), so
    # kernels and passes run on real per-rank shapes without a multi-GPU host. 4 layers
    # by default (KDA + dense MLP, KDA, KDA, MLA; with_layers gives other depths).
    "k3-tp8-rank": _preset(
        hidden=7168, layers=4, mla_every=4, heads=12, kda_heads=12, kda_head_dim=128,
        q_lora=1536, kv_lora=512, nope=128, rope=64, vocab=20480, dense_inter=4224,
        experts=896, topk=16, moe_inter=384, latent=3584, block=12, expert_format="mxfp4",
        max_positions=1048576,
    ),
    # Two TP8 ranks of K3 as one model: k3-tp8-rank with its heads, KDA heads, dense and
    # expert intermediates and vocab rows doubled, so that at --tp 2 each rank holds one
    # TP8 rank's shapes (issue #26: the whole step on two GPUs with NCCL).
    "k3-tp8-rank-x2": _preset(
        hidden=7168, layers=4, mla_every=4, heads=24, kda_heads=24, kda_head_dim=128,
        q_lora=1536, kv_lora=512, nope=128, rope=64, vocab=40960, dense_inter=8448,
        experts=896, topk=16, moe_inter=768, latent=3584, block=12, expert_format="mxfp4",
        max_positions=1048576,
    ),
}


def with_layers(cfg: K3Config, num_layers: int) -> K3Config:
    """``cfg`` with ``num_layers`` layers laid out by its own rule: MLA every
    ``full_attn_layers[0]`` layers (1-based) plus the last layer, the rest KDA. Everything
    else (widths, dense layers, expert format) is kept; the result is validated."""
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise ConfigError(f"number of layers must be a positive integer, got {num_layers!r}")
    lin = cfg.linear_attn
    if not lin.full_attn_layers:
        raise ConfigError("cannot choose the layer kinds: the config has no MLA layer "
                          "(full_attn_layers is empty), so it follows no MLA period")
    full, kda = _k3_layers(num_layers, lin.full_attn_layers[0])
    lin = dataclasses.replace(lin, full_attn_layers=full, kda_layers=kda)
    return cfg.replace(num_hidden_layers=num_layers, linear_attn=lin)


def get_preset(name: str) -> K3Config:
    """The built-in configuration ``name`` (a key of :data:`PRESETS`)."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    return PRESETS[name]


def preset_name(cfg: K3Config) -> str | None:
    """The name of the preset equal to ``cfg``, or None for a custom configuration."""
    return next((name for name, preset in PRESETS.items() if preset == cfg), None)
