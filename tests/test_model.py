"""The reference model: incremental decode equals prefill, MLA forms agree, the real config."""

from __future__ import annotations

import pytest
import torch

from k3compile.batch import CacheShape
from k3compile.config import PRESETS
from k3compile.model import K3ForCausalLM
from k3compile.reference import ReferenceEngine, RequestError, load_reference
from k3compile.sharding import ParallelPlan, shard_specs

PROMPTS = [[5, 9, 100, 7, 3, 44, 21, 8, 90, 11], [17], [300, 301, 302], [2, 4]]


def engine(model, slots: int = 8, blocks: int = 64, block_size: int = 4) -> ReferenceEngine:
    return ReferenceEngine(model, CacheShape(num_slots=slots, num_blocks=blocks, block_size=block_size))


def incremental_logits(model, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Feed each prompt one token per step (sequences of different lengths drop out)."""
    eng = engine(model)
    ids, first = eng.prefill([p[:1] for p in prompts])
    out = [[first[i]] for i in range(len(prompts))]
    for t in range(1, max(map(len, prompts))):
        active = [i for i, p in enumerate(prompts) if len(p) > t]
        logits = eng.decode([ids[i] for i in active], [prompts[i][t] for i in active])
        for j, i in enumerate(active):
            out[i].append(logits[j])
    return [torch.stack(o) for o in out]


@pytest.mark.parametrize("preset", ["tiny", "tiny-h24", "tiny-linear"])
@pytest.mark.parametrize("experts", ["bf16", "mxfp4"])
def test_incremental_decode_equals_prefill(model_dirs, preset, experts):
    model = load_reference(model_dirs(preset, experts))
    _, full = engine(model).prefill(PROMPTS, all_logits=True)
    assert torch.isfinite(full).all() and full.std() > 0.1  # well-conditioned, not collapsed
    incremental = incremental_logits(model, PROMPTS)
    offset = 0
    for prompt, inc in zip(PROMPTS, incremental):
        ref = full[offset : offset + len(prompt)]
        offset += len(prompt)
        torch.testing.assert_close(inc, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


def test_chunked_prefill_continues_a_sequence(model_dirs):
    """Prefill in two chunks (the second reads the cached context) equals one prefill."""
    model = load_reference(model_dirs("tiny"))
    prompt = PROMPTS[0]
    _, whole = engine(model).prefill([prompt], all_logits=True)
    eng = engine(model)
    (sid,), first = eng.prefill([prompt[:6]], all_logits=True)
    second = eng.step([sid], [prompt[6:]], all_logits=True)
    torch.testing.assert_close(torch.cat([first, second]), whole, rtol=1e-4, atol=1e-4)


def test_batch_composition_does_not_change_results(model_dirs):
    """A sequence's logits do not depend on which other sequences share its step."""
    model = load_reference(model_dirs("tiny"))
    _, together = engine(model).prefill(PROMPTS)
    for i, p in enumerate(PROMPTS):
        _, alone = engine(model).prefill([p])
        torch.testing.assert_close(alone[0], together[i], rtol=1e-5, atol=1e-5)


def test_bf16_model_tracks_fp32(model_dirs):
    """bf16 follows fp32 closely up to the first MoE layer; after it a router may pick
    another expert for a token whose top-k scores are close, so only the direction of
    the final logits is compared."""
    d = model_dirs("tiny")
    _, ref = engine(load_reference(d)).prefill(PROMPTS)
    _, low = engine(load_reference(d, dtype=torch.bfloat16)).prefill(PROMPTS)
    assert torch.isfinite(low).all()
    cos = torch.nn.functional.cosine_similarity(low.flatten(), ref.flatten(), dim=0)
    assert cos > 0.9, cos


def test_bad_requests_leave_other_sequences_untouched(model_dirs):
    model = load_reference(model_dirs("tiny"))
    eng = engine(model, slots=2, blocks=4, block_size=4)
    (sid,), _ = eng.prefill([[1, 2, 3]])
    before = [c.state.clone() if hasattr(c, "state") else c.kv.clone() for c in eng.caches]
    with pytest.raises(RequestError, match="empty prompt"):
        eng.prefill([[]])
    with pytest.raises(RequestError, match="outside the vocabulary"):
        eng.decode([sid], [model.config.vocab_size])
    with pytest.raises(RequestError, match="token id -1 outside"):
        eng.prefill([[1, 2, -1, 5]])
    with pytest.raises(RequestError, match="token True is not an integer"):
        eng.prefill([[1, True]])
    with pytest.raises(RequestError, match="token 2.0 is not an integer"):
        eng.prefill([[1, 2.0]])
    with pytest.raises(RequestError, match="beyond capacity"):
        eng.step([sid], [list(range(20))])
    with pytest.raises(RequestError, match="free slots"):
        eng.prefill([[1], [2]])
    after = [c.state if hasattr(c, "state") else c.kv for c in eng.caches]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert eng.sequences[sid].length == 3 and len(eng.table.free_slots) == 1


def test_real_k3_config_builds_on_meta():
    cfg = PRESETS["k3"]
    with torch.device("meta"):
        model = K3ForCausalLM(cfg)
    assert len(model.model.layers) == 93
    kinds = [layer.kind for layer in model.model.layers]
    assert kinds.count("mla") == 24 and kinds.count("kda") == 69
    assert kinds[91] == kinds[92] == "mla" and kinds[0] == "kda"
    params = sum(p.numel() for p in model.parameters())
    assert 2.7e12 < params < 2.9e12, params
    # TP8: per-rank shapes of the production sharding.
    with torch.device("meta"):
        rank = K3ForCausalLM(cfg, ParallelPlan(tp=8, rank=3))
    layer = rank.model.layers[0].self_attn
    assert layer.q_proj.weight.shape == (12 * 128, 7168) and layer.A_log.shape == (12,)
    mla = rank.model.layers[3].self_attn
    assert mla.q_b_proj.weight.shape == (12 * 192, 1536) and mla.kv_a_proj_with_mqa.weight.shape == (576, 7168)
    moe = rank.model.layers[1].mlp
    assert moe.experts.w1.shape == (896, 384, 3584) and moe.experts.w2.shape == (896, 3584, 384)
    assert moe.routed_expert_up_proj.weight.shape == (7168, 3584)  # replicated: the dedup target
    specs = shard_specs(rank)
    assert str(specs["model.layers.1.mlp.experts.w2"].placement) == "S(2)"
    assert str(specs["model.layers.1.mlp.routed_expert_up_proj.weight"].placement) == "R"


def test_activations_stay_well_conditioned(model_dirs):
    """The generator's scales keep the residual stream O(1) through every layer."""
    model = load_reference(model_dirs("tiny"))
    rms: list[float] = []
    for layer in model.model.layers:
        layer.register_forward_hook(lambda m, i, o: rms.append(o[0].pow(2).mean().sqrt().item()))
    engine(model).prefill(PROMPTS)
    assert len(rms) == len(model.model.layers)
    assert all(0.05 < r < 20 for r in rms), rms
