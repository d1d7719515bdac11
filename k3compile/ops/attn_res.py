"""``k3::attn_res_mix``: the Attention Residuals mix over block summaries.

Candidates v_0..v_n = [*blocks, partial] (each [T, D]). Each is scored by
logit_i = < v_i * rsqrt(mean(v_i^2) + eps) * norm_w, proj_w >, the scores are
softmax-ed over candidates per token, and the output mixes the *raw* candidates:
out = sum_i softmax(logit)_i * v_i. The normalisation only scores. Computed in fp32,
returned in the activation dtype (as the official model does).

``k3::attn_res_mix_norm`` is the mix followed by the RMSNorm that every mix of K3 feeds
(``input_layernorm``, ``post_attention_layernorm``, the final ``norm``): one op, so that a
GPU runs it as one kernel (``passes/fuse_attn_res_norm.py`` rewrites the pair). Its
reference is the two ops one after the other, the mix rounded to the activation dtype in
between, so the rewrite computes what the graph did.
"""

from __future__ import annotations

import torch
from torch import Tensor

from k3compile.ops.norm import rms_norm


def attn_res_mix_reference(partial: Tensor, blocks: list[Tensor], proj: Tensor, norm: Tensor, eps: float) -> Tensor:
    """The mix in torch ops (the op's CPU implementation; GPU kernels fall back to it)."""
    v = torch.stack([*blocks, partial]).float()  # [n+1, T, D]
    normed = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
    logits = (normed * (norm.float() * proj.float().reshape(-1))).sum(-1)  # [n+1, T]
    weights = torch.softmax(logits, dim=0)
    return (weights.unsqueeze(-1) * v).sum(0).to(partial.dtype)


@torch.library.custom_op("k3::attn_res_mix", mutates_args=())
def attn_res_mix(partial: Tensor, blocks: list[Tensor], proj: Tensor, norm: Tensor, eps: float) -> Tensor:
    return attn_res_mix_reference(partial, blocks, proj, norm, eps)


@attn_res_mix.register_fake
def _(partial: Tensor, blocks: list[Tensor], proj: Tensor, norm: Tensor, eps: float) -> Tensor:
    return torch.empty_like(partial)


@torch.library.custom_op("k3::attn_res_mix_norm", mutates_args=())
def attn_res_mix_norm(partial: Tensor, blocks: list[Tensor], proj: Tensor, norm: Tensor, eps: float,
                      weight: Tensor, norm_eps: float) -> Tensor:
    return rms_norm(attn_res_mix_reference(partial, blocks, proj, norm, eps), weight, norm_eps)


@attn_res_mix_norm.register_fake
def _(partial: Tensor, blocks: list[Tensor], proj: Tensor, norm: Tensor, eps: float, weight: Tensor,
      norm_eps: float) -> Tensor:
    return torch.empty_like(partial)


# Placement rules and costs: k3compile/placement/k3_rules.py.
