"""``k3::add_rank_block``: add this rank's block of a tensor into a pending partial sum.

    out = acc + pad(block)      pad: ``block`` at [start, start + n) of dim ``dim``, zeros elsewhere

With ``start`` = rank * n, the padded blocks of all ranks tile the whole dim, so a
following all-reduce of ``out`` yields ``all_reduce(acc) + concat(blocks)``: each rank
contributes its own coordinates of a result that used to be computed in full on every
rank (the dedup pass, ``passes/dedup_replicated_projection.py``). ``start`` is a 0-d int64
tensor (a per-rank constant buffer), not a Python int: the program is shared by all ranks
and the op must not synchronise the host (CUDA graphs), so the index is built on device.
"""

from __future__ import annotations

import torch
from torch import Tensor


@torch.library.custom_op("k3::add_rank_block", mutates_args=())
def add_rank_block(acc: Tensor, block: Tensor, start: Tensor, dim: int) -> Tensor:
    index = start + torch.arange(block.shape[dim], device=acc.device)
    return acc.index_add(dim, index, block.to(acc.dtype))


@add_rank_block.register_fake
def _(acc: Tensor, block: Tensor, start: Tensor, dim: int) -> Tensor:
    return torch.empty_like(acc)


# Placement (k3compile.placement): P + S(dim) at the rank's block -> P; one add per element
# of the block.
from k3compile.placement import register_op_rules, shard_into_partial  # noqa: E402

register_op_rules({add_rank_block: shard_into_partial("acc", "block", "dim")})
