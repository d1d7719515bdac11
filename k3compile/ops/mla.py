"""Gated NoPE MLA attention ops over a paged latent cache.

Cache layout (one tensor per MLA layer): ``kv_cache[num_blocks, block_size, W]`` with
W = kv_lora_rank + qk_rope_head_dim (576 in K3): per token the RMS-normalised latent
(first kv_lora_rank values) followed by k_pe, the key part shared by all heads (no
rotary embedding: NoPE), in the model dtype; or, in an FP8 cache, ``W + 16`` FP8
elements per token, the values with their scales (``k3compile/mla_cache_fp8.py``). Sequence i's
position p lives in block ``block_table[i, p // block_size]`` at offset
``p % block_size``. Every op reads either layout; the dequantised values are what
attention sees.

``k3::mla_cache_write``  stores new tokens' (latent, k_pe) at their flat slots in place,
                         quantised there for an FP8 cache (padding rows of a batch point
                         at a scratch block the runtime reserves, so the write never
                         needs a data-dependent mask).
``k3::mla_prefill``      the naive form: k_nope = W_UK latent, v = W_UV latent per head
                         (kv_b_proj rows are per head [k_nope | v]), causal softmax of
                         scale * (q_nope.k_nope + q_pe.k_pe) over the whole context.
``k3::mla_decode``       the absorbed form: a W-wide query (q_nope W_UK ++ q_pe) against
                         the W-wide cache, values the first kv_lora_rank entries; returns
                         the latent output and the log-sum-exp of the scaled scores
                         (-inf and a zero output for an empty context), so that partial
                         results over disjoint positions can be merged exactly.
``k3::mla_prefill_partial``  the absorbed form for many new tokens per sequence over ONE
                         decode-context-parallel member's cached positions (this step's
                         included, written first): causal by global position, (o, lse) to
                         be merged with the other members' like ``mla_decode``'s; what
                         ``split_mla_context`` makes of ``mla_prefill``, so that a sequence
                         with history can continue under DCP.
``k3::mla_decode_split_kv``  ``mla_decode`` with the contract of the fast split-KV kernel:
                         the head count is a multiple of 16. The graph names the kernel it
                         needs; its default implementation is the reference, and the
                         runtime registers the Triton split-KV kernel for it on GPUs.
                         Only the ``pad_attention_heads`` pass emits it.
``k3::pad_heads`` / ``k3::narrow_heads``  zero heads appended to dim 1 of this rank's
                         block / the block's first heads (a copy). They exist as ops, not
                         ``aten.constant_pad_nd`` / ``aten.slice``, because they act on each
                         rank's block of a head-sharded tensor: placement-wise they are
                         per-shard (S(1) -> S(1)), which a pad or slice of the logical
                         tensor's sharded dim is not.
"""

from __future__ import annotations

import torch
from torch import Tensor

from k3compile.mla_cache_fp8 import (
    cache_rows_as_values,
    cache_value_width,
    dequantize_rows,
    is_fp8_cache,
    is_fp8_dtype,
    quantize_rows,
)


