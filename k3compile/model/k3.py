"""The K3 text backbone, rank-local: embeddings, 93 decoder layers with Attention
Residuals, final mix, norm and lm_head (K3_ARCHITECTURE.md section 3).

Attention Residuals replace the plain residual stream. Per layer l, with the running
partial sum p (starts as the embedding) and the list B of finished block sums:

    h = Mix(p, B; self_attention_res) if B else p
    if l % attn_res_block_size == 0:  B.append(p); p = None      (a new block starts)
    a = attn(input_layernorm(h));      p = a if p is None else p + a
    h = Mix(p, B; mlp_res);            p = p + mlp(post_attention_layernorm(h))

    logits = lm_head(norm(Mix(p, B; output_attn_res)))

so B = [embedding, sum(layers 0..11), sum(12..23), ...]. Mix is ``k3::attn_res_mix``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

import k3compile.ops  # noqa: F401  (registers torch.ops.k3.*, which this module calls)
from k3compile.batch import Batch, LayerCache
from k3compile.config import K3Config
from k3compile.distributed import TPGroup
from k3compile.model.kda import KDAAttention
from k3compile.model.layers import ParallelLMHead, ReplicatedLinear, RMSNorm, VocabParallelEmbedding
from k3compile.model.mla import MLAAttention
from k3compile.model.moe import DenseMLP, LatentMoE, expert_split_problem
from k3compile.sharding import ParallelPlan


class AttnResMix(nn.Module):
    """One Attention Residuals mix: ``<name>_proj.weight`` [1, hidden] and ``<name>_norm.weight``."""

    def __init__(self, hidden: int, eps: float, prefix: str, plan: ParallelPlan, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.proj = ReplicatedLinear(hidden, 1, f"{prefix}_proj", plan, dtype)
        self.norm = RMSNorm(hidden, eps, f"{prefix}_norm", plan, dtype)

    def forward(self, partial: Tensor, blocks: list[Tensor]) -> Tensor:
        return torch.ops.k3.attn_res_mix(partial, blocks, self.proj.weight, self.norm.weight, self.eps)


class K3DecoderLayer(nn.Module):
    def __init__(self, cfg: K3Config, layer: int, plan: ParallelPlan, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        prefix = f"model.layers.{layer}"
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.layer = layer
        self.kind = cfg.layer_kinds[layer]
        self.starts_block = layer % cfg.attn_res_block_size == 0
        self.self_attention_res = AttnResMix(hidden, eps, f"{prefix}.self_attention_res", plan, dtype)
        self.mlp_res = AttnResMix(hidden, eps, f"{prefix}.mlp_res", plan, dtype)
        self.input_layernorm = RMSNorm(hidden, eps, f"{prefix}.input_layernorm", plan, dtype)
        self.post_attention_layernorm = RMSNorm(hidden, eps, f"{prefix}.post_attention_layernorm", plan, dtype)
        attn_cls = KDAAttention if self.kind == "kda" else MLAAttention
        self.self_attn = attn_cls(cfg, layer, plan, tp, dtype)
        self.mlp = LatentMoE(cfg, layer, plan, tp, dtype) if cfg.is_moe_layer(layer) else DenseMLP(cfg, layer, plan, tp, dtype)

    def forward(
        self, partial: Tensor, blocks: list[Tensor], batch: Batch, cache: LayerCache
    ) -> tuple[Tensor, list[Tensor]]:
        h = self.self_attention_res(partial, blocks) if blocks else partial
        attn_out = self.self_attn(self.input_layernorm(h), batch, cache)
        if self.starts_block:
            blocks = [*blocks, partial]
            partial = attn_out
        else:
            partial = partial + attn_out
        h = self.mlp_res(partial, blocks)
        partial = partial + self.mlp(self.post_attention_layernorm(h))
        return partial, blocks


class K3Model(nn.Module):
    def __init__(self, cfg: K3Config, plan: ParallelPlan, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        hidden = cfg.hidden_size
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, hidden, "model.embed_tokens", plan, tp, dtype)
        self.layers = nn.ModuleList(K3DecoderLayer(cfg, i, plan, tp, dtype) for i in range(cfg.num_hidden_layers))
        self.output_attn_res = AttnResMix(hidden, cfg.rms_norm_eps, "model.output_attn_res", plan, dtype)
        self.norm = RMSNorm(hidden, cfg.rms_norm_eps, "model.norm", plan, dtype)

    def forward(self, input_ids: Tensor, batch: Batch, caches: list[LayerCache]) -> Tensor:
        partial = self.embed_tokens(input_ids)
        blocks: list[Tensor] = []
        for layer, cache in zip(self.layers, caches, strict=True):
            partial, blocks = layer(partial, blocks, batch, cache)
        return self.output_attn_res(partial, blocks)


class K3ForCausalLM(nn.Module):
    """The rank-local K3 language model: ``(input_ids [T], batch, caches) -> logits [n_out, V]``.

    Build it under ``torch.device("meta")`` to get shapes without memory, then load
    weights with :func:`k3compile.checkpoint.loader.load_weights`.
    """

    def __init__(
        self,
        cfg: K3Config,
        plan: ParallelPlan = ParallelPlan(),
        tp: TPGroup | None = None,
        dtype: torch.dtype = torch.bfloat16,
    ):
        super().__init__()
        tp = tp or TPGroup(plan.tp)
        if tp.size != plan.tp:
            raise ValueError(f"process group size {tp.size} does not match the plan's tp={plan.tp}")
        check_divisible(cfg, plan.tp)
        self.config = cfg
        self.plan = plan
        self.dtype = dtype
        self.model = K3Model(cfg, plan, tp, dtype)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, "lm_head", plan, tp, dtype)

    def forward(self, input_ids: Tensor, batch: Batch, caches: list[LayerCache]) -> Tensor:
        hidden = self.model(input_ids, batch, caches)
        return self.lm_head(self.model.norm(hidden[batch.logit_indices]))


def check_divisible(cfg: K3Config, tp: int) -> None:
    """Every split dimension must divide by ``tp``; name the first that does not."""
    splits = {
        "num_attention_heads": cfg.num_attention_heads,
        "linear_attn_config.num_heads": cfg.linear_attn.num_heads,
        "vocab_size": cfg.vocab_size,
        "intermediate_size": cfg.intermediate_size,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "num_shared_experts * moe_intermediate_size": cfg.shared_intermediate_size,
    }
    for name, size in splits.items():
        if size % tp:
            raise ValueError(f"{name} = {size} does not divide by tp = {tp}")
    problem = expert_split_problem(cfg, tp)
    if problem is not None:
        raise ValueError(problem)


def count_parameters(cfg: K3Config) -> int:
    """Parameters of the full (TP1) model, counted on the ``meta`` device: no memory is used,
    so even the 2.8T-parameter K3 takes a few seconds."""
    with torch.device("meta"):
        model = K3ForCausalLM(cfg)
    return sum(p.numel() for p in model.parameters())
