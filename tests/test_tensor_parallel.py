"""TP 2 and 4 on real gloo process groups give the TP1 logits and the same greedy tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from k3compile.batch import CacheShape
from k3compile.distributed import world_tp_group
from k3compile.reference import ReferenceEngine, load_reference
from k3compile.sharding import ParallelPlan

PROMPTS = [[5, 9, 100, 7, 3, 44, 21, 8, 90, 11], [17], [300, 301, 302]]
NEW_TOKENS = 16


def prefill_and_generate(model_dir: Path, plan: ParallelPlan, tp=None) -> tuple[torch.Tensor, list[list[int]]]:
    torch.set_num_threads(1)
    model = load_reference(model_dir, plan, tp)
    shape = CacheShape(num_slots=4, num_blocks=32, block_size=4)
    _, logits = ReferenceEngine(model, shape).prefill(PROMPTS, all_logits=True)
    tokens = ReferenceEngine(model, shape).generate(PROMPTS, NEW_TOKENS)
    return logits, tokens


def _rank_main(rank: int, world: int, model_dir: Path):
    return prefill_and_generate(model_dir, ParallelPlan(tp=world, rank=rank), world_tp_group())


@pytest.mark.slow
@pytest.mark.parametrize(
    "preset,experts,tp",
    [("tiny", "mxfp4", 2), pytest.param("tiny", "bf16", 4, marks=pytest.mark.sweep), ("tiny-h24", "bf16", 2)]
)
def test_tp_matches_tp1(model_dirs, preset, experts, tp, rank_pools):
    model_dir = model_dirs(preset, experts)
    ref_logits, ref_tokens = prefill_and_generate(model_dir, ParallelPlan())
    results = rank_pools.get(tp).run(_rank_main, model_dir)
    for rank, (logits, tokens) in enumerate(results):
        torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4 * ref_logits.abs().max().item())
        assert tokens == ref_tokens, f"rank {rank}"
    assert all(len(t) == NEW_TOKENS for t in ref_tokens)
