"""An independent, plain fp64 forward of the Kimi K3 text model (prefill logits).

Written from ``../shared/K3_ARCHITECTURE.md`` (cited below as "notes §N") and the public
sources it names, *not* from ``k3compile/model``, ``k3compile/ops`` or
``k3compile/reference.py``: it shares no code with the project, only the checkpoint
format. It reads a model directory as a serving engine would -- ``config.json`` (nested
``text_config`` for Kimi K3, or a flat Kimi Linear config) and the safetensors files --
dequantises MXFP4 experts itself, and computes every position's logits of each sequence
with naive loops: the KDA recurrence token by token, MLA as full softmax attention with
explicit keys and values (not absorbed), the MoE expert by expert.

Everything runs in float64 so that comparing against a float32 implementation measures
the float32 rounding of the other side. Clarity over speed: meant for the tiny presets.

    model = IndependentK3("path/to/model_dir")
    logits = model.forward([[5, 9, 100], [17]])   # list of [T_i, vocab] float64 tensors
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

F64 = torch.float64

# notes §1: E2M1 (1 sign, 2 exponent, 1 mantissa bit): codes 0..7 are these magnitudes,
# bit 3 is the sign. E8M0 scale byte b means 2**(b - 127), one per 32 inputs.
E2M1_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
E2M1_TABLE = torch.tensor(E2M1_VALUES + [-v for v in E2M1_VALUES], dtype=F64)
MXFP4_GROUP = 32
E8M0_BIAS = 127


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """notes §1: ``packed`` uint8 [rows, cols/2] (low nibble = even element), ``scale``
    uint8 [rows, cols/32] -> float64 [rows, cols]."""
    rows, half = packed.shape
    low = (packed & 0x0F).long()
    high = (packed >> 4).long()
    codes = torch.stack([low, high], dim=-1).reshape(rows, 2 * half)  # even, odd, even, ...
    values = E2M1_TABLE[codes]
    exponents = scale.long() - E8M0_BIAS
    factors = torch.pow(torch.tensor(2.0, dtype=F64), exponents.to(F64))
    return values * factors.repeat_interleave(MXFP4_GROUP, dim=1)


# ---------------------------------------------------------------- building blocks (§3)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim: x * rsqrt(mean(x^2) + eps) * w."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """y = x W^T, W stored [out, in] as in the checkpoint."""
    return x @ weight.T


def situ_glu(x, w_gate, w_up, w_down, beta: float, linear_beta: float) -> torch.Tensor:
    """notes §3 SiTU-GLU: gate' = b tanh(gate/b) sigmoid(gate); up' = bl tanh(up/bl);
    out = down(gate' * up')."""
    gate = linear(x, w_gate)
    up = linear(x, w_up)
    gate = beta * torch.tanh(gate / beta) * torch.sigmoid(gate)
    up = linear_beta * torch.tanh(up / linear_beta)
    return linear(gate * up, w_down)


def attn_res_mix(partial, blocks, proj, norm, eps: float) -> torch.Tensor:
    """notes §3 Attention Residuals, Mix(p, B; proj, norm): candidates v = [B..., p];
    logit_i = < v_i * rsqrt(mean(v_i^2) + eps), norm.w * proj.w >; softmax over the
    candidates (per token); output = sum_i softmax_i * v_i (raw v_i)."""
    v = torch.stack(list(blocks) + [partial])  # [n, T, D]
    k = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
    logits = (k * (norm * proj.reshape(-1))).sum(-1)  # [n, T]
    weights = torch.softmax(logits, dim=0)
    return (weights.unsqueeze(-1) * v).sum(0)


def causal_depthwise_conv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """notes §3 KDA step 1: depthwise causal conv, no bias. x [T, C], weight [C, 1, K].
    out[t, c] = sum_j w[c, j] * x[t - (K-1) + j, c] with zeros before the sequence start
    (the last tap multiplies the current token)."""
    T, C = x.shape
    K = weight.shape[-1]
    w = weight.reshape(C, K)
    out = torch.zeros_like(x)
    for t in range(T):
        for j in range(K):
            src = t - (K - 1) + j
            if src >= 0:
                out[t] += w[:, j] * x[src]
    return out


def l2_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


# ------------------------------------------------------------------------ checkpoint


class Checkpoint:
    """notes §1: config.json + safetensors (sharded with an index, or one file)."""

    def __init__(self, model_dir: str | Path):
        self.dir = Path(model_dir)
        top = json.loads((self.dir / "config.json").read_text())
        if "text_config" in top:  # Kimi K3: text model nested, keys prefixed
            self.config, self.prefix = top["text_config"], "language_model."
        else:  # Kimi Linear: flat config, no prefix
            self.config, self.prefix = top, ""
        index = self.dir / "model.safetensors.index.json"
        if index.exists():
            self.files = json.loads(index.read_text())["weight_map"]
        else:
            with safe_open(str(self.dir / "model.safetensors"), "pt") as f:
                self.files = {k: "model.safetensors" for k in f.keys()}
        self._cache: dict[str, torch.Tensor] = {}

    def has(self, name: str) -> bool:
        return self.prefix + name in self.files

    def raw(self, name: str) -> torch.Tensor:
        key = self.prefix + name
        with safe_open(str(self.dir / self.files[key]), "pt") as f:
            return f.get_tensor(key)

    def get(self, name: str) -> torch.Tensor:
        """A tensor as float64 (cached)."""
        if name not in self._cache:
            self._cache[name] = self.raw(name).to(F64)
        return self._cache[name]

    def expert_weight(self, name: str) -> torch.Tensor:
        """A routed-expert weight (``...experts.E.w1``): bf16 ``.weight`` or MXFP4
        ``.weight_packed`` + ``.weight_scale`` (trust the files, notes §1)."""
        if name not in self._cache:
            if self.has(name + ".weight"):
                self._cache[name] = self.raw(name + ".weight").to(F64)
            else:
                packed = self.raw(name + ".weight_packed")
                scale = self.raw(name + ".weight_scale")
                self._cache[name] = dequantize_mxfp4(packed, scale)
        return self._cache[name]


# ---------------------------------------------------------------------------- model


class IndependentK3:
    def __init__(self, model_dir: str | Path):
        self.ckpt = Checkpoint(model_dir)
        c = self.ckpt.config
        self.layers = c["num_hidden_layers"]
        self.eps = c["rms_norm_eps"]
        self.beta = c.get("activation_situ_beta", 4.0)
        self.linear_beta = c.get("activation_situ_linear_beta", 25.0)
        if c.get("hidden_act", "situ") != "situ":
            raise ValueError("only the SiTU activation is implemented")
        # MLA (notes §2, §3)
        self.heads = c["num_attention_heads"]
        self.kv_lora = c["kv_lora_rank"]
        self.nope = c["qk_nope_head_dim"]
        self.rope = c["qk_rope_head_dim"]
        self.v_dim = c["v_head_dim"]
        # KDA (notes §2 linear_attn_config; layer lists are 1-based)
        lin = c["linear_attn_config"]
        self.kda_heads = lin["num_heads"]
        self.kda_dim = lin["head_dim"]
        self.lower_bound = lin["gate_lower_bound"]
        self.mla_layers = {n - 1 for n in lin["full_attn_layers"]}
        # MoE (notes §2, §3)
        self.first_dense = c["first_k_dense_replace"]
        self.topk = c["num_experts_per_token"]
        self.scaling = c["routed_scaling_factor"]
        self.renormalize = c["moe_renormalize"]
        self.latent_norm = c["latent_moe_use_norm"]
        if c.get("moe_router_activation_func", "sigmoid") != "sigmoid":
            raise ValueError("only sigmoid routing is implemented")
        if c.get("use_grouped_topk") and c.get("num_expert_group", 1) != 1:
            raise ValueError("grouped top-k with more than one group is not implemented (K3 has 1)")
        self.block_size = c.get("attn_res_block_size")

    def w(self, name: str) -> torch.Tensor:
        return self.ckpt.get(name)

    # notes §3 "KDA layer" -----------------------------------------------------------
    def kda(self, i: int, x: torch.Tensor) -> torch.Tensor:
        p = f"model.layers.{i}.self_attn."
        T = x.shape[0]
        H, D = self.kda_heads, self.kda_dim
        # 1. projections, each through its own causal depthwise conv, then SiLU
        q, k, v = (
            torch.nn.functional.silu(causal_depthwise_conv(linear(x, self.w(p + f"{n}_proj.weight")),
                                                           self.w(p + f"{n}_conv1d.weight")))
            for n in ("q", "k", "v")
        )
        q, k, v = q.reshape(T, H, D), k.reshape(T, H, D), v.reshape(T, H, D)
        # 2. L2-normalise q and k per head (eps 1e-6); scale q by D^-0.5
        q = l2_normalize(q, 1e-6) * D**-0.5
        k = l2_normalize(k, 1e-6)
        # 3. beta = sigmoid(b_proj(x)), one per head
        beta = torch.sigmoid(linear(x, self.w(p + "b_proj.weight")))  # [T, H]
        # 4. decay gate in log space, per head and key channel: g in (lower_bound, 0);
        #    A_log holds one value per head (its first H entries)
        a = linear(linear(x, self.w(p + "f_a_proj.weight")), self.w(p + "f_b_proj.weight")).reshape(T, H, D)
        A = torch.exp(self.w(p + "A_log").reshape(-1)[:H]).reshape(1, H, 1)
        g = self.lower_bound * torch.sigmoid(A * (a + self.w(p + "dt_bias").reshape(1, H, D)))
        # 5. delta rule, token by token (all heads at once), state S[h] of shape [D_k, D_v]
        S = torch.zeros(H, D, D, dtype=F64)
        o = torch.zeros(T, H, D, dtype=F64)
        for t in range(T):
            S = torch.exp(g[t]).unsqueeze(-1) * S  # S <- diag(exp g) S
            u = v[t] - torch.einsum("hkv,hk->hv", S, k[t])  # u = v - S^T k
            S = S + beta[t].reshape(H, 1, 1) * torch.einsum("hk,hv->hkv", k[t], u)  # S <- S + beta k u^T
            o[t] = torch.einsum("hkv,hk->hv", S, q[t])  # o = S^T q, read after the update
        # 6. per-head RMSNorm (eps 1e-5) times the full-rank sigmoid gate, then o_proj
        o = rms_norm(o, self.w(p + "o_norm.weight"), 1e-5)
        o = o * torch.sigmoid(linear(x, self.w(p + "g_proj.weight"))).reshape(T, H, D)
        return linear(o.reshape(T, H * D), self.w(p + "o_proj.weight"))

    # notes §3 "Gated NoPE MLA", prefill (naive) form ----------------------------------
    def mla(self, i: int, x: torch.Tensor) -> torch.Tensor:
        p = f"model.layers.{i}.self_attn."
        T = x.shape[0]
        H, nope, rope, dv, r = self.heads, self.nope, self.rope, self.v_dim, self.kv_lora
        q_lat = rms_norm(linear(x, self.w(p + "q_a_proj.weight")), self.w(p + "q_a_layernorm.weight"), 1e-6)
        q = linear(q_lat, self.w(p + "q_b_proj.weight")).reshape(T, H, nope + rope)
        q_nope, q_pe = q[..., :nope], q[..., nope:]
        c = linear(x, self.w(p + "kv_a_proj_with_mqa.weight"))  # [T, r + rope]
        latent = rms_norm(c[:, :r], self.w(p + "kv_a_layernorm.weight"), 1e-6)
        k_pe = c[:, r:]  # shared by all heads, never rotated (NoPE)
        kv_b = self.w(p + "kv_b_proj.weight").reshape(H, nope + dv, r)
        w_uk, w_uv = kv_b[:, :nope], kv_b[:, nope:]  # per head [nope, r] and [dv, r]
        scale = (nope + rope) ** -0.5
        o = torch.zeros(T, H, dv, dtype=F64)
        for h in range(H):
            k_nope = latent @ w_uk[h].T  # [T, nope]
            v = latent @ w_uv[h].T  # [T, dv]
            scores = scale * (q_nope[:, h] @ k_nope.T + q_pe[:, h] @ k_pe.T)  # [T, T]
            causal = torch.ones(T, T, dtype=torch.bool).tril()
            scores = scores.masked_fill(~causal, float("-inf"))
            o[:, h] = torch.softmax(scores, dim=-1) @ v
        o = o.reshape(T, H * dv) * torch.sigmoid(linear(x, self.w(p + "g_proj.weight")))
        return linear(o, self.w(p + "o_proj.weight"))

    # notes §3 SiTU-GLU, dense MLP of the first layers ---------------------------------
    def dense_mlp(self, i: int, x: torch.Tensor) -> torch.Tensor:
        p = f"model.layers.{i}.mlp."
        return situ_glu(x, self.w(p + "gate_proj.weight"), self.w(p + "up_proj.weight"),
                        self.w(p + "down_proj.weight"), self.beta, self.linear_beta)

    # notes §3 "Latent MoE" ------------------------------------------------------------
    def moe(self, i: int, x: torch.Tensor) -> torch.Tensor:
        p = f"model.layers.{i}.block_sparse_moe."
        # 1. router on the full hidden x, sigmoid scores
        scores = torch.sigmoid(linear(x, self.w(p + "gate.weight")))  # [T, E]
        # 2. top-k by score + correction bias (the bias only selects)
        chosen = torch.topk(scores + self.w(p + "gate.e_score_correction_bias"), self.topk, dim=-1).indices
        # 4. into the latent space
        z = linear(x, self.w(p + "routed_expert_down_proj.weight"))
        y = torch.zeros_like(z)
        for t in range(x.shape[0]):
            s = scores[t, chosen[t]]
            # 3. weights: renormalised over the chosen experts, times the scaling factor
            weights = s / (s.sum() + 1e-20) if self.renormalize else s
            weights = weights * self.scaling
            # 5. weighted sum of SiTU-GLU experts in the latent space
            for e, wt in zip(chosen[t].tolist(), weights):
                ep = p + f"experts.{e}."
                y[t] += wt * situ_glu(z[t], self.ckpt.expert_weight(ep + "w1"), self.ckpt.expert_weight(ep + "w3"),
                                      self.ckpt.expert_weight(ep + "w2"), self.beta, self.linear_beta)
        # 6. RMSNorm in the latent space, back up to the hidden size
        if self.latent_norm:
            y = rms_norm(y, self.w(p + "routed_expert_norm.weight"), self.eps)
        y = linear(y, self.w(p + "routed_expert_up_proj.weight"))
        # 7. plus the shared experts (one SiTU MLP) on the full hidden x
        sp = p + "shared_experts."
        return y + situ_glu(x, self.w(sp + "gate_proj.weight"), self.w(sp + "up_proj.weight"),
                            self.w(sp + "down_proj.weight"), self.beta, self.linear_beta)

    def attention(self, i: int, x: torch.Tensor) -> torch.Tensor:
        return self.mla(i, x) if i in self.mla_layers else self.kda(i, x)

    def mlp(self, i: int, x: torch.Tensor) -> torch.Tensor:
        return self.dense_mlp(i, x) if i < self.first_dense else self.moe(i, x)

    # notes §3 "Attention Residuals" and the final norm / lm_head ----------------------
    def forward_one(self, tokens: list[int]) -> torch.Tensor:
        """Logits of every position of one sequence, [T, vocab] float64."""
        ids = torch.tensor(tokens, dtype=torch.long)
        partial = self.w("model.embed_tokens.weight")[ids]  # p starts as the embedding
        blocks: list[torch.Tensor] = []  # B starts empty
        for i in range(self.layers):
            lp = f"model.layers.{i}."
            if self.block_size is None:  # plain pre-norm residual (no AttnRes)
                x = rms_norm(partial, self.w(lp + "input_layernorm.weight"), self.eps)
                partial = partial + self.attention(i, x)
                x = rms_norm(partial, self.w(lp + "post_attention_layernorm.weight"), self.eps)
                partial = partial + self.mlp(i, x)
                continue
            # 1. mix the blocks and the running partial sum for the attention input
            h = (attn_res_mix(partial, blocks, self.w(lp + "self_attention_res_proj.weight"),
                              self.w(lp + "self_attention_res_norm.weight"), self.eps) if blocks else partial)
            # 2. a block boundary: the partial sum becomes a block and restarts
            attn_out = self.attention(i, rms_norm(h, self.w(lp + "input_layernorm.weight"), self.eps))
            if i % self.block_size == 0:
                blocks.append(partial)
                partial = attn_out  # 3. after a reset, p = attn(...)
            else:
                partial = partial + attn_out  # 3. p = p + attn(...)
            # 4. mix again for the MLP input
            h = attn_res_mix(partial, blocks, self.w(lp + "mlp_res_proj.weight"),
                             self.w(lp + "mlp_res_norm.weight"), self.eps)
            partial = partial + self.mlp(i, rms_norm(h, self.w(lp + "post_attention_layernorm.weight"), self.eps))
        if self.block_size is not None:
            final = attn_res_mix(partial, blocks, self.w("model.output_attn_res_proj.weight"),
                                 self.w("model.output_attn_res_norm.weight"), self.eps)
        else:
            final = partial
        return linear(rms_norm(final, self.w("model.norm.weight"), self.eps), self.w("lm_head.weight"))

    @torch.no_grad()
    def forward(self, sequences: list[list[int]]) -> list[torch.Tensor]:
        """Prefill logits of each sequence (independently): a list of [T_i, vocab]."""
        return [self.forward_one(list(seq)) for seq in sequences]
