"""An experiment, not kept: launch_floor.py's ideal step with and without programmatic
dependent launch (each read and empty kernel waiting for its predecessor before its first
load). BENCHMARKS.md, "Programmatic dependent launch across the step".

    cd benchmarks && python launch_floor.py --out /tmp/lf --batches 1,16,64
    python ../docs/experiments/pdl_ideal_step.py /tmp/lf/launch_floor.json
"""

import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from gpu_timing import replay_time  # noqa: E402


@triton.jit
def _read(x_ptr, sums_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(sums_ptr + tl.program_id(0), tl.sum(x.to(tl.float32), axis=0))


@triton.jit
def _empty(x_ptr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def run(sizes: list[int], empties: int, block: int, warps: int, pdl: bool) -> float:
    bufs = [torch.randn(max(s // 2, 1), device="cuda", dtype=torch.bfloat16) for s in sizes]
    sums = torch.empty(max(triton.cdiv(b.numel(), 2048) for b in bufs), device="cuda")
    kw = {"launch_pdl": True} if pdl else {}

    def step() -> None:
        for b in bufs:
            _read[(triton.cdiv(b.numel(), block),)](b, sums, b.numel(), BLOCK=block, PDL=pdl, num_warps=warps, **kw)
        for _ in range(empties):
            _empty[(1,)](sums, PDL=pdl, **kw)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return replay_time(graph, 30) * 1e6


def main() -> None:
    for r in json.loads(Path(sys.argv[1]).read_text())["results"]:
        sizes = [int(n["MB"] * 1e6) for n in r["nodes"]]
        empties = r["real_kernels"] - len(sizes)
        for pdl in (False, True):
            reads = min(run(sizes, 0, b, w, pdl) for b, w in ((4096, 4), (8192, 8)))
            with_empties = min(run(sizes, empties, b, w, pdl) for b, w in ((4096, 4), (8192, 8)))
            print(json.dumps({"batch": r["batch"], "pdl": pdl, "reads_us": round(reads, 1),
                              "with_empties_us": round(with_empties, 1), "floor_us": r["floor_us"]}), flush=True)


if __name__ == "__main__":
    main()
