"""What the export tests share: the runtime they compare an exported program against, and
its greedy decode steps as the exported program's inputs (tests/test_export_*.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from k3compile.export import ExportOptions
from k3compile.export.trace import STEP_INPUTS
from k3compile.runtime.engine import Runtime, RuntimeOptions

#: three prompts: one spanning blocks, a short one, a single token
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [42, 7], [3]]


def relative_error(got: np.ndarray, want: torch.Tensor) -> float:
    want = want.float().numpy()
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def cpu_runtime(artifact: Path, options: ExportOptions, rank: int = 0) -> Runtime:
    """The artifact's ``rank`` on the CPU, op by op, with the export's cache capacity (at
    TP > 1 in a process that is that rank of the process group)."""
    from k3compile.artifact import load_artifact

    return Runtime(load_artifact(artifact), rank, torch.device("cpu"),
                   RuntimeOptions(max_sequences=options.max_sequences, max_context=options.max_context,
                                  cuda_graphs=False, lowering="eager"))


def prefill_prompts(rt: Runtime) -> tuple[list[int], list[int]]:
    """PROMPTS prefilled by ``rt``: their sequence ids and first greedy tokens."""
    ids, logits = rt.prefill(PROMPTS)
    return ids, logits.argmax(-1).tolist()


def greedy_decode_steps(rt: Runtime, ids: list[int], tokens: list[int],
                        steps: int) -> Iterator[tuple[dict[str, np.ndarray], torch.Tensor]]:
    """``steps`` greedy decode steps of ``rt`` after :func:`prefill_prompts`: for each, the
    step's inputs by name (STEP_INPUTS) and the runtime's logits, ``rt.cache_tensors`` then
    holding the step's result."""
    for _ in range(steps):
        rt.table.reserve(ids, [1] * len(ids))
        batch = rt.table.make_batch(ids, [1] * len(ids), True, device=rt.device)
        step = (torch.tensor(tokens), batch.cu_seqlens, batch.seq_lens, batch.state_slots, batch.block_table,
                batch.slot_mapping, batch.logit_indices)
        want = rt._run("decode", step[0], batch)
        rt.table.advance(ids, [1] * len(ids))
        yield {n: t.numpy() for n, t in zip(STEP_INPUTS, step, strict=True)}, want
        tokens = want.argmax(-1).tolist()
