"""Row kernels of the MoE tail: RMSNorm and adding a rank's block into a partial sum.

The torch references of ``k3::rms_norm`` and ``k3::add_rank_block`` are several kernels
each on a GPU (cast, square, mean, rsqrt, two multiplies, cast back; arange, add,
index_add): at decode, where a row is a few KB, each launch costs more than its bytes.
These are one launch each, one program per row (and per column block for the add):

- ``rms_norm(x, w, eps)``: ``x * rsqrt(mean(x^2) + eps) * w`` in fp32, stored in x's dtype;
  the row (K3: 3584 or 7168 wide) is held in registers in one pass.
- ``add_rank_block(acc, block, start)``: ``out = acc``, plus ``block`` at columns
  ``[start, start + n)`` of the last dim; ``start`` is read on the device (a per-rank
  buffer), so the launch is the same on every rank and can be captured in a CUDA graph.
- ``add_rank_block_linear(acc, x, weight, start)``: the same with the block computed in
  the kernel, ``x @ weight^T`` (the rank's rows of a replicated linear: at decode a GEMV
  that is latency bound, so the add rides along instead of being a second launch). Two
  kinds of programs in one grid (axis 1: blocks of ``BLOCK_T`` rows of x): the first
  ``cdiv(n, LINEAR_BLOCK_N)`` programs each own ``LINEAR_BLOCK_N`` weight rows, i.e.
  output columns ``start + [j*BLOCK_N, (j+1)*BLOCK_N)``, and compute their dot products
  over K in ``BLOCK_K`` chunks (fp32) plus acc; the others copy acc's ``N - n`` columns
  outside the block, ``COPY_BLOCK`` at a time (column c' maps to c' below start, else
  c' + n). Which is which depends only on n, so the grid does not depend on ``start``.

:func:`register_cuda_kernels` makes them the CUDA implementations of the k3 ops
(the runtime calls it when it runs on a GPU; the ops' torch references stay the CPU
implementations and the numerical truth).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, width, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    x = tl.load(x_ptr + row * width + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / width + eps)
    tl.store(y_ptr + row * width + cols, (x * inv * w).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _add_rank_block_kernel(acc_ptr, block_ptr, start_ptr, out_ptr, width, n, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    start = tl.load(start_ptr)
    acc = tl.load(acc_ptr + row * width + cols, mask=mask, other=0.0).to(tl.float32)
    inside = mask & (cols >= start) & (cols < start + n)
    add = tl.load(block_ptr + row * n + (cols - start), mask=inside, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * width + cols, (acc + add).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _add_rank_block_linear_kernel(acc_ptr, x_ptr, w_ptr, start_ptr, out_ptr, T, N, n, K,
                                  BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                  COPY_BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_mask = rows < T
    start = tl.load(start_ptr).to(tl.int32)
    n_linear = tl.cdiv(n, BLOCK_N)
    if pid < n_linear:
        # Weight rows [pid*BLOCK_N, +BLOCK_N) -> output columns start + those.
        wrows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        wmask = wrows < n
        ks = tl.arange(0, BLOCK_K)
        dot = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kmask = (k0 + ks) < K
            x = tl.load(x_ptr + rows[:, None] * K + (k0 + ks)[None, :],
                        mask=row_mask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
            w = tl.load(w_ptr + wrows[:, None] * K + (k0 + ks)[None, :],
                        mask=wmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
            dot += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
        out_offs = rows[:, None] * N + (start + wrows)[None, :]
        out_mask = row_mask[:, None] & wmask[None, :]
        acc = tl.load(acc_ptr + out_offs, mask=out_mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + out_offs, (acc + dot).to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # Columns outside [start, start + n): the (N - n) of them, COPY_BLOCK at a time.
        c = (pid - n_linear) * COPY_BLOCK + tl.arange(0, COPY_BLOCK)
        copy_cols = tl.where(c < start, c, c + n)
        copy_mask = row_mask[:, None] & (c < N - n)[None, :]
        copy_offs = rows[:, None] * N + copy_cols[None, :]
        tl.store(out_ptr + copy_offs, tl.load(acc_ptr + copy_offs, mask=copy_mask, other=0.0), mask=copy_mask)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    width = x.shape[-1]
    if weight.shape != (width,):
        raise ValueError(f"rms_norm: weight of shape {tuple(weight.shape)} for rows of width {width}")
    x2 = x.reshape(-1, width).contiguous()
    y = torch.empty_like(x2)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, weight.contiguous(), y, width, eps, BLOCK=triton.next_power_of_2(width))
    return y.view(x.shape)


ADD_BLOCK = 1024


def add_rank_block(acc: Tensor, block: Tensor, start: Tensor, dim: int) -> Tensor:
    if dim not in (-1, acc.dim() - 1):
        raise ValueError(f"add_rank_block: the kernel adds along the last dim, got dim={dim}")
    width, n = acc.shape[-1], block.shape[-1]
    if block.shape[:-1] != acc.shape[:-1] or n > width:
        raise ValueError(f"add_rank_block: block {tuple(block.shape)} does not fit acc {tuple(acc.shape)}")
    acc2, block2 = acc.reshape(-1, width).contiguous(), block.reshape(-1, n).contiguous()
    out = torch.empty_like(acc2)
    if acc2.shape[0]:
        grid = (acc2.shape[0], triton.cdiv(width, ADD_BLOCK))
        _add_rank_block_kernel[grid](acc2, block2, start.reshape(1), out, width, n, BLOCK=ADD_BLOCK)
    return out.view(acc.shape)


LINEAR_BLOCK_N, LINEAR_BLOCK_K, LINEAR_MAX_BLOCK_T, COPY_BLOCK = 8, 256, 4, 512


def add_rank_block_linear(acc: Tensor, x: Tensor, weight: Tensor, start: Tensor) -> Tensor:
    width, (n, K) = acc.shape[-1], weight.shape
    if x.shape[-1] != K or x.shape[:-1] != acc.shape[:-1] or n > width:
        raise ValueError(f"add_rank_block_linear: x {tuple(x.shape)} @ weight {tuple(weight.shape)}^T "
                         f"does not fit acc {tuple(acc.shape)}")
    acc2, x2 = acc.reshape(-1, width).contiguous(), x.reshape(-1, K).contiguous()
    out = torch.empty_like(acc2)
    T = acc2.shape[0]
    if T:
        block_t = min(triton.next_power_of_2(T), LINEAR_MAX_BLOCK_T)
        programs = triton.cdiv(n, LINEAR_BLOCK_N) + triton.cdiv(width - n, COPY_BLOCK)
        _add_rank_block_linear_kernel[(programs, triton.cdiv(T, block_t))](
            acc2, x2, weight.contiguous(), start.reshape(1), out, T, width, n, K,
            BLOCK_T=block_t, BLOCK_N=LINEAR_BLOCK_N, BLOCK_K=LINEAR_BLOCK_K, COPY_BLOCK=COPY_BLOCK)
    return out.view(acc.shape)


def register_cuda_kernels() -> None:
    """Use these kernels for ``k3::rms_norm``, ``k3::add_rank_block`` and
    ``k3::add_rank_block_linear`` on CUDA/ROCm tensors (registering again replaces the
    same functions)."""
    import k3compile.ops.norm as norm
    import k3compile.ops.partial as partial

    norm.rms_norm.register_kernel("cuda")(rms_norm)
    partial.add_rank_block.register_kernel("cuda")(add_rank_block)
    partial.add_rank_block_linear.register_kernel("cuda")(add_rank_block_linear)
