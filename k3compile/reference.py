"""Reference execution: prefill and incremental decode of a batch of sequences on one rank.

Sequences of different lengths share one set of caches: each holds a KDA state slot
(conv + fp32 recurrent state, zeroed when the sequence starts) and a list of MLA cache
blocks that grows as it does. A step packs the new tokens of several sequences
(prefill: any number per sequence, also continuing a sequence; decode: one each) into a
:class:`Batch` and runs the rank-local model eagerly. With TP > 1 every rank runs the
same engine on the same requests (SPMD) and gets the same logits.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from k3compile.batch import Batch, CacheShape, KDALayerCache, allocate_caches
from k3compile.checkpoint.loader import load_weights
from k3compile.config import K3Config, load_config
from k3compile.distributed import TPGroup
from k3compile.model import K3ForCausalLM
from k3compile.sharding import ParallelPlan


class RequestError(ValueError):
    """A request the engine cannot serve (no state was changed)."""


@dataclass
class Sequence:
    slot: int
    blocks: list[int] = field(default_factory=list)
    length: int = 0


class ReferenceEngine:
    """Eager prefill/decode/generate over the reference model with real caches."""

    def __init__(self, model: K3ForCausalLM, cache_shape: CacheShape, device: torch.device | str = "cpu"):
        self.model = model
        self.cfg: K3Config = model.config
        self.shape = cache_shape
        self.device = torch.device(device)
        self.caches = allocate_caches(self.cfg, model.plan, cache_shape, model.dtype, self.device)
        self.sequences: dict[int, Sequence] = {}
        self._free_slots = list(range(cache_shape.num_slots))
        self._free_blocks = list(range(cache_shape.num_blocks))
        self._next_id = 0

    # ----- sequence bookkeeping ----------------------------------------------
    def new_sequence(self) -> int:
        if not self._free_slots:
            raise RequestError(f"all {self.shape.num_slots} sequence slots are in use")
        slot = self._free_slots.pop(0)
        for cache in self.caches:
            if isinstance(cache, KDALayerCache):
                for t in (cache.conv_q, cache.conv_k, cache.conv_v, cache.state):
                    t[slot].zero_()
        seq_id = self._next_id
        self._next_id += 1
        self.sequences[seq_id] = Sequence(slot)
        return seq_id

    def release(self, seq_id: int) -> None:
        seq = self.sequences.pop(seq_id)
        self._free_slots.append(seq.slot)
        self._free_blocks.extend(seq.blocks)

    def _reserve(self, seq_ids: list[int], counts: list[int]) -> None:
        """Give each sequence the blocks its new tokens need, or fail changing nothing."""
        bs = self.shape.block_size
        need = [max(0, -(-(self.sequences[s].length + n) // bs) - len(self.sequences[s].blocks))
                for s, n in zip(seq_ids, counts)]
        if sum(need) > len(self._free_blocks):
            raise RequestError(
                f"context beyond capacity: {sum(need)} more cache blocks needed, {len(self._free_blocks)} free"
            )
        for s, n in zip(seq_ids, need):
            self.sequences[s].blocks.extend(self._free_blocks[:n])
            del self._free_blocks[:n]

    def _check_tokens(self, tokens: list[list[int]]) -> None:
        for i, toks in enumerate(tokens):
            if not toks:
                raise RequestError(f"request {i}: empty prompt")
            bad = [t for t in toks if not 0 <= t < self.cfg.vocab_size]
            if bad:
                raise RequestError(f"request {i}: token id {bad[0]} outside the vocabulary [0, {self.cfg.vocab_size})")

    def _validate(self, seq_ids: list[int], tokens: list[list[int]]) -> None:
        if len(seq_ids) != len(tokens) or not seq_ids:
            raise RequestError("need one token list per sequence and at least one sequence")
        if len(set(seq_ids)) != len(seq_ids):
            raise RequestError("a sequence appears twice in one step")
        unknown = [s for s in seq_ids if s not in self.sequences]
        if unknown:
            raise RequestError(f"unknown sequence {unknown[0]}")
        self._check_tokens(tokens)

    def make_batch(self, seq_ids: list[int], counts: list[int], decode: bool, all_logits: bool) -> Batch:
        bs = self.shape.block_size
        seqs = [self.sequences[s] for s in seq_ids]
        cu = [0]
        for n in counts:
            cu.append(cu[-1] + n)
        width = max(len(s.blocks) for s in seqs)
        table = torch.zeros(len(seqs), width, dtype=torch.int32)
        slot_mapping = []
        for i, (seq, n) in enumerate(zip(seqs, counts)):
            table[i, : len(seq.blocks)] = torch.tensor(seq.blocks, dtype=torch.int32)
            for pos in range(seq.length, seq.length + n):
                slot_mapping.append(seq.blocks[pos // bs] * bs + pos % bs)
        logit_indices = list(range(cu[-1])) if all_logits else [c - 1 for c in cu[1:]]
        dev = self.device
        return Batch(
            cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor([s.length + n for s, n in zip(seqs, counts)], dtype=torch.int32, device=dev),
            state_slots=torch.tensor([s.slot for s in seqs], dtype=torch.int64, device=dev),
            block_table=table.to(dev),
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=dev),
            logit_indices=torch.tensor(logit_indices, dtype=torch.int64, device=dev),
            decode=decode,
        )

    # ----- steps ----------------------------------------------------------------
    @torch.no_grad()
    def step(self, seq_ids: list[int], tokens: list[list[int]], all_logits: bool = False) -> Tensor:
        """Run the new ``tokens`` of each sequence; returns fp32 logits of the last token of
        each sequence [N, V] (or of every new token, [T, V], with ``all_logits``)."""
        self._validate(seq_ids, tokens)
        counts = [len(t) for t in tokens]
        self._reserve(seq_ids, counts)
        decode = all(n == 1 for n in counts)
        batch = self.make_batch(seq_ids, counts, decode, all_logits)
        ids = torch.tensor([t for toks in tokens for t in toks], dtype=torch.int64, device=self.device)
        logits = self.model(ids, batch, self.caches)
        for s, n in zip(seq_ids, counts):
            self.sequences[s].length += n
        return logits

    def prefill(self, prompts: list[list[int]], all_logits: bool = False) -> tuple[list[int], Tensor]:
        """Start one sequence per prompt and prefill them in one packed step."""
        self._check_tokens(prompts)
        if len(prompts) > len(self._free_slots):
            raise RequestError(f"{len(prompts)} new sequences but only {len(self._free_slots)} free slots")
        ids = [self.new_sequence() for _ in prompts]
        try:
            return ids, self.step(ids, prompts, all_logits)
        except RequestError:
            for s in ids:
                self.release(s)
            raise

    def decode(self, seq_ids: list[int], tokens: list[int]) -> Tensor:
        return self.step(seq_ids, [[t] for t in tokens])

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy generation; returns the new tokens of each prompt."""
        ids, logits = self.prefill(prompts)
        out = [[] for _ in prompts]
        for step in range(max_new_tokens):
            next_tokens = logits.argmax(-1).tolist()
            for o, t in zip(out, next_tokens):
                o.append(t)
            if step + 1 < max_new_tokens:
                logits = self.decode(ids, next_tokens)
        for s in ids:
            self.release(s)
        return out


def load_reference(
    model_dir: str | Path,
    plan: ParallelPlan = ParallelPlan(),
    tp: TPGroup | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> K3ForCausalLM:
    """Build the rank-local model for ``plan`` and load its slice of ``model_dir``."""
    cfg = load_config(model_dir)
    with torch.device("meta"):
        model = K3ForCausalLM(cfg, plan, tp, dtype)
    model = model.to_empty(device=device)
    load_weights(model, model_dir, plan, cfg.checkpoint_prefix)
    return model.eval()
