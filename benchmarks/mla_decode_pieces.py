"""Where a split-KV MLA decode step's time goes, and how it moves with its launch choices.

    python benchmarks/mla_decode_pieces.py pieces      # pad, split kernel, combine, alone
    python benchmarks/mla_decode_pieces.py splits      # split counts, head tiles
    python benchmarks/mla_decode_pieces.py combine     # the combine's block shapes

Same harness as benchmarks/mla_decode.py (K3 widths, bf16 cache in 64-token blocks in
random order, CUDA graphs over cache copies beyond L2, replays timed from their first
kernel). ``pieces``: at 16 and 32 heads, batch 1, contexts 1K / 32K / 128K, for several
split counts: the padding copy (12 -> 16 heads), the split kernel alone, the combine
alone (its partials in L2, as after the split kernel), and both through the launcher.
``splits``: the whole launcher at split counts around the cost model's choice, batch 1
and 16, and a 32-head tile against two 16-head programs. ``combine``: the combine kernel
at block shapes x warps against the torch reference. Prints one line per measurement.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
import triton
from gpu_timing import graph_time
from k3compile.runtime.kernels import mla_common as mc
from k3compile.runtime.kernels import mla_split_kv as sk
from mla_decode import LATENT, SCALE, WIDTH, cache_copies, paged_cache

REPEATS = 30


def split_kernel_alone(q, cache, table, seq_lens, splits: int, cfg: sk.SplitKVConfig, o_part, lse_part) -> None:
    """The launcher's split-KV launch without the combine (partials left in o_part / lse_part)."""
    desc = sk._kv_descriptors(cache, LATENT, cfg.block_n)
    lat, pe = desc or (None, None)
    B, H, W = q.shape
    sk._mla_decode_split_kv_kernel[(H // cfg.block_h, splits, B)](
        q, cache, lat, pe, table, seq_lens, o_part, lse_part, SCALE * mc.LOG2E, H, splits,
        q.stride(0), q.stride(1), cache.stride(0), cache.stride(1), table.stride(0),
        *o_part.stride()[:3], *lse_part.stride(), cache.shape[1],
        **sk._split_kv_constexprs(cfg, W, LATENT, q.dtype, desc is not None),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def combine_alone(o_part, lse_part, o, lse, splits: int, block_s: int, block_l: int, warps: int) -> None:
    B, H = o.shape[:2]
    sk._combine_splits_kernel[(B, H, triton.cdiv(LATENT, block_l))](
        o_part, lse_part, o, lse, *o_part.stride()[:3], *lse_part.stride()[:2], *o.stride()[:2], *lse.stride(),
        splits, L=LATENT, BLOCK_L=block_l, BLOCK_S=block_s, num_warps=warps)


def pieces(gen: torch.Generator, l2: int) -> None:
    for heads in (16, 32):
        for context in (1024, 32768, 131072):
            caches, table, seq_lens = paged_cache(1, context, 64, gen, cache_copies(context * WIDTH * 2, l2))
            q = torch.randn(1, heads, WIDTH, device="cuda").bfloat16()
            q12, q_pad = q[:, :12].clone(), torch.zeros_like(q)
            cfg = sk.split_kv_config("sm_90", heads)
            pad = graph_time([lambda: q_pad[:, :12].copy_(q12)] * len(caches), REPEATS)
            print(f"h{heads} ctx{context}: pad 12 -> {heads} heads {pad * 1e6:.1f} us", flush=True)
            for s in (16, 32, 64, 128, 132, 192, 256, 264, 512):
                if s * 32 > context:
                    continue
                o_part = torch.empty(1, heads, s, LATENT, device="cuda")
                lse_part = torch.empty(1, heads, s, device="cuda")
                o = torch.empty(1, heads, LATENT, device="cuda", dtype=torch.bfloat16)
                lse = torch.empty(1, heads, device="cuda")
                c = sk._combine_constexprs(LATENT, s)
                t_split = graph_time([lambda c_=c_: split_kernel_alone(q, c_, table, seq_lens, s, cfg, o_part, lse_part)
                                      for c_ in caches], REPEATS)
                t_comb = graph_time([lambda: combine_alone(o_part, lse_part, o, lse, s, c["BLOCK_S"], c["BLOCK_L"],
                                                           sk._COMBINE_WARPS)] * len(caches), REPEATS)
                t_all = graph_time([lambda c_=c_: sk.mla_decode_split_kv(q, c_, table, seq_lens, SCALE, LATENT,
                                                                         num_splits=s, config=cfg)
                                    for c_ in caches], REPEATS)
                print(f"h{heads} ctx{context} splits {s}: split kernel {t_split * 1e6:.1f} us, combine "
                      f"{t_comb * 1e6:.1f} us, launcher {t_all * 1e6:.1f} us", flush=True)
            del caches


def splits(gen: torch.Generator, l2: int) -> None:
    cases = [(16, 1, 1024, (16, 32)), (16, 1, 32768, (96, 128, 132, 147, 192, 256)),
             (16, 1, 131072, (128, 132, 256)), (16, 16, 32768, (4, 8, 9, 16, 17, 33)),
             (16, 16, 131072, (8, 9, 16, 17, 33, 66)), (32, 16, 65536, (8, 16, 17, 33)),
             (32, 16, 131072, (8, 16, 33))]
    for heads, batch, context, counts in cases:
        kv = batch * context * WIDTH * 2
        caches, table, seq_lens = paged_cache(batch, context, 64, gen, cache_copies(kv, l2))
        q = torch.randn(batch, heads, WIDTH, device="cuda").bfloat16()
        cfgs = [sk.split_kv_config("sm_90", heads)]
        if heads == 32:
            cfgs.append(dataclasses.replace(cfgs[0], block_h=16))
        default = sk.choose_num_splits(batch, heads, table.shape[1] * 64, 132, cfgs[0])
        for cfg in cfgs:
            for s in counts:
                t = graph_time([lambda c=c: sk.mla_decode_split_kv(q, c, table, seq_lens, SCALE, LATENT, num_splits=s,
                                                                   config=cfg) for c in caches], REPEATS)
                print(f"h{heads} b{batch} ctx{context} head tile {cfg.block_h} splits {s}"
                      f"{' (default)' if s == default else ''}: {t * 1e6:.1f} us, {kv / t / 1e12:.2f} TB/s", flush=True)
        del caches


def combine(gen: torch.Generator, l2: int) -> None:
    for B, H, s in ((1, 16, 128), (1, 16, 256), (1, 16, 32), (16, 16, 16), (16, 16, 33), (16, 32, 16)):
        o_part = torch.randn(B, H, s, LATENT, device="cuda", generator=gen)
        lse_part = torch.randn(B, H, s, device="cuda", generator=gen)
        o = torch.empty(B, H, LATENT, device="cuda", dtype=torch.bfloat16)
        lse = torch.empty(B, H, device="cuda")
        want = (torch.softmax(lse_part, -1)[..., None] * o_part).sum(2)
        for block_l in (16, 32, 64, 128):
            for block_s in (16, 32, 64, 128):
                for warps in (1, 2, 4):
                    if block_l * block_s // (32 * warps) > 128:
                        continue
                    run = lambda: combine_alone(o_part, lse_part, o, lse, s, block_s, block_l, warps)  # noqa: E731
                    run()
                    err = (o.float() - want).abs().max().item()
                    if err > 2e-2:
                        raise SystemExit(f"combine [{block_s}, {block_l}] on {warps} warps: error {err}")
                    t = graph_time([run] * 64, REPEATS)
                    print(f"B{B} H{H} splits {s}: BLOCK_S {block_s} BLOCK_L {block_l} warps {warps}: "
                          f"{t * 1e6:.2f} us", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("pieces", "splits", "combine"))
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    {"pieces": pieces, "splits": splits, "combine": combine}[args.what](gen, l2)


if __name__ == "__main__":
    main()
