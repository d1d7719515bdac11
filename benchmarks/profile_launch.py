"""One launch of a decode kernel at a chosen shape, for a profiler (Nsight Compute) to look at.

    ncu --kernel-name regex:split_kv --launch-skip 1 --launch-count 1 --section WarpStateStats \
        python3 benchmarks/profile_launch.py mla --heads 32 --batch 16 --context 65536
    ncu --kernel-name regex:kda_decode --launch-skip 1 --launch-count 1 --section SpeedOfLight \
        python3 benchmarks/profile_launch.py kda --batch 64 --block-v 64

Each kernel runs twice (the first call compiles) with its default launch or the choices
given: MLA split-KV on a full paged bf16 cache at K3's widths; fused KDA at K3's per-rank
TP8 shapes (benchmarks/kda_decode.py's problem).
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
from k3compile.runtime.kernels import mla_split_kv as sk
from k3compile.runtime.kernels.kda_decode import kda_decode_fused
from kda_decode import make_problem
from mla_decode import LATENT, SCALE, WIDTH, paged_cache


def mla(args: argparse.Namespace) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    (cache,), table, seq_lens = paged_cache(args.batch, args.context, 64, gen)
    q = torch.randn(args.batch, args.heads, WIDTH, generator=gen, device="cuda").bfloat16()
    config = sk.split_kv_config("sm_90", args.heads)
    config = dataclasses.replace(
        config, block_n=args.block_n or config.block_n, num_warps=args.warps or config.num_warps,
        num_stages=args.stages or config.num_stages, tma=config.tma and not args.pointers)
    for _ in range(2):
        sk.mla_decode_split_kv(q, cache, table, seq_lens, SCALE, LATENT, config=config)
    print(config)


def kda(args: argparse.Namespace) -> None:
    # more state slots than one launch touches, and other slots on the second launch: its
    # state reads come from HBM, as in a serving step
    num_slots = max(512, 2 * args.batch)
    problem = make_problem(args.batch, num_slots, torch.device("cuda"))
    slot_sets = torch.randperm(num_slots, device="cuda")[: 2 * args.batch].view(2, args.batch)
    plan = {k: v for k, v in {"block_v": args.block_v, "num_warps": args.warps}.items() if v}
    for slots in slot_sets:
        kda_decode_fused(**problem, slots=slots, **plan)
    print(plan or "default plan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="kernel", required=True)
    p = sub.add_parser("mla", help="the split-KV MLA decode kernel")
    p.add_argument("--heads", type=int, default=16, help="a multiple of 16 (the kernel's, unpadded)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--block-n", type=int)
    p.add_argument("--warps", type=int)
    p.add_argument("--stages", type=int)
    p.add_argument("--pointers", action="store_true", help="pointer gathers instead of tensor descriptors")
    p = sub.add_parser("kda", help="the fused single-token KDA decode kernel")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--block-v", type=int)
    p.add_argument("--warps", type=int)
    args = parser.parse_args()
    (mla if args.kernel == "mla" else kda)(args)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
