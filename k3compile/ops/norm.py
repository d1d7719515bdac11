"""``k3::rms_norm``: RMSNorm over the last dim, computed in fp32.

y = x * rsqrt(mean(x^2) + eps) * w. One op (rather than five aten nodes) so that passes
see a norm as one replicated elementwise step, as serving engines run it as one kernel.
"""

from __future__ import annotations

import torch
from torch import Tensor


@torch.library.custom_op("k3::rms_norm", mutates_args=())
def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return y.to(x.dtype)


@rms_norm.register_fake
def _(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return torch.empty_like(x)


# Placement rule and cost: k3compile/placement/k3_rules.py.
