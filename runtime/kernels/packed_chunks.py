"""Packed sequences cut in chunks, and chunks in groups, numbered on the device.

Sequences packed one after another (cu_seqlens [N+1]) are cut in chunks of CHUNK tokens;
each sequence's chunks are numbered after the previous sequences', so chunk ids are dense
and a kernel's grid can be sized for the worst case (:func:`worst_chunks`) without reading
cu_seqlens back: programs past the real count exit.

- :func:`chunk_table` (one launch): each chunk's sequence and first token, each sequence's
  first chunk and chunk count. The KDA state pass and the short conv read it; the KDA
  preparation locates its own chunk with the same search (:func:`locate_chunks`).
- :func:`chunk_groups` (one launch): each sequence's chunks cut in groups of ``size``
  chunks, the segments the KDA state pass walks by chunk groups (kda_prefill_scan).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from k3compile.runtime.kernels import counted
from k3compile.runtime.kernels.aot import KernelLaunch, launch_signature

@dataclass(frozen=True)
class Segments:
    """Runs of chunks the state pass walks: per segment its first chunk and chunk count,
    and the real count [1] (a worst-case grid; programs past it exit)."""

    chunk0: Tensor
    chunks: Tensor
    count: Tensor


@dataclass(frozen=True)
class ChunkGroups:
    """Each sequence's chunks cut into groups of ``size`` (its last group may be shorter),
    numbered sequence after sequence; computed on the device (:func:`chunk_groups`)."""

    size: int
    segments: Segments  # the groups
    seq_first: Tensor  # [N] each sequence's first group
    seq_groups: Tensor  # [N] its group count
    start_rows: Tensor  # each group's row in the start states: its number
    end_rows: Tensor  # and in the final states: -1, none (the group scan writes them)


@dataclass(frozen=True)
class ChunkTable:
    """Packed sequences cut in chunks of ``chunk`` tokens, numbered sequence after
    sequence, for a worst-case grid of :func:`worst_chunks` programs; computed on the device by
    one launch, no host synchronisation."""

    cu: Tensor  # cu_seqlens as int64 [N+1]
    seq: Tensor  # [worst] each chunk's sequence (programs past ``count`` exit)
    first: Tensor  # [worst] each chunk's first token
    count: Tensor  # [1] the real number of chunks
    sequences: Tensor  # [1] N
    seq_first: Tensor  # [N] each sequence's first chunk
    seq_chunks: Tensor  # [N] its chunk count


#: chunk ids and sequences per block of the chunk-table kernel (their [ids, sequences]
#: comparisons are live together), and its warps
TABLE_BLOCK = 128
TABLE_SEQUENCES = 32
TABLE_WARPS = 4


@triton.jit
def _sequence_chunks(cu_ptr, i, N, CHUNK):
    """Sequences i's first tokens (int64) and chunk counts (int32; 0 for i >= N); CHUNK
    tokens a chunk (a compile-time constant, or a group's tokens at run time)."""
    real = i < N
    lo = tl.load(cu_ptr + i, mask=real, other=0).to(tl.int64)
    tokens = tl.load(cu_ptr + i + 1, mask=real, other=0).to(tl.int64) - lo
    return lo, tl.where(real, (tokens + CHUNK - 1) // CHUNK, 0).to(tl.int32)


@triton.jit
def locate_chunks(cu_ptr, ids, N, CHUNK, BS: tl.constexpr):
    """Chunk ids [B] of the packed sequences delimited by cu_seqlens, cut in chunks of CHUNK
    tokens numbered sequence after sequence: each id's sequence (the number of sequences
    whose chunks end at or before it, ``searchsorted(ends, id, right=True)``; the last one
    for ids past the chunks) and first token (its sequence's first chunk is the largest of
    those ends), and the number of chunks; BS sequences at a time."""
    seq = tl.zeros_like(ids)
    start = tl.zeros_like(ids)
    total = tl.zeros([], dtype=tl.int32)
    for s0 in range(0, N, BS):
        i = s0 + tl.arange(0, BS)
        _, n = _sequence_chunks(cu_ptr, i, N, CHUNK)
        ends = total + tl.cumsum(n, 0)
        before = (ends[None, :] <= ids[:, None]) & (i < N)[None, :]
        seq += tl.sum(before.to(tl.int32), axis=1)
        start = tl.maximum(start, tl.max(tl.where(before, ends[None, :], 0), axis=1))
        total += tl.sum(n, 0)
    seq = tl.minimum(seq, N - 1)
    return seq, tl.load(cu_ptr + seq).to(tl.int64) + (ids - start).to(tl.int64) * CHUNK, total


@counted
@triton.jit
def _chunk_table_kernel(
    cu_in_ptr, cu_ptr, seq_ptr, first_ptr, counts_ptr, seq_first_ptr, seq_chunks_ptr,  # ChunkTable's tensors
    N, worst, CHUNK: tl.constexpr, BLOCK: tl.constexpr, BS: tl.constexpr,
):
    """Program p: chunk ids [p BLOCK, (p + 1) BLOCK) (:func:`locate_chunks`). Program 0 also
    writes the per-sequence columns, cu_seqlens as int64 and the counts [chunks, N]."""
    ids = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    seq, first, total = locate_chunks(cu_in_ptr, ids, N, CHUNK, BS)
    in_grid = ids < worst
    tl.store(seq_ptr + ids, seq.to(tl.int64), mask=in_grid)
    tl.store(first_ptr + ids, first, mask=in_grid)
    if tl.program_id(0) == 0:
        done = tl.zeros([], dtype=tl.int32)
        for s0 in range(0, N, BS):
            i = s0 + tl.arange(0, BS)
            real = i < N
            lo, n = _sequence_chunks(cu_in_ptr, i, N, CHUNK)
            tl.store(cu_ptr + i, lo, mask=real)
            tl.store(seq_first_ptr + i, (done + tl.cumsum(n, 0) - n).to(tl.int64), mask=real)
            tl.store(seq_chunks_ptr + i, n.to(tl.int64), mask=real)
            done += tl.sum(n, 0)
        tl.store(cu_ptr + N, tl.load(cu_in_ptr + N).to(tl.int64))
        tl.store(counts_ptr, total.to(tl.int64))
        tl.store(counts_ptr + 1, total.to(tl.int64) * 0 + N)


@triton.jit
def _chunks_before(cu_ptr, seqs, N, CHUNK: tl.constexpr, BS: tl.constexpr):
    """The chunks of the sequences before each of ``seqs``, BS sequences at a time."""
    before = tl.zeros_like(seqs)
    for s0 in range(0, N, BS):
        i = s0 + tl.arange(0, BS)
        _, n = _sequence_chunks(cu_ptr, i, N, CHUNK)
        before += tl.sum(tl.where(i[None, :] < seqs[:, None], n[None, :], 0), axis=1)
    return before


@counted
@triton.jit
def _chunk_groups_kernel(
    cu_ptr, chunk0_ptr, chunks_ptr, start_rows_ptr, end_rows_ptr, count_ptr, seq_first_ptr, seq_groups_ptr,
    N, worst, size, CHUNK: tl.constexpr, BLOCK: tl.constexpr, BS: tl.constexpr,
):
    """Program p: groups [p BLOCK, (p + 1) BLOCK) of ``size`` chunks of CHUNK tokens, numbered
    sequence after sequence (:func:`locate_chunks` with a group's tokens for a chunk's): each
    group's first chunk and chunk count (0 past the real groups), its row in the start
    states (its number) and in the final states (-1: none). Program 0 also writes each
    sequence's first group and group count, and the real count."""
    ids = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    span = size * CHUNK
    seq, first, total = locate_chunks(cu_ptr, ids, N, span, BS)
    lo, n = _sequence_chunks(cu_ptr, seq, N, CHUNK)
    k = ((first - lo) // span).to(tl.int32)  # the group's index within its sequence
    in_grid = ids < worst
    tl.store(chunk0_ptr + ids, (_chunks_before(cu_ptr, seq, N, CHUNK, BS) + k * size).to(tl.int64), mask=in_grid)
    tl.store(chunks_ptr + ids, tl.where(ids < total, tl.minimum(n - k * size, size), 0).to(tl.int64), mask=in_grid)
    tl.store(start_rows_ptr + ids, ids.to(tl.int64), mask=in_grid)
    tl.store(end_rows_ptr + ids, tl.full([BLOCK], -1, tl.int64), mask=in_grid)
    if tl.program_id(0) == 0:
        done = tl.zeros([], dtype=tl.int32)
        for s0 in range(0, N, BS):
            i = s0 + tl.arange(0, BS)
            _, g = _sequence_chunks(cu_ptr, i, N, span)
            tl.store(seq_first_ptr + i, (done + tl.cumsum(g, 0) - g).to(tl.int64), mask=i < N)
            tl.store(seq_groups_ptr + i, g.to(tl.int64), mask=i < N)
            done += tl.sum(g, 0)
        tl.store(count_ptr, total.to(tl.int64))


def worst_chunks(tokens: int, sequences: int, chunk: int) -> int:
    """The most chunks of ``chunk`` tokens that ``tokens`` packed tokens in ``sequences``
    sequences make (each sequence may end in a partial chunk): the grids' size."""
    return triton.cdiv(tokens, chunk) + sequences


def worst_groups(worst_chunks: int, sequences: int, size: int) -> int:
    """The most groups of ``size`` chunks that ``sequences`` sequences of ``worst_chunks``
    chunks at most make (each sequence may end in a partial group): the group grids' size."""
    return triton.cdiv(worst_chunks, size) + sequences


def chunk_table(cu_seqlens: Tensor, total: int, chunk: int) -> ChunkTable:
    """The :class:`ChunkTable` of ``total`` packed tokens delimited by ``cu_seqlens``."""
    N = cu_seqlens.numel() - 1
    worst = worst_chunks(total, N, chunk)
    i64 = {"dtype": torch.int64, "device": cu_seqlens.device}
    cu, seq, first, counts = torch.empty(N + 1, **i64), torch.empty(worst, **i64), torch.empty(worst, **i64), \
        torch.empty(2, **i64)
    seq_first, seq_chunks = torch.empty(N, **i64), torch.empty(N, **i64)
    _chunk_table_kernel[(triton.cdiv(worst, TABLE_BLOCK),)](
        cu_seqlens, cu, seq, first, counts, seq_first, seq_chunks, N, worst, CHUNK=chunk, BLOCK=TABLE_BLOCK,
        BS=TABLE_SEQUENCES, num_warps=TABLE_WARPS)
    return ChunkTable(cu, seq, first, counts[:1], counts[1:], seq_first, seq_chunks)


def chunk_groups(cu_seqlens: Tensor, total: int, chunk: int, size: int) -> ChunkGroups:
    """The packed sequences' chunks of ``chunk`` tokens cut into groups of ``size``
    (:class:`ChunkGroups`), for a worst-case grid; computed on the device by
    one launch, no host synchronisation."""
    N = cu_seqlens.numel() - 1
    worst = worst_groups(worst_chunks(total, N, chunk), N, size)
    buf = torch.empty(4 * worst + 1 + 2 * N, dtype=torch.int64, device=cu_seqlens.device)
    chunk0, chunks, start_rows, end_rows, count, seq_first, seq_groups = buf.split([worst] * 4 + [1, N, N])
    _chunk_groups_kernel[(triton.cdiv(worst, TABLE_BLOCK),)](
        cu_seqlens, chunk0, chunks, start_rows, end_rows, count, seq_first, seq_groups, N, worst, size, CHUNK=chunk,
        BLOCK=TABLE_BLOCK, BS=TABLE_SEQUENCES, num_warps=TABLE_WARPS)
    return ChunkGroups(size, Segments(chunk0, chunks, count), seq_first, seq_groups, start_rows, end_rows)


def chunk_table_launch(chunk: int) -> KernelLaunch:
    """The chunk-table kernel as :func:`chunk_table` launches it for chunks of ``chunk``
    tokens (the runtime's cu_seqlens are int32)."""
    types = {"cu_in_ptr": "*i32", **{p: "*i64" for p in ("cu_ptr", "seq_ptr", "first_ptr", "counts_ptr",
                                                         "seq_first_ptr", "seq_chunks_ptr")}}
    c = {"CHUNK": chunk, "BLOCK": TABLE_BLOCK, "BS": TABLE_SEQUENCES}
    return KernelLaunch("kda_prefill chunk table", _chunk_table_kernel, launch_signature(_chunk_table_kernel, types, c),
                        c, TABLE_WARPS)


def chunk_groups_launch(chunk: int) -> KernelLaunch:
    """The chunk-groups kernel as :func:`chunk_groups` launches it for chunks of ``chunk``
    tokens (the runtime's cu_seqlens are int32)."""
    types = {"cu_ptr": "*i32", **{p: "*i64" for p in ("chunk0_ptr", "chunks_ptr", "start_rows_ptr", "end_rows_ptr",
                                                      "count_ptr", "seq_first_ptr", "seq_groups_ptr")}}
    c = {"CHUNK": chunk, "BLOCK": TABLE_BLOCK, "BS": TABLE_SEQUENCES}
    return KernelLaunch("kda_prefill chunk groups", _chunk_groups_kernel,
                        launch_signature(_chunk_groups_kernel, types, c), c, TABLE_WARPS)
