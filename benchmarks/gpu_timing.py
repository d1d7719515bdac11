"""Timing helpers shared by the GPU benchmarks (run as scripts from ``benchmarks/``).

Small decode steps are timed the way they run in serving: captured in a CUDA graph and
replayed, the median over repeats. Achievable bandwidth is measured in the same run as
a large device-to-device copy.

Before each timed replay the stream spins on the GPU (``LAUNCH_COVER_CYCLES``) while the
host queues the replay, so the timed span starts at the graph's first kernel. Without it
the span also held the host's launch of the graph (several us), which a graph of only a
few calls (a large KV cache copied just past L2: 2 to 6 calls) spread over those calls:
up to about 1 us per call (fifth session: the 12 -> 16 head pad at batch 1 / 32K, 6
calls, 2.4 -> 1.5 us; BENCHMARKS.md results before that session include it). In a
served decode step one graph holds hundreds of kernels, so that launch is not part of
any one kernel's time.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

from k3compile.bench import copy_bandwidth  # noqa: F401  (the benchmarks' copy bandwidth: the runtime bench's)

#: GPU clock cycles the stream spins before each timed replay (about 0.5 ms on an H200):
#: long enough for the host to queue the replay behind it
LAUNCH_COVER_CYCLES = 1_000_000


def graph_time(fns: list[Callable[[], object]], repeats: int) -> float:
    """Seconds per call: the calls captured back to back in one CUDA graph, replayed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (compiles the kernels) outside the capture
        for fn in fns[:2]:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    return replay_time(graph, repeats) / len(fns)


def replay_time(graph: torch.cuda.CUDAGraph, repeats: int) -> float:
    """Seconds per replay of a captured graph, the median; timed from its first kernel
    (the stream spins while the host queues the replay)."""
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        torch.cuda._sleep(LAUNCH_COVER_CYCLES)
        start.record()
        graph.replay()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / 1e3)
    return statistics.median(times)


def eager_time(fn: Callable[..., object], repeats: int = 5, setup: Callable[[], object] | None = None,
               cover_cycles: int = 0) -> float:
    """Milliseconds per eager call of ``fn`` (what prefill runs: no graph), CUDA events, the
    median of ``repeats`` after one warm-up call. ``setup``: called before each call, outside
    the timed span, its result passed to ``fn`` (fresh state for an op that updates it).
    ``cover_cycles``: the stream spins that long before each timed span while the host
    queues the call, so that the span starts at its first kernel: the device's time, the
    host's only where the device waits on it after that kernel."""
    times = []
    for i in range(repeats + 1):
        args = () if setup is None else (setup(),)
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if cover_cycles:
            torch.cuda._sleep(cover_cycles)
        start.record()
        fn(*args)
        stop.record()
        stop.synchronize()
        if i:
            times.append(start.elapsed_time(stop))
    return statistics.median(times)
