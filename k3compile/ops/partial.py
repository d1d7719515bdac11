"""Adding this rank's block of a tensor into a pending partial sum.

``k3::add_rank_block(acc, block, start, dim)``::

    out = acc + pad(block)      pad: ``block`` at [start, start + n) of dim ``dim``, zeros elsewhere

With ``start`` = rank * n, the padded blocks of all ranks tile the whole dim, so a
following all-reduce of ``out`` yields ``all_reduce(acc) + concat(blocks)``: each rank
contributes its own coordinates of a result that used to be computed in full on every
rank (the dedup pass, ``passes/dedup_replicated_linear.py``). ``start`` is a 0-d int64
tensor (a per-rank constant buffer), not a Python int: the program is shared by all ranks
and the op must not synchronise the host (CUDA graphs), so the index is built on device.

``k3::add_rank_block_linear(acc, x, weight, start)`` is the same with the block computed
in the op: ``add_rank_block(acc, F.linear(x, weight), start, -1)`` (x [..., K], weight
[n, K] this rank's rows of a replicated weight, acc [..., N]). One op, so that a GPU runs
the rows GEMV and the add as one kernel (``runtime/kernels/rows.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def _add_rank_block(acc: Tensor, block: Tensor, start: Tensor, dim: int) -> Tensor:
    index = start + torch.arange(block.shape[dim], device=acc.device)
    return acc.index_add(dim, index, block.to(acc.dtype))


@torch.library.custom_op("k3::add_rank_block", mutates_args=())
def add_rank_block(acc: Tensor, block: Tensor, start: Tensor, dim: int) -> Tensor:
    return _add_rank_block(acc, block, start, dim)


@add_rank_block.register_fake
def _(acc: Tensor, block: Tensor, start: Tensor, dim: int) -> Tensor:
    return torch.empty_like(acc)


@torch.library.custom_op("k3::add_rank_block_linear", mutates_args=())
def add_rank_block_linear(acc: Tensor, x: Tensor, weight: Tensor, start: Tensor) -> Tensor:
    return _add_rank_block(acc, F.linear(x, weight), start, acc.dim() - 1)


@add_rank_block_linear.register_fake
def _(acc: Tensor, x: Tensor, weight: Tensor, start: Tensor) -> Tensor:
    return torch.empty_like(acc)


# Placement rule and cost: k3compile/placement/k3_rules.py.
