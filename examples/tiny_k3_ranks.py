"""What each gloo rank runs in ``optimize_tiny_k3.ipynb``: load the artifact, prefill, generate.

``k3compile.distributed.run_ranks(fn, world, ...)`` calls ``fn(rank, world, ...)`` on
``world`` spawned processes joined in one gloo group, and a spawned process can only run
a function it can import: one defined in a notebook cell cannot be sent to it. The
notebook's folder is the kernel's working directory, so the ranks import this module.
"""

from __future__ import annotations

from pathlib import Path

import torch

from k3compile import runtime


def prefill_and_generate(
    rank: int, world: int, artifact: Path, prompts: list[list[int]], new_tokens: int, max_context: int
) -> tuple[torch.Tensor, list[list[int]]]:
    """This rank's prefill logits of ``prompts`` (last token of each) and its greedy tokens."""
    torch.set_num_threads(1)  # two ranks on a 2-core CPU
    options = runtime.RuntimeOptions(max_sequences=len(prompts), max_context=max_context, device="cpu")
    rt = runtime.load(artifact, rank=rank, world_size=world, options=options)
    try:
        seq_ids, logits = rt.prefill(prompts)
        for seq in seq_ids:
            rt.release(seq)
        tokens = rt.generate(prompts, new_tokens, runtime.SamplingParams(temperature=0.0))
    finally:
        rt.close()
    return logits, tokens
