"""MLA prefill in the expanded form: the context's latents decompressed once into per-head
keys and values (one GEMM), then flash attention of the new tokens over them.

    k_nope | v = latent W_UK^T | latent W_UV^T        [P, H, Dn + Dv]  (P: the batch's positions)
    o[t, h] = softmax_j(scale (q_nope k_nope_j + q_pe k_pe_j), j <= pos(t)) v_j

Semantics are those of ``torch.ops.k3.mla_prefill`` (k3compile/ops/mla.py; its reference is
this form in fp32). The absorbed form (``mla_attention.mla_prefill_absorbed``) instead
attends in the 576-wide latent space: per (new token, visible position, head) it costs
2 (L + R + L) FLOPs (K3: 2,176) against 2 (Dn + R + Dv) here (640), but needs no
decompression, which costs 2 L (Dn + Dv) per context position and head (262,144 at K3).
So the absorbed form can win only for a few new tokens against a long history (its
kernel also runs its FLOPs several times slower): :func:`prefill_form` chooses per call
from the two FLOP counts and the measured rates.

``_mla_expanded_kernel``, grid (tiles of BLOCK_M new tokens, heads, sequences): one head's
[BLOCK_M, Dn + R] queries against BLOCK_N positions at a time, online softmax in the log2
domain in fp32, the causal limit aligned to the bottom right (a sequence's new tokens are
its last positions). Tiles of positions every row sees run without masks; only the
diagonal ones mask. k_pe is one [P, R] tensor shared by every head, as in the cache.

Memory: the decompressed keys and values are 2 (Dn + Dv) H bytes per context position in
bf16 (6 KiB at one TP8 rank of K3: 200 MB at 32K positions), alive for one call. Longer
contexts are taken a window of :data:`WINDOW_POSITIONS` at a time: each window's positions
decompressed, then attended by the same kernel, which keeps the online softmax's running
max, sum and unnormalised output in fp32 between windows and normalises after the last.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from k3compile.mla_cache_fp8 import cache_rows_as_values, cache_value_width, is_fp8_cache
from k3compile.runtime.kernels import counted
from k3compile.runtime.kernels.aot import TRITON_DTYPES, KernelLaunch
from k3compile.runtime.kernels.mla_common import (
    _INTERPRETED,
    LOG2E,
    _dot_constexprs,
    _empty,
    _kernel_launch,
)
from k3compile.runtime.kernels.targets import device_target


@counted
@triton.jit(do_not_specialize=["w_start", "w_end"])
def _mla_expanded_kernel(
    q_ptr, kv_ptr, pe_ptr, cu_q_ptr, cu_kv_ptr, ctx_ptr, o_ptr, m_ptr, l_ptr, acc_ptr,
    scale_log2, w_start, w_end,
    stride_qt, stride_qh, stride_kvp, stride_kvh, stride_pep, stride_ot, stride_oh,
    DN: tl.constexpr, R: tl.constexpr, DV: tl.constexpr,
    BLOCK_DN: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, FP32_DOT: tl.constexpr,
    FIRST: tl.constexpr, LAST: tl.constexpr,
):
    """Program (new-token tile m, head h, sequence n) over the window [w_start, w_end) of
    context positions. q [T, H, DN + R] (q_nope, then q_pe); kv [P, H, DN + DV] (k_nope,
    then v) and pe [P, R]: sequence n's positions w_start.. at rows cu_kv[n]:cu_kv[n+1];
    ctx [N] the contexts' lengths; o [T, H, DV]. Between windows the online softmax's state
    is kept in m, l [T, H] and acc [T, H, DV] (fp32): FIRST starts it, LAST writes o
    (one window: both, no state). FP32_DOT: dots on fp32 copies (the interpreter's bf16
    dot is wrong, triton#11584)."""
    m0 = tl.program_id(0) * BLOCK_M
    h = tl.program_id(1)
    n = tl.program_id(2)
    q_start = tl.load(cu_q_ptr + n)
    n_new = tl.load(cu_q_ptr + n + 1) - q_start
    if m0 >= n_new:
        return
    kv_start = tl.load(cu_kv_ptr + n)
    history = tl.load(ctx_ptr + n) - n_new  # positions before the new tokens

    rows = m0 + tl.arange(0, BLOCK_M)
    row_ok = rows < n_new
    row_end = history + rows + 1  # exclusive causal limit of each row
    d_n = tl.arange(0, BLOCK_DN)
    d_r = tl.arange(0, BLOCK_R)
    d_v = tl.arange(0, BLOCK_DV)
    p_ty = q_ptr.dtype.element_ty
    dot_ty = tl.float32 if FP32_DOT else p_ty

    q_row = q_ptr + (q_start + rows).to(tl.int64)[:, None] * stride_qt + h * stride_qh
    q_nope = tl.load(q_row + d_n[None, :], mask=row_ok[:, None] & (d_n[None, :] < DN), other=0.0).to(dot_ty)
    q_pe = tl.load(q_row + DN + d_r[None, :], mask=row_ok[:, None] & (d_r[None, :] < R), other=0.0).to(dot_ty)

    # the window's rows start at position w_start (a multiple of BLOCK_N)
    kv_head = kv_ptr + (kv_start.to(tl.int64) - w_start) * stride_kvp + h * stride_kvh
    pe_seq = pe_ptr + (kv_start.to(tl.int64) - w_start) * stride_pep
    state = (q_start + rows).to(tl.int64) * (tl.num_programs(1)) + h  # row of m / l / acc
    if FIRST:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    else:
        m_i = tl.load(m_ptr + state, mask=row_ok, other=0.0)
        l_i = tl.load(l_ptr + state, mask=row_ok, other=1.0)
        acc = tl.load(acc_ptr + state[:, None] * DV + d_v[None, :], mask=row_ok[:, None] & (d_v[None, :] < DV),
                      other=0.0)
    # [0, unmasked): tiles every row of this tile sees whole (row m0 sees history + m0 + 1)
    unmasked = (history + m0 + 1) // BLOCK_N * BLOCK_N
    tile_end = tl.minimum(history + tl.minimum(m0 + BLOCK_M, n_new), w_end)
    for n0 in range(w_start, tile_end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        diagonal = n0 >= unmasked
        valid = pos < tile_end
        kv_row = kv_head + pos.to(tl.int64)[:, None] * stride_kvp
        k_nope = tl.load(kv_row + d_n[None, :], mask=valid[:, None] & (d_n[None, :] < DN), other=0.0)
        k_pe = tl.load(pe_seq + pos.to(tl.int64)[:, None] * stride_pep + d_r[None, :],
                       mask=valid[:, None] & (d_r[None, :] < R), other=0.0)
        v = tl.load(kv_row + DN + d_v[None, :], mask=valid[:, None] & (d_v[None, :] < DV), other=0.0)
        s = tl.dot(q_nope, tl.trans(k_nope.to(dot_ty)), input_precision=DOT_PRECISION)
        s = tl.dot(q_pe, tl.trans(k_pe.to(dot_ty)), s, input_precision=DOT_PRECISION) * scale_log2
        if diagonal:
            s = tl.where(pos[None, :] < row_end[:, None], s, float("-inf"))
        # every row sees position 0: finite from the first window's first tile, so a row that
        # sees none of a later tile keeps its state (alpha 1, p 0)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = tl.dot(p.to(p_ty).to(dot_ty), v.to(dot_ty), acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new

    if LAST:
        o_row = o_ptr + (q_start + rows).to(tl.int64)[:, None] * stride_ot + h * stride_oh
        tl.store(o_row + d_v[None, :], (acc / l_i[:, None]).to(o_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & (d_v[None, :] < DV))
    else:
        tl.store(m_ptr + state, m_i, mask=row_ok)
        tl.store(l_ptr + state, l_i, mask=row_ok)
        tl.store(acc_ptr + state[:, None] * DV + d_v[None, :], acc, mask=row_ok[:, None] & (d_v[None, :] < DV))


@dataclass(frozen=True)
class ExpandedContext:
    """A batch's context positions, decompressed: sequence n's at rows cu[n]:cu[n+1]."""

    kv: Tensor  # [P, H, Dn + Dv] k_nope then v, in the model dtype
    k_pe: Tensor  # [P, R]
    cu: Tensor  # [N + 1] int32
    start: int = 0  # the first context position held: rows are positions start.. of each sequence


def expand_context(kv_cache: Tensor, kv_b_weight: Tensor, block_table: Tensor, seq_lens: Tensor, num_heads: int,
                   total: int, window: tuple[int, int] | None = None) -> ExpandedContext:
    """Gather each sequence's ``seq_lens[n]`` cached rows (``total`` in all) and decompress
    their latents with ``kv_b_weight`` [H (Dn + Dv), L]: one GEMM in the weight's dtype (an
    FP8 cache's rows dequantised first). ``window`` (start, end): only each sequence's
    positions in [start, end), ``total`` of them in all."""
    L = kv_b_weight.shape[1]
    W = cache_value_width(kv_cache)
    dev = kv_cache.device
    start, end = window or (0, None)
    lengths = seq_lens.long() - start
    lengths = lengths.clamp(0, None if end is None else end - start)
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=dev)
    torch.cumsum(lengths, 0, out=cu[1:])
    seq = torch.repeat_interleave(torch.arange(lengths.numel(), device=dev), lengths, output_size=total)
    pos = torch.arange(total, device=dev) - cu[seq] + start
    bs = kv_cache.shape[1]
    rows = kv_cache[block_table[seq, pos // bs].long(), pos % bs]  # [P, W (+ FP8 scales)]
    if is_fp8_cache(kv_cache):
        rows = cache_rows_as_values(rows, L).to(kv_b_weight.dtype)
    kv = (rows[:, :L] @ kv_b_weight.t()).view(total, num_heads, -1)
    return ExpandedContext(kv, rows[:, L:W].contiguous(), cu.to(torch.int32), start)


#: context positions decompressed at a time (a multiple of every target's BLOCK_N): 768 MiB
#: of bf16 keys and values at one TP8 rank of K3 (6 KiB a position), so a million-token
#: history is attended in 8 windows instead of decompressing 6 GiB at once
WINDOW_POSITIONS = 131072


@dataclass(frozen=True)
class ExpandedConfig:
    block_m: int  # new tokens per program
    block_n: int  # positions per step
    num_warps: int
    num_stages: int


def expanded_config(target: str, dtype: torch.dtype) -> ExpandedConfig:
    """Tiles and warps per target at K3's shapes (Dn = Dv = 128, R = 64): on CUDA the
    fastest of an H200 sweep (BENCHMARKS.md), on AMD from the AOT resources (docs/kernels.md:
    two waves per SIMD, i.e. one 8-wave workgroup per CU; the pipelined loads' LDS left to
    the compiler). fp32 tiles are twice as wide: half the rows."""
    if dtype == torch.float32:
        return ExpandedConfig(64, 32, 4, 1)
    return ExpandedConfig(128, 64, 8, 3) if target == "sm_90" else ExpandedConfig(128, 64, 8, 1)


def _constexprs(nope: int, rope: int, value: int, dtype: torch.dtype, config: ExpandedConfig,
                interpreted: bool = _INTERPRETED) -> dict[str, object]:
    pow2 = lambda n: max(16, triton.next_power_of_2(n))  # noqa: E731
    return {"DN": nope, "R": rope, "DV": value, "BLOCK_DN": pow2(nope), "BLOCK_R": pow2(rope),
            "BLOCK_DV": pow2(value), "BLOCK_M": config.block_m, "BLOCK_N": config.block_n,
            **_dot_constexprs(dtype, interpreted)}


def mla_prefill_expanded(q: Tensor, kv_cache: Tensor, kv_b_weight: Tensor, cu_seqlens: Tensor, block_table: Tensor,
                         seq_lens: Tensor, scale: float, counts: PrefillCounts,
                         window: int = WINDOW_POSITIONS) -> Tensor:
    """``k3::mla_prefill`` in the expanded form (module docstring): q [T, H, Dn + R] ->
    o [T, H, Dv] in q's dtype. ``counts``: the batch's sizes on the host
    (:func:`prefill_counts`). Contexts longer than ``window`` positions are decompressed and
    attended a window at a time (:data:`WINDOW_POSITIONS`), the online softmax carried
    between windows in fp32, so the decompressed keys stay bounded."""
    H = q.shape[1]
    block_n = expanded_config(device_target(q.device), q.dtype).block_n
    if window <= 0 or window % block_n:
        raise ValueError(f"window {window}: a positive multiple of the kernel's {block_n} positions needed")
    starts = range(0, max(counts.contexts, default=0), window)
    if len(starts) <= 1:
        ctx = expand_context(kv_cache, kv_b_weight, block_table, seq_lens, H, counts.positions)
        return expanded_attention(q, ctx, cu_seqlens, seq_lens, scale, counts.max_new_tokens)
    R = cache_value_width(kv_cache) - kv_b_weight.shape[1]
    Dv = kv_b_weight.shape[0] // H - (q.shape[-1] - R)
    state = WindowState.empty(q.shape[0], H, Dv, q.device)
    for i, start in enumerate(starts):
        end = start + window
        total = sum(min(max(c - start, 0), window) for c in counts.contexts)
        ctx = expand_context(kv_cache, kv_b_weight, block_table, seq_lens, H, total, (start, end))
        o = expanded_attention(q, ctx, cu_seqlens, seq_lens, scale, counts.max_new_tokens, state=state,
                               first=i == 0, last=i == len(starts) - 1, end=end)
    return o


@dataclass(frozen=True)
class WindowState:
    """The online softmax of every (new token, head) between windows, fp32."""

    m: Tensor  # [T, H] running max (log2 domain)
    l: Tensor  # [T, H] running sum  # noqa: E741
    acc: Tensor  # [T, H, Dv] unnormalised output

    @staticmethod
    def empty(tokens: int, heads: int, value: int, device: torch.device) -> WindowState:
        return WindowState(torch.empty(tokens, heads, dtype=torch.float32, device=device),
                           torch.empty(tokens, heads, dtype=torch.float32, device=device),
                           torch.empty(tokens, heads, value, dtype=torch.float32, device=device))


def expanded_attention(q: Tensor, ctx: ExpandedContext, cu_seqlens: Tensor, seq_lens: Tensor, scale: float,
                       max_new_tokens: int, config: ExpandedConfig | None = None, state: WindowState | None = None,
                       first: bool = True, last: bool = True, end: int = 2**31 - 1) -> Tensor:
    """The kernel: causal attention of q [T, H, Dn + R] (sequence n's new tokens at rows
    cu_seqlens[n]:cu_seqlens[n+1], the last of its ``seq_lens[n]`` positions) over ``ctx``
    (positions ``ctx.start`` to ``end``) -> o [T, H, Dv] when ``last`` (else o is unwritten
    and ``state`` holds the softmax so far). ``config``: the target's
    (:func:`expanded_config`) unless given."""
    T, H, _ = q.shape
    R = ctx.k_pe.shape[1]
    Dn = q.shape[-1] - R
    Dv = ctx.kv.shape[-1] - Dn
    o = _empty((T, H, Dv), q.dtype, q.device)
    if T == 0:
        return o
    q = q if q.stride(-1) == 1 else q.contiguous()
    config = config or expanded_config(device_target(q.device), q.dtype)
    if ctx.start % config.block_n:
        raise ValueError(f"window start {ctx.start}: a multiple of the kernel's {config.block_n} positions needed")
    if state is None and not (first and last):
        raise ValueError("expanded_attention over several windows needs a WindowState")
    if state is None:  # one window: no state is read or written
        state = WindowState.empty(0, 0, 0, q.device)
    grid = (triton.cdiv(max_new_tokens, config.block_m), H, ctx.cu.numel() - 1)
    _mla_expanded_kernel[grid](
        q, ctx.kv, ctx.k_pe, cu_seqlens, ctx.cu, seq_lens, o, state.m, state.l, state.acc, scale * LOG2E, ctx.start, end,
        q.stride(0), q.stride(1), ctx.kv.stride(0), ctx.kv.stride(1), ctx.k_pe.stride(0), o.stride(0), o.stride(1),
        **_constexprs(Dn, R, Dv, q.dtype, config), FIRST=first, LAST=last, num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return o


@dataclass(frozen=True)
class PrefillCounts:
    """A prefill batch's sizes, read once on the host (prefill runs eagerly)."""

    new_tokens: tuple[int, ...]  # per sequence
    contexts: tuple[int, ...]  # per sequence, its new tokens included

    @property
    def max_new_tokens(self) -> int:
        return max(self.new_tokens, default=0)

    @property
    def positions(self) -> int:
        return sum(self.contexts)

    def pairs(self) -> int:
        """(new token, visible position) pairs of the causal prefill."""
        return sum(n * (c - n) + n * (n + 1) // 2 for n, c in zip(self.new_tokens, self.contexts, strict=True))


def prefill_counts(cu_seqlens: Tensor, seq_lens: Tensor) -> PrefillCounts:
    """:class:`PrefillCounts` of a batch (one device-to-host copy)."""
    both = torch.cat([cu_seqlens.long(), seq_lens.long()]).tolist()
    cu, ctx = both[:cu_seqlens.numel()], both[cu_seqlens.numel():]
    return PrefillCounts(tuple(b - a for a, b in zip(cu[:-1], cu[1:], strict=True)), tuple(ctx))


#: the absorbed prefill kernel's FLOP rate over the expanded form's (kernel and
#: decompression), measured on an H200 at K3's per-rank shapes (BENCHMARKS.md): its [16, 576]
#: row tiles of (token, head) pairs use the matrix units far less well
ABSORBED_RELATIVE_RATE = 0.15


def prefill_form(counts: PrefillCounts, heads: int, latent: int, rope: int, nope: int, value: int) -> str:
    """"expanded" or "absorbed": the form whose FLOPs take less time for this batch, the
    absorbed form's at :data:`ABSORBED_RELATIVE_RATE` of the expanded form's rate (module
    docstring)."""
    pairs = counts.pairs()
    new = sum(counts.new_tokens)
    absorbed = 2 * heads * (pairs * (2 * latent + rope) + new * latent * (nope + value))
    expanded = 2 * heads * (counts.positions * latent * (nope + value) + pairs * (nope + rope + value))
    return "expanded" if expanded * ABSORBED_RELATIVE_RATE < absorbed else "absorbed"


def aot_launch(target: str, dtype: torch.dtype = torch.bfloat16, nope: int = 128, rope: int = 64,
               value: int = 128, first: bool = True, last: bool = True) -> KernelLaunch:
    """The kernel as :func:`mla_prefill_expanded` specialises it on ``target`` at K3's widths:
    by default for contexts of one window; ``first`` / ``last`` False: a window that
    continues / leaves the softmax state (named ``mla_prefill_expanded_window_*``)."""
    t = TRITON_DTYPES[dtype]
    config = expanded_config(target, dtype)
    c = {**_constexprs(nope, rope, value, dtype, config, interpreted=False), "FIRST": first, "LAST": last}
    ptrs = {"q_ptr": t, "kv_ptr": t, "pe_ptr": t, "cu_q_ptr": "i32", "cu_kv_ptr": "i32", "ctx_ptr": "i32", "o_ptr": t,
            "m_ptr": "fp32", "l_ptr": "fp32", "acc_ptr": "fp32"}
    name = "mla_prefill_expanded" if first and last else \
        f"mla_prefill_expanded_window_{'first' if first else 'last' if last else 'middle'}"
    return _kernel_launch(name, _mla_expanded_kernel, ptrs, c, config.num_warps, config.num_stages)


def aot_launches(target: str, dtype: torch.dtype = torch.bfloat16) -> list[KernelLaunch]:
    """The kernel's four variants (one window; a context's first, middle and last window)."""
    return [aot_launch(target, dtype, first=f, last=la) for f, la in ((True, True), (True, False), (False, False),
                                                                     (False, True))]
