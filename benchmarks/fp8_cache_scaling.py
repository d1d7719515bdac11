"""Issue #20, first study: how to scale an FP8 (E4M3) MLA latent cache.

Decode attention (the absorbed form, ``k3::mla_decode``'s reference) over one sequence's
cache, once from the bf16 cache and once from each FP8 layout, against fp32 math on the
bf16 values. The cache rows are K3's: 512 RMS-normalised latent values (per-channel gains,
a few large ones, as trained norms have) then 64 k_pe values on another scale. No real
K3 checkpoint is available here, so the rows are drawn, not computed: the study compares
layouts, it does not predict the real model's error (that needs the real cache).

    python benchmarks/fp8_cache_scaling.py [--context 2048] [--heads 16] [--seed 0]

Layouts (bytes per token; bf16 is 1152):
  per-tensor   one fp32 scale for the whole cache (from its amax, known only after the fact)  576
  per-token    one scale per token for all 576 values                                        580
  token+rope   per token: one scale for the 512 latent values, one for the 64 k_pe values    584
  tile128      per token: a scale per 128 latent values, k_pe kept in bf16 (656 B)           656
"""

from __future__ import annotations

import argparse

import torch

from k3compile.ops.mla import mla_decode_reference

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
L, R = 512, 64


def _quantize(x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """x through FP8 with scale amax / 448 (amax broadcast against x), back to fp32."""
    scale = (amax / FP8_MAX).clamp(min=1e-12)
    return (x / scale).to(FP8).float() * scale


def layouts(kv: torch.Tensor) -> dict[str, torch.Tensor]:
    """The cache [T, 576] as each layout stores and dequantises it."""
    lat, pe = kv[:, :L], kv[:, L:]
    tiles = lat.view(-1, L // 128, 128)
    return {
        "per-tensor": _quantize(kv, kv.abs().amax()),
        "per-token": _quantize(kv, kv.abs().amax(-1, keepdim=True)),
        "token+rope": torch.cat([_quantize(lat, lat.abs().amax(-1, keepdim=True)),
                                 _quantize(pe, pe.abs().amax(-1, keepdim=True))], -1),
        "tile128": torch.cat([_quantize(tiles, tiles.abs().amax(-1, keepdim=True)).view(-1, L), pe], -1),
    }


def draw_cache(context: int, gen: torch.Generator) -> torch.Tensor:
    """[context, 576] bf16 rows: latent ~ N(0, 1) x per-channel gains (log-normal, eight
    channels 8x larger), k_pe ~ N(0, 1) x 3 (another projection's scale)."""
    gains = torch.exp(0.5 * torch.randn(L, generator=gen))
    gains[torch.randperm(L, generator=gen)[:8]] *= 8
    lat = torch.randn(context, L, generator=gen) * gains
    pe = 3 * torch.randn(context, R, generator=gen)
    return torch.cat([lat, pe], -1).bfloat16()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(args.seed)
    kv = draw_cache(args.context, gen).float()
    q = torch.randn(1, args.heads, L + R, generator=gen) / (L + R) ** 0.5 * 4  # peaked but not one-hot scores
    scale = (128 + 64) ** -0.5
    table = torch.arange(1, dtype=torch.int32).view(1, 1)
    lens = torch.tensor([args.context], dtype=torch.int32)

    def attend(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return mla_decode_reference(q, cache.view(1, args.context, L + R), table, lens, scale, L)

    o_ref, lse_ref = attend(kv)
    print(f"context {args.context}, {args.heads} heads; error of o relative to max|o| per head, of lse absolute")
    print(f"{'layout':12} {'o max':>10} {'o mean':>10} {'lse max':>10}  cache rows max rel. err")
    for name, deq in layouts(kv).items():
        o, lse = attend(deq)
        rel = (o - o_ref).abs() / o_ref.abs().amax(-1, keepdim=True)
        row = ((deq - kv).abs().amax(-1) / kv.abs().amax(-1)).amax()
        print(f"{name:12} {rel.max().item():10.2e} {rel.mean().item():10.2e} "
              f"{(lse - lse_ref).abs().max().item():10.2e}  {row.item():.2e}")


if __name__ == "__main__":
    main()
