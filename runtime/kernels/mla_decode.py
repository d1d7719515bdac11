"""Triton kernels for absorbed MLA attention over the paged latent cache.

Semantics are those of ``torch.ops.k3.mla_decode`` (k3compile/ops/mla.py): an absorbed
query row of width W = L + R (K3: 576 = 512 latent + 64 k_pe) attends to its sequence's
cached rows (position p of sequence n lives at
``kv_cache[block_table[n, p // block_size], p % block_size]``); scores are
``scale * q.k`` over the full W, values are the first L = ``value_dim`` entries of the
same rows (the latent is both key and value: MLA's absorbed form). Outputs: ``o`` [.., L]
in q's dtype and ``lse`` (fp32, natural log), so that attention over disjoint parts of
a context merges exactly (split-KV here, DCP across ranks); an empty context gives
o = 0, lse = -inf.

Two kernel sources. In the absorbed form all heads share K and V, so one cache row read
from HBM feeds every head of its sequence: both put several heads (or (token, head)
rows) against one KV tile on the matrix units.

``mla_decode_split_kv``  the FAST decode kernel (flash-decoding), ``mla_split_kv.py``:
    a program takes BLOCK_H heads of one sequence against one of ``num_splits`` chunks
    of its context, so that even batch 1 fills every CU/SM; fp32 partials (o, lse) per
    split, merged with LSE weights by a combine kernel. Head counts must be multiples of
    16, the smallest head tile: K3 at TP8 has 12 heads per rank, which a compiler pass
    pads to 16 (DCP gathers 32 or 96).
``mla_decode_generic``  what engines fall back to for other head counts: one program
    per (batch, head), vector math (a 1-row tile cannot use the matrix units). Correct
    for any head count, but every head re-reads the context and a batch-1 step runs only
    H programs, so its time grows with the context.
``mla_prefill_absorbed``  causal prefill for any head count (K3 at TP8: 12): 16-row
    tiles of a sequence's (token, head) rows, so 12 heads fill the matrix units too;
    each tile reads the context only up to its last row's position.
The last two share ``_mla_attention_kernel`` (``mla_attention.py``; DECODE: one new token
per sequence).

The KV loops read BLOCK_N cache rows per step (a gather through the block table, any
block size, or for the split-KV kernel on sm_90 one bulk copy by tensor descriptor) as
a [BLOCK_N, L] latent tile and a [BLOCK_N, R] k_pe tile; the latent
tile serves both products (scores and values), so each cache byte is read once. Both
parts are padded to powers of two (and to 16, the smallest dot) under masks, so the
same source runs K3's 576/512 and the tiny test widths. The online softmax runs in the
log2 domain in fp32. Tile sizes come from AOT reports (:mod:`.aot`; the tests compile
every specialisation for gfx950, gfx942 and sm_90 and require no spills).

What the kernels share (the declaration :class:`MLAKernel`, widths, input checks) is in
``mla_common.py``. Each kernel has a declaration (``SPLIT_KV``, ``GENERIC``, ``PREFILL``,
with its launcher) of what it accepts; the target tables and the head-padding pass derive
from this module's ``MLA_DECODE_KERNELS`` / ``MLA_PREFILL_KERNELS``. :func:`register_kernels`
makes them the implementations of ``k3::mla_decode`` (:func:`mla_decode_op`) and
``k3::mla_decode_split_kv`` on a device type; :func:`aot_launches` lists every kernel as
the launchers specialise it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from k3compile.mla_cache_fp8 import cache_value_width
from k3compile.ops import mla as mla_ops
from k3compile.runtime.kernels import mla_prefill_expanded as expanded
from k3compile.runtime.kernels.aot import KernelLaunch
from k3compile.runtime.kernels.mla_attention import GENERIC, PREFILL, attention_aot_launches, mla_prefill_partial
from k3compile.runtime.kernels.mla_common import MLAKernel
from k3compile.runtime.kernels.mla_split_kv import (
    SPLIT_KV,
    combine_aot_launch,
    mla_decode_split_kv,
    split_kv_aot_launches,
)

#: fastest first: a caller takes the first kernel that accepts its shape
MLA_DECODE_KERNELS: list[MLAKernel] = [SPLIT_KV, GENERIC]
MLA_PREFILL_KERNELS: list[MLAKernel] = [PREFILL]


def mla_decode_op(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, scale: float,
                  value_dim: int) -> tuple[Tensor, Tensor]:
    """``k3::mla_decode`` as an engine dispatches it: the first kernel of
    ``MLA_DECODE_KERNELS`` that takes the shape (split-KV when it takes the head count,
    e.g. 96 gathered heads under DCP8, else the generic kernel), else (a dtype or width
    no kernel takes) the op's torch reference."""
    for kernel in MLA_DECODE_KERNELS:
        if kernel.accepts(q.shape[1], q.dtype, q.shape[2], value_dim):
            return kernel.launch(q, kv_cache, block_table, seq_lens, scale, value_dim)
    return mla_ops.mla_decode_reference(q, kv_cache, block_table, seq_lens, scale, value_dim)


