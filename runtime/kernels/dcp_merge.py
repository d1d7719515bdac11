"""Triton kernels of the DCP merge ops (k3compile/ops/dcp.py), one launch each.

``k3::dcp_rescale`` (reduce-scatter merge) weights this member's partial attention
output by ``exp(lse - logsumexp_k lse_k)`` over the members' LSEs and lays it out heads
first for the reduce-scatter that sums the members' terms. Its torch reference is ~8
small kernels (logsumexp, subtract, exp, NaN fix, cast, multiply, transpose copy);
decode runs it once per MLA layer per step, so it is one launch here: one program per
(sequence, head) reads the ``dcp`` LSEs of that row, computes the weight (0 where this
member owns no position: lse = -inf), and writes the scaled value row transposed.

The all-to-all merge: ``k3::dcp_pack`` copies each (sequence, head) row of the partial
output with its LSE into the send buffer, member-major; ``k3::dcp_merge`` reads the
``dcp`` rows of one (sequence, own head) from the receive buffer, weights them by their
LSEs and writes the merged row in the model dtype. One program per (sequence, head).

:func:`register_kernels` makes the three launchers the ops' implementations on a device type.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from k3compile.ops import dcp as dcp_ops
from k3compile.runtime.kernels import counted
from k3compile.runtime.kernels.aot import TRITON_DTYPES, KernelLaunch, launch_signature


@counted
@triton.jit
def _dcp_rescale_kernel(o_ptr, lse_ptr, lse_all_ptr, out_ptr, B, H, D,
                        DCP: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program (b, h): out[h, b, :] = o[b, h, :] * exp(lse[b, h] - logsumexp_k lse_all[k*B + b, h])."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    merged_max = float("-inf")
    for k in tl.static_range(DCP):
        merged_max = tl.maximum(merged_max, tl.load(lse_all_ptr + (k * B + b) * H + h))
    total = 0.0
    for k in tl.static_range(DCP):
        v = tl.load(lse_all_ptr + (k * B + b) * H + h)
        total += tl.where(v == float("-inf"), 0.0, tl.exp(v - merged_max))
    mine = tl.load(lse_ptr + b * H + h)
    # total > 0 whenever mine is finite (mine is one of the gathered values)
    weight = tl.where(mine == float("-inf"), 0.0, tl.exp(mine - merged_max) / total)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    row = tl.load(o_ptr + (b * H + h) * D + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + (h * B + b) * D + cols, row * weight, mask=mask)


def dcp_rescale(o: Tensor, lse: Tensor, lse_gathered: Tensor, dcp: int) -> Tensor:
    """``k3::dcp_rescale`` on a GPU: o [B, H, D], lse [B, H] fp32, lse_gathered [dcp*B, H]
    fp32 -> [H, B, D] fp32."""
    B, H, D = o.shape
    if lse.shape != (B, H) or lse_gathered.shape != (dcp * B, H):
        raise ValueError(f"dcp_rescale: o {tuple(o.shape)}, lse {tuple(lse.shape)} and lse_gathered "
                         f"{tuple(lse_gathered.shape)} do not match dcp={dcp}")
    o, lse, lse_gathered = o.contiguous(), lse.float().contiguous(), lse_gathered.float().contiguous()
    out = torch.empty(H, B, D, dtype=torch.float32, device=o.device)
    if B and H:
        _dcp_rescale_kernel[(B, H)](o, lse, lse_gathered, out, B, H, D, DCP=dcp,
                                    BLOCK_D=triton.next_power_of_2(D), num_warps=4)
    return out


@counted
@triton.jit
def _dcp_pack_kernel(o_ptr, lse_ptr, out_ptr, B, H, D, DCP: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program (b, head): out[head // h, b, head % h, :D] = o[b, head], [..., D] = lse[b, head]
    (h = H / DCP heads per member)."""
    b = tl.program_id(0)
    head = tl.program_id(1)
    h = H // DCP
    cols = tl.arange(0, BLOCK_D)
    row = tl.load(o_ptr + (b * H + head) * D + cols, mask=cols < D, other=0.0).to(tl.float32)
    dst = out_ptr + (((head // h) * B + b) * h + head % h) * (D + 1)
    tl.store(dst + cols, row, mask=cols < D)
    tl.store(dst + D, tl.load(lse_ptr + b * H + head))


@counted
@triton.jit
def _dcp_merge_kernel(rows_ptr, out_ptr, B, h, D, DCP: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program (b, j): out[b, j] = sum_k exp(lse_k - logsumexp lse) o_k over the DCP rows
    rows[k, b, j] = (o_k [D], lse_k); 0 where every lse_k is -inf."""
    b = tl.program_id(0)
    j = tl.program_id(1)
    stride_k = B * h * (D + 1)
    first = rows_ptr + (b * h + j) * (D + 1)
    merged_max = float("-inf")
    for k in tl.static_range(DCP):
        merged_max = tl.maximum(merged_max, tl.load(first + k * stride_k + D))
    merged_max = tl.where(merged_max == float("-inf"), 0.0, merged_max)  # no position anywhere: weights 0
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    total = 0.0
    acc = tl.zeros([BLOCK_D], tl.float32)
    for k in tl.static_range(DCP):
        w = tl.exp(tl.load(first + k * stride_k + D) - merged_max)  # exp(-inf) = 0 for an empty member
        total += w
        acc += w * tl.load(first + k * stride_k + cols, mask=mask, other=0.0)
    out = acc / tl.where(total > 0, total, 1.0)  # acc = 0 where total = 0
    tl.store(out_ptr + (b * h + j) * D + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def dcp_pack(o: Tensor, lse: Tensor, dcp: int) -> Tensor:
    """``k3::dcp_pack`` on a GPU: o [B, dcp*h, D], lse [B, dcp*h] -> [dcp, B, h, D + 1] fp32."""
    B, H, D = o.shape
    if lse.shape != (B, H) or H % dcp:
        raise ValueError(f"dcp_pack: o {tuple(o.shape)} and lse {tuple(lse.shape)} do not match dcp={dcp}")
    o, lse = o.contiguous(), lse.float().contiguous()
    out = torch.empty(dcp, B, H // dcp, D + 1, dtype=torch.float32, device=o.device)
    if B and H:
        _dcp_pack_kernel[(B, H)](o, lse, out, B, H, D, DCP=dcp, BLOCK_D=triton.next_power_of_2(D), num_warps=4)
    return out


def dcp_merge(received: Tensor, dtype: torch.dtype) -> Tensor:
    """``k3::dcp_merge`` on a GPU: received [dcp, B, h, D + 1] fp32 -> [B, h, D] ``dtype``."""
    dcp, B, h, D1 = received.shape
    received = received.float().contiguous()
    out = torch.empty(B, h, D1 - 1, dtype=dtype, device=received.device)
    if B and h:
        _dcp_merge_kernel[(B, h)](received, out, B, h, D1 - 1, DCP=dcp, BLOCK_D=triton.next_power_of_2(D1 - 1),
                                  num_warps=4)
    return out


def register_kernels(device_type: str) -> None:
    """Make :func:`dcp_rescale`, :func:`dcp_pack` and :func:`dcp_merge` the ``device_type``
    implementations of the k3 ops of the same names, one launch each instead of the
    references' several kernels (registering again replaces the same functions)."""
    dcp_ops.dcp_rescale.register_kernel(device_type)(dcp_rescale)
    dcp_ops.dcp_pack.register_kernel(device_type)(dcp_pack)
    dcp_ops.dcp_merge.register_kernel(device_type)(dcp_merge)


def aot_launches(dcp: int, value_dim: int = 512, dtype: torch.dtype = torch.bfloat16) -> dict[str, KernelLaunch]:
    """The three kernels as their launchers specialise them for a DCP group of ``dcp``
    members, attention outputs of ``value_dim`` values in ``dtype``, for AOT checks."""
    t = TRITON_DTYPES[dtype]
    constexprs = {"DCP": dcp, "BLOCK_D": triton.next_power_of_2(value_dim)}
    kernels = {"rescale": (_dcp_rescale_kernel, {"o_ptr": f"*{t}", "lse_ptr": "*fp32", "lse_all_ptr": "*fp32",
                                                 "out_ptr": "*fp32"}),
               "pack": (_dcp_pack_kernel, {"o_ptr": f"*{t}", "lse_ptr": "*fp32", "out_ptr": "*fp32"}),
               "merge": (_dcp_merge_kernel, {"rows_ptr": "*fp32", "out_ptr": f"*{t}"})}
    return {name: KernelLaunch(f"dcp_{name}", fn, launch_signature(fn, types, constexprs), constexprs, 4)
            for name, (fn, types) in kernels.items()}
