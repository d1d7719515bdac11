"""The MLA kernel tests' cases (tests/test_kernel_mla_decode.py, tests/test_kernel_mla_fp8.py):
paged caches in a random block order with garbage outside the contexts, bf16 / fp32 or
FP8, the op's fp32 reference on the same values, and the MLA_O / MLA_LSE check."""

from __future__ import annotations

import torch
from tolerances import MLA_LSE, MLA_O, assert_close_scaled

import k3compile.ops  # noqa: F401  (registers torch.ops.k3)
from k3compile.mla_cache_fp8 import is_fp8_cache, quantize_rows
from k3compile.runtime.kernels import mla_common as mc

DEVICE = "cuda" if torch.cuda.is_available() and not mc._INTERPRETED else "cpu"


def paged(lens: list[int], W: int, block_size: int, dtype: torch.dtype, gen: torch.Generator):
    """A cache whose blocks are handed out in a random order, garbage (large values) in
    every slot no sequence owns, and a block table whose unused entries point at garbage."""
    need = [-(-n // block_size) for n in lens]
    width = max(max(need), 1)
    num_blocks = sum(need) + 3
    cache = torch.randn(num_blocks, block_size, W, generator=gen) * 100
    order = torch.randperm(num_blocks, generator=gen)
    table = torch.randint(0, num_blocks, (len(lens), width), generator=gen, dtype=torch.int32)
    taken = 0
    for i, (n, k) in enumerate(zip(lens, need, strict=True)):
        blocks = order[taken:taken + k]
        taken += k
        table[i, :k] = blocks.int()
        ctx = torch.randn(n, W, generator=gen)
        flat = (blocks[:, None] * block_size + torch.arange(block_size)).flatten()[:n]
        cache.view(-1, W)[flat] = ctx
    return cache.to(dtype).to(DEVICE), table.to(DEVICE), torch.tensor(lens, dtype=torch.int32, device=DEVICE)


def reference(q, cache, table, seq_lens, scale, value_dim):
    """The op's torch reference in fp32 on the same values (an FP8 cache: its dequantised values)."""
    cache = cache.cpu() if is_fp8_cache(cache) else cache.float().cpu()
    return torch.ops.k3.mla_decode(q.float().cpu(), cache, table.cpu(), seq_lens.cpu(), scale, value_dim)


def to_fp8(cache: torch.Tensor, latent: int, fmt: torch.dtype) -> torch.Tensor:
    """A float cache's rows (garbage ones too) quantised into the FP8 layout of ``fmt``."""
    nb, bs, W = cache.shape
    return quantize_rows(cache.float().cpu().view(-1, W), latent, fmt).view(nb, bs, -1).to(cache.device)


def check(got, want, dtype: torch.dtype = torch.bfloat16) -> None:
    """o per (token, head) row and lse against the reference, with MLA_O and MLA_LSE."""
    o, lse = got
    assert_close_scaled(o, want[0], dtype, roundings=MLA_O(dtype), dims=-1, what="o")
    assert_close_scaled(lse, want[1], torch.float32, roundings=MLA_LSE, what="lse")


def case(H: int, L: int, R: int, lens: list[int], block_size: int, dtype=torch.bfloat16, seed: int = 0,
         kv_dtype: torch.dtype | None = None):
    """q and a paged cache (of ``kv_dtype``, default ``dtype``; an FP8 format: the FP8 layout)."""
    gen = torch.Generator().manual_seed(seed)
    cache, table, seq_lens = paged(lens, L + R, block_size, dtype, gen)
    if kv_dtype is not None and kv_dtype != dtype:
        cache = to_fp8(cache, L, kv_dtype)
    q = torch.randn(len(lens), H, L + R, generator=gen).to(dtype).to(DEVICE)
    return q, cache, table, seq_lens, (L + R) ** -0.5


def poison_past_contexts(cache: torch.Tensor, table: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """NaN in every cache row no context covers (what unwritten cache memory may hold; in
    an FP8 cache every byte 0xFF: NaN codes and NaN scales)."""
    owned = torch.zeros(cache.shape[0] * cache.shape[1], dtype=torch.bool)
    bs = cache.shape[1]
    for n, ctx in enumerate(seq_lens.tolist()):
        pos = torch.arange(ctx)
        owned[table[n].cpu().long()[pos // bs] * bs + pos % bs] = True
    poisoned = cache.clone()
    rows = poisoned.view(torch.uint8) if is_fp8_cache(cache) else poisoned
    rows.view(-1, cache.shape[-1])[~owned.to(cache.device)] = 0xFF if is_fp8_cache(cache) else float("nan")
    return poisoned


def without_poison(cache: torch.Tensor) -> torch.Tensor:
    """``poison_past_contexts``' cache with 0 for its NaN rows (the reference's input)."""
    if not is_fp8_cache(cache):
        return cache.nan_to_num(0.0)
    clean = cache.clone()
    raw = clean.view(torch.uint8).view(-1, cache.shape[-1])
    raw[(raw == 0xFF).all(-1)] = 0
    return clean
