"""Triton kernel of ``k3::dcp_rescale``: one DCP member's merge term in one launch.

The op (k3compile/ops/dcp.py) weights this member's partial attention output by
``exp(lse - logsumexp_k lse_k)`` over the members' LSEs and lays it out heads first for
the reduce-scatter that sums the members' terms. Its torch reference is ~8 small
kernels (logsumexp, subtract, exp, NaN fix, cast, multiply, transpose copy); decode runs
it once per MLA layer per step, so it is one launch here: one program per (sequence,
head) reads the ``dcp`` LSEs of that row, computes the weight (0 where this member owns
no position: lse = -inf), and writes the scaled value row transposed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


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
