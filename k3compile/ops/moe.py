"""Latent-MoE ops: the router's logits, sigmoid top-k routing and the routed-expert computation.

``k3::router_logits``: x W_gate^T in fp32 whatever the dtypes of x and W_gate (K3 routes
on fp32 logits). One op rather than ``linear(x.float(), W.float())`` so that a kernel may
read W as stored: a product of two bf16 (or fp16) values is exact in fp32, so bf16
operands with fp32 accumulation give the same logits up to summation order, without the
fp32 copy of W (twice its bytes, every step) that the cast makes.

``k3::sigmoid_topk_route``: s = sigmoid(router logits); experts are *selected* by the
top-k of s + e_score_correction_bias (the bias balances load and only affects
selection); the weights are the unbiased s of the chosen experts, renormalised to sum
to one (eps 1e-20) and multiplied by routed_scaling_factor. The k ids of a token come
in order of decreasing biased score; equal scores go to the lower expert id (a rule
every kernel keeps, so that ties route the same everywhere).

``k3::moe_experts``: y = sum_k w_k * expert_{id_k}(z), each expert a SiTU-GLU MLP
(w1 gate, w3 up, w2 down), accumulated in fp32. Under tensor parallelism every rank
holds each expert's slice of the intermediate dim, so the result is a Partial sum.

``k3::moe_experts_mxfp4``: the same function with the expert weights as the checkpoint
stores them (``k3compile/checkpoint/mxfp4.py``): each of w1, w3, w2 as E2M1 codes packed
two per byte (``[E, rows, cols / 2]``) and one E8M0 scale byte per 32 input values
(``[E, rows, cols / 32]``). Its reference dequantises the experts the step picked (exact
in bf16 and fp32) and runs ``k3::moe_experts``' reference on them, so on the CPU the two
ops agree bit for bit; GPU kernels (``k3compile/runtime/kernels/moe.py``) dequantise in
registers.
"""

from __future__ import annotations

import torch
from torch import Tensor

from k3compile.checkpoint.mxfp4 import unpack_mxfp4
from k3compile.ops.activations import situ_glu


@torch.library.custom_op("k3::router_logits", mutates_args=())
def router_logits(x: Tensor, weight: Tensor) -> Tensor:
    return torch.nn.functional.linear(x.float(), weight.float())


@router_logits.register_fake
def _(x: Tensor, weight: Tensor):
    return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=torch.float32)


@torch.library.custom_op("k3::sigmoid_topk_route", mutates_args=())
def sigmoid_topk_route(
    logits: Tensor, correction_bias: Tensor, top_k: int, renormalize: bool, scaling: float
) -> tuple[Tensor, Tensor]:
    scores = torch.sigmoid(logits.float())
    # A stable descending sort: equal biased scores keep the lower expert id first.
    order = torch.sort(scores + correction_bias.float(), dim=-1, descending=True, stable=True).indices
    ids = order[..., :top_k].contiguous()
    weights = scores.gather(-1, ids)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


@sigmoid_topk_route.register_fake
def _(logits: Tensor, correction_bias: Tensor, top_k: int, renormalize: bool, scaling: float):
    shape = (*logits.shape[:-1], top_k)
    return logits.new_empty(shape, dtype=torch.float32), logits.new_empty(shape, dtype=torch.int64)


def _experts_reference(
    z: Tensor, weights: Tensor, ids: Tensor, w1: Tensor, w3: Tensor, w2: Tensor, beta: float, linear_beta: float
) -> Tensor:
    out = torch.zeros(z.shape, dtype=torch.float32, device=z.device)
    if z.is_cuda and torch.cuda.is_current_stream_capturing():
        # Inside a CUDA graph no host sync is allowed: visit every expert with a
        # per-token weight that is zero where the token did not pick it.
        for e in range(w1.shape[0]):
            gate = (weights * (ids == e)).sum(-1, keepdim=True).float()
            h = situ_glu(z @ w1[e].t(), z @ w3[e].t(), beta, linear_beta).to(z.dtype)
            out += gate * (h @ w2[e].t()).float()
        return out.to(z.dtype)
    flat_ids = ids.reshape(-1)
    token_of = torch.arange(z.shape[0], device=z.device).repeat_interleave(ids.shape[-1])
    for e in torch.unique(flat_ids).tolist():
        hit = flat_ids == e
        tokens = token_of[hit]
        x = z[tokens]
        h = situ_glu(x @ w1[e].t(), x @ w3[e].t(), beta, linear_beta).to(z.dtype)
        y = (h @ w2[e].t()).float()
        out.index_add_(0, tokens, y * weights.reshape(-1)[hit].unsqueeze(-1).float())
    return out.to(z.dtype)


@torch.library.custom_op("k3::moe_experts", mutates_args=())
def moe_experts(
    z: Tensor,
    weights: Tensor,
    ids: Tensor,
    w1: Tensor,
    w3: Tensor,
    w2: Tensor,
    situ_beta: float,
    situ_linear_beta: float,
) -> Tensor:
    """z [T, D], weights/ids [T, k], w1/w3 [E, I, D], w2 [E, D, I] -> [T, D] in z.dtype."""
    return _experts_reference(z, weights, ids, w1, w3, w2, situ_beta, situ_linear_beta)


@moe_experts.register_fake
def _(z, weights, ids, w1, w3, w2, situ_beta, situ_linear_beta):
    return torch.empty_like(z)


@torch.library.custom_op("k3::moe_experts_mxfp4", mutates_args=())
def moe_experts_mxfp4(
    z: Tensor,
    weights: Tensor,
    ids: Tensor,
    w1_packed: Tensor,
    w1_scale: Tensor,
    w3_packed: Tensor,
    w3_scale: Tensor,
    w2_packed: Tensor,
    w2_scale: Tensor,
    situ_beta: float,
    situ_linear_beta: float,
) -> Tensor:
    """z [T, D], weights/ids [T, k]; w1/w3 packed [E, I, D/2] + scales [E, I, D/32], w2 packed
    [E, D, I/2] + scales [E, D, I/32] (uint8) -> [T, D] in z.dtype."""
    if z.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "k3::moe_experts_mxfp4: the torch reference picks experts on the host and cannot run inside a "
            "CUDA graph; register the GPU kernels first (k3compile.runtime.kernels.register_gpu_kernels)"
        )
    picked, local_ids = torch.unique(ids, return_inverse=True)  # dequantise only what the step uses

    def dense(packed: Tensor, scale: Tensor) -> Tensor:
        return unpack_mxfp4(packed[picked], scale[picked], z.dtype)

    w1, w3, w2 = dense(w1_packed, w1_scale), dense(w3_packed, w3_scale), dense(w2_packed, w2_scale)
    return _experts_reference(z, weights, local_ids, w1, w3, w2, situ_beta, situ_linear_beta)


@moe_experts_mxfp4.register_fake
def _(z, weights, ids, w1_packed, w1_scale, w3_packed, w3_scale, w2_packed, w2_scale, situ_beta, situ_linear_beta):
    return torch.empty_like(z)


# Placement rule and cost: k3compile/placement/k3_rules.py.
