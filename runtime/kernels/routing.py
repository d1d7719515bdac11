"""The MoE router's kernels: its fp32 logits and sigmoid top-k routing.

Semantics are those of ``torch.ops.k3.router_logits`` and ``torch.ops.k3.sigmoid_topk_route``
(k3compile/ops/moe.py, whose torch references are the numerical truth).

- ``router_logits``: with bf16 / fp16 operands one cuBLAS GEMM that reads the gate as
  stored and writes fp32 (products of two bf16 values are exact in fp32).
- ``_route_kernel``: one program per token; sigmoid in fp32, top-k of ``s + bias`` by
  ``top_k`` rounds of one max-reduction over keys (score bits, then the id reversed), so
  ids come in decreasing biased score with ties to the lower expert id (the reference's
  stable sort); weights ``s[ids]``, renormalised (``/ (sum + 1e-20)``) and scaled.

Both run inside CUDA graphs: no host synchronisation, one launch each.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from k3compile.runtime.kernels import counted
from k3compile.runtime.kernels.aot import TRITON_DTYPES, KernelLaunch, launch_signature
from k3compile.runtime.kernels.targets import NVIDIA_TARGETS, device_target

MAX_EXPERTS = 4096  # one register row per token in the routing kernel
ROUTE_WARPS = 4  # one token's 896 scores per program (H200: 5.5 us at 4 warps, 9.3 at 1)


@counted
@triton.jit
def _route_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, E, logits_stride, scaling,
                  TOP_K: tl.constexpr, K_POW2: tl.constexpr, BLOCK_E: tl.constexpr, RENORMALIZE: tl.constexpr):
    """One token per program. Each of the top_k rounds is ONE max-reduction over int64 keys
    (order-preserving bits of the biased score << 32 | BLOCK_E - 1 - id): the largest key is
    the best score with ties to the lowest id. The weights re-read the picked logits.
    ``logits_stride``: elements from one token's logits to the next (columns of a wider
    product, ``moe_input.py``)."""
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    valid = e < E
    s = tl.sigmoid(tl.load(logits_ptr + t * logits_stride + e, mask=valid, other=0.0).to(tl.float32))
    score = s + tl.load(bias_ptr + e, mask=valid, other=0.0).to(tl.float32)
    score = tl.where(score != score, float("inf"), score)  # NaN first, as torch's descending sort
    bits = score.to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # signed order of ints = order of floats
    key = (ordered.to(tl.int64) << 32) | (BLOCK_E - 1 - e).to(tl.int64)
    key = tl.where(valid, key, -9223372036854775807 - 1)
    slots = tl.arange(0, K_POW2)
    sel_id = tl.zeros([K_POW2], dtype=tl.int32)
    for k in range(TOP_K):  # a loop, not unrolled: 16 unrolled rounds of 1024 lanes compile slowly
        best = tl.max(key, axis=0)
        pick = (BLOCK_E - 1 - (best & 0xFFFFFFFF)).to(tl.int32)
        sel_id = tl.where(slots == k, pick, sel_id)
        key = tl.where(e == pick, -9223372036854775807 - 1, key)
    keep = slots < TOP_K
    sel_w = tl.sigmoid(tl.load(logits_ptr + t * logits_stride + sel_id, mask=keep, other=0.0).to(tl.float32))
    sel_w = tl.where(keep, sel_w, 0.0)
    if RENORMALIZE:
        sel_w = sel_w / (tl.sum(sel_w, axis=0) + 1e-20)
    tl.store(weights_ptr + t * TOP_K + slots, sel_w * scaling, mask=keep)
    tl.store(ids_ptr + t * TOP_K + slots, sel_id.to(tl.int64), mask=keep)


def router_logits(x: Tensor, weight: Tensor) -> Tensor:
    """``k3::router_logits``: with bf16 / fp16 operands one GEMM that reads the weight as
    stored and writes fp32 (``torch.mm(..., out_dtype=float32)``, cuBLAS on CUDA), else the
    reference's fp32 product."""
    if x.dtype == weight.dtype and x.dtype in (torch.bfloat16, torch.float16) and \
            device_target(x.device) in NVIDIA_TARGETS:  # the CPU too; not ROCm
        flat = torch.mm(x.reshape(-1, x.shape[-1]), weight.t(), out_dtype=torch.float32)
        return flat.view(*x.shape[:-1], weight.shape[0])
    return torch.nn.functional.linear(x.float(), weight.float())


def sigmoid_topk_route(logits: Tensor, correction_bias: Tensor, top_k: int, renormalize: bool,
                       scaling: float) -> tuple[Tensor, Tensor]:
    """``k3::sigmoid_topk_route`` in one launch: (weights fp32 [..., top_k], ids int64)."""
    E = logits.shape[-1]
    if logits.dtype not in TRITON_DTYPES or not correction_bias.dtype.is_floating_point:
        raise ValueError(f"sigmoid_topk_route: logits {logits.dtype} / bias {correction_bias.dtype} must be float")
    if correction_bias.shape != (E,) or not 1 <= top_k <= E or E > MAX_EXPERTS:
        raise ValueError(f"sigmoid_topk_route: logits {tuple(logits.shape)}, bias {tuple(correction_bias.shape)}, "
                         f"top_k {top_k}: need bias [E], 1 <= top_k <= E <= {MAX_EXPERTS}")
    x = logits.reshape(-1, E)
    if x.stride(-1) != 1:
        x = x.contiguous()
    weights = torch.empty((x.shape[0], top_k), dtype=torch.float32, device=x.device)
    ids = torch.empty((x.shape[0], top_k), dtype=torch.int64, device=x.device)
    if x.shape[0]:
        block_e = triton.next_power_of_2(E)
        _route_kernel[(x.shape[0],)](x, correction_bias.contiguous(), weights, ids, E, x.stride(0), float(scaling),
                                     TOP_K=top_k, K_POW2=triton.next_power_of_2(top_k), BLOCK_E=block_e,
                                     RENORMALIZE=bool(renormalize), num_warps=ROUTE_WARPS)
    shape = (*logits.shape[:-1], top_k)
    return weights.view(shape), ids.view(shape)


def register_kernels(device_type: str) -> None:
    """Use these kernels for ``k3::router_logits`` and ``k3::sigmoid_topk_route`` on
    ``device_type`` tensors (registering again replaces the same functions)."""
    from k3compile.ops import moe

    moe.router_logits.register_kernel(device_type)(router_logits)
    moe.sigmoid_topk_route.register_kernel(device_type)(sigmoid_topk_route)


def aot_requests(E: int = 896, top_k: int = 16) -> list[KernelLaunch]:
    """The routing kernel's specialisation at K3's expert count and top-k."""
    c = {"TOP_K": top_k, "K_POW2": triton.next_power_of_2(top_k), "BLOCK_E": triton.next_power_of_2(E),
         "RENORMALIZE": True}
    types = {"logits_ptr": "*fp32", "bias_ptr": "*fp32", "weights_ptr": "*fp32", "ids_ptr": "*i64", "scaling": "fp32"}
    return [KernelLaunch("route", _route_kernel, launch_signature(_route_kernel, types, c), c, ROUTE_WARPS)]
