"""Latent-MoE ops: sigmoid top-k routing and the routed-expert computation.

``k3::sigmoid_topk_route``: s = sigmoid(router logits); experts are *selected* by the
top-k of s + e_score_correction_bias (the bias balances load and only affects
selection); the weights are the unbiased s of the chosen experts, renormalised to sum
to one (eps 1e-20) and multiplied by routed_scaling_factor.

``k3::moe_experts``: y = sum_k w_k * expert_{id_k}(z), each expert a SiTU-GLU MLP
(w1 gate, w3 up, w2 down), accumulated in fp32. Under tensor parallelism every rank
holds each expert's slice of the intermediate dim, so the result is a Partial sum.
"""

from __future__ import annotations

import torch
from torch import Tensor

from k3compile.ops.activations import situ_glu


@torch.library.custom_op("k3::sigmoid_topk_route", mutates_args=())
def sigmoid_topk_route(
    logits: Tensor, correction_bias: Tensor, top_k: int, renormalize: bool, scaling: float
) -> tuple[Tensor, Tensor]:
    scores = torch.sigmoid(logits.float())
    ids = torch.topk(scores + correction_bias.float(), top_k, dim=-1).indices
    weights = scores.gather(-1, ids)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


@sigmoid_topk_route.register_fake
def _(logits: Tensor, correction_bias: Tensor, top_k: int, renormalize: bool, scaling: float):
    shape = (*logits.shape[:-1], top_k)
    return logits.new_empty(shape, dtype=torch.float32), logits.new_empty(shape, dtype=torch.int64)


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
    out = torch.zeros(z.shape, dtype=torch.float32, device=z.device)
    if z.is_cuda and torch.cuda.is_current_stream_capturing():
        # Inside a CUDA graph no host sync is allowed: visit every expert with a
        # per-token weight that is zero where the token did not pick it.
        for e in range(w1.shape[0]):
            gate = (weights * (ids == e)).sum(-1, keepdim=True).float()
            h = situ_glu(z @ w1[e].t(), z @ w3[e].t(), situ_beta, situ_linear_beta).to(z.dtype)
            out += gate * (h @ w2[e].t()).float()
        return out.to(z.dtype)
    flat_ids = ids.reshape(-1)
    token_of = torch.arange(z.shape[0], device=z.device).repeat_interleave(ids.shape[-1])
    for e in torch.unique(flat_ids).tolist():
        hit = flat_ids == e
        tokens = token_of[hit]
        x = z[tokens]
        h = situ_glu(x @ w1[e].t(), x @ w3[e].t(), situ_beta, situ_linear_beta).to(z.dtype)
        y = (h @ w2[e].t()).float()
        out.index_add_(0, tokens, y * weights.reshape(-1)[hit].unsqueeze(-1).float())
    return out.to(z.dtype)


@moe_experts.register_fake
def _(z, weights, ids, w1, w3, w2, situ_beta, situ_linear_beta):
    return torch.empty_like(z)


# Placement (k3compile.placement). Routing works on whole rows of expert scores (4 FLOPs
# per logit: sigmoid, bias add, top-k, weights). The experts are split on their
# intermediate dim (w1/w3 [E, I, D] on I, w2 [E, D, I] on I): each rank's SiTU-MLPs give
# a partial sum of the down projection, hence Partial.
from k3compile.placement import Cost, CostCall, register_op_rules, rowwise, split  # noqa: E402
from k3compile.sharding import Partial  # noqa: E402


def _moe_experts_cost(call: CostCall) -> Cost:
    """2*3*T*top_k*I*D (three GEMVs per routed token; I = this rank's intermediate);
    bytes: activations plus the weights of the experts touched (at most T*top_k)."""
    T, D = call.shape("z")
    top_k = call.size("ids", -1)
    E, I = call.size("w1", 0), call.size("w1", 1)
    touched = min(E, T * top_k) * 3 * I * D * call.itemsize("w1")
    act = call.nbytes("z") + call.nbytes("weights") + call.nbytes("ids") + call.out_bytes()
    return Cost(2 * 3 * T * top_k * I * D, act + touched)


register_op_rules({
    sigmoid_topk_route: rowwise("logits", flops_per_element=4),
    moe_experts: split({"w1": 1, "w3": 1, "w2": 2}, out=Partial(), what="expert intermediate",
                       cost=_moe_experts_cost),
})
