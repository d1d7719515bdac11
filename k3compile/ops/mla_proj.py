"""``k3::mla_input_proj``: an MLA layer's three input projections with their consumers.

An MLA layer reads its normalised input x with three bias-free linears and puts each
result through one cheap consumer (``k3compile/model/mla.py``)::

    q_c  = rms_norm(x @ W_qa^T, q_a_layernorm.weight, q_eps)              [T, q_lora_rank]
    c    = x @ W_kva^T                                                     [T, L + R]
    kv   = cat(rms_norm(c[:, :L], kv_a_layernorm.weight, kv_eps), c[:, L:])   (cached)
    gate = sigmoid(x @ W_g^T)                                              [T, heads * v_head_dim]

``k3::mla_input_proj(x, W_qa, W_kva, W_g, q_norm_weight, kv_norm_weight, q_eps, kv_eps, L)
-> (q_c, kv, gate)`` is that, so that the three projections can run as ONE GEMM: the
runtime lays the three weights out as consecutive rows of one buffer at load
(``k3compile/runtime/weight_layout.py``, in :data:`PROJECTION_WEIGHTS` order), and its GPU
implementation multiplies x by all their rows at once, then one kernel normalises, copies
and gates the product's column blocks in place. Three outputs, not the product and views
of it: a custom op may not return aliases, and the consumers are what makes them fresh.

Reference (every device; the numerical truth): exactly the graph's ops, the norms through
``torch.ops.k3.rms_norm``, so the rewrite is bit-identical on the CPU. Each output is in
x's dtype, as the graph had it.

Placement (``k3compile/placement/k3_rules.py``): x and the q_a / kv_a weights are
replicated (every rank caches the whole latent), g_proj is column-parallel: W_g Shard(0)
gives gate Shard(1) and q_c, kv Replicate.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["PROJECTION_WEIGHTS", "mla_input_proj", "mla_input_proj_reference"]

#: ``mla_input_proj``'s weights, in the order the runtime lays their rows out
PROJECTION_WEIGHTS = ("q_a_weight", "kv_a_weight", "g_weight")


def mla_input_proj_reference(
    q: Tensor, c: Tensor, g: Tensor, q_norm_weight: Tensor, kv_norm_weight: Tensor, q_eps: float, kv_eps: float,
    kv_lora_rank: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """The consumers of the three projections' outputs ``q``, ``c``, ``g`` (the graph's ops)."""
    rms_norm = torch.ops.k3.rms_norm
    q_c = rms_norm(q, q_norm_weight, q_eps)
    kv = torch.cat([rms_norm(c[:, :kv_lora_rank], kv_norm_weight, kv_eps), c[:, kv_lora_rank:]], -1)
    return q_c, kv, torch.sigmoid(g)


@torch.library.custom_op("k3::mla_input_proj", mutates_args=())
def mla_input_proj(
    x: Tensor,
    q_a_weight: Tensor,
    kv_a_weight: Tensor,
    g_weight: Tensor,
    q_norm_weight: Tensor,
    kv_norm_weight: Tensor,
    q_eps: float,
    kv_eps: float,
    kv_lora_rank: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """x [T, hidden] -> (q_c [T, q_lora_rank], kv [T, kv_lora_rank + rope], gate [T, G]):
    the three linears, then :func:`mla_input_proj_reference`; reference."""
    q, c, g = (torch.nn.functional.linear(x, w) for w in (q_a_weight, kv_a_weight, g_weight))
    return mla_input_proj_reference(q, c, g, q_norm_weight, kv_norm_weight, q_eps, kv_eps, kv_lora_rank)


@mla_input_proj.register_fake
def _(
    x: Tensor, q_a_weight: Tensor, kv_a_weight: Tensor, g_weight: Tensor, q_norm_weight: Tensor,
    kv_norm_weight: Tensor, q_eps: float, kv_eps: float, kv_lora_rank: int,
) -> tuple[Tensor, Tensor, Tensor]:
    torch._check(x.dim() == 2, lambda: f"mla_input_proj: x must be [T, hidden], got {x.dim()} dims")
    T = x.shape[0]
    return (x.new_empty(T, q_a_weight.shape[0]), x.new_empty(T, kv_a_weight.shape[0]),
            x.new_empty(T, g_weight.shape[0]))


# Placement rule and cost: k3compile/placement/k3_rules.py.
