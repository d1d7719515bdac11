"""``k3::situ_and_mul``: the SiTU-GLU activation of K3's MLPs and experts.

gate' = b * tanh(gate / b) * sigmoid(gate)   (b = activation_situ_beta, 4 in K3)
up'   = bl * tanh(up / bl)                   (bl = activation_situ_linear_beta, 25)
out   = gate' * up'

Both branches are soft-clipped versions of SiLU and identity, computed in fp32.

``k3::situ_and_mul_proj(x, gate_weight, up_weight, ...)`` is the op with the two
projections that feed it (``gate = x @ W_gate^T``, ``up = x @ W_up^T``), so that they can
run as ONE GEMM: the runtime lays the two weights out as consecutive rows of one buffer
(``k3compile/runtime/weight_layout.py``) and its GPU implementation multiplies x by both at
once. Its reference is the two linears and the op: what the graph computed.
"""

from __future__ import annotations

import torch
from torch import Tensor


def situ_glu(gate: Tensor, up: Tensor, beta: float, linear_beta: float) -> Tensor:
    """SiTU-GLU in fp32 (shared by the op and the expert reference)."""
    g = gate.float()
    u = up.float()
    return beta * torch.tanh(g / beta) * torch.sigmoid(g) * (linear_beta * torch.tanh(u / linear_beta))


@torch.library.custom_op("k3::situ_and_mul", mutates_args=())
def situ_and_mul(gate: Tensor, up: Tensor, beta: float, linear_beta: float) -> Tensor:
    return situ_glu(gate, up, beta, linear_beta).to(gate.dtype)


@situ_and_mul.register_fake
def _(gate: Tensor, up: Tensor, beta: float, linear_beta: float) -> Tensor:
    return torch.empty_like(gate)


#: ``situ_and_mul_proj``'s weights, in the order the runtime lays their rows out
PROJECTION_WEIGHTS = ("gate_weight", "up_weight")


@torch.library.custom_op("k3::situ_and_mul_proj", mutates_args=())
def situ_and_mul_proj(x: Tensor, gate_weight: Tensor, up_weight: Tensor, beta: float, linear_beta: float) -> Tensor:
    gate, up = torch.nn.functional.linear(x, gate_weight), torch.nn.functional.linear(x, up_weight)
    return situ_and_mul(gate, up, beta, linear_beta)


@situ_and_mul_proj.register_fake
def _(x: Tensor, gate_weight: Tensor, up_weight: Tensor, beta: float, linear_beta: float) -> Tensor:
    return x.new_empty(*x.shape[:-1], gate_weight.shape[0])


# Placement rules and costs: k3compile/placement/k3_rules.py.
