"""Where a prefill's device time goes: one prompt through the ``k3-tp8-rank`` slice (one
TP8 rank's real shapes at TP1), device time per kernel from the torch profiler, largest
first, with the wall time of the same prefill. CUDA GPU only.

    python benchmarks/prefill_profile.py --out DIR [--layers 4] [--prompt-lens 4096,32768] [--top 25]

Each prompt is prefilled once to warm up (Triton compiles), then once under the profiler.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from decode_nodes import slice_runtime
from rich.console import Console
from rich.table import Table
from torch.profiler import ProfilerActivity, profile


def prefill_once(rt, prompt: list[int]) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    ids, logits = rt.prefill([prompt])
    logits.argmax(-1).tolist()
    elapsed = time.perf_counter() - start
    rt.release(ids[0])
    return elapsed * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--prompt-lens", default="4096,32768")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    lens = [int(n) for n in args.prompt_lens.split(",")]
    rt = slice_runtime(args.out, args.layers, 1, max(lens) + 64)
    for length in lens:
        prompt = torch.randint(0, rt.cfg.vocab_size, (length,), generator=torch.Generator().manual_seed(0)).tolist()
        prefill_once(rt, prompt)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            wall = prefill_once(rt, prompt)
        totals: dict[str, list[float]] = {}
        for e in prof.events():
            if e.device_type.name == "CUDA":
                totals.setdefault(e.name, []).append(e.device_time / 1e3)
        rows = sorted(((name, sum(t), len(t)) for name, t in totals.items()), key=lambda r: -r[1])
        table = Table(title=f"prefill of {length} tokens: {wall:.1f} ms wall, "
                            f"{sum(r[1] for r in rows):.1f} ms on the device in {sum(r[2] for r in rows)} kernels")
        for col in ("kernel", "ms", "calls"):
            table.add_column(col, justify="left" if col == "kernel" else "right")
        for name, ms, calls in rows[:args.top]:
            table.add_row(name[:90], f"{ms:.2f}", str(calls))
        Console(width=130).print(table)


if __name__ == "__main__":
    main()
