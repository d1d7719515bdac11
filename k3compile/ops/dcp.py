"""Ops of decode context parallelism (k3compile/context_parallel.py explains the layout).

``k3::dcp_local_lengths``  each sequence's number of positions this rank stores, from
                           the global lengths and this rank's first position in a cycle
                           (a per-rank constant input).
``k3::dcp_rescale``        one DCP member's partial attention over its own positions,
                           weighted for the merge: with lse_k the members' log-sum-exps
                           of one (sequence, head), the merged output is
                           sum_k exp(lse_k - logsumexp_j lse_j) * o_k, so member k scales
                           its o_k by its weight and a reduce-scatter sums the terms.
                           Returned heads-first ``[H, B, D]`` fp32 (the reduce-scatter
                           splits dim 0, so each member gets its own heads back). A member
                           that owns no position of a sequence has lse = -inf: weight 0.

``k3::dcp_pack``           the all-to-all merge's send buffer: this member's partial
                           output and LSE for the whole group's heads, ``[dcp, B, h, D+1]``
                           fp32, chunk k holding member k's h heads (LSE in the last column).
``k3::dcp_merge``          the all-to-all merge's end: from every member's partial output
                           and LSE of this member's heads (the all-to-all's output, same
                           layout), the merged output ``[B, h, D]`` in the model dtype.
``k3::dcp_local_blocks``   this member's cache blocks of a step's sequences as bytes
                           ``[N, B, bs, W * itemsize]`` uint8 (its block table's rows): what the
                           prefill's history all-gather sends (as bytes, so that an FP8 cache
                           travels on backends without FP8 types, gloo among them).
``k3::dcp_history_order``  the group's all-gathered blocks (member-major) -> every sequence's
                           whole history in position order as a cache ``[N*dcp*B, bs, W]`` in
                           the cache's dtype and its block table ``[N, dcp*B]``: what a DCP1
                           prefill reads (passes/split_mla_context.py, ``prefill="gathered"``).

The collectives between them are plain functional collectives in the graph over the
group ``k3compile.context_parallel.DCP_GROUP_NAME``: all-gather of queries, then either
all-gather of LSEs + reduce-scatter of rescaled outputs, or one all-to-all of packed
(output, LSE) rows (passes/split_mla_context.py, ``merge``).

The implementations here are the torch references; the runtime registers one-launch
Triton kernels for ``dcp_rescale``, ``dcp_pack`` and ``dcp_merge`` on GPUs.
"""

from __future__ import annotations

import torch
from torch import Tensor

from k3compile.context_parallel import local_lengths


@torch.library.custom_op("k3::dcp_local_lengths", mutates_args=())
def dcp_local_lengths(seq_lens: Tensor, position_offset: Tensor, dcp: int, interleave: int) -> Tensor:
    """seq_lens [B] (global context lengths) -> [B] int32 positions this rank stores."""
    return local_lengths(seq_lens, position_offset, dcp, interleave)


@dcp_local_lengths.register_fake
def _(seq_lens, position_offset, dcp, interleave):
    return torch.empty_like(seq_lens, dtype=torch.int32)


@torch.library.custom_op("k3::dcp_rescale", mutates_args=())
def dcp_rescale(o: Tensor, lse: Tensor, lse_gathered: Tensor, dcp: int) -> Tensor:
    """o [B, H, D] and lse [B, H] of this member; lse_gathered [dcp*B, H] every member's
    (stacked in member order) -> this member's merge term, heads first [H, B, D] fp32."""
    B = lse.shape[0]
    merged = torch.logsumexp(lse_gathered.view(dcp, B, -1), dim=0)  # -inf only if no member has a position
    weight = torch.exp(lse - merged).nan_to_num(0.0)  # -inf - -inf = nan: an empty sequence
    return (o.float() * weight.unsqueeze(-1)).permute(1, 0, 2).contiguous()


@dcp_rescale.register_fake
def _(o, lse, lse_gathered, dcp):
    B, H, D = o.shape
    return o.new_empty(H, B, D, dtype=torch.float32)