def mla_prefill_op(q: Tensor, kv_cache: Tensor, kv_b_weight: Tensor, cu_seqlens: Tensor, block_table: Tensor,
                   seq_lens: Tensor, scale: float) -> Tensor:
    """``k3::mla_prefill`` (the naive form's semantics) in the form with fewer FLOPs for
    the batch (``mla_prefill_expanded.prefill_form``): the expanded kernel over decompressed
    keys and values (prompts), or the absorbed prefill kernel (q_nope W_UK ++ q_pe against
    the latent cache, then W_UV on the latent output: a few new tokens against a long
    history). Both flash-style: no [heads, tokens, context] score tensor as the reference's.
    The reference for shapes the kernels do not take."""
    H, L = q.shape[1], kv_b_weight.shape[1]
    W = cache_value_width(kv_cache)
    nope = q.shape[-1] - (W - L)
    if not PREFILL.accepts(H, q.dtype, W, L) or cu_seqlens.dtype != torch.int32:
        return mla_ops.mla_prefill_reference(q, kv_cache, kv_b_weight, cu_seqlens, block_table, seq_lens, scale)
    counts = expanded.prefill_counts(cu_seqlens, seq_lens)
    value = kv_b_weight.shape[0] // H - nope
    if expanded.prefill_form(counts, H, L, W - L, nope, value) == "expanded":
        return expanded.mla_prefill_expanded(q, kv_cache, kv_b_weight, cu_seqlens, block_table, seq_lens, scale,
                                             counts)
    o, _ = PREFILL.launch(absorb_queries(q, kv_b_weight, nope), kv_cache, cu_seqlens, block_table, seq_lens, scale, L,
                          max_new_tokens=counts.max_new_tokens)
    return values_of_latent_output(o, kv_b_weight, nope)


def absorb_queries(q: Tensor, kv_b_weight: Tensor, nope: int) -> Tensor:
    """Naive-form queries [T, H, nope + R] -> absorbed ones [T, H, L + R]: q_nope W_UK ++ q_pe."""
    w = kv_b_weight.view(q.shape[1], -1, kv_b_weight.shape[1])
    return torch.cat([torch.einsum("thd,hdl->thl", q[..., :nope], w[:, :nope]), q[..., nope:]], dim=-1)


def values_of_latent_output(o: Tensor, kv_b_weight: Tensor, nope: int) -> Tensor:
    """The absorbed form's latent output [T, H, L] -> the naive form's [T, H, Dv]: W_UV o."""
    w = kv_b_weight.view(o.shape[1], -1, kv_b_weight.shape[1])
    return torch.einsum("thl,hdl->thd", o, w[:, nope:])


def register_kernels(device_type: str) -> None:
    """Make :func:`mla_decode_op`, :func:`mla_decode_split_kv`, :func:`mla_prefill_op` and the
    prefill kernel's ``mla_prefill_partial`` the ``device_type`` implementations of
    ``k3::mla_decode``, ``k3::mla_decode_split_kv``, ``k3::mla_prefill`` and
    ``k3::mla_prefill_partial`` (registering again replaces the same functions)."""
    mla_ops.mla_decode.register_kernel(device_type)(mla_decode_op)
    mla_ops.mla_decode_split_kv.register_kernel(device_type)(mla_decode_split_kv)
    mla_ops.mla_prefill_partial.register_kernel(device_type)(mla_prefill_partial)
    mla_ops.mla_prefill.register_kernel(device_type)(mla_prefill_op)


def aot_launches(target: str, qk_dim: int = 576, value_dim: int = 512, dtype: torch.dtype = torch.bfloat16,
                 num_splits: int = 64, kv_dtype: torch.dtype | None = None) -> list[KernelLaunch]:
    """Every MLA kernel as the launchers specialise it on ``target`` (a key of ``aot.TARGETS``) for
    a ``kv_dtype`` cache (default ``dtype``; an FP8 format: the FP8 layout), for AOT checks
    with aot.compile_for_target: the split-KV kernel once per head tile
    (``mla_decode_split_kv_h16`` ...), the generic and prefill kernels, the split combine
    and the expanded prefill kernel's variants (which read no cache: the same for every
    cache) at K3's per-head widths."""
    return [*split_kv_aot_launches(target, qk_dim, value_dim, dtype, kv_dtype),
            *attention_aot_launches(target, qk_dim, value_dim, dtype, kv_dtype),
            combine_aot_launch(value_dim, dtype, num_splits), *expanded.aot_launches(target, dtype)]
