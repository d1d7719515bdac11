"""The MoE router's logits at K3's shapes (x [T, 7168] bf16, gate [896, 7168] bf16, fp32
logits): today's graph against the alternatives, and the HBM floor. CUDA GPU only.

    python benchmarks/router_logits.py [--batches 1 16 64 256]

(a) ``F.linear(x.float(), w.float())``: what the captured model runs (the weight is cast to
    fp32 every step: 12.8 MB read, 25.7 MB written and read again);
(b) ``k3::router_logits`` as the runtime runs it on CUDA (bf16 operands, fp32 output);
(c) the weight kept in fp32: ``F.linear(x.float(), w32)`` (twice the weight bytes).
Floor: the bf16 weight, x and the logits over the copy bandwidth of the run. Each graph
holds 8 calls on 8 different weights (one layer each), so weights come from HBM.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from gpu_timing import copy_bandwidth, graph_time

import k3compile.ops  # noqa: F401  (registers torch.ops.k3)
from k3compile.runtime.kernels import register_gpu_kernels

E, D, LAYERS = 896, 7168, 8


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    args = ap.parse_args()
    register_gpu_kernels()
    gen = torch.Generator(device="cuda").manual_seed(0)
    ws = [(torch.randn(E, D, generator=gen, device="cuda") / D**0.5).bfloat16() for _ in range(LAYERS)]
    w32 = [w.float() for w in ws]
    bandwidth = copy_bandwidth(2 << 30, 10)
    for T in args.batches:
        xs = [torch.randn(T, D, generator=gen, device="cuda").bfloat16() for _ in range(LAYERS)]
        ref = F.linear(xs[0].double(), ws[0].double())
        new = torch.ops.k3.router_logits(xs[0], ws[0])
        err = float((new.double() - ref).abs().max() / ref.abs().max())
        assert new.dtype == torch.float32 and err < 1e-5, err
        variants = {
            "cast_fp32 (today)": [lambda x=x, w=w: F.linear(x.float(), w.float()) for x, w in zip(xs, ws)],
            "k3::router_logits": [lambda x=x, w=w: torch.ops.k3.router_logits(x, w) for x, w in zip(xs, ws)],
            "fp32_weight": [lambda x=x, w=w: F.linear(x.float(), w) for x, w in zip(xs, w32)],
        }
        floor = (E * D * 2 + T * D * 2 + T * E * 4) / bandwidth
        row = {"T": T, "floor_us": round(floor * 1e6, 2), "rel_err": err}
        for name, fns in variants.items():
            row[name] = round(graph_time(fns, 20) * 1e6, 2)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
