"""The dense linears of one TP8 rank at decode batches: the vendor GEMV (``F.linear``:
cuBLAS) against the rows split-K Triton kernel (``runtime/kernels/rows.py``, run with a
zero accumulator, so it computes ``x @ W^T`` alone), a plain read of the weight's bytes and
the HBM floor. CUDA GPU only.

    python benchmarks/small_batch_linear.py [--batches 1 4 16] [--merged] [--sweep]

Shapes (rows n, columns K): the slice's dense weights at one TP8 rank (KDA and MLA
projections, the shared expert, layer 0's dense MLP, the routed latent projection, the
LM head's vocabulary slice); with ``--merged`` the merged groups the passes build instead
(a KDA layer's q/k/v/g/f_a/b padded to 6,336 rows, a MoE layer's router/down/gate/up, an
MLA layer's q_a/kv_a/g, the dense MLP's gate/up) with the LM head and the latent up- and
output projections. Each CUDA graph holds 8 calls on 8 different weights (more than L2 for
all but the smallest), time per call; the split-K kernel at its default configuration and
at a few others (``--sweep``: a grid of rows per program, K splits, K tile and warps),
each checked against ``F.linear`` first; "read": the Triton read of
``benchmarks/stream_floor.py`` over the weight's bytes (its fastest plan).
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from gpu_timing import copy_bandwidth, graph_time
from stream_floor import time_read

from k3compile.runtime.kernels import register_gpu_kernels
from k3compile.runtime.kernels.rows import SplitKConfig, add_rank_block_linear_splitk, choose_splitk_config

SHAPES = [(1536, 7168), (7168, 1536), (128, 7168), (768, 7168), (7168, 768), (3584, 7168), (2304, 7168),
          (20480, 7168)]
MERGED_SHAPES = [(6336, 7168), (6016, 7168), (3648, 7168), (8448, 7168), (20480, 7168), (7168, 3584),
                 (7168, 1536)]
CALLS = 8
SWEEP = [(block_n, split_k, warps, block_k) for block_n in (4, 8, 16) for split_k in (1, 2)
         for warps in (4, 8) for block_k in (512, 1024)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--merged", action="store_true", help="the merged groups' shapes (see the docstring)")
    ap.add_argument("--sweep", action="store_true", help="a grid of split-K configurations")
    args = ap.parse_args()
    register_gpu_kernels()
    bandwidth = copy_bandwidth(2 << 30, 10)
    l2_bytes = torch.cuda.get_device_properties(0).L2_cache_size
    gen = torch.Generator(device="cuda").manual_seed(0)
    start = torch.zeros((), dtype=torch.int64, device="cuda")
    for n, K in MERGED_SHAPES if args.merged else SHAPES:
        ws = [(torch.randn(n, K, generator=gen, device="cuda") / K**0.5).bfloat16() for _ in range(CALLS)]
        for T in args.batches:
            x = torch.randn(T, K, generator=gen, device="cuda").bfloat16()
            acc = torch.zeros(T, n, dtype=torch.bfloat16, device="cuda")
            configs = {"default": choose_splitk_config(T)}
            others = [(b, s, w, 128) for b, s, w in ((32, 14, 4), (16, 28, 4), (64, 7, 4))]
            for block_n, split_k, warps, block_k in SWEEP if args.sweep and T == 1 else others:
                configs[f"n{block_n}k{split_k}w{warps}b{block_k}"] = SplitKConfig(block_n, split_k, warps, block_k,
                                                                                 T > 1)
            row = {"n": n, "K": K, "T": T, "floor_us": round((n * K + T * (n + K)) * 2 / bandwidth * 1e6, 2)}
            row["cublas"] = round(graph_time([lambda w=w: F.linear(x, w) for w in ws], 20) * 1e6, 2)
            row["read"] = round(min(time_read(n * K * 2, l2_bytes, 20).values()) * 1e6, 2) if T == 1 else None
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
