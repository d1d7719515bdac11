"""MLA prefill at one TP8 rank's shapes (12 heads, L = 512, k_pe 64, q_nope and v 128 per
head, bf16): what the runtime runs for ``k3::mla_prefill`` on a GPU
(``runtime/kernels/mla_decode.mla_prefill_op``: the expanded kernel or the absorbed one,
whichever ``prefill_form`` picks), each form's kernel, against
``torch.nn.functional.scaled_dot_product_attention`` on the expanded form, and the compute
floors; plus the KDA short conv's prefill kernels against their torch reference. CUDA GPU only.

    python benchmarks/mla_prefill.py [--tokens 4096 32768] [--sweep]

One fresh prompt of ``tokens`` tokens (its latents already in the paged cache, as the
runtime writes them before attention), ms per call, eager, median of 5 after a warm-up.
"expanded + SDPA": k_nope and v decompressed from the latents (two einsums, timed with it)
and SDPA's causal attention (its flash backend); "SDPA alone" without the decompression.
"k3 expanded": the decompression and the kernel (what the op runs for a prompt);
"expanded kernel alone" from decompressed keys and values, as "SDPA alone".
``--sweep``: the expanded kernel at other tiles / warps / stages too (ms per config).
Floors: each form's FLOPs over the bf16 matrix throughput of a large ``torch.matmul``
measured in the same run (absorbed: 2 x (576 + 512) per new token, visible position and
head; expanded: 2 x (192 + 128) per pair and head, plus 2 x 512 x 256 per position and head
for the decompression). Correctness first: the kernel path against SDPA's output.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from gpu_timing import eager_time as timed

import k3compile.ops  # noqa: F401  (registers torch.ops.k3)
from k3compile.ops.kda import short_conv_prefill_reference
from k3compile.runtime.kernels import mla_decode, short_conv
from k3compile.runtime.kernels import mla_prefill_expanded as ex

H, L, R, DN, DV, BLOCK = 12, 512, 64, 128, 128, 64
#: expanded-kernel configs --sweep times (block_m, block_n, warps, stages)
SWEEP = [ex.ExpandedConfig(*c) for c in [(128, 64, 8, 1), (128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2),
                                         (128, 32, 4, 2), (64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 4, 3)]]


def matmul_flops_per_s() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    return 2 * 8192**3 / (timed(lambda: a @ a, 10) / 1e3)


def mla_case(T: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    blocks = -(-T // BLOCK)
    latents = torch.randn(T, L + R, generator=gen, device="cuda").bfloat16()
    cache = torch.zeros(blocks + 1, BLOCK, L + R, device="cuda", dtype=torch.bfloat16)
    cache.view(-1, L + R)[BLOCK:BLOCK + T] = latents  # block 0 is scratch
    return {"q": torch.randn(T, H, DN + R, generator=gen, device="cuda").bfloat16(), "cache": cache,
            "latents": latents,
            "kv_b": (torch.randn(H * (DN + DV), L, generator=gen, device="cuda") / L**0.5).bfloat16(),
            "cu": torch.tensor([0, T], dtype=torch.int32, device="cuda"),
            "table": torch.arange(1, blocks + 1, dtype=torch.int32, device="cuda")[None],
            "seq_lens": torch.tensor([T], dtype=torch.int32, device="cuda")}


def expanded(x: dict[str, torch.Tensor], scale: float, decompress: bool = True,
             kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    w = x["kv_b"].view(H, DN + DV, L)
    latent, k_pe = x["latents"][:, :L], x["latents"][:, L:]
    if kv is None or decompress:
        k_nope = torch.einsum("tl,hdl->htd", latent, w[:, :DN])
        v = torch.einsum("tl,hdl->htd", latent, w[:, DN:])
    else:
        k_nope, v = kv
    k = torch.cat([k_nope, k_pe[None].expand(H, -1, -1)], dim=-1)
    q = x["q"].transpose(0, 1)
    return F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, scale=scale)[0].transpose(0, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 32768])
    ap.add_argument("--sweep", action="store_true", help="the expanded kernel at other tiles, warps and stages")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    peak = matmul_flops_per_s()
    print(json.dumps({"bf16 matmul TFLOP/s": round(peak / 1e12, 1)}), flush=True)
    scale = (DN + R) ** -0.5
    for T in args.tokens:
        x = mla_case(T, gen)
        ours = lambda: mla_decode.mla_prefill_op(x["q"], x["cache"], x["kv_b"], x["cu"], x["table"],  # noqa: E731
                                                 x["seq_lens"], scale)
        want = expanded(x, scale).float()
        err = float((ours().float() - want).abs().max() / want.abs().max())
        w = x["kv_b"].view(H, DN + DV, L)
        kv = (torch.einsum("tl,hdl->htd", x["latents"][:, :L], w[:, :DN]),
              torch.einsum("tl,hdl->htd", x["latents"][:, :L], w[:, DN:]))
        pairs = T * (T + 1) / 2
        absorbed_floor = 2 * pairs * H * (L + R + L) / peak * 1e3
        expanded_floor = (2 * pairs * H * (DN + R + DV) + 2 * T * H * L * (DN + DV)) / peak * 1e3
        counts = ex.prefill_counts(x["cu"], x["seq_lens"])
        ctx = ex.expand_context(x["cache"], x["kv_b"], x["table"], x["seq_lens"], H, T)
        q_abs = mla_decode.absorb_queries(x["q"], x["kv_b"], DN)
        absorbed = lambda: mla_decode.PREFILL.launch(q_abs, x["cache"], x["cu"], x["table"], x["seq_lens"],  # noqa: E731
                                                     scale, L, max_new_tokens=T)
        err_abs = float((mla_decode.values_of_latent_output(absorbed()[0], x["kv_b"], DN).float() - want).abs().max()
                        / want.abs().max())
        row = {"tokens": T, "form": ex.prefill_form(counts, H, L, R, DN, DV), "err_vs_sdpa": err,
               "err_absorbed_vs_sdpa": err_abs,
               "k3 op ms": round(timed(ours), 2),
               "k3 expanded ms": round(timed(lambda: ex.mla_prefill_expanded(x["q"], x["cache"], x["kv_b"], x["cu"],
                                                                              x["table"], x["seq_lens"], scale,
                                                                              counts)), 2),
               "expanded kernel alone ms": round(timed(lambda: ex.expanded_attention(x["q"], ctx, x["cu"], x["seq_lens"], scale, T)), 2),
               "absorbed kernel alone ms": round(timed(absorbed), 2),
               "expanded + SDPA ms": round(timed(lambda: expanded(x, scale)), 2),
               "SDPA alone ms": round(timed(lambda: expanded(x, scale, decompress=False, kv=kv)), 2),
               "absorbed floor ms": round(absorbed_floor, 2), "expanded floor ms": round(expanded_floor, 2)}
        row["expanded kernel % of matmul"] = round(100 * (expanded_floor - 2 * T * H * L * (DN + DV) / peak * 1e3)
                                                   / row["expanded kernel alone ms"], 1)
        if args.sweep:
            for cfg in SWEEP:
                try:
                    row[f"expanded {tuple(vars(cfg).values())} ms"] = round(
                        timed(lambda: ex.expanded_attention(x["q"], ctx, x["cu"], x["seq_lens"], scale, T, cfg)), 2)
                except Exception as e:  # out of resources: say so and go on
                    row[f"expanded {tuple(vars(cfg).values())} ms"] = type(e).__name__
        C, K = 1536, 4
        xs = torch.randn(T, C, generator=gen, device="cuda").bfloat16()
        wc = torch.randn(C, K, generator=gen, device="cuda").bfloat16()
        cu = torch.tensor([0, T], dtype=torch.int32, device="cuda")
        slots = torch.tensor([0], device="cuda")
        state = torch.zeros(1, C, K - 1, device="cuda", dtype=torch.bfloat16)
        row["short conv kernels ms"] = round(timed(lambda: short_conv.short_conv_prefill(xs, wc, state, cu, slots)), 3)
        row["short conv reference ms"] = round(timed(lambda: short_conv_prefill_reference(xs, wc, state, cu, slots)), 3)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
