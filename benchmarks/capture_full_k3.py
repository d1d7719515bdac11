"""Capture time and peak memory of the full K3 configuration (93 layers) on meta tensors.

    python benchmarks/capture_full_k3.py --tp 8

Prints one line per phase and the process's peak RSS; the goal is under 60 s and 4 GB
for all phases on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import time

import torch

from k3compile.capture import capture
from k3compile.config import PRESETS
from k3compile.placement import propagate_placements
from k3compile.sharding import ParallelPlan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--preset", default="k3")
    parser.add_argument("--layers", type=int, default=None, help="truncate to N layers (MLA every 4th), for scaling")
    parser.add_argument("--phases", default="decode,prefill")
    args = parser.parse_args()
    cfg = PRESETS[args.preset]
    if args.layers:
        full = tuple(range(4, args.layers + 1, 4))
        kda = tuple(i for i in range(1, args.layers + 1) if i not in full)
        lin = dataclasses.replace(cfg.linear_attn, full_attn_layers=full, kda_layers=kda)
        cfg = cfg.replace(num_hidden_layers=args.layers, linear_attn=lin)
    start = time.perf_counter()
    captured = capture(cfg, ParallelPlan(args.tp, 0), torch.bfloat16, phases=tuple(args.phases.split(",")))
    total = time.perf_counter() - start
    t = time.perf_counter()
    for program in captured.programs.values():
        propagate_placements(program.graph_module, program, captured.specs, captured.plan)
    placements = time.perf_counter() - t
    result = {
        "preset": args.preset,
        "layers": cfg.num_hidden_layers,
        "tp": args.tp,
        "seconds": {k: round(v, 1) for k, v in captured.stats.seconds.items()},
        "capture_total_s": round(total, 1),
        "placements_s": round(placements, 1),
        "nodes": captured.stats.nodes,
        "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
