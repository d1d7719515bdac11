"""Capture time and peak memory of the full K3 configuration (93 layers) on meta tensors.

    python benchmarks/capture_full_k3.py --tp 8

Prints one line per phase and the process's peak RSS; the goal is under 60 s and 4 GB
for all phases on a 2-core CPU.
"""

from __future__ import annotations

import argparse
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
    args = parser.parse_args()
    start = time.perf_counter()
    captured = capture(PRESETS[args.preset], ParallelPlan(args.tp, 0), torch.bfloat16)
    total = time.perf_counter() - start
    t = time.perf_counter()
    for program in captured.programs.values():
        propagate_placements(program.graph_module, program, captured.specs, captured.plan)
    placements = time.perf_counter() - t
    result = {
        "preset": args.preset,
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