def gather_context(kv_cache: Tensor, block_table_row: Tensor, length: int) -> Tensor:
    """The first ``length`` cached tokens of one sequence, [length, W]."""
    block_size = kv_cache.shape[1]
    pos = torch.arange(length, device=kv_cache.device)
    blocks = block_table_row.long()[pos // block_size]
    return kv_cache[blocks, pos % block_size]


def mla_cache_write_reference(kv_cache: Tensor, kv: Tensor, slot_mapping: Tensor, latent_dim: int) -> None:
    """The torch reference of ``k3::mla_cache_write`` (any device)."""
    flat = kv_cache.view(-1, kv_cache.shape[-1])
    if is_fp8_cache(kv_cache):
        rows = quantize_rows(kv, latent_dim, kv_cache.dtype)
        flat.view(torch.uint8).index_copy_(0, slot_mapping.long(), rows.view(torch.uint8))
    else:
        flat.index_copy_(0, slot_mapping.long(), kv.to(flat.dtype))


@torch.library.custom_op("k3::mla_cache_write", mutates_args=("kv_cache",))
def mla_cache_write(kv_cache: Tensor, kv: Tensor, slot_mapping: Tensor, latent_dim: int) -> None:
    """kv [T, W] (latent_dim latent values, then k_pe) goes to flat slots ``slot_mapping``
    [T] (block * block_size + offset), quantised with its per-token scales for an FP8 cache."""
    mla_cache_write_reference(kv_cache, kv, slot_mapping, latent_dim)


@mla_cache_write.register_fake
def _(kv_cache: Tensor, kv: Tensor, slot_mapping: Tensor, latent_dim: int) -> None:
    return None


@torch.library.custom_op("k3::mla_prefill", mutates_args=())
def mla_prefill(
    q: Tensor,
    kv_cache: Tensor,
    kv_b_weight: Tensor,
    cu_seqlens: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    scale: float,
) -> Tensor:
    """q [T, H, Dn+R] (packed new tokens; each sequence's new tokens are the last of its
    ``seq_lens[i]`` context positions, already written to the cache) -> o [T, H, Dv]."""
    return mla_prefill_reference(q, kv_cache, kv_b_weight, cu_seqlens, block_table, seq_lens, scale)


def mla_prefill_reference(q: Tensor, kv_cache: Tensor, kv_b_weight: Tensor, cu_seqlens: Tensor, block_table: Tensor,
                          seq_lens: Tensor, scale: float) -> Tensor:
    """``k3::mla_prefill``'s torch reference (the naive form, fp32 math on any device)."""
    cu = cu_seqlens.tolist()
    contexts = [gather_context(kv_cache, block_table[i], ctx) for i, ctx in enumerate(seq_lens.tolist())]
    return _prefill_attention(q, contexts, kv_b_weight, cu, scale)


def _prefill_attention(q: Tensor, contexts: list[Tensor], kv_b_weight: Tensor, cu: list[int], scale: float) -> Tensor:
    """Causal naive-form attention of each sequence's new tokens ``q[cu[i]:cu[i+1]]`` (the
    last of its context) over its cached context ``contexts[i]`` [ctx, L + R]."""
    T, H, Dqk = q.shape
    L = kv_b_weight.shape[1]
    W = cache_value_width(contexts[0]) if contexts else L
    Dn = Dqk - (W - L)
    w = kv_b_weight.float().view(H, -1, L)
    w_uk, w_uv = w[:, :Dn], w[:, Dn:]  # [H, Dn, L], [H, Dv, L]
    out = q.new_zeros(T, H, w_uv.shape[1])
    for i, c in enumerate(contexts):
        start, stop = cu[i], cu[i + 1]
        n_new, ctx = stop - start, c.shape[0]
        if n_new == 0:
            continue
        c = cache_rows_as_values(c, L)
        latent, k_pe = c[:, :L], c[:, L:]
        k_nope = torch.einsum("cl,hdl->hcd", latent, w_uk)  # [H, ctx, Dn]
        v = torch.einsum("cl,hdl->hcd", latent, w_uv)  # [H, ctx, Dv]
        qi = q[start:stop].float().transpose(0, 1)  # [H, n_new, Dqk]
        scores = qi[..., :Dn] @ k_nope.transpose(1, 2) + (qi[..., Dn:] @ k_pe.t()).expand(H, -1, -1)
        q_pos = torch.arange(ctx - n_new, ctx, device=q.device)
        mask = torch.arange(ctx, device=q.device)[None, :] > q_pos[:, None]
        probs = torch.softmax((scores * scale).masked_fill(mask, float("-inf")), dim=-1)
        out[start:stop] = (probs @ v).transpose(0, 1).to(out.dtype)
    return out


@mla_prefill.register_fake
def _(q, kv_cache, kv_b_weight, cu_seqlens, block_table, seq_lens, scale):
    H = q.shape[1]
    L = kv_b_weight.shape[1]
    Dn = q.shape[-1] - (cache_value_width(kv_cache) - L)
    return q.new_empty(q.shape[0], H, kv_b_weight.shape[0] // H - Dn)


@torch.library.custom_op("k3::mla_prefill_new_tokens", mutates_args=())
def mla_prefill_new_tokens(
    q: Tensor, kv: Tensor, kv_b_weight: Tensor, cu_seqlens: Tensor, seq_lens: Tensor, scale: float,
    cache_dtype: torch.dtype,
) -> Tensor:
    """``mla_prefill`` of sequences whose whole context is this step's tokens: attention
    over their latents ``kv`` [T, L + R] as computed (not read back from the cache), as
    the cache of ``cache_dtype`` holds them (through its FP8 rounding for an FP8 cache:
    the same values ``mla_prefill`` would read back). Under context parallelism a rank's
    cache holds only its own positions, so prefill attends to the fresh latents every
    rank has; a sequence with earlier context is an error (``seq_lens`` must equal the
    new-token counts)."""
    cu = cu_seqlens.tolist()
    new = [b - a for a, b in zip(cu, cu[1:])]
    history = [(i, ctx - n) for i, (ctx, n) in enumerate(zip(seq_lens.tolist(), new)) if ctx != n]
    if history:
        i, earlier = history[0]
        raise ValueError(
            f"k3::mla_prefill_new_tokens: sequence {i} has {earlier} earlier tokens; context-parallel "
            "prefill starts new sequences only"
        )
    L = kv_b_weight.shape[1]
    if is_fp8_dtype(cache_dtype):
        kv = dequantize_rows(quantize_rows(kv, L, cache_dtype), L)
    return _prefill_attention(q, [kv[a:b] for a, b in zip(cu, cu[1:])], kv_b_weight, cu, scale)


@mla_prefill_new_tokens.register_fake
def _(q, kv, kv_b_weight, cu_seqlens, seq_lens, scale, cache_dtype):
    H = q.shape[1]
    L = kv_b_weight.shape[1]
    Dn = q.shape[-1] - (kv.shape[-1] - L)
    return q.new_empty(q.shape[0], H, kv_b_weight.shape[0] // H - Dn)


def mla_decode_reference(
    q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, scale: float, value_dim: int
) -> tuple[Tensor, Tensor]:
    """The torch reference of the decode ops (fp32 math on any device): q [B, H, W]
    absorbed queries -> (o [B, H, value_dim] in q.dtype, lse [B, H] fp32)."""
    B, H, W = q.shape
    block_size = kv_cache.shape[1]
    max_len = block_table.shape[1] * block_size
    pos = torch.arange(max_len, device=q.device)
    blocks = block_table.long().gather(1, (pos // block_size).expand(B, -1))  # [B, max_len]
    ctx = cache_rows_as_values(kv_cache[blocks, (pos % block_size).expand(B, -1)], value_dim)  # [B, max_len, W]
    scores = torch.einsum("bhw,bcw->bhc", q.float(), ctx) * scale
    valid = pos[None, :] < seq_lens.long()[:, None]  # [B, max_len]
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # -inf where the context is empty
    probs = torch.exp(scores - lse.unsqueeze(-1).clamp_min(torch.finfo(torch.float32).min))
    probs = probs.nan_to_num(0.0)
    out = torch.einsum("bhc,bcl->bhl", probs, ctx[..., :value_dim])
    return out.to(q.dtype), lse


def _mla_decode_fake(q, kv_cache, block_table, seq_lens, scale, value_dim):
    B, H, _ = q.shape
    return q.new_empty(B, H, value_dim), q.new_empty(B, H, dtype=torch.float32)


@torch.library.custom_op("k3::mla_decode", mutates_args=())
def mla_decode(
    q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, scale: float, value_dim: int
) -> tuple[Tensor, Tensor]:
    """q [B, H, W] absorbed queries -> (o [B, H, value_dim] in q.dtype, lse [B, H] fp32)."""
    return mla_decode_reference(q, kv_cache, block_table, seq_lens, scale, value_dim)


mla_decode.register_fake(_mla_decode_fake)

def mla_prefill_partial_reference(
    q: Tensor, kv_cache: Tensor, block_table: Tensor, cu_seqlens: Tensor, seq_lens: Tensor, position_offset: Tensor,
    dcp: int, interleave: int, scale: float, value_dim: int,
) -> tuple[Tensor, Tensor]:
    """The torch reference of ``k3::mla_prefill_partial`` (fp32 math on any device).

    q [T, H, W]: absorbed queries of the packed new tokens (sequence i's are the last
    ``cu_seqlens[i+1] - cu_seqlens[i]`` of its ``seq_lens[i]`` global positions). This
    member's cache holds, per sequence, its local positions m = 0, 1, ... in position order
    (``k3compile/context_parallel.py``): global position ``(m // interleave) * dcp *
    interleave + position_offset + m % interleave``. A new token at global position p
    attends to the cached positions <= p. Returns (o [T, H, value_dim] in q.dtype, lse
    [T, H] fp32; -inf and a zero output where this member holds none of them)."""
    from k3compile.context_parallel import local_lengths

    T, H, _ = q.shape
    block_size = kv_cache.shape[1]
    o = q.new_zeros(T, H, value_dim)
    lse = torch.full((T, H), float("-inf"), dtype=torch.float32, device=q.device)
    cu = cu_seqlens.tolist()
    lengths = seq_lens.tolist()
    local = local_lengths(seq_lens, position_offset, dcp, interleave).tolist()
    offset = int(position_offset)
    for i, (length, n_local) in enumerate(zip(lengths, local)):
        start, stop = cu[i], cu[i + 1]
        if stop == start or n_local == 0:
            continue
        m = torch.arange(n_local, device=q.device)
        blocks = block_table[i].long()[m // block_size]
        ctx = cache_rows_as_values(kv_cache[blocks, m % block_size], value_dim)  # [n_local, W]
        pos = (m // interleave) * (dcp * interleave) + offset + m % interleave
        q_pos = torch.arange(length - (stop - start), length, device=q.device)
        scores = torch.einsum("thw,cw->thc", q[start:stop].float(), ctx) * scale
        scores = scores.masked_fill((pos[None, :] > q_pos[:, None])[:, None, :], float("-inf"))
        part = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - part.unsqueeze(-1).clamp_min(torch.finfo(torch.float32).min)).nan_to_num(0.0)
        o[start:stop] = torch.einsum("thc,cl->thl", probs, ctx[:, :value_dim]).to(q.dtype)
        lse[start:stop] = part
    return o, lse


@torch.library.custom_op("k3::mla_prefill_partial", mutates_args=())
def mla_prefill_partial(
    q: Tensor, kv_cache: Tensor, block_table: Tensor, cu_seqlens: Tensor, seq_lens: Tensor, position_offset: Tensor,
    dcp: int, interleave: int, scale: float, value_dim: int,
) -> tuple[Tensor, Tensor]:
    """Absorbed causal prefill over one DCP member's positions (see
    :func:`mla_prefill_partial_reference`) -> (o [T, H, value_dim], lse [T, H])."""
    return mla_prefill_partial_reference(q, kv_cache, block_table, cu_seqlens, seq_lens, position_offset, dcp,
                                         interleave, scale, value_dim)


@mla_prefill_partial.register_fake
def _(q, kv_cache, block_table, cu_seqlens, seq_lens, position_offset, dcp, interleave, scale, value_dim):
    T, H, _ = q.shape
    return q.new_empty(T, H, value_dim), q.new_empty(T, H, dtype=torch.float32)


#: The head multiple ``k3::mla_decode_split_kv`` requires: the split-KV kernel's smallest
#: head tile. Defined here, with the op's contract; the runtime's kernel module reads it
#: (its ``HEAD_TILE``), the op library never imports the runtime.
SPLIT_KV_HEAD_MULTIPLE = 16


def _check_split_kv_heads(q: Tensor) -> None:
    if q.dim() != 3 or q.shape[1] % SPLIT_KV_HEAD_MULTIPLE:
        raise ValueError(
            f"k3::mla_decode_split_kv needs q [B, H, W] with H a multiple of {SPLIT_KV_HEAD_MULTIPLE}, "
            f"got {tuple(q.shape)}; pad the heads (pass pad_attention_heads) or call k3::mla_decode"
        )


@torch.library.custom_op("k3::mla_decode_split_kv", mutates_args=())
def mla_decode_split_kv(
    q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, scale: float, value_dim: int
) -> tuple[Tensor, Tensor]:
    """``mla_decode`` for head counts that are multiples of 16 (the fast kernel's tile).
    The reference here; the runtime registers the Triton split-KV kernel for GPUs."""
    _check_split_kv_heads(q)
    return mla_decode_reference(q, kv_cache, block_table, seq_lens, scale, value_dim)


@mla_decode_split_kv.register_fake
def _(q, kv_cache, block_table, seq_lens, scale, value_dim):
    _check_split_kv_heads(q)
    return _mla_decode_fake(q, kv_cache, block_table, seq_lens, scale, value_dim)


@torch.library.custom_op("k3::pad_heads", mutates_args=())
def pad_heads(x: Tensor, heads: int) -> Tensor:
    """x [B, H, ...] -> [B, heads, ...]: x followed by heads - H zero heads (heads >= H)."""
    if heads < x.shape[1]:
        raise ValueError(f"k3::pad_heads: cannot pad {x.shape[1]} heads to {heads}")
    padded = x.new_zeros(x.shape[0], heads, *x.shape[2:])
    padded[:, : x.shape[1]] = x
    return padded


@pad_heads.register_fake
def _(x: Tensor, heads: int) -> Tensor:
    return x.new_empty(x.shape[0], heads, *x.shape[2:])


@torch.library.custom_op("k3::narrow_heads", mutates_args=())
def narrow_heads(x: Tensor, heads: int) -> Tensor:
    """x [B, H, ...] -> its first ``heads`` heads [B, heads, ...] (a contiguous copy: a
    custom op's output may not alias its input)."""
    if heads > x.shape[1]:
        raise ValueError(f"k3::narrow_heads: cannot take {heads} of {x.shape[1]} heads")
    return x[:, :heads].clone(memory_format=torch.contiguous_format)


@narrow_heads.register_fake
def _(x: Tensor, heads: int) -> Tensor:
    return x.new_empty(x.shape[0], heads, *x.shape[2:])


# Placement rule and cost: k3compile/placement/k3_rules.py.
