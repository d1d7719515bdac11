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

The collectives between them are plain functional collectives in the graph
(all-gather of queries and LSEs, reduce-scatter of outputs) over the group
``k3compile.context_parallel.DCP_GROUP_NAME``.
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


# Placement: dcp_local_lengths is a per-rank value; dcp_rescale sees only RankLocal inputs
# (the attention partials), which the analysis's generic rule places RankLocal.
from k3compile.placement import Cost, CostCall, rank_local, register_op_rules, split  # noqa: E402


def _rescale_cost(call: CostCall) -> Cost:
    B, H, D = call.shape("o")
    return Cost(B * H * (D + 2 * int(call.arg("dcp")) + 2))


register_op_rules({
    dcp_local_lengths: rank_local(),
    # Only RankLocal inputs reach it in a valid graph; with all Replicate it would be a
    # merge of one member (dcp=1), still elementwise per head.
    dcp_rescale: split({"o": 1, "lse": 1, "lse_gathered": 1}, out=0, what="heads", cost=_rescale_cost),
})
