"""Streaming floors at the decode kernels' own byte counts: how fast the simplest kernels
that move the same bytes run in the same harness.

    python benchmarks/stream_floor.py --out /tmp/stream-floor

BENCHMARKS.md states each kernel's bandwidth against the copy bandwidth of one large
eager copy (``gpu_timing.copy_bandwidth``). A decode step moves far less: 37.7 MB (MLA,
batch 1, 32K) or 50 MB read and written (the KDA state at batch 64). At those sizes a
launch's ramp, its last wave and the graph's gap between launches are part of the step,
so this script times, for each size, kernels that do nothing but stream those bytes,
captured in CUDA graphs over buffer copies that exceed L2 (as the decode benchmarks do):

- ``read``: a Triton kernel that reads the buffer (bf16) and writes one sum per program,
  the MLA decode kernel's traffic (it reads its KV once and writes little);
- ``rmw``: a Triton kernel that reads and rewrites the buffer in place (fp32), the KDA
  kernel's state traffic; and torch's in-place ``add_`` as a second opinion;
- ``empty``: a kernel that does nothing, the per-launch floor of a graph node.

Each Triton kernel is timed at several block sizes and warps; the fastest is the floor.
Prints a markdown table; writes ``results.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
import triton
import triton.language as tl

from gpu_timing import copy_bandwidth, graph_time  # benchmarks/ is the script's directory

#: (name, bytes, kind): the decode steps whose bytes BENCHMARKS.md compares to copy bandwidth
CASES = (
    ("MLA KV, batch 1, 32K", 1 * 32768 * 576 * 2, "read"),
    ("MLA KV, batch 1, 128K", 1 * 131072 * 576 * 2, "read"),
    ("MLA KV, batch 16, 32K", 16 * 32768 * 576 * 2, "read"),
    ("KDA state, batch 8", 8 * 12 * 128 * 128 * 4, "rmw"),
    ("KDA state, batch 64", 64 * 12 * 128 * 128 * 4, "rmw"),
    ("KDA state, batch 256", 256 * 12 * 128 * 128 * 4, "rmw"),
)
#: (elements per program, warps) tried for each Triton kernel
PLANS = ((2048, 4), (4096, 4), (8192, 8), (16384, 8), (32768, 16))


@triton.jit
def _read_kernel(x_ptr, sums_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(sums_ptr + tl.program_id(0), tl.sum(x.to(tl.float32), axis=0))


@triton.jit
def _rmw_kernel(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    tl.store(x_ptr + offs, x * 0.5 + 1.0, mask=mask)  # stays bounded however often it runs


@triton.jit
def _empty_kernel(x_ptr):
    pass


def copies_past_l2(nbytes: int, l2_bytes: int) -> int:
    """Buffer copies so that one graph replay touches 4x L2 (every call streams from HBM)."""
    return min(256, max(2, math.ceil(4 * l2_bytes / nbytes)))


def time_read(nbytes: int, l2_bytes: int, repeats: int) -> dict[str, float]:
    n = nbytes // 2
    bufs = [torch.randn(n, device="cuda", dtype=torch.bfloat16) for _ in range(copies_past_l2(nbytes, l2_bytes))]
    times = {}
    for block, warps in PLANS:
        sums = torch.empty(triton.cdiv(n, block), device="cuda")
        fns = [lambda b=b: _read_kernel[(triton.cdiv(n, block),)](b, sums, n, BLOCK=block, num_warps=warps)
               for b in bufs]
        times[f"triton read {block}/{warps}w"] = graph_time(fns, repeats)
    times["torch sum"] = graph_time([lambda b=b: b.sum(dtype=torch.float32) for b in bufs], repeats)
    return times


def time_rmw(nbytes: int, l2_bytes: int, repeats: int) -> dict[str, float]:
    n = nbytes // 4
    bufs = [torch.rand(n, device="cuda") for _ in range(copies_past_l2(2 * nbytes, l2_bytes))]
    times = {}
    for block, warps in PLANS:
        fns = [lambda b=b: _rmw_kernel[(triton.cdiv(n, block),)](b, n, BLOCK=block, num_warps=warps) for b in bufs]
        times[f"triton rmw {block}/{warps}w"] = graph_time(fns, repeats)
    times["torch add_"] = graph_time([lambda b=b: b.add_(1.0) for b in bufs], repeats)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    props = torch.cuda.get_device_properties(0)
    l2_bytes = getattr(props, "L2_cache_size", 50 * 2**20)
    bandwidth = copy_bandwidth(2**30, 20)
    x = torch.empty(1, device="cuda")
    empty_s = graph_time([lambda: _empty_kernel[(1,)](x) for _ in range(64)], args.repeats)
    rows = []
    for name, nbytes, kind in CASES:
        times = (time_read if kind == "read" else time_rmw)(nbytes, l2_bytes, args.repeats)
        moved = nbytes if kind == "read" else 2 * nbytes
        best = min(times, key=times.get)
        rows.append({"case": name, "kind": kind, "bytes_moved": moved, "times_s": times, "best": best,
                     "best_s": times[best], "copy_floor_s": moved / bandwidth})
    report = {"device": props.name, "torch": torch.__version__, "triton": triton.__version__,
              "copy_bandwidth_Bps": bandwidth, "empty_kernel_s": empty_s, "cases": rows}
    (args.out / "results.json").write_text(json.dumps(report, indent=1))
    print(f"{props.name}: copy bandwidth {bandwidth / 1e12:.2f} TB/s; an empty kernel per graph node "
          f"{empty_s * 1e6:.2f} us\n")
    print("| bytes of | moved (MB) | copy-bandwidth floor (us) | fastest streaming kernel (us) | which | "
          "its share of copy bandwidth |")
    print("|---|---:|---:|---:|---|---:|")
    for r in rows:
        print(f"| {r['case']} ({r['kind']}) | {r['bytes_moved'] / 1e6:.1f} | {r['copy_floor_s'] * 1e6:.1f} | "
              f"{r['best_s'] * 1e6:.1f} | {r['best']} | {r['copy_floor_s'] / r['best_s']:.0%} |")


if __name__ == "__main__":
    main()
