"""Whole-model cross-check against an independent fp64 forward (tests/independent_k3.py).

tests/independent_k3.py is written from the architecture notes (../shared/K3_ARCHITECTURE.md),
not from k3compile's model code: it reads config.json and the safetensors itself,
dequantises MXFP4 experts itself, and computes prefill logits with naive loops in float64.
Here its logits are compared with

- the project's eager reference model (k3compile.reference, float32): every position of
  each prompt, one prompt longer than a KDA chunk (64 tokens) and several MLA cache blocks;
- a compiled artifact (default ``cpu`` target, float32) run through the runtime on the CPU:
  prefill, then greedy decode steps, each step's logits against the independent forward
  of the extended sequence, and the greedy tokens equal.

Tolerance: max|diff| <= REL_TOL * max|logits| over each sequence's compared positions.
Measured (2026-12-02, CPU): at most 2.9e-6 against the eager reference (the 70-token
prompt; 2.3e-7 to 2.6e-6 for the short ones) and 2.1e-6 against the artifact: float32
rounding (eps 1.2e-7) accumulated over the layers. REL_TOL = 3e-5 leaves 10x headroom and
still fails the subtlest wrong variant tried on the fp64 side (routing weights not
renormalised: 1.6e-4, most of it undone by the latent RMSNorm); structural mistakes (MXFP4
nibble order, AttnRes block boundaries, no AttnRes mix, the KDA gate bound) give 0.1 to
1.3 in these units.
"""

from __future__ import annotations

import pytest
import torch

from independent_k3 import Checkpoint, IndependentK3
from k3compile import runtime
from k3compile.batch import CacheShape
from k3compile.reference import ReferenceEngine, load_reference
from k3compile.validation import one_thread

REL_TOL = 3e-5
PROMPTS = [[5, 9, 100, 7, 3, 44, 21], [17, 300, 2], [11]]
#: Longer than one KDA prefill chunk (64) and several MLA cache blocks (16).
LONG_PROMPT = [(7 * i + 3) % 509 for i in range(70)]
DECODE_STEPS = 4


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny float64 matmuls on a shared 2-core machine run 10-30x slower with 2 threads."""
    with one_thread():
        yield


def assert_close(mine: torch.Tensor, theirs: torch.Tensor, what: str) -> float:
    """max|mine - theirs| <= REL_TOL * max|theirs|; returns the ratio max|diff| / max|theirs|."""
    theirs = theirs.to(torch.float64)
    diff = (mine - theirs).abs().max().item()
    scale = theirs.abs().max().item()
    assert diff <= REL_TOL * scale, f"{what}: max|diff| {diff:.3e} > {REL_TOL} * max|logits| ({scale:.3f})"
    return diff / scale


def test_mxfp4_dequantisation_matches_the_bf16_checkpoint(model_dirs):
    """The independent MXFP4 decoding (notes section 1) gives exactly the bf16 checkpoint
    of the same seed, which holds the exact dequantisation of the same draw."""
    packed, dense = Checkpoint(model_dirs("tiny", "mxfp4")), Checkpoint(model_dirs("tiny", "bf16"))
    cfg = packed.config
    checked = 0
    for layer in range(cfg["first_k_dense_replace"], cfg["num_hidden_layers"]):
        for e in range(cfg["num_experts"]):
            for w in ("w1", "w2", "w3"):
                name = f"model.layers.{layer}.block_sparse_moe.experts.{e}.{w}"
                assert packed.has(name + ".weight_packed") and not packed.has(name + ".weight")
                assert torch.equal(packed.expert_weight(name), dense.expert_weight(name)), name
                checked += 1
    assert checked == 6 * 8 * 3


CASES = [("tiny", "mxfp4"), ("tiny-linear", "bf16"), ("tiny-h24", "mxfp4")]


@pytest.mark.parametrize("preset, experts", CASES)
def test_eager_reference_matches_the_independent_fp64_forward(model_dirs, preset, experts):
    model_dir = model_dirs(preset, experts)
    prompts = PROMPTS + [LONG_PROMPT]
    engine = ReferenceEngine(load_reference(model_dir), CacheShape(num_slots=4, num_blocks=32, block_size=16))
    _, logits = engine.prefill(prompts, all_logits=True)  # float32 [sum T, vocab]
    theirs = logits.split([len(p) for p in prompts])
    mine = IndependentK3(model_dir).forward(prompts)
    for i, (m, t) in enumerate(zip(mine, theirs)):
        assert m.shape == t.shape
        assert_close(m, t, f"{preset} prompt {i}")
        assert torch.equal(m.argmax(-1), t.argmax(-1)), f"{preset} prompt {i}: greedy tokens differ"


@pytest.mark.parametrize("preset, experts", CASES[:2])
def test_compiled_artifact_matches_the_independent_fp64_forward(model_dirs, compile_once, preset, experts):
    model_dir = model_dirs(preset, experts)
    artifact = compile_once(preset, experts, dtype="float32").out_dir  # default target: cpu
    options = runtime.RuntimeOptions(max_sequences=4, max_context=96, device="cpu")
    rt = runtime.load(artifact, rank=0, world_size=1, options=options)
    prompts = PROMPTS + [LONG_PROMPT]
    ids, logits = rt.prefill(prompts)  # last-token logits [N, vocab]
    steps, generated = [logits], [[] for _ in prompts]
    for step in range(DECODE_STEPS):
        tokens = logits.argmax(-1).tolist()
        for g, t in zip(generated, tokens):
            g.append(t)
        if step < DECODE_STEPS - 1:
            logits = rt.decode(ids, tokens)
            steps.append(logits)
    # One independent prefill of each extended sequence gives every step's logits.
    mine = IndependentK3(model_dir).forward([p + g[:-1] for p, g in zip(prompts, generated)])
    for i, (p, m) in enumerate(zip(prompts, mine)):
        mine_steps = m[len(p) - 1:]  # the positions the runtime produced logits for
        theirs = torch.stack([s[i].cpu() for s in steps])
        assert_close(mine_steps, theirs, f"{preset} sequence {i}")
        assert mine_steps.argmax(-1).tolist() == generated[i], f"{preset} sequence {i}: greedy tokens differ"
