"""``k3::situ_and_mul``: the SiTU-GLU activation of K3's MLPs and experts.

gate' = b * tanh(gate / b) * sigmoid(gate)   (b = activation_situ_beta, 4 in K3)
up'   = bl * tanh(up / bl)                   (bl = activation_situ_linear_beta, 25)
out   = gate' * up'

Both branches are soft-clipped versions of SiLU and identity, computed in fp32.
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


# Placement rule and cost: k3compile/placement/k3_rules.py.
