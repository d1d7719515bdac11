"""Gated NoPE MLA with q-LoRA, rank-local (K3_ARCHITECTURE.md section 3).

    q        = q_b_proj(RMSNorm(q_a_proj x))                 -> [H, Dn + R] = [q_nope | q_pe]
    c        = kv_a_proj_with_mqa x;  latent = RMSNorm(c[:L]); k_pe = c[L:]   (cached: L + R)
    prefill  : naive form, k_nope = W_UK latent, v = W_UV latent       (k3::mla_prefill)
    decode   : absorbed form, q_lat = q_nope W_UK ([H, L]); a (L+R)-wide query against the
               (L+R)-wide cache gives o_lat ([H, L]); o = W_UV o_lat    (k3::mla_decode)
    y        = o_proj(o * sigmoid(g_proj x))                                  (all-reduced)

No rotary embedding anywhere (NoPE); softmax scale (Dn + R)^-0.5. Heads are split across
TP ranks (q_b, kv_b, g_proj column-parallel, o_proj row-parallel); q_a and kv_a are
replicated, so every rank caches the full latent of every token.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

import k3compile.ops  # noqa: F401  (registers torch.ops.k3.*, which this module calls)
from k3compile.batch import Batch, MLALayerCache
from k3compile.config import K3Config
from k3compile.distributed import TPGroup
from k3compile.model.layers import ColumnParallelLinear, ReplicatedLinear, RMSNorm, RowParallelLinear
from k3compile.sharding import ParallelPlan

#: The official modeling code leaves these two norms at the RMSNorm default eps.
LORA_NORM_EPS = 1e-6


class MLAAttention(nn.Module):
    def __init__(self, cfg: K3Config, layer: int, plan: ParallelPlan, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        H = cfg.num_attention_heads
        hidden = cfg.hidden_size
        self.tp = tp
        self.heads = H // plan.tp
        self.nope = cfg.qk_nope_head_dim
        self.rope = cfg.qk_rope_head_dim
        self.v_dim = cfg.v_head_dim
        self.latent = cfg.kv_lora_rank
        self.scale = cfg.mla_softmax_scale
        prefix = f"model.layers.{layer}.self_attn"

        self.q_a_proj = ReplicatedLinear(hidden, cfg.q_lora_rank, f"{prefix}.q_a_proj", plan, dtype)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LORA_NORM_EPS, f"{prefix}.q_a_layernorm", plan, dtype)
        self.q_b_proj = ColumnParallelLinear(cfg.q_lora_rank, H * cfg.qk_head_dim, f"{prefix}.q_b_proj", plan, dtype)
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, cfg.mla_cache_width, f"{prefix}.kv_a_proj_with_mqa", plan, dtype)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, LORA_NORM_EPS, f"{prefix}.kv_a_layernorm", plan, dtype)
        self.kv_b_proj = ColumnParallelLinear(
            cfg.kv_lora_rank, H * (cfg.qk_nope_head_dim + cfg.v_head_dim), f"{prefix}.kv_b_proj", plan, dtype
        )
        self.g_proj = ColumnParallelLinear(hidden, H * cfg.v_head_dim, f"{prefix}.g_proj", plan, dtype)
        self.o_proj = RowParallelLinear(H * cfg.v_head_dim, hidden, f"{prefix}.o_proj", plan, dtype)

    def forward(self, x: Tensor, batch: Batch, cache: MLALayerCache) -> Tensor:
        T = x.shape[0]
        h, Dn, L = self.heads, self.nope, self.latent
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(T, h, Dn + self.rope)
        c = self.kv_a_proj_with_mqa(x)
        kv = torch.cat([self.kv_a_layernorm(c[:, :L]), c[:, L:]], dim=-1)
        torch.ops.k3.mla_cache_write(cache.kv, kv, batch.slot_mapping, L)
        if batch.decode:
            w_kv = self.kv_b_proj.weight.view(h, Dn + self.v_dim, L)
            w_uk, w_uv = w_kv[:, :Dn], w_kv[:, Dn:]
            q_lat = torch.einsum("thd,hdl->thl", q[..., :Dn], w_uk)
            q_abs = torch.cat([q_lat, q[..., Dn:]], dim=-1)
            o_lat, _lse = torch.ops.k3.mla_decode(q_abs, cache.kv, batch.block_table, batch.seq_lens, self.scale, L)
            o = torch.einsum("thl,hdl->thd", o_lat, w_uv)
        else:
            o = torch.ops.k3.mla_prefill(
                q, cache.kv, self.kv_b_proj.weight, batch.cu_seqlens, batch.block_table, batch.seq_lens, self.scale
            )
        o = o.reshape(T, h * self.v_dim) * torch.sigmoid(self.g_proj(x))
        return self.tp.all_reduce(self.o_proj(o))
