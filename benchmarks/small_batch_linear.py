"""The dense linears of one TP8 rank at decode batches: the vendor GEMV (``F.linear``:
cuBLAS) against the rows split-K Triton kernel (``runtime/kernels/rows.py``, run with a
zero accumulator, so it computes ``x @ W^T`` alone), and the HBM floor. CUDA GPU only.

    python benchmarks/small_batch_linear.py [--batches 1 4 16]

Shapes (rows n, columns K): the slice's dense weights at one TP8 rank (KDA and MLA
projections, the shared expert, layer 0's dense MLP, the routed latent projection, the
LM head's vocabulary slice). Each CUDA graph holds 8 calls on 8 different weights (more
than L2 for all but the smallest), time per call; the split-K kernel at its default
configuration and at a few others, each checked against ``F.linear`` first.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from gpu_timing import copy_bandwidth, graph_time

from k3compile.runtime.kernels import register_gpu_kernels
from k3compile.runtime.kernels.rows import SplitKConfig, add_rank_block_linear_splitk, choose_splitk_config

SHAPES = [(1536, 7168), (7168, 1536), (128, 7168), (768, 7168), (7168, 768), (3584, 7168), (2304, 7168),
          (20480, 7168)]
CALLS = 8


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    args = ap.parse_args()
    register_gpu_kernels()
    bandwidth = copy_bandwidth(2 << 30, 10)
    gen = torch.Generator(device="cuda").manual_seed(0)
    start = torch.zeros((), dtype=torch.int64, device="cuda")
    for n, K in SHAPES:
        ws = [(torch.randn(n, K, generator=gen, device="cuda") / K**0.5).bfloat16() for _ in range(CALLS)]
        for T in args.batches:
            x = torch.randn(T, K, generator=gen, device="cuda").bfloat16()
            acc = torch.zeros(T, n, dtype=torch.bfloat16, device="cuda")
            configs = {"default": choose_splitk_config(T)}
            for block_n, split_k, warps in ((32, 14, 4), (16, 28, 4), (64, 7, 4)):
                configs[f"n{block_n}k{split_k}w{warps}"] = SplitKConfig(block_n, split_k, warps, 128, T > 1)
            row = {"n": n, "K": K, "T": T, "floor_us": round((n * K + T * (n + K)) * 2 / bandwidth * 1e6, 2)}
            row["cublas"] = round(graph_time([lambda w=w: F.linear(x, w) for w in ws], 20) * 1e6, 2)
            want = F.linear(x.float(), ws[0].float())
            for name, cfg in configs.items():
                got = add_rank_block_linear_splitk(acc, x, ws[0], start, cfg).float()
                err = float((got - want).abs().max() / want.abs().max())
                if err > 1e-2:
                    row[name] = f"wrong ({err:.2g})"
                    continue
                fns = [lambda w=w, cfg=cfg: add_rank_block_linear_splitk(acc, x, w, start, cfg) for w in ws]
                row[name] = round(graph_time(fns, 20) * 1e6, 2)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
