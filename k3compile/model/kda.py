"""Kimi Delta Attention, rank-local (K3_ARCHITECTURE.md section 3, "KDA layer").

Per token, H heads of width D (12 of 96 heads per rank at TP8):

    q, k, v = silu(conv_q(q_proj x)), silu(conv_k(k_proj x)), silu(conv_v(v_proj x))
    g       = lower_bound * sigmoid(exp(A_log[h]) * (f_b_proj(f_a_proj x) + dt_bias))
    beta    = sigmoid(b_proj x)
    S       = (I - beta k k^T) diag(exp g) S + beta k v^T,   o = S^T (q / |q| * D^-0.5)
    y       = o_proj( RMSNorm_D(o; o_norm) * sigmoid(g_proj x) )        (all-reduced)

k is L2-normalised inside the recurrence ops. Column-parallel by head: q/k/v/g/b/f_b
projections, conv weights, A_log, dt_bias; f_a is replicated (its 128-wide output
feeds every head); o_proj is row-parallel.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

import k3compile.ops  # noqa: F401  (registers torch.ops.k3.*, which this module calls)
from k3compile.batch import Batch, KDALayerCache
from k3compile.config import K3Config
from k3compile.distributed import TPGroup
from k3compile.model.layers import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear, weight_spec
from k3compile.sharding import ParallelPlan, register_sharded_parameter


def a_log_size(cfg: K3Config) -> int:
    """K3 stores A_log with 128 entries of which the first num_heads (96) are used, one per
    head. No source states the rule behind 128; we read it as head_dim (equal in K3) and
    store one per head when a config has more heads than head_dim."""
    return max(cfg.linear_attn.num_heads, cfg.linear_attn.head_dim)


class KDAAttention(nn.Module):
    def __init__(self, cfg: K3Config, layer: int, plan: ParallelPlan, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        lin = cfg.linear_attn
        H, D, K = lin.num_heads, lin.head_dim, lin.short_conv_kernel_size
        hidden = cfg.hidden_size
        prefix = f"model.layers.{layer}.self_attn"
        self.tp = tp
        self.heads = H // plan.tp
        self.head_dim = D
        self.lower_bound = lin.gate_lower_bound
        self.norm_eps = cfg.rms_norm_eps

        self.q_proj = ColumnParallelLinear(hidden, H * D, f"{prefix}.q_proj", plan, dtype)
        self.k_proj = ColumnParallelLinear(hidden, H * D, f"{prefix}.k_proj", plan, dtype)
        self.v_proj = ColumnParallelLinear(hidden, H * D, f"{prefix}.v_proj", plan, dtype)
        for name in ("q_conv1d", "k_conv1d", "v_conv1d"):
            conv = nn.Module()
            spec = weight_spec(f"{prefix}.{name}.weight", (H * D, 1, K), 0, "f32")
            register_sharded_parameter(conv, "weight", spec, plan, dtype)
            setattr(self, name, conv)
        self.f_a_proj = ReplicatedLinear(hidden, D, f"{prefix}.f_a_proj", plan, dtype)
        self.f_b_proj = ColumnParallelLinear(D, H * D, f"{prefix}.f_b_proj", plan, dtype)
        self.b_proj = ColumnParallelLinear(hidden, H, f"{prefix}.b_proj", plan, dtype)
        self.g_proj = ColumnParallelLinear(hidden, H * D, f"{prefix}.g_proj", plan, dtype)
        spec = weight_spec(f"{prefix}.A_log", (a_log_size(cfg),), 0, "f32", extent=H)
        self.A_log = register_sharded_parameter(self, "A_log", spec, plan, dtype)
        spec = weight_spec(f"{prefix}.dt_bias", (H * D,), 0, "f32")
        self.dt_bias = register_sharded_parameter(self, "dt_bias", spec, plan, dtype)
        self.o_norm = nn.Module()
        register_sharded_parameter(self.o_norm, "weight", weight_spec(f"{prefix}.o_norm.weight", (D,), None, "f32"), plan, dtype)
        # Through the staged GEMM dispatch, as in the engine K3 was profiled in (model/gemm.py).
        self.o_proj = RowParallelLinear(H * D, hidden, f"{prefix}.o_proj", plan, dtype, dispatch=True)

    def _conv_weight(self, conv: nn.Module) -> Tensor:
        return conv.weight.view(conv.weight.shape[0], conv.weight.shape[-1])

    def forward(self, x: Tensor, batch: Batch, cache: KDALayerCache) -> Tensor:
        T = x.shape[0]
        h, D = self.heads, self.head_dim
        slots = batch.state_slots
        if batch.decode:
            conv = lambda y, c, s: torch.ops.k3.short_conv_decode(y, self._conv_weight(c), s, slots)  # noqa: E731
        else:
            conv = lambda y, c, s: torch.ops.k3.short_conv_prefill(  # noqa: E731
                y, self._conv_weight(c), s, batch.cu_seqlens, slots
            )
        q = conv(self.q_proj(x), self.q_conv1d, cache.conv_q).view(T, h, D)
        k = conv(self.k_proj(x), self.k_conv1d, cache.conv_k).view(T, h, D)
        v = conv(self.v_proj(x), self.v_conv1d, cache.conv_v).view(T, h, D)
        g = torch.ops.k3.kda_gate(self.f_b_proj(self.f_a_proj(x)).view(T, h, D), self.A_log, self.dt_bias, self.lower_bound)
        beta = torch.sigmoid(self.b_proj(x).float())
        scale = D**-0.5
        if batch.decode:
            o = torch.ops.k3.kda_decode(q, k, v, g, beta, cache.state, slots, scale)
        else:
            o = torch.ops.k3.kda_prefill(q, k, v, g, beta, cache.state, batch.cu_seqlens, slots, scale)
        o = torch.ops.k3.gated_rms_norm(o, self.g_proj(x).view(T, h, D), self.o_norm.weight, self.norm_eps)
        return self.tp.all_reduce(self.o_proj(o.reshape(T, h * D)))
