"""What the export tests share: the runtime they compare an exported program against, its
steps (prefill or greedy decode) as the exported program's inputs, and the comparison of
an exported step's outputs with the runtime's (tests/test_export_*.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

from k3compile.batch import zero_state_slot
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


def new_sequences(rt: Runtime, count: int) -> list[int]:
    """``count`` new sequences of ``rt``, their KDA state slots zeroed (as ``Runtime.prefill``
    starts them)."""
    ids = [rt.table.new_sequence() for _ in range(count)]
    for s in ids:
        zero_state_slot(rt.caches, rt.table.sequences[s].slot)
    return ids


def runtime_step(rt: Runtime, ids: list[int], tokens: list[list[int]]) -> tuple[dict[str, np.ndarray], torch.Tensor]:
    """One step of ``rt``'s program (decode when every sequence gets one token, else
    prefill) with ``tokens[i]`` new tokens of sequence ``ids[i]``: the step's inputs by name
    (STEP_INPUTS) and the runtime's logits, ``rt.cache_tensors`` then holding the step's
    result."""
    counts = [len(t) for t in tokens]
    decode = all(n == 1 for n in counts)
    rt.table.reserve(ids, counts)
    batch = rt.table.make_batch(ids, counts, decode, device=rt.device)
    step = (torch.tensor([t for toks in tokens for t in toks]), batch.cu_seqlens, batch.seq_lens, batch.state_slots,
            batch.block_table, batch.slot_mapping, batch.logit_indices)
    want = rt._run("decode" if decode else "prefill", step[0], batch)
    rt.table.advance(ids, counts)
    return {n: t.numpy() for n, t in zip(STEP_INPUTS, step, strict=True)}, want


def greedy_decode_steps(rt: Runtime, ids: list[int], tokens: list[int],
                        steps: int) -> Iterator[tuple[dict[str, np.ndarray], torch.Tensor]]:
    """``steps`` greedy decode steps of ``rt`` after :func:`prefill_prompts`: for each, the
    step's inputs by name (STEP_INPUTS) and the runtime's logits, ``rt.cache_tensors`` then
    holding the step's result."""
    for _ in range(steps):
        feeds, want = runtime_step(rt, ids, [[t] for t in tokens])
        yield feeds, want
        tokens = want.argmax(-1).tolist()


def assert_step_equals_the_runtime(outputs: dict[str, np.ndarray], want: torch.Tensor, rt: Runtime,
                                   cache_outputs: dict[str, str], caches: dict[str, np.ndarray]) -> list[int]:
    """An exported step's ``outputs`` by name (the logits, then every cache output in the
    order of ``rt.cache_tensors``) equal the runtime's logits ``want`` and caches within 1e-5
    relative; each cache output then goes into ``caches`` as its input's next value. The
    greedy tokens."""
    assert outputs["logits"].shape == tuple(want.shape) and relative_error(outputs["logits"], want) < 1e-5
    names = [n for n in outputs if n != "logits"]
    for name, cache in zip(names, rt.cache_tensors, strict=True):
        got = outputs[name]
        assert relative_error(got, cache) < 1e-5 or np.abs(got - cache.numpy()).max() == 0, name
        caches[cache_outputs[name]] = got
    return want.argmax(-1).tolist()


def prefill_then_decode(rt: Runtime, run_prefill: Callable[[dict[str, np.ndarray], torch.Tensor], list[int]],
                        run_decode: Callable[[dict[str, np.ndarray], torch.Tensor], list[int]]) -> None:
    """The prefill exports' scenario on ``rt``'s unused slots (zero in the exported caches
    too): the three PROMPTS (20 tokens), then a ragged batch of 9 tokens in which two of
    them continue after their cached tokens and a new sequence starts, then two greedy
    decode steps. ``run_prefill`` / ``run_decode`` run the exported step on its inputs by
    name, check it against the runtime's logits (given) and return the greedy tokens."""
    ids = new_sequences(rt, len(PROMPTS))
    first = run_prefill(*runtime_step(rt, ids, PROMPTS))
    ids += new_sequences(rt, 1)
    second = run_prefill(*runtime_step(rt, [ids[0], ids[2], ids[3]], [[first[0], 7, 8, 9], [first[2]],
                                                                      [11, 12, 13, 14]]))
    tokens = [second[0], first[1], second[1], second[2]]
    for feeds, want in greedy_decode_steps(rt, ids, tokens, 2):
        run_decode(feeds, want)
