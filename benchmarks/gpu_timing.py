"""Timing helpers shared by the GPU benchmarks (run as scripts from ``benchmarks/``).

Small decode steps are timed the way they run in serving: captured in a CUDA graph and
replayed, the median over repeats. Achievable bandwidth is measured in the same run as
a large device-to-device copy.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


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
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        graph.replay()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / 1e3 / len(fns))
    return statistics.median(times)


def copy_bandwidth(nbytes: int, repeats: int) -> float:
    """Bytes per second of a device-to-device copy, counting bytes read and written.

    Timed eagerly with events, not in a CUDA graph: a copy captured in a graph becomes a
    memcpy node, which ran at 2.75 TB/s on an H200 against 4.2 TB/s for the same copy
    launched eagerly; the higher figure is the bandwidth kernels can reach."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        dst.copy_(src)
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / 1e3)
    return 2 * nbytes / statistics.median(times)
