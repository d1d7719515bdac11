"""The presets: the real K3's values (K3_ARCHITECTURE.md), the tiny presets' structure, the
rank slices' per-rank shapes (``k3-tp8-rank`` at TP1 against a rank of K3 at TP8,
``k3-tp8-rank-x2`` at TP2 against ``k3-tp8-rank``), and ``with_layers``' layouts."""

from __future__ import annotations

import dataclasses

import pytest

from k3compile.config import PRESETS, ConfigError, get_preset, with_layers


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
