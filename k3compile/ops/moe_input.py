"""``k3::moe_input_proj``: a MoE layer's four input projections with their consumers.

A latent-MoE layer reads its normalised input x with four bias-free linears
(``k3compile/model/moe.py``), each through one consumer::

    weights, ids = sigmoid_topk_route(router_logits(x, W_router), bias, top_k, ...)   routing
    z            = x @ W_down^T                              [T, latent]: the routed experts' input
    h            = situ_and_mul(x @ W_gate^T, x @ W_up^T)    [T, I_shared]: the shared expert

``k3::moe_input_proj(x, W_router, bias, W_down, W_gate, W_up, top_k, renormalize, scaling,
beta, linear_beta) -> (weights, ids, z, h)`` is that, so that the four projections can run
as ONE GEMM: the runtime lays the weights out as consecutive rows of one buffer at load
(``k3compile/runtime/weight_layout.py``, in :data:`PROJECTION_WEIGHTS` order), and its GPU
implementation multiplies x by all their rows at once with fp32 output (the router's
logits are fp32 anyway), routes from the logits' columns in place, and one kernel rounds z
and takes the SiTU-GLU of the shared expert's columns (``runtime/kernels/moe_input.py``).
Four outputs, not the product and views of it: a custom op may not return aliases.

Reference (every device; the numerical truth): exactly the graph's ops, so the rewrite is
bit-identical on the CPU.

Placement (``k3compile/placement/k3_rules.py``): x, the router, its bias and the latent
down-projection are replicated; the shared expert's gate and up are column-parallel:
W_gate, W_up Shard(0) give h Shard(1), the routing and z Replicate.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["PROJECTION_WEIGHTS", "moe_input_proj"]

#: ``moe_input_proj``'s weights, in the order the runtime lays their rows out
PROJECTION_WEIGHTS = ("router_weight", "down_weight", "gate_weight", "up_weight")


@torch.library.custom_op("k3::moe_input_proj", mutates_args=())
def moe_input_proj(
    x: Tensor,
    router_weight: Tensor,
    correction_bias: Tensor,
    down_weight: Tensor,
    gate_weight: Tensor,
    up_weight: Tensor,
    top_k: int,
    renormalize: bool,
    scaling: float,
    beta: float,
    linear_beta: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """x [T, hidden] -> (routing weights fp32 [T, top_k], expert ids int64 [T, top_k],
    z [T, latent], h [T, I_shared]); reference."""
    k3 = torch.ops.k3
    weights, ids = k3.sigmoid_topk_route(k3.router_logits(x, router_weight), correction_bias, top_k, renormalize,
                                         scaling)
    z = torch.nn.functional.linear(x, down_weight)
    return weights, ids, z, k3.situ_and_mul_proj(x, gate_weight, up_weight, beta, linear_beta)


@moe_input_proj.register_fake
def _(
    x: Tensor, router_weight: Tensor, correction_bias: Tensor, down_weight: Tensor, gate_weight: Tensor,
    up_weight: Tensor, top_k: int, renormalize: bool, scaling: float, beta: float, linear_beta: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    torch._check(x.dim() == 2, lambda: f"moe_input_proj: x must be [T, hidden], got {x.dim()} dims")
    T = x.shape[0]
    return (x.new_empty(T, top_k, dtype=torch.float32), x.new_empty(T, top_k, dtype=torch.int64),
            x.new_empty(T, down_weight.shape[0]), x.new_empty(T, gate_weight.shape[0]))


# Placement rule and cost: k3compile/placement/k3_rules.py.