@torch.library.custom_op("k3::dcp_pack", mutates_args=())
def dcp_pack(o: Tensor, lse: Tensor, dcp: int) -> Tensor:
    """o [B, dcp*h, D] and lse [B, dcp*h] of this member (member k's heads at k*h) ->
    [dcp, B, h, D + 1] fp32: chunk k, sent to member k, holds k's heads, LSE last."""
    B, H, D = o.shape
    rows = torch.cat([o.float(), lse.float().unsqueeze(-1)], dim=-1)
    return rows.view(B, dcp, H // dcp, D + 1).permute(1, 0, 2, 3).contiguous()


@dcp_pack.register_fake
def _(o, lse, dcp):
    B, H, D = o.shape
    return o.new_empty(dcp, B, H // dcp, D + 1, dtype=torch.float32)


@torch.library.custom_op("k3::dcp_merge", mutates_args=())
def dcp_merge(received: Tensor, dtype: torch.dtype) -> Tensor:
    """received [dcp, B, h, D + 1] fp32 (chunk k: member k's partial output and LSE of this
    member's heads) -> sum_k exp(lse_k - logsumexp_j lse_j) o_k as [B, h, D] ``dtype``;
    0 where no member owns a position."""
    o, lse = received[..., :-1], received[..., -1]
    weight = torch.exp(lse - torch.logsumexp(lse, dim=0)).nan_to_num(0.0)  # -inf - -inf: no position
    return (weight.unsqueeze(-1) * o).sum(0).to(dtype)


@dcp_merge.register_fake
def _(received, dtype):
    _, B, h, D1 = received.shape
    return received.new_empty(B, h, D1 - 1, dtype=dtype)


@torch.library.custom_op("k3::dcp_local_blocks", mutates_args=())
def dcp_local_blocks(kv_cache: Tensor, block_table: Tensor) -> Tensor:
    """kv_cache [num_blocks, bs, W] and block_table [N, B] -> [N, B, bs, W * itemsize]
    uint8: the bytes of the blocks of each sequence's table row, in order."""
    return kv_cache[block_table.long()].view(torch.uint8)


@dcp_local_blocks.register_fake
def _(kv_cache, block_table):
    N, B = block_table.shape
    _, bs, W = kv_cache.shape
    return kv_cache.new_empty(N, B, bs, W * kv_cache.dtype.itemsize, dtype=torch.uint8)


@torch.library.custom_op("k3::dcp_history_order", mutates_args=())
def dcp_history_order(gathered: Tensor, dcp: int, interleave: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """gathered [dcp*N, B, bs, W * itemsize] uint8: member k's :func:`dcp_local_blocks` at
    rows k*N.. -> (cache [N*dcp*B, bs, W] ``dtype``, block_table [N, dcp*B] int32):
    sequence n's position p at
    row p of its blocks n*dcp*B... Position p lives with member (p // interleave) % dcp at
    its local position (p // (dcp*interleave)) * interleave + p % interleave
    (k3compile/context_parallel.py); positions past a sequence's length hold whatever its
    members' blocks hold there (attention masks them by seq_lens)."""
    rows, B, bs, W = gathered.shape
    N = rows // dcp
    by_sequence = gathered.view(dcp, N, B * bs, W).transpose(0, 1)  # [N, dcp, B*bs, W]
    p = torch.arange(dcp * B * bs, device=gathered.device)
    member = (p // interleave) % dcp
    # a local index past the member's blocks belongs to a position no member stores (past
    # every sequence's length when the interleave does not divide B*bs): any row will do
    at = ((p // (dcp * interleave)) * interleave + p % interleave).clamp_(max=B * bs - 1)
    cache = by_sequence[:, member, at].reshape(N * dcp * B, bs, W).view(dtype)
    table = torch.arange(N * dcp * B, dtype=torch.int32, device=gathered.device).view(N, dcp * B)
    return cache, table


@dcp_history_order.register_fake
def _(gathered, dcp, interleave, dtype):
    rows, B, bs, W = gathered.shape
    N = rows // dcp
    return (gathered.new_empty(N * dcp * B, bs, W // dtype.itemsize, dtype=dtype),
            gathered.new_empty(N, dcp * B, dtype=torch.int32))


# Placement rule and cost: k3compile/placement/k3_rules.py.
