"""The KDA short convolution over packed prefill sequences, in two Triton launches.

Semantics are those of ``torch.ops.k3.short_conv_prefill`` (k3compile/ops/kda.py, whose
torch reference is the numerical truth): per sequence, ``xx = conv_state[slot] ++ x_seq``
(the K-1 earlier inputs per channel, oldest first, then the new tokens),
``y[t] = silu(sum_j weight[:, j] * xx[t + j])`` in fp32, stored in x's dtype, and
``conv_state[slot]`` becomes the last K-1 entries of ``xx``. The reference walks the
sequences in Python; here:

1. ``_short_conv_kernel``, grid (chunks of BT tokens over all sequences, channel blocks):
   each output from its K inputs, read from x or, before a sequence's first token, from
   its conv state (chunks numbered on the device: ``packed_chunks.chunk_table``).
2. ``_conv_state_kernel``, grid (sequences, channel blocks): the new conv states, after
   the outputs read the old ones (stream order).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from k3compile.ops import kda as kda_ops
from k3compile.runtime.kernels import counted
from k3compile.runtime.kernels.aot import TRITON_DTYPES, KernelLaunch, launch_signature
from k3compile.runtime.kernels.packed_chunks import chunk_table

#: tokens and channels per program of the output kernel, and its warps (AOT at K3's shapes,
#: bf16: 32 tokens spilled on sm_90 at 4 and 8 warps; 16 tokens at 8 warps: 168 registers)
BLOCK_T = 16
BLOCK_C = 128
WARPS = 8


@counted
@triton.jit
def _short_conv_kernel(x_ptr, w_ptr, state_ptr, y_ptr, cu_ptr, chunk_seq_ptr, chunk_first_ptr, n_chunks_ptr,
                       slots_ptr, C, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    c = tl.program_id(0)
    if c >= tl.load(n_chunks_ptr):
        return
    seq = tl.load(chunk_seq_ptr + c)
    start = tl.load(cu_ptr + seq)
    end = tl.load(cu_ptr + seq + 1)
    slot = tl.load(slots_ptr + seq)
    tok = tl.load(chunk_first_ptr + c) + tl.arange(0, BT)
    ch = tl.program_id(1) * BC + tl.arange(0, BC)
    ch_ok = ch < C
    ok = (tok < end)[:, None] & ch_ok[None, :]
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    for j in tl.static_range(K):
        src = tok - (K - 1) + j  # the input this tap reads: a token of the sequence, or history
        hist = src < start
        from_x = tl.load(x_ptr + src[:, None].to(tl.int64) * C + ch[None, :], mask=ok & (src >= start)[:, None],
                         other=0.0)
        h_pos = src - start + (K - 1)  # its place in the conv state (oldest first)
        from_state = tl.load(state_ptr + (slot * C + ch[None, :]).to(tl.int64) * (K - 1) + h_pos[:, None],
                             mask=ok & hist[:, None], other=0.0)
        w = tl.load(w_ptr + ch * K + j, mask=ch_ok, other=0.0).to(tl.float32)
        acc += w[None, :] * (from_x.to(tl.float32) + from_state.to(tl.float32))
    y = acc * tl.sigmoid(acc)
    tl.store(y_ptr + tok[:, None].to(tl.int64) * C + ch[None, :], y.to(y_ptr.dtype.element_ty), mask=ok)


@counted
@triton.jit
def _conv_state_kernel(x_ptr, state_ptr, cu_ptr, slots_ptr, C, K: tl.constexpr, BC: tl.constexpr):
    i = tl.program_id(0)
    start = tl.load(cu_ptr + i)
    n = tl.load(cu_ptr + i + 1) - start
    slot = tl.load(slots_ptr + i)
    ch = tl.program_id(1) * BC + tl.arange(0, BC)
    ch_ok = ch < C
    row = state_ptr + (slot * C + ch).to(tl.int64) * (K - 1)
    # new[m] = xx[n + m]: history entry n + m while that is < K - 1, else token n + m - (K - 1)
    old = ()
    for m in tl.static_range(K - 1):
        old = old + (tl.load(row + m, mask=ch_ok),)
    new = ()
    for m in tl.static_range(K - 1):
        src = n + m + ch * 0  # its place in xx, per channel (a vector: masks are built from vectors)
        from_x = tl.load(x_ptr + (start + src - (K - 1)).to(tl.int64) * C + ch, mask=ch_ok & (src >= K - 1),
                         other=0.0)
        kept = tl.zeros([BC], dtype=old[0].dtype)
        for h in tl.static_range(K - 1):
            kept = tl.where(src == h, old[h], kept)
        new = new + (tl.where(src >= K - 1, from_x.to(old[0].dtype), kept),)
    for m in tl.static_range(K - 1):
        tl.store(row + m, new[m], mask=ch_ok)


def short_conv_prefill(x: Tensor, weight: Tensor, conv_state: Tensor, cu_seqlens: Tensor, slots: Tensor) -> Tensor:
    """``k3::short_conv_prefill`` in two launches (module docstring); updates
    ``conv_state[slots]`` in place. A non-contiguous conv state runs the reference."""
    T, C = x.shape
    K = weight.shape[1]
    if weight.shape != (C, K) or conv_state.dim() != 3 or conv_state.shape[1:] != (C, K - 1):
        raise ValueError(f"short_conv_prefill: x {tuple(x.shape)}, weight {tuple(weight.shape)} and conv_state "
                         f"{tuple(conv_state.shape)} do not describe [T, C], [C, K], [S, C, K-1]")
    if not conv_state.is_contiguous() or K < 2:
        return kda_ops.short_conv_prefill_reference(x, weight, conv_state, cu_seqlens, slots)
    y = torch.empty_like(x)
    N = slots.numel()
    if T == 0 or N == 0:
        return y
    x = x.contiguous()
    table = chunk_table(cu_seqlens, T, BLOCK_T)
    slots = slots.to(dtype=torch.int64)
    blocks = triton.cdiv(C, BLOCK_C)
    _short_conv_kernel[(table.seq.numel(), blocks)](
        x, weight.contiguous(), conv_state, y, table.cu, table.seq, table.first, table.count, slots, C,
        K=K, BT=BLOCK_T, BC=BLOCK_C, num_warps=WARPS)
    _conv_state_kernel[(N, blocks)](x, conv_state, table.cu, slots, C, K=K, BC=BLOCK_C, num_warps=4)
    return y


def aot_requests(channels: int = 1536, dtype: torch.dtype = torch.bfloat16) -> list[KernelLaunch]:
    """Both kernels as the launcher runs them at K3's per-rank q / k / v channels (12 x 128, K = 4)."""
    t = TRITON_DTYPES[dtype]
    ptrs = {"x_ptr": f"*{t}", "w_ptr": f"*{t}", "state_ptr": f"*{t}", "y_ptr": f"*{t}", "cu_ptr": "*i64",
            "chunk_seq_ptr": "*i64", "chunk_first_ptr": "*i64", "n_chunks_ptr": "*i64", "slots_ptr": "*i64"}
    conv_c = {"K": 4, "BT": BLOCK_T, "BC": BLOCK_C}
    state_c = {"K": 4, "BC": BLOCK_C}
    return [KernelLaunch("short_conv", _short_conv_kernel, launch_signature(_short_conv_kernel, ptrs, conv_c),
                         conv_c, WARPS),
            KernelLaunch("conv_state", _conv_state_kernel, launch_signature(_conv_state_kernel, ptrs, state_c),
                         state_c, 4)]


def register_kernels(device_type: str) -> None:
    """Make :func:`short_conv_prefill` the ``device_type`` implementation of ``k3::short_conv_prefill``."""
    kda_ops.short_conv_prefill.register_kernel(device_type)(short_conv_prefill)
