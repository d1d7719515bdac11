"""Where a prefill's device time goes: one prompt through the ``k3-tp8-rank`` slice (one
TP8 rank's real shapes at TP1), device time per kernel from the torch profiler, largest
first, with the wall time of the same prefill. CUDA GPU only.

    python benchmarks/prefill_profile.py --out DIR [--layers 4] [--prompt-lens 4096,32768] [--top 25] [--host] [--python]

Each prompt is prefilled once to warm up (Triton compiles), once timed (the wall time
reported) and once under the profiler (whose CPU activity with ``--host`` slows the host).
``--host``: also where the wall time that is not on the device goes: the device's idle
time between its first and last kernel, the host calls that wait for it (synchronisations,
copies to the host), the host operations running while the device idles (the top-level
operations whose time overlaps the device's idle gaps) and the host operations by their
own CPU time. ``--python``: one more prefill under cProfile, the Python functions by their
own time (what the host runs between the torch operations).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
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


def busy_ms(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of (start, end) intervals in us, as ms."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total / 1e3


def idle_gaps(kernels: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The (start, end) intervals in which no kernel runs, between the first and the last."""
    gaps, reach = [], None
    for start, end in sorted(kernels):
        if reach is not None and start > reach:
            gaps.append((reach, start))
        reach = end if reach is None else max(reach, end)
    return gaps


def idle_by_host_op(prof, gaps: list[tuple[float, float]]) -> dict[str, float]:
    """ms of device idle time by the top-level host operation running meanwhile
    ("(no host operation)" where none runs: Python between operations)."""
    top = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                 if e.device_type.name == "CPU" and e.cpu_parent is None)
    idle: dict[str, float] = {}
    for g0, g1 in gaps:
        covered = 0.0
        for start, end, name in top:
            if start >= g1:
                break
            overlap = min(end, g1) - max(start, g0)
            if overlap > 0:
                idle[name] = idle.get(name, 0.0) + overlap / 1e3
                covered += overlap
        idle["(no host operation)"] = idle.get("(no host operation)", 0.0) + max(0.0, g1 - g0 - covered) / 1e3
    return idle


def host_tables(prof, top: int) -> list[Table]:
    """The --host tables of one profiled prefill."""
    kernels = [(e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type.name == "CUDA"]
    span = (max(end for _, end in kernels) - min(start for start, _ in kernels)) / 1e3
    busy = busy_ms(kernels)
    waits: dict[str, list[float]] = {}  # the CUDA runtime calls that block the host (a copy to it syncs too)
    for e in prof.events():
        if e.device_type.name == "CPU" and e.name.startswith("cuda") and "Synchronize" in e.name:
            waits.setdefault(e.name, []).append(e.self_cpu_time_total / 1e3)
    summary = Table(title=f"device: {busy:.1f} ms busy of the {span:.1f} ms from its first kernel to its last "
                          f"({span - busy:.1f} ms idle)")
    for col in ("host call that waits", "ms", "calls"):
        summary.add_column(col, justify="left" if col.startswith("host") else "right")
    for name, times in sorted(waits.items(), key=lambda kv: -sum(kv[1])):
        summary.add_row(name[:90], f"{sum(times):.2f}", str(len(times)))
    copies = [e for e in prof.events() if e.device_type.name == "CPU" and e.name == "cudaMemcpyAsync"]
    summary.add_row("cudaMemcpyAsync (a copy to the host waits)", f"{sum(e.self_cpu_time_total for e in copies) / 1e3:.2f}",
                    str(len(copies)))
    idle = Table(title="device idle time by the host operation running meanwhile")
    for col in ("operation", "idle ms"):
        idle.add_column(col, justify="left" if col == "operation" else "right")
    for name, ms in sorted(idle_by_host_op(prof, idle_gaps(kernels)).items(), key=lambda kv: -kv[1])[:top]:
        idle.add_row(name[:90], f"{ms:.2f}")
    ops = Table(title="host operations by their own CPU time")
    for col in ("operation", "self ms", "calls"):
        ops.add_column(col, justify="left" if col == "operation" else "right")
    for avg in sorted(prof.key_averages(), key=lambda a: -a.self_cpu_time_total)[:top]:
        ops.add_row(avg.key[:90], f"{avg.self_cpu_time_total / 1e3:.2f}", str(avg.count))
    return [summary, idle, ops]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--prompt-lens", default="4096,32768")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--host", action="store_true", help="also the host's share of the wall time")
    parser.add_argument("--python", action="store_true", help="also the Python functions by their own time")
    args = parser.parse_args()
    lens = [int(n) for n in args.prompt_lens.split(",")]
    rt = slice_runtime(args.out, args.layers, 1, max(lens) + 64)
    for length in lens:
        prompt = torch.randint(0, rt.cfg.vocab_size, (length,), generator=torch.Generator().manual_seed(0)).tolist()
        prefill_once(rt, prompt)
        wall = prefill_once(rt, prompt)
        activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if args.host else [])
        with profile(activities=activities) as prof:
            prefill_once(rt, prompt)
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
        if args.host:
            for extra in host_tables(prof, args.top):
                Console(width=130).print(extra)
        if args.python:
            python = cProfile.Profile()
            python.runcall(prefill_once, rt, prompt)
            pstats.Stats(python).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
