"""SiTU MLPs and the latent MoE, rank-local (K3_ARCHITECTURE.md section 3).

Latent MoE on the full hidden x:

    w, ids = top-k(sigmoid(x W_gate^T) + bias)          (bias selects only; renormalised)
    z      = routed_expert_down_proj x                  (hidden -> latent, replicated)
    y      = all_reduce( sum_k w_k expert_k(z) )        (experts TP-split on intermediate)
    y      = routed_expert_up_proj( RMSNorm(y; routed_expert_norm) )   (replicated)
    out    = y + all_reduce( shared_experts(x) )

At TP the up-projection runs, whole and identical, on every rank: the redundancy that
the dedup pass removes.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

import k3compile.ops  # noqa: F401  (registers torch.ops.k3.*, which this module calls)
from k3compile.config import K3Config
from k3compile.distributed import TPGroup
from k3compile.model.layers import ColumnParallelLinear, ReplicatedLinear, RMSNorm, RowParallelLinear, weight_spec
from k3compile.checkpoint.mxfp4 import GROUP_SIZE
from k3compile.sharding import ParallelPlan, ShardingError, ShardSpec, register_sharded_parameter


class SiTUMLP(nn.Module):
    """down(situ_and_mul(gate x, up x)): gate/up column-parallel, down row-parallel.

    Returns the Partial output; the caller all-reduces."""

    def __init__(
        self, cfg: K3Config, hidden: int, inter: int, prefix: str, plan: ParallelPlan, dtype: torch.dtype
    ):
        super().__init__()
        self.beta, self.linear_beta = cfg.situ_beta, cfg.situ_linear_beta
        self.gate_proj = ColumnParallelLinear(hidden, inter, f"{prefix}.gate_proj", plan, dtype)
        self.up_proj = ColumnParallelLinear(hidden, inter, f"{prefix}.up_proj", plan, dtype)
        self.down_proj = RowParallelLinear(inter, hidden, f"{prefix}.down_proj", plan, dtype)

    def forward(self, x: Tensor) -> Tensor:
        act = torch.ops.k3.situ_and_mul(self.gate_proj(x), self.up_proj(x), self.beta, self.linear_beta)
        return self.down_proj(act)


class DenseMLP(nn.Module):
    """The dense MLP of the first ``first_k_dense_replace`` layers."""

    def __init__(self, cfg: K3Config, layer: int, plan: ParallelPlan, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        self.tp = tp
        self.mlp = SiTUMLP(cfg, cfg.hidden_size, cfg.intermediate_size, f"model.layers.{layer}.mlp", plan, dtype)

    def forward(self, x: Tensor) -> Tensor:
        return self.tp.all_reduce(self.mlp(x))


def mxfp4_tp_degrees(inter: int) -> list[int]:
    """Tensor-parallel degrees that split an intermediate dim of ``inter`` into whole MXFP4
    scale groups (w2 is quantised along it)."""
    return [d for d in range(1, inter // GROUP_SIZE + 1) if inter % (d * GROUP_SIZE) == 0]


def expert_split_problem(cfg: K3Config, tp: int) -> str | None:
    """Why ``tp`` cannot split MXFP4 routed experts, or None. They keep one scale per 32
    values of w2's input (the intermediate dim), so a rank's slice of it must be whole
    groups; bf16 experts split anywhere."""
    inter = cfg.moe_intermediate_size
    if cfg.expert_format != "mxfp4" or (inter % tp == 0 and (inter // tp) % GROUP_SIZE == 0):
        return None
    degrees = ", ".join(map(str, mxfp4_tp_degrees(inter)))
    return (f"each rank would hold {inter / tp:g} of the routed experts' {inter} intermediate values, which "
            f"cuts w2's MXFP4 scale groups of {GROUP_SIZE}; tensor-parallel degrees that keep whole groups: {degrees}")


def expert_spec(cfg: K3Config, layer: int, proj: str, shape: tuple[int, int], dim: int) -> ShardSpec:
    base = f"model.layers.{layer}.block_sparse_moe.experts"
    names = tuple(f"{base}.{e}.{proj}.weight" for e in range(cfg.num_experts))
    return ShardSpec(names=names, shape=shape, dtype="bf16", dim=dim, quantized=True)


class LatentMoE(nn.Module):
    def __init__(self, cfg: K3Config, layer: int, plan: ParallelPlan, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        hidden, latent, inter = cfg.hidden_size, cfg.routed_expert_hidden_size, cfg.moe_intermediate_size
        prefix = f"model.layers.{layer}.block_sparse_moe"
        problem = expert_split_problem(cfg, plan.tp)
        if problem is not None:
            raise ShardingError(f"tp={plan.tp}: {problem}")
        self.tp = tp
        self.top_k = cfg.num_experts_per_token
        self.renormalize = cfg.moe_renormalize
        self.scaling = cfg.routed_scaling_factor
        self.beta, self.linear_beta = cfg.situ_beta, cfg.situ_linear_beta

        self.gate = ReplicatedLinear(hidden, cfg.num_experts, f"{prefix}.gate", plan, dtype)
        spec = weight_spec(f"{prefix}.gate.e_score_correction_bias", (cfg.num_experts,), None, "f32")
        register_sharded_parameter(self.gate, "e_score_correction_bias", spec, plan, dtype)
        self.routed_expert_down_proj = ReplicatedLinear(hidden, latent, f"{prefix}.routed_expert_down_proj", plan, dtype)
        self.experts = nn.Module()
        for proj, shape, dim in (("w1", (inter, latent), 0), ("w3", (inter, latent), 0), ("w2", (latent, inter), 1)):
            register_sharded_parameter(self.experts, proj, expert_spec(cfg, layer, proj, shape, dim), plan, dtype)
        self.routed_expert_norm = RMSNorm(latent, cfg.rms_norm_eps, f"{prefix}.routed_expert_norm", plan, dtype)
        self.routed_expert_up_proj = ReplicatedLinear(latent, hidden, f"{prefix}.routed_expert_up_proj", plan, dtype)
        self.shared_experts = SiTUMLP(cfg, hidden, cfg.shared_intermediate_size, f"{prefix}.shared_experts", plan, dtype)

    def forward(self, x: Tensor) -> Tensor:
        logits = torch.ops.k3.router_logits(x, self.gate.weight)
        weights, ids = torch.ops.k3.sigmoid_topk_route(
            logits, self.gate.e_score_correction_bias, self.top_k, self.renormalize, self.scaling
        )
        z = self.routed_expert_down_proj(x)
        e = self.experts
        routed = torch.ops.k3.moe_experts(z, weights, ids, e.w1, e.w3, e.w2, self.beta, self.linear_beta)
        routed = self.routed_expert_up_proj(self.routed_expert_norm(self.tp.all_reduce(routed)))
        return routed + self.tp.all_reduce(self.shared_experts(x))
