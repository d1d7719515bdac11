"""Sequence bookkeeping shared by the reference engine and the runtime.

Each live sequence holds a KDA state slot (conv + recurrent state, zeroed by the owner of
the caches when the sequence starts) and a growing list of MLA cache blocks. A step packs
the new tokens of several sequences into a :class:`~k3compile.batch.Batch`. Every
request is checked before anything changes: a bad request raises :class:`RequestError`
and leaves all sequences and caches as they were.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from k3compile.batch import Batch, CacheShape
from k3compile.context_parallel import SCRATCH_SLOT, ContextLayout


class RequestError(ValueError):
    """A request that cannot be served (no state was changed)."""


def is_whole_number(value: object) -> bool:
    """An int (or numpy integer), not a bool or a float: what token ids and counts must be."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_max_new_tokens(max_new_tokens: object) -> None:
    """A RequestError unless ``max_new_tokens`` is a whole number >= 0."""
    if not is_whole_number(max_new_tokens) or max_new_tokens < 0:
        raise RequestError(f"max_new_tokens: a whole number >= 0 needed, got {max_new_tokens!r}")


class GenerationStopped(RuntimeError):
    """A generation failed after its prefill. ``tokens`` holds each prompt's new tokens up
    to the failure (all prompts advance together, so they hold the same number); the
    failure itself is ``__cause__``, and the message says both."""

    def __init__(self, tokens: list[list[int]], cause: BaseException):
        done = len(tokens[0]) if tokens else 0
        super().__init__(f"stopped after {done} new token(s) per prompt: {cause}")
        self.tokens = tokens


@dataclass
class Sequence:
    slot: int
    blocks: list[int] = field(default_factory=list)
    length: int = 0


