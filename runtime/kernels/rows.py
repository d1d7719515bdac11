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
- ``add_rank_block_linear(acc, x, weight, start)``: the block computed as ``x @ weight^T``
  by the vendor GEMV (cuBLAS / hipBLASLt), then the add above. A Triton kernel doing the
  GEMV and the add in one launch was measured slower on an H200 (17.8 us against 11.4 us
  for the 896 x 3584 rows at batch 1, 4x slower at batch 64): the vendor GEMV's K
  reduction is better than a portable one, and the launch it saves is worth ~2 us.

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


def add_rank_block_linear(acc: Tensor, x: Tensor, weight: Tensor, start: Tensor) -> Tensor:
    width, (n, K) = acc.shape[-1], weight.shape
    if x.shape[-1] != K or x.shape[:-1] != acc.shape[:-1] or n > width:
        raise ValueError(f"add_rank_block_linear: x {tuple(x.shape)} @ weight {tuple(weight.shape)}^T "
                         f"does not fit acc {tuple(acc.shape)}")
    return add_rank_block(acc, torch.nn.functional.linear(x, weight), start, -1)


def register_cuda_kernels() -> None:
    """Use these kernels for ``k3::rms_norm``, ``k3::add_rank_block`` and
    ``k3::add_rank_block_linear`` on CUDA/ROCm tensors (registering again replaces the
    same functions)."""
    import k3compile.ops.norm as norm
    import k3compile.ops.partial as partial

    norm.rms_norm.register_kernel("cuda")(rms_norm)
    partial.add_rank_block.register_kernel("cuda")(add_rank_block)
    partial.add_rank_block_linear.register_kernel("cuda")(add_rank_block_linear)
