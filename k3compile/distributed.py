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
    """The tensor-parallel group as the model sees it: its size and its process group."""

    size: int = 1
    group: dist.ProcessGroup | None = None

    def __post_init__(self) -> None:
        if self.size > 1 and self.group is None:
            raise ValueError(f"a TP group of size {self.size} needs a process group")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of ``x`` over the group (Partial -> Replicate)."""
        if self.size == 1:
            return x
        return funcol.wait_tensor(funcol.all_reduce(x, "sum", self.group))

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Concatenation of every rank's ``x`` along ``dim`` (Shard(dim) -> Replicate)."""
        if self.size == 1:
            return x
        return funcol.wait_tensor(funcol.all_gather_tensor(x.contiguous(), dim, self.group))


def world_tp_group() -> TPGroup:
    """The default process group as the TP group (one process per rank, e.g. torchrun)."""
    if not dist.is_initialized():
        return TPGroup()
    return TPGroup(dist.get_world_size(), dist.group.WORLD)