class SequenceTable:
    """Slots and cache blocks of the live sequences.

    ``reserved_slots``/``reserved_blocks`` are kept out of the free lists: the runtime
    points the padding rows of CUDA-graph batches at them.

    Under decode context parallelism (``layout.dcp > 1``) the blocks are this rank's: a
    sequence holds blocks for the positions the rank owns, stored densely in position
    order, and a new token the rank does not own is written to the scratch slot (block 0
    offset 0, which must be reserved). ``seq_lens`` in the batches stays global."""

    def __init__(
        self,
        vocab_size: int,
        shape: CacheShape,
        reserved_slots: int = 0,
        reserved_blocks: int = 0,
        layout: ContextLayout = ContextLayout(),
    ):
        if reserved_slots >= shape.num_slots or reserved_blocks >= shape.num_blocks:
            raise ValueError(f"cache shape {shape} leaves nothing after the reserved slots/blocks")
        if layout.dcp > 1 and reserved_blocks < 1:
            raise ValueError("context parallelism writes tokens a rank does not own to block 0: reserve it")
        self.vocab_size = vocab_size
        self.shape = shape
        self.layout = layout
        self.sequences: dict[int, Sequence] = {}
        self.free_slots = list(range(reserved_slots, shape.num_slots))
        self.free_blocks = list(range(reserved_blocks, shape.num_blocks))
        self._next_id = 0

    def new_sequence(self) -> int:
        if not self.free_slots:
            raise RequestError(f"all {len(self.free_slots) + len(self.sequences)} sequence slots are in use")
        seq_id = self._next_id
        self._next_id += 1
        self.sequences[seq_id] = Sequence(self.free_slots.pop(0))
        return seq_id

    def release(self, seq_id: int) -> None:
        if seq_id not in self.sequences:
            raise RequestError(f"unknown sequence {seq_id!r} (never started, or released already)")
        seq = self.sequences.pop(seq_id)
        self.free_slots.append(seq.slot)
        self.free_blocks.extend(seq.blocks)

    def check_tokens(self, tokens: list[list[int]]) -> None:
        for i, toks in enumerate(tokens):
            if not isinstance(toks, (list, tuple)):
                raise RequestError(f"request {i}: a list of token ids needed, got {toks!r:.60}")
            if not toks:
                raise RequestError(f"request {i}: empty prompt")
            if not all(type(t) is int for t in toks):  # plain ints pass quickly (long prompts)
                not_ids = [t for t in toks if not is_whole_number(t)]
                if not_ids:
                    raise RequestError(f"request {i}: token {not_ids[0]!r} is not an integer token id")
            if min(toks) < 0 or max(toks) >= self.vocab_size:
                bad = next(t for t in toks if not 0 <= t < self.vocab_size)
                raise RequestError(f"request {i}: token id {bad} outside the vocabulary [0, {self.vocab_size})")

    def check_step(self, seq_ids: list[int], tokens: list[list[int]]) -> None:
        if len(seq_ids) != len(tokens) or not seq_ids:
            raise RequestError("need one token list per sequence and at least one sequence")
        if len(set(seq_ids)) != len(seq_ids):
            raise RequestError("a sequence appears twice in one step")
        unknown = [s for s in seq_ids if s not in self.sequences]
        if unknown:
            raise RequestError(f"unknown sequence {unknown[0]}")
        self.check_tokens(tokens)

    def check_new(self, prompts: list[list[int]]) -> None:
        self.check_tokens(prompts)
        if len(prompts) > len(self.free_slots):
            raise RequestError(f"{len(prompts)} new sequences but only {len(self.free_slots)} free slots")

    def check_room(self, seq_ids: list[int], counts: list[int]) -> list[int]:
        """The blocks each sequence needs for ``counts`` more tokens; a RequestError if the
        free blocks do not cover them all."""
        bs = self.shape.block_size
        need = [
            max(0, -(-self.layout.local_length(self.sequences[s].length + n) // bs) - len(self.sequences[s].blocks))
            for s, n in zip(seq_ids, counts)
        ]
        if sum(need) > len(self.free_blocks):
            raise RequestError(
                f"context beyond capacity: {sum(need)} more cache blocks needed, {len(self.free_blocks)} free"
            )
        return need

    def reserve(self, seq_ids: list[int], counts: list[int]) -> None:
        """Give each sequence the blocks its new tokens need, or fail changing nothing."""
        need = self.check_room(seq_ids, counts)
        for s, n in zip(seq_ids, need):
            self.sequences[s].blocks.extend(self.free_blocks[:n])
            del self.free_blocks[:n]

    def advance(self, seq_ids: list[int], counts: list[int]) -> None:
        for s, n in zip(seq_ids, counts):
            self.sequences[s].length += n

    def cache_slot(self, seq: Sequence, position: int) -> int:
        """The MLA cache row (block * block_size + offset) that ``seq``'s token at
        ``position`` is written to on this rank (its blocks reserved); the scratch slot for a
        position another DCP rank owns."""
        if not self.layout.owns(position):
            return SCRATCH_SLOT
        local = self.layout.local_position(position)
        bs = self.shape.block_size
        return seq.blocks[local // bs] * bs + local % bs

    def cache_slots(self, seq: Sequence, start: int, count: int) -> Tensor:
        """:meth:`cache_slot` of positions ``start`` .. ``start + count - 1`` of ``seq`` (int64)."""
        positions = torch.arange(start, start + count)
        layout, bs = self.layout, self.shape.block_size
        owned = (positions // layout.interleave) % layout.dcp == layout.rank
        local = (positions // layout.cycle) * layout.interleave + positions % layout.interleave
        blocks = torch.tensor(seq.blocks, dtype=torch.int64)
        block = blocks[torch.where(owned, local // bs, 0)] if seq.blocks else torch.zeros_like(positions)
        return torch.where(owned, block * bs + local % bs, SCRATCH_SLOT)

    def make_batch(
        self,
        seq_ids: list[int],
        counts: list[int],
        decode: bool,
        all_logits: bool = False,
        device: torch.device | str = "cpu",
        table_width: int | None = None,
    ) -> Batch:
        """The step metadata for ``counts[i]`` new tokens of each sequence (blocks reserved).
        Under DCP the block table is as wide on every member of the group (the blocks the
        largest share of the longest context needs; a member's unused entries are block 0),
        so that a prefill can all-gather the members' blocks."""
        seqs = [self.sequences[s] for s in seq_ids]
        cu = [0]
        for n in counts:
            cu.append(cu[-1] + n)
        width = table_width or max(1, *(len(s.blocks) for s in seqs))
        if table_width is None and self.layout.dcp > 1:  # the same on every member: the history all-gather
            bs = self.shape.block_size
            width = max(width, *(-(-self.layout.max_local_length(s.length + n) // bs) for s, n in zip(seqs, counts)))
        table = torch.zeros(len(seqs), width, dtype=torch.int32)
        for i, seq in enumerate(seqs):
            table[i, : len(seq.blocks)] = torch.tensor(seq.blocks, dtype=torch.int32)
        slot_mapping = torch.cat([self.cache_slots(seq, seq.length, n) for seq, n in zip(seqs, counts)])
        logit_indices = list(range(cu[-1])) if all_logits else [c - 1 for c in cu[1:]]
        return Batch(
            cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=device),
            seq_lens=torch.tensor([s.length + n for s, n in zip(seqs, counts)], dtype=torch.int32, device=device),
            state_slots=torch.tensor([s.slot for s in seqs], dtype=torch.int64, device=device),
            block_table=table.to(device),
            slot_mapping=slot_mapping.to(device),
            logit_indices=torch.tensor(logit_indices, dtype=torch.int64, device=device),
            decode=decode,
        )


@dataclass
class Generation:
    """New tokens per prompt, and where the time went (synchronised wall clock)."""

    tokens: list[list[int]]
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_steps: int = 0


def generate_tokens(
    engine: object,
    prompts: list[list[int]],
    max_new_tokens: int,
    pick: Callable[[torch.Tensor], list[int]],
    sync: Callable[[], None] = lambda: None,
    decode_tokens: Callable[[list[int], list[int], int], list[list[int]]] | None = None,
) -> Generation:
    """Prefill ``prompts`` together, then decode them together until each has
    ``max_new_tokens`` new tokens; ``pick`` turns logits [N, V] into tokens.

    ``engine`` has ``prefill(prompts) -> (ids, logits)``, ``decode(ids, tokens)`` and
    ``release(id)`` (the reference engine and the runtime). ``decode_tokens(ids, tokens,
    steps)``, where given, runs all decode steps at once, picking as ``pick`` would (and
    raises GenerationStopped with the tokens it picked when a step fails).

    A failure after the prefill raises :class:`GenerationStopped` holding the tokens made
    so far. Sequences are released at the end, also on error."""
    import time

    check_max_new_tokens(max_new_tokens)
    start = time.perf_counter()
    ids, logits = engine.prefill(prompts)
    sync()
    result = Generation([[] for _ in prompts], prefill_s=time.perf_counter() - start)
    start = time.perf_counter()
    try:
        if decode_tokens is not None and max_new_tokens > 0:
            result.tokens = [[t] for t in pick(logits)]
            try:
                rest = decode_tokens(ids, [out[0] for out in result.tokens], max_new_tokens - 1)
            except GenerationStopped as stopped:
                cause = stopped.__cause__
                raise GenerationStopped([[*out, *more] for out, more in zip(result.tokens, stopped.tokens)],
                                        cause) from cause
            result.tokens = [[*out, *more] for out, more in zip(result.tokens, rest)]
            result.decode_steps = max_new_tokens - 1
        for step in range(max_new_tokens if decode_tokens is None else 0):
            for out, token in zip(result.tokens, pick(logits)):
                out.append(token)
            if step + 1 < max_new_tokens:
                logits = engine.decode(ids, [out[-1] for out in result.tokens])
                result.decode_steps += 1
        sync()
    except GenerationStopped:
        raise
    except Exception as e:
        raise GenerationStopped(result.tokens, e) from e
    finally:
        for s in ids:
            engine.release(s)
    result.decode_s = time.perf_counter() - start
    return result
