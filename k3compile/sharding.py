"""Parallel plan, placements and per-parameter sharding specs.

Every parameter of the rank-local model carries a :class:`ShardSpec`: which checkpoint
tensor(s) it comes from, their full shape and storage format, and which slice a rank
holds. One spec serves three readers: the loader (each rank reads only its slice), the
model generator (which writes the full tensors), and the placement analysis (a
parameter is ``Shard(d)`` or ``Replicate()`` on the TP mesh).

Placements follow DTensor/GSPMD: ``Replicate`` (every rank holds the same value),
``Shard(d)`` (rank r holds the r-th equal block along dim d), ``Partial`` (the value is
the sum over ranks of what each rank holds).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

CheckpointDType = Literal["bf16", "f32", "u8"]

#: The torch dtype of each checkpoint storage dtype ("u8": MXFP4 codes and scales).
CHECKPOINT_TORCH_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "f32": torch.float32, "u8": torch.uint8}


class ShardingError(ValueError):
    """A tensor cannot be split the way the parallel plan asks."""


@dataclass(frozen=True)
class Replicate:
    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True)
class Shard:
    dim: int

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True)
class Partial:
    reduce_op: str = "sum"

    def __str__(self) -> str:
        return "P"


@dataclass(frozen=True)
class RankLocal:
    """A value of this rank alone, not a block, copy or summand of one logical tensor:
    under decode context parallelism the MLA cache, block table and slot mapping, and
    the attention partials over a rank's own positions (merged by an LSE-weighted
    collective, which no sum/concat placement describes)."""

    def __str__(self) -> str:
        return "L"


Placement = Replicate | Shard | Partial | RankLocal


@dataclass(frozen=True)
class ParallelPlan:
    """How the model is split: tensor parallelism ``tp``; this process is ``rank``.

    Decode context parallelism ``dcp`` (a divisor of ``tp``) splits the MLA history by
    position within groups of ``dcp`` consecutive TP ranks: position p is stored by
    group member ``(p // dcp_interleave) % dcp`` (see :mod:`k3compile.context_parallel`).
    The weights stay split by ``tp`` alone."""

    tp: int = 1
    rank: int = 0
    dcp: int = 1
    dcp_interleave: int = 1

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise ShardingError(f"tp must be >= 1, got {self.tp}")
        if not 0 <= self.rank < self.tp:
            raise ShardingError(f"rank {self.rank} is outside [0, tp={self.tp})")
        if self.dcp < 1 or self.tp % self.dcp:
            raise ShardingError(f"dcp must be a divisor of tp={self.tp}, got {self.dcp}")
        if self.dcp_interleave < 1:
            raise ShardingError(f"dcp_interleave must be >= 1, got {self.dcp_interleave}")

    @property
    def dcp_rank(self) -> int:
        """This rank's index in its DCP group (which positions it stores)."""
        return self.rank % self.dcp

    def for_rank(self, rank: int) -> ParallelPlan:
        """The same plan seen from ``rank``."""
        return dataclasses.replace(self, rank=rank)


@dataclass(frozen=True)
class ShardSpec:
    """Which part of which checkpoint tensor(s) one rank's parameter holds.

    ``names`` holds one checkpoint name, or several that are stacked along a new
    leading dim (routed experts: one tensor per expert, one stacked parameter).
    ``shape`` is the full logical shape of each named tensor (for mxfp4 tensors the
    dequantised shape). ``quantized`` marks tensors a checkpoint may store as
    ``mxfp4-pack-quantized`` (``<base>.weight_packed`` + ``<base>.weight_scale`` instead of
    ``<base>.weight``; the loader reads which from the index). ``dim`` is the
    checkpoint dim split across TP ranks (None: replicated); when ``extent`` is set only
    the first ``extent`` entries of ``dim`` are used and split (``A_log`` is stored with
    128 entries of which the first H are the heads').
    """

    names: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: CheckpointDType
    dim: int | None = None
    extent: int | None = None
    quantized: bool = False

    def __post_init__(self) -> None:
        if not self.names:
            raise ShardingError("a ShardSpec needs at least one checkpoint name")
        if self.dim is not None and not 0 <= self.dim < len(self.shape):
            raise ShardingError(f"{self.names[0]}: shard dim {self.dim} out of range for shape {self.shape}")
        if self.extent is not None and (self.dim is None or self.extent > self.shape[self.dim]):
            raise ShardingError(f"{self.names[0]}: extent {self.extent} needs a shard dim of at least that size")

    @property
    def stacked(self) -> bool:
        return len(self.names) > 1

    def split_range(self, plan: ParallelPlan) -> tuple[int, int] | None:
        """[start, stop) along ``dim`` held by ``plan.rank``; None when replicated."""
        if self.dim is None:
            return None
        extent = self.shape[self.dim] if self.extent is None else self.extent
        if extent % plan.tp:
            raise ShardingError(
                f"{self.names[0]}: dim {self.dim} of size {extent} does not divide by tp={plan.tp}"
            )
        block = extent // plan.tp
        return plan.rank * block, (plan.rank + 1) * block

    def local_index(self, plan: ParallelPlan) -> tuple[slice, ...]:
        """Index of this rank's part in one full (logical) checkpoint tensor."""
        index = [slice(None)] * len(self.shape)
        rng = self.split_range(plan)
        if rng is not None:
            index[self.dim] = slice(*rng)
        return tuple(index)

    def local_shape(self, plan: ParallelPlan) -> tuple[int, ...]:
        shape = list(self.shape)
        rng = self.split_range(plan)
        if rng is not None:
            shape[self.dim] = rng[1] - rng[0]
        return (len(self.names), *shape) if self.stacked else tuple(shape)

    def param_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """F32 checkpoint tensors (o_norm, A_log, dt_bias, conv, router bias) stay fp32 and
        U8 ones (MXFP4 codes and scales) stay bytes; BF16 ones take the model dtype."""
        return model_dtype if self.dtype == "bf16" else CHECKPOINT_TORCH_DTYPES[self.dtype]

    @property
    def placement(self) -> Placement:
        if self.dim is None:
            return Replicate()
        return Shard(self.dim + (1 if self.stacked else 0))

    def full_numel(self) -> int:
        return math.prod(self.shape) * len(self.names)


@dataclass(frozen=True)
class ShardOffset:
    """A per-rank constant: where this rank's block of ``extent`` starts (e.g. the first
    vocabulary id of its embedding rows). Programs are shared by all ranks (SPMD), so such
    a value is a graph input (a buffer) filled per rank at load, never a baked-in number.

    ``extent`` is split into ``period`` blocks (default: ``tp``), and ranks take them in
    turn: rank r starts at ``(r % period) * extent // period``. A DCP group of ``period``
    ranks uses it for the first position each member owns in a cycle of positions."""

    extent: int
    period: int | None = None

    def value(self, plan: ParallelPlan) -> int:
        period = self.period or plan.tp
        if self.extent % period:
            raise ShardingError(f"extent {self.extent} does not divide into {period} blocks")
        return (plan.rank % period) * (self.extent // period)

    def tensor(self, plan: ParallelPlan, device: torch.device | str = "cpu") -> torch.Tensor:
        return torch.tensor(self.value(plan), dtype=torch.int64, device=device)


def register_shard_offset(module: nn.Module, name: str, offset: ShardOffset, plan: ParallelPlan) -> torch.Tensor:
    """Register ``module.<name>`` as an int64 scalar buffer holding ``offset`` for ``plan``."""
    module.register_buffer(name, offset.tensor(plan))
    module.__dict__.setdefault("rank_constants", {})[name] = offset
    return getattr(module, name)


def rank_constants(model: nn.Module) -> dict[str, ShardOffset]:
    """Every per-rank constant buffer by its fully qualified name."""
    out: dict[str, ShardOffset] = {}
    for mod_name, mod in model.named_modules():
        for name, offset in mod.__dict__.get("rank_constants", {}).items():
            out[f"{mod_name}.{name}" if mod_name else name] = offset
    return out


def fill_rank_constants(model: nn.Module, plan: ParallelPlan) -> None:
    """Write every per-rank constant for ``plan`` (after ``to_empty`` left them garbage)."""
    for mod in model.modules():
        for name, offset in mod.__dict__.get("rank_constants", {}).items():
            getattr(mod, name).copy_(offset.tensor(plan))


def register_sharded_parameter(
    module: nn.Module, name: str, spec: ShardSpec, plan: ParallelPlan, model_dtype: torch.dtype
) -> nn.Parameter:
    """Create ``module.<name>`` with the rank-local shape of ``spec`` and record the spec.

    The tensor is uninitialised (or on ``meta`` under ``torch.device('meta')``): the
    loader fills it from the checkpoint.
    """
    param = nn.Parameter(
        torch.empty(spec.local_shape(plan), dtype=spec.param_dtype(model_dtype)), requires_grad=False
    )
    module.register_parameter(name, param)
    specs: dict[str, ShardSpec] = module.__dict__.setdefault("shard_specs", {})
    specs[name] = spec
    return param


def shard_specs(model: nn.Module) -> dict[str, ShardSpec]:
    """Every parameter's spec by its fully qualified name; fails if one has none."""
    out: dict[str, ShardSpec] = {}
    for mod_name, mod in model.named_modules():
        for pname, spec in mod.__dict__.get("shard_specs", {}).items():
            out[f"{mod_name}.{pname}" if mod_name else pname] = spec
    missing = [n for n, _ in model.named_parameters() if n not in out]
    if missing:
        raise ShardingError(f"parameters without a shard spec: {missing[:5]}")
    return out
