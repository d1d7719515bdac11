"""Target tables: which MLA attention kernels each target has and which shapes they accept.

Passes ask these tables, never hard-coded numbers: "does the fastest decode kernel of
``h200`` take 12 heads, and if not, what is the next head count it takes?". Every fact
comes from a kernel's own declaration:

- GPU targets (``cuda`` / ``hip``): the Triton kernels of
  ``k3compile.runtime.kernels.mla_decode`` (one source for CUDA and ROCm), fastest first
  as that module lists them (``MLA_DECODE_KERNELS``, ``MLA_PREFILL_KERNELS``), on every
  target whose architecture the kernels are compiled and checked for ahead of time
  (``k3compile.runtime.kernels.aot.TARGETS``: ``sm_90``, ``gfx950``, ``gfx942``).
- ``cpu``: the ops' torch reference, declared by :class:`ReferenceKernel`: any head
  count, any floating dtype, any width.

Each table entry pairs a declaration with the ``k3`` op that runs exactly that kernel in a
graph (``k3::mla_decode_split_kv`` for the split-KV kernel), or ``None`` when no op pins
the kernel. The Triton module is imported only when a GPU target's table is first built,
so ``import k3compile`` (and a ``cpu`` compile) never imports Triton.

    >>> fast_attention_kernel("h200", "decode").name
    'mla_decode_split_kv'
    >>> next_accepted_heads("h200", 12, torch.bfloat16, qk_dim=576, value_dim=512)
    16
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Literal, Protocol

import torch

from k3compile.targets import get_target

Phase = Literal["decode", "prefill"]


class KernelDeclaration(Protocol):
    """What a declaration says about an attention kernel (``MLAKernel`` of
    runtime/kernels/mla_common.py satisfies it, and so does :class:`ReferenceKernel`)."""

    @property
    def name(self) -> str: ...

    @property
    def head_multiple(self) -> int: ...

    @property
    def splits_kv(self) -> bool: ...

    def reason_rejected(self, num_heads: int, dtype: torch.dtype, qk_dim: int, value_dim: int) -> str | None: ...

    def accepts(self, num_heads: int, dtype: torch.dtype, qk_dim: int, value_dim: int) -> bool: ...


@dataclass(frozen=True)
class ReferenceKernel:
    """The torch reference of a ``k3`` attention op as a declaration: it runs on any device
    and computes in fp32, so it takes every head count, floating dtype and width."""

    name: str
    phase: Phase
    head_multiple: int = 1
    splits_kv: bool = False

    def reason_rejected(self, num_heads: int, dtype: torch.dtype, qk_dim: int, value_dim: int) -> str | None:
        if num_heads < 1:
            return f"{self.name} needs at least one head, got {num_heads}"
        if not dtype.is_floating_point:
            return f"{self.name} needs a floating dtype, got {dtype}"
        return None

    def accepts(self, num_heads: int, dtype: torch.dtype, qk_dim: int, value_dim: int) -> bool:
        return self.reason_rejected(num_heads, dtype, qk_dim, value_dim) is None


@dataclass(frozen=True)
class AttentionKernel:
    """One kernel a target has: its declaration and the ``k3`` op that runs exactly it in a
    graph (``None``: only the runtime's dispatch of the generic op reaches it)."""

    declaration: KernelDeclaration
    op: str | None

    @property
    def name(self) -> str:
        return self.declaration.name

    def reason_rejected(self, num_heads: int, dtype: torch.dtype, qk_dim: int, value_dim: int) -> str | None:
        return self.declaration.reason_rejected(num_heads, dtype, qk_dim, value_dim)

    def accepts(self, num_heads: int, dtype: torch.dtype, qk_dim: int, value_dim: int) -> bool:
        return self.declaration.accepts(num_heads, dtype, qk_dim, value_dim)

    def padded_heads(self, num_heads: int) -> int:
        """The fewest heads >= ``num_heads`` the declared head multiple allows (the only
        head count worth trying: other constraints do not depend on the heads)."""
        multiple = self.declaration.head_multiple
        return -(-num_heads // multiple) * multiple


@dataclass(frozen=True)
class KernelTable:
    """A target's MLA attention kernels per phase, fastest first."""

    target: str
    decode: tuple[AttentionKernel, ...]
    prefill: tuple[AttentionKernel, ...]

    def kernels(self, phase: Phase) -> tuple[AttentionKernel, ...]:
        if phase not in ("decode", "prefill"):
            raise ValueError(f"unknown phase {phase!r}; choose decode or prefill")
        return self.decode if phase == "decode" else self.prefill


@cache
def kernel_table(target: str) -> KernelTable:
    """The table of ``target`` (a name in ``k3compile.targets.TARGETS``)."""
    t = get_target(target)
    if t.device == "cpu":
        return KernelTable(
            target,
            decode=(AttentionKernel(ReferenceKernel("k3::mla_decode reference", "decode"), "k3::mla_decode"),),
            prefill=(AttentionKernel(ReferenceKernel("k3::mla_prefill reference", "prefill"), "k3::mla_prefill"),),
        )
    # Triton is imported here, on the first GPU table, not with k3compile.
    from k3compile.runtime.kernels import aot
    from k3compile.runtime.kernels import mla_decode as kernels
    from k3compile.runtime.kernels.mla_split_kv import SPLIT_KV

    if t.arch not in aot.TARGETS:
        raise ValueError(f"target {target}: its architecture {t.arch} is not one the Triton kernels are "
                         f"compiled for ({', '.join(aot.TARGETS)})")
    ops = {SPLIT_KV.name: "k3::mla_decode_split_kv"}  # the kernels a graph can name
    return KernelTable(
        target,
        decode=tuple(AttentionKernel(k, ops.get(k.name)) for k in kernels.MLA_DECODE_KERNELS),
        prefill=tuple(AttentionKernel(k, ops.get(k.name)) for k in kernels.MLA_PREFILL_KERNELS),
    )


def fast_attention_kernel(target: str, phase: Phase) -> AttentionKernel | None:
    """The fastest MLA kernel ``target`` has for ``phase`` (what a runtime picks when the
    shape allows), or ``None`` when it has none. On ``cpu`` that is the torch reference."""
    kernels = kernel_table(target).kernels(phase)
    return kernels[0] if kernels else None


def next_accepted_heads(
    target: str, heads: int, dtype: torch.dtype, qk_dim: int, value_dim: int, phase: Phase = "decode"
) -> int | None:
    """The fewest heads >= ``heads`` that ``target``'s fastest ``phase`` kernel accepts with
    this dtype and these widths (``heads`` itself when accepted), or ``None`` when no head
    count helps (no kernel, or it rejects the dtype or widths). The candidate is the next
    multiple of the kernel's declared head multiple, confirmed by its own predicate."""
    kernel = fast_attention_kernel(target, phase)
    if kernel is None or heads < 1:
        return None
    padded = kernel.padded_heads(heads)
    return padded if kernel.accepts(padded, dtype, qk_dim, value_dim) else None
