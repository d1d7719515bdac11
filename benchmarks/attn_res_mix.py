"""The Attention Residuals mix + RMSNorm at K3's shapes (rows [T, 7168] bf16, 2 or 9
candidates): the fused kernel against what the graph ran before, and the HBM floor. CUDA
GPU only.

    python benchmarks/attn_res_mix.py [--rows 1 16 64 1024] [--candidates 2 9]

(a) ``reference + norm``: ``k3::attn_res_mix``'s torch reference, then the RMSNorm kernel
    (the graph before ``fuse_attn_res_norm``, without a mix kernel);
(b) ``torch.compile(reference + norm)``: what Inductor makes of the same torch code;
(c) ``k3::attn_res_mix_norm``: the fused Triton kernel (runtime/kernels/attn_res.py).
Floor: the candidates read once and the output written once, over the copy bandwidth of
the run. Each CUDA graph holds 8 calls on different candidates, as a step's 8 mixes.
"""

from __future__ import annotations

import argparse
import json

import torch
from gpu_timing import copy_bandwidth, graph_time

import k3compile.ops  # noqa: F401  (registers torch.ops.k3)
from k3compile.ops.attn_res import attn_res_mix_reference
from k3compile.runtime.kernels import register_gpu_kernels

D, CALLS, EPS = 7168, 8, 1e-5


def reference_then_norm(p, blocks, proj, norm_w, weight):
    return torch.ops.k3.rms_norm(attn_res_mix_reference(p, blocks, proj, norm_w, EPS), weight, EPS)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 1024])
    ap.add_argument("--candidates", type=int, nargs="+", default=[2, 9])
    args = ap.parse_args()
    register_gpu_kernels()
    compiled = torch.compile(lambda *a: torch.ops.k3.rms_norm(attn_res_mix_reference(*a[:4], EPS), a[4], EPS),
                             dynamic=False)
    gen = torch.Generator(device="cuda").manual_seed(0)
    proj = (torch.randn(1, D, generator=gen, device="cuda") / D**0.5).bfloat16()
    norm_w, weight = ((torch.rand(D, generator=gen, device="cuda") + 0.5).bfloat16() for _ in range(2))
    bandwidth = copy_bandwidth(2 << 30, 10)
    for n in args.candidates:
        for T in args.rows:
            calls = [[torch.randn(T, D, generator=gen, device="cuda").bfloat16() for _ in range(n)]
                     for _ in range(CALLS)]
            want = reference_then_norm(calls[0][-1], calls[0][:-1], proj, norm_w, weight).float()
            got = torch.ops.k3.attn_res_mix_norm(calls[0][-1], calls[0][:-1], proj, norm_w, EPS, weight, EPS)
            err = float((got.float() - want).abs().max() / want.abs().max())
            variants = {
                "reference + norm": lambda c: reference_then_norm(c[-1], c[:-1], proj, norm_w, weight),
                "torch.compile": lambda c: compiled(c[-1], c[:-1], proj, norm_w, weight),
                "k3::attn_res_mix_norm": lambda c: torch.ops.k3.attn_res_mix_norm(c[-1], c[:-1], proj, norm_w, EPS,
                                                                                  weight, EPS),
            }
            floor = (n + 1) * T * D * 2 / bandwidth
            row = {"candidates": n, "rows": T, "floor_us": round(floor * 1e6, 2), "rel_err": err}
            for name, fn in variants.items():
                row[name] = round(graph_time([lambda c=c, fn=fn: fn(c) for c in calls], 20) * 1e6, 2)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
