"""CUDA/HIP graphs of the decode program, one per batch bucket, and the step inputs they read.

A replay reads its inputs from static device buffers. What a decode step changes there is
small: per sequence its new token, its state slot, the cache row its token is written to
(one [3, B] int64 copy) and its length (one [B] int32 copy), both from pinned staging
memory; and block table entries only where a sequence gained a block or a row now holds
another sequence (a few entries, not the [B, blocks] table). The staging buffers come in
two sets used in turn, each guarded by an event, so the host fills one step's inputs while
the previous step's copies are still queued; nothing is allocated per step.

Every graph ends by writing its next tokens into its own token input, so decoding feeds
itself (:meth:`DecodeGraphs.decode_tokens`): step after step is queued without reading a
token back in between; the tokens go to pinned host memory asynchronously and are read
once, at the end. The graphs captured at load pick the argmax; sampling with a temperature
uses a second graph per bucket, captured on first use, that ends with
:func:`~k3compile.runtime.sampling.sample_on_device` over sampling parameters held in a
static tensor. Padding rows of a bucket read and write only the scratch state slot and
cache block.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from k3compile.runtime.sampling import SamplingParams, sample_on_device, sampling_tensor

#: the KDA state slot and the MLA cache block that padding rows use (reserved at allocation)
SCRATCH_SLOT = 0
SCRATCH_BLOCK = 0

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class DecodeGraphs:
    """The decode program captured once per batch bucket, over static inputs."""

    def __init__(self, runtime: Any):
        """``runtime``: the engine.Runtime whose decode program, caches and sequence table
        these graphs serve (not imported here: the engine imports this module)."""
        self.rt = runtime
        self.max_batch = runtime.options.max_sequences
        self.buckets = [b for b in BUCKETS if b < self.max_batch] + [self.max_batch]
        dev, B, width = runtime.device, self.max_batch, runtime.max_blocks_per_seq
        self.block_size = runtime.table.shape.block_size
        # Static inputs: token ids, state slots and cache rows share one buffer (one copy).
        self.meta = torch.zeros(3, B, dtype=torch.int64, device=dev)
        self.ids, self.slots, self.slot_mapping = self.meta
        self.slots.fill_(SCRATCH_SLOT)
        self.slot_mapping.fill_(SCRATCH_BLOCK * self.block_size)
        self.cu = torch.arange(B + 1, dtype=torch.int32, device=dev)
        self.seq_lens = torch.ones(B, dtype=torch.int32, device=dev)
        self.table = torch.full((B, width), SCRATCH_BLOCK, dtype=torch.int32, device=dev)
        self.logit_indices = torch.arange(B, dtype=torch.int64, device=dev)
        self.sampling = torch.zeros(3, dtype=torch.float32, device=dev)  # of the sampling graphs
        # Staging, two sets: (meta, seq_lens, table) in pinned memory, and numpy views to fill them.
        self._stage = [(torch.zeros(3, B, dtype=torch.int64).pin_memory(), torch.ones(B, dtype=torch.int32).pin_memory(),
                        torch.zeros(B, width, dtype=torch.int32).pin_memory()) for _ in range(2)]
        self._stage_np = [tuple(t.numpy() for t in stage) for stage in self._stage]
        self._staged = [torch.cuda.Event(), torch.cuda.Event()]
        self._turn = 0
        #: per table row: (sequence id, blocks of it written there), what the device table holds
        self._rows: list[tuple[int, int] | None] = [None] * B
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, Tensor]] = {b: self._capture(b) for b in self.buckets}
        self.sampling_graphs: dict[int, torch.cuda.CUDAGraph] = {}  # captured on first use

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def _inputs(self, b: int) -> tuple:
        return (self.ids[:b], self.cu[: b + 1], self.seq_lens[:b], self.slots[:b], self.table[:b],
                self.slot_mapping[:b], self.logit_indices[:b], self.rt.cache_tensors)

    def _step(self, b: int, sampled: bool) -> Tensor:
        logits = self.rt.modules["decode"](*self._inputs(b))
        # the next step's tokens, in its own input (decode_tokens)
        self.ids[:b].copy_(sample_on_device(logits, self.sampling) if sampled else logits.argmax(-1))
        return logits

    def _capture(self, b: int, sampled: bool = False) -> tuple[torch.cuda.CUDAGraph, Tensor]:
        # The warm-up runs a real step: let it read and write only the scratch slot and block.
        self.slots.fill_(SCRATCH_SLOT)
        self.slot_mapping.fill_(SCRATCH_BLOCK * self.block_size)
        self.seq_lens.fill_(1)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm up outside the graph (allocations, autotuning)
            self._step(b, sampled)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = self._step(b, sampled)
        return graph, out

    def stage(self, seq_ids: list[int], tokens: list[int] | None) -> int:
        """Queue the copies of the next step's inputs (blocks reserved, lengths not yet
        advanced); ``tokens`` None keeps the token ids the last replay wrote. Returns the
        bucket to replay."""
        n, table = len(seq_ids), self.rt.table
        b = self.bucket(n)
        turn = self._turn
        self._turn ^= 1
        self._staged[turn].synchronize()  # the copies this set fed two steps ago are done
        meta, lens, blocks = self._stage[turn]
        meta_np, lens_np, blocks_np = self._stage_np[turn]
        seqs = [table.sequences[s] for s in seq_ids]
        if tokens is not None:
            meta_np[0, :n] = tokens
            meta_np[0, n:b] = 0
        meta_np[1, :n] = [s.slot for s in seqs]
        meta_np[1, n:b] = SCRATCH_SLOT
        meta_np[2, :n] = [table.cache_slot(s, s.length) for s in seqs]
        meta_np[2, n:b] = SCRATCH_BLOCK * self.block_size
        lens_np[:n] = [s.length + 1 for s in seqs]
        lens_np[n:b] = 1
        first = 0 if tokens is not None else 1
        self.meta[first:, :b].copy_(meta[first:, :b], non_blocking=True)
        self.seq_lens[:b].copy_(lens[:b], non_blocking=True)
        for i, (sid, seq) in enumerate(zip(seq_ids, seqs)):
            row = self._rows[i]
            start = row[1] if row is not None and row[0] == sid else 0
            if start < len(seq.blocks):
                blocks_np[i, start:len(seq.blocks)] = seq.blocks[start:]
                self.table[i, start:len(seq.blocks)].copy_(blocks[i, start:len(seq.blocks)], non_blocking=True)
                self._rows[i] = (sid, len(seq.blocks))
        for i in range(n, b):  # padding rows read the scratch block (a stale row would do, but say so)
            if self._rows[i] is not None:
                self.table[i].fill_(SCRATCH_BLOCK)
                self._rows[i] = None
        self._staged[turn].record()
        return b

    def run(self, seq_ids: list[int], tokens: list[int]) -> Tensor:
        """One decode step (blocks reserved): fp32 logits [N, V], a copy."""
        b = self.stage(seq_ids, tokens)
        graph, out = self.graphs[b]
        graph.replay()
        return out[: len(seq_ids)].clone()

    def decode_tokens(self, seq_ids: list[int], tokens: list[int], steps: int,
                      sampling: SamplingParams) -> list[list[int]]:
        """``steps`` decode steps of the sequences (room checked by the caller), the first
        fed ``tokens``, each later one the tokens the previous step picked on the device
        (argmax, or drawn as ``sampling`` says: the device generator seeded with its seed);
        returns each sequence's ``steps`` new tokens. Reads tokens back once, at the end."""
        n, table = len(seq_ids), self.rt.table
        b = self.bucket(n)
        if sampling.temperature == 0:
            graph = self.graphs[b][0]
        else:
            if b not in self.sampling_graphs:
                self.sampling_graphs[b] = self._capture(b, sampled=True)[0]
            graph = self.sampling_graphs[b]
            self.sampling.copy_(sampling_tensor(sampling, self.sampling.device))
            if sampling.seed is not None:
                torch.cuda.manual_seed(sampling.seed)
        picked = torch.empty(steps, b, dtype=torch.int64).pin_memory()
        for t in range(steps):
            table.reserve(seq_ids, [1] * n)
            self.stage(seq_ids, tokens if t == 0 else None)
            graph.replay()
            picked[t].copy_(self.ids[:b], non_blocking=True)
            table.advance(seq_ids, [1] * n)
        torch.cuda.current_stream().synchronize()
        return picked[:, :n].T.tolist()
