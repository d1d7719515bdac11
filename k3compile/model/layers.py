"""Rank-local building blocks: parallel linears, norms, vocab-parallel embedding and head.

Each module is built for one rank of a :class:`ParallelPlan` and registers its
parameters with a :class:`ShardSpec` naming the checkpoint tensor they come from.

* ``ColumnParallelLinear``: weight [out, in] split on ``out``; input Replicate, output
  Shard(-1).
* ``RowParallelLinear``: weight split on ``in``; input Shard(-1), output Partial. The
  caller all-reduces explicitly, so collectives stay visible in the model code (and the
  graph) where the math has them.
* ``ReplicatedLinear``: every rank holds the whole weight.

A linear built with ``dispatch=True`` runs through the serving-style GEMM dispatch of
:mod:`k3compile.model.gemm` (staging copy, then ``torch.cond`` between a tiled GEMM and
a GEMV fallback), as the KDA output projection does in the engine K3 was profiled in.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import k3compile.ops  # noqa: F401  (registers torch.ops.k3.*, which this module calls)
from k3compile.distributed import TPGroup
from k3compile.model.gemm import dispatch_linear
from k3compile.sharding import (
    CheckpointDType,
    ParallelPlan,
    ShardOffset,
    ShardSpec,
    register_shard_offset,
    register_sharded_parameter,
)


def weight_spec(
    name: str, shape: tuple[int, ...], dim: int | None, dtype: CheckpointDType = "bf16", extent: int | None = None
) -> ShardSpec:
    return ShardSpec(names=(name,), shape=shape, dtype=dtype, dim=dim, extent=extent)


class _Linear(nn.Module):
    shard_dim: int | None = None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        prefix: str,
        plan: ParallelPlan,
        dtype: torch.dtype,
        dispatch: bool = False,
    ):
        super().__init__()
        spec = weight_spec(f"{prefix}.weight", (out_features, in_features), self.shard_dim)
        self.weight = register_sharded_parameter(self, "weight", spec, plan, dtype)
        self.dispatch = dispatch

    def forward(self, x: Tensor) -> Tensor:
        return dispatch_linear(x, self.weight) if self.dispatch else F.linear(x, self.weight)


class ColumnParallelLinear(_Linear):
    shard_dim = 0


class RowParallelLinear(_Linear):
    shard_dim = 1


class ReplicatedLinear(_Linear):
    shard_dim = None


class RMSNorm(nn.Module):
    """RMSNorm (``k3::rms_norm``), replicated. K3 stores most norm weights in BF16."""

    def __init__(
        self, size: int, eps: float, prefix: str, plan: ParallelPlan, dtype: torch.dtype,
        checkpoint_dtype: CheckpointDType = "bf16",
    ):
        super().__init__()
        self.eps = eps
        spec = weight_spec(f"{prefix}.weight", (size,), None, checkpoint_dtype)
        self.weight = register_sharded_parameter(self, "weight", spec, plan, dtype)

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.k3.rms_norm(x, self.weight, self.eps)


class VocabParallelEmbedding(nn.Module):
    """Each rank holds vocab rows [r*V/tp, (r+1)*V/tp); the others' tokens contribute zero
    and an all-reduce assembles every embedding."""

    def __init__(
        self, vocab: int, hidden: int, prefix: str, plan: ParallelPlan, tp: TPGroup, dtype: torch.dtype
    ):
        super().__init__()
        self.tp = tp
        spec = weight_spec(f"{prefix}.weight", (vocab, hidden), 0)
        self.weight = register_sharded_parameter(self, "weight", spec, plan, dtype)
        register_shard_offset(self, "vocab_start", ShardOffset(vocab), plan)

    def forward(self, ids: Tensor) -> Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        inside = (local >= 0) & (local < self.weight.shape[0])
        emb = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        return self.tp.all_reduce(emb * inside.unsqueeze(-1).to(emb.dtype))


class ParallelLMHead(nn.Module):
    """Vocab-parallel output projection; logits are all-gathered along the vocab."""

    def __init__(self, vocab: int, hidden: int, prefix: str, plan: ParallelPlan, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        self.tp = tp
        spec = weight_spec(f"{prefix}.weight", (vocab, hidden), 0)
        self.weight = register_sharded_parameter(self, "weight", spec, plan, dtype)

    def forward(self, x: Tensor) -> Tensor:
        return self.tp.all_gather(F.linear(x, self.weight).float(), dim=-1)
