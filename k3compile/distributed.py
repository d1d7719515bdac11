"""Tensor-parallel collectives for the rank-local model.

The model calls torch's *functional* collectives (``_c10d_functional.all_reduce`` and
friends): they are pure ops that ``torch.export`` records as single graph nodes, with
no dependence on a live process group at trace time beyond its name. At TP1 no
collective is emitted at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol


@dataclass(frozen=True)
class TPGroup:
    """The tensor-parallel group as the model sees it: its size and its process group.

    ``group`` may be None for a size > 1 when the model is only built (e.g. on ``meta``
    to count parameters or check shapes); running a collective then fails clearly."""

    size: int = 1
    group: dist.ProcessGroup | None = None

    def _group(self) -> dist.ProcessGroup:
        if self.group is None:
            raise RuntimeError(f"TP group of size {self.size} has no process group; initialise torch.distributed")
        return self.group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of ``x`` over the group (Partial -> Replicate)."""
        if self.size == 1:
            return x
        return funcol.all_reduce(x, "sum", self._group())

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Concatenation of every rank's ``x`` along ``dim`` (Shard(dim) -> Replicate)."""
        if self.size == 1:
            return x
        # funcol gathers along dim 0 only: stack ranks first, then lay them out along ``dim``.
        stacked = funcol.all_gather_single(x.contiguous(), 0, self._group())
        d = dim % x.dim()
        return stacked.unflatten(0, (self.size, -1)).movedim(0, d).flatten(d, d + 1)


def world_tp_group() -> TPGroup:
    """The default process group as the TP group (one process per rank, e.g. torchrun)."""
    if not dist.is_initialized():
        return TPGroup()
    return TPGroup(dist.get_world_size(), dist.group.WORLD)
