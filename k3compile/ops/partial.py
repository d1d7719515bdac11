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


# Placement (k3compile.placement): P + S(dim) at the rank's block -> P; one add per element
# of the block.
from k3compile.placement import (  # noqa: E402
    Cost,
    CostCall,
    OpRule,
    PlacementError,
    register_op_rules,
    shard_into_partial,
)
from k3compile.sharding import Partial, Replicate, Shard  # noqa: E402


def _add_rank_block_linear_rule() -> OpRule:
    """``acc`` P + ``x`` R @ ``weight`` S(0) (a row block of a replicated weight, so the
    product is S(last) and this is ``shard_into_partial`` of the product) -> P; all R -> R.
    Cost: the rows GEMV, 2*T*K*n."""
    R = Replicate()
    expected = {"acc": Partial(), "x": R, "weight": Shard(0), "start": R}

    def propagate(node, pls):
        if all(p == R for p in pls.values()):
            return R
        if any(pls.get(k) != v for k, v in expected.items()):
            got = ", ".join(f"{k}={p}" for k, p in pls.items())
            raise PlacementError(
                f"node {node.name!r} (k3.add_rank_block_linear): expected acc=P, x=R, weight=S(0), start=R "
                f"(or all R); input placements: {got}")
        return Partial()

    def cost(call: CostCall) -> Cost:
        return Cost(2 * call.numel("x") * call.size("weight", 0))

    return OpRule("shard_into_partial", propagate, cost=cost, primary="x",
                  description="acc P + (x R @ weight S(0))^T at the rank's block -> P")


register_op_rules({
    add_rank_block: shard_into_partial("acc", "block", "dim"),
    add_rank_block_linear: _add_rank_block_linear_rule(),
})
