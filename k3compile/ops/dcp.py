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

The collectives between them are plain functional collectives in the graph over the
group ``k3compile.context_parallel.DCP_GROUP_NAME``: all-gather of queries, then either
all-gather of LSEs + reduce-scatter of rescaled outputs, or one all-to-all of packed
(output, LSE) rows (passes/split_mla_context.py, ``merge``).
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


@dcp_rescale.register_kernel("cuda")  # ROCm builds of torch report "cuda" too
def _(o, lse, lse_gathered, dcp):
    # One Triton launch instead of the reference's ~8 kernels (imported on first call:
    # Triton stays out of ``import k3compile``).
    from k3compile.runtime.kernels.dcp_merge import dcp_rescale as kernel

    return kernel(o, lse, lse_gathered, dcp)


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


@dcp_pack.register_kernel("cuda")
def _(o, lse, dcp):
    from k3compile.runtime.kernels.dcp_merge import dcp_pack as kernel

    return kernel(o, lse, dcp)


@dcp_merge.register_kernel("cuda")
def _(received, dtype):
    from k3compile.runtime.kernels.dcp_merge import dcp_merge as kernel

    return kernel(received, dtype)


# Placement: dcp_local_lengths is a per-rank value; dcp_rescale sees only RankLocal inputs
# (the attention partials), which the analysis's generic rule places RankLocal.
from k3compile.placement import Cost, CostCall, rank_local, register_op_rules, split  # noqa: E402


def _rescale_cost(call: CostCall) -> Cost:
    B, H, D = call.shape("o")
    return Cost(B * H * (D + 2 * int(call.arg("dcp")) + 2))


def _pack_cost(call: CostCall) -> Cost:
    B, H, D = call.shape("o")
    return Cost(B * H * (D + 1))


def _merge_cost(call: CostCall) -> Cost:
    dcp, B, h, D1 = call.shape("received")
    return Cost(dcp * B * h * (2 * D1 + 2))


register_op_rules({
    dcp_local_lengths: rank_local(),
    # RankLocal partials in (the generic rule); heads split per member either way.
    dcp_pack: split({"o": 1, "lse": 1}, out=2, what="heads", cost=_pack_cost),
    # Its input, the DCP all-to-all's output, holds this rank's own heads (dim 2): the TP
    # split of the heads, so the merged output is the attention's usual Shard(1).
    dcp_merge: split({"received": 2}, out=1, what="heads", cost=_merge_cost),
    # Only RankLocal inputs reach it in a valid graph; with all Replicate it would be a
    # merge of one member (dcp=1), still elementwise per head.
    dcp_rescale: split({"o": 1, "lse": 1, "lse_gathered": 1}, out=0, what="heads", cost=_rescale_cost),
})
