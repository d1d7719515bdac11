"""The slice's decode step at its own kernel granularity: how fast it could be if every
kernel that moves weights or caches streamed its bytes like the simplest read kernel, and
every other kernel cost an empty launch.

    python benchmarks/launch_floor.py --out DIR [--batches 1,16,64] [--context 1024]

The step's floor (``k3compile.bench.step_floor``: its bytes over a copy bandwidth) assumes
one perfect stream. A real step is a chain of kernels, each with a ramp and a last wave,
and the graph's gap between them. This script builds, for one decode step of the
``k3-tp8-rank`` slice (Inductor lowering, CUDA graphs):

- the bytes of every node of the decode program (its weights, counted as ``step_floor``
  counts them: the embedding's batch rows, the routed experts the batch picks in
  expectation; the MLA history on the attention node, the KDA state read and written on
  the KDA node), found by running the program node by node and matching its tensor
  arguments to the runtime's weights;
- an "ideal step": one CUDA graph of a Triton read kernel per node that moves bytes, over
  buffers of those sizes in the step's order, and optionally empty kernels up to the
  real replay's kernel count; the fastest of five uniform launch plans;

and prints the real graph replay, the ideal step with and without the empty kernels, the
floor, and per node the real kernels' time (an eager step, profiler range per node)
against the ideal read's. Output also as ``launch_floor.json`` in ``--out``.
"""

from __future__ import annotations

import argparse
import bisect
import json
from pathlib import Path

import torch
import triton
from decode_nodes import node_times, slice_runtime  # benchmarks/ is the script's directory
from gpu_timing import replay_time
from stream_floor import PLANS, _empty_kernel, _read_kernel
from torch import fx
from torch.profiler import ProfilerActivity, profile
from torch.utils._pytree import tree_leaves

from k3compile import runtime
from k3compile.bench import copy_bandwidth, kernel_times, start_sequences, step_floor


class _NodeBytes(fx.Interpreter):
    """Runs the decode program and records, per node, the weights it reads: (the weight's
    name, the bytes of the argument, which may be a view of part of it)."""

    def __init__(self, module: fx.GraphModule, weights: dict[str, torch.Tensor]):
        super().__init__(module)
        self.ranges = sorted((t.data_ptr(), t.data_ptr() + t.nbytes, name) for name, t in weights.items() if t.numel())
        self.starts = [r[0] for r in self.ranges]
        self.read: dict[str, dict[str, int]] = {}

    def weight_of(self, t: torch.Tensor) -> str | None:
        i = bisect.bisect_right(self.starts, t.data_ptr()) - 1
        return self.ranges[i][2] if i >= 0 and t.data_ptr() < self.ranges[i][1] else None

    def run_node(self, n: fx.Node) -> object:
        if n.op == "call_function":
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            for t in tree_leaves((args, kwargs)):
                name = self.weight_of(t) if isinstance(t, torch.Tensor) and t.numel() else None
                if name is not None:
                    self.read.setdefault(n.name, {})[name] = t.numel() * t.element_size()
        return super().run_node(n)


def node_bytes(rt: runtime.Runtime, ids: list[int], context: int) -> list[tuple[str, str, int]]:
    """(node, target, bytes) of the decode program's nodes that move bytes, in graph order
    (views included: the caller keeps the nodes that launch kernels)."""
    module = rt.graph_modules["decode"]
    runner = _NodeBytes(module, rt.weights)
    rt.step(ids, [[1]] * len(ids), module=lambda *args: runner.run(*args))
    floor = step_floor(rt, len(ids), context)
    E = rt.cfg.num_experts
    targets = {n.name: str(n.target) for n in module.graph.nodes}
    mla = [n for n, t in targets.items() if "mla_decode" in t]
    kda = [n for n, t in targets.items() if "kda_decode" in t]
    out = []
    for name, target in targets.items():
        total = 0.0
        for weight_name, nbytes in runner.read.get(name, {}).items():
            if weight_name.endswith("embed_tokens.weight"):
                total += len(ids) * rt.weights[weight_name][0].nbytes
            elif ".mlp.experts." in weight_name:
                total += nbytes * floor.distinct_experts_per_layer / E
            else:
                total += nbytes
        total += floor.mla_history / len(mla) if name in mla else 0
        total += floor.kda_state / len(kda) if name in kda else 0
        if total:
            out.append((name, target, int(total)))
    return out


def time_ideal(sizes: list[int], empties: int, repeats: int) -> dict[str, object]:
    """Replay time of one graph of read kernels over ``sizes`` bytes (+ ``empties`` empty
    kernels), the fastest of the uniform plans, and each read's time in it."""
    bufs = [torch.randn(max(s // 2, 1), device="cuda", dtype=torch.bfloat16) for s in sizes]
    sums = torch.empty(max(triton.cdiv(b.numel(), PLANS[0][0]) for b in bufs), device="cuda")
    best: dict[str, object] = {}
    for block, warps in PLANS:
        def step() -> None:
            for b in bufs:
                _read_kernel[(triton.cdiv(b.numel(), block),)](b, sums, b.numel(), BLOCK=block, num_warps=warps)
            for _ in range(empties):
                _empty_kernel[(1,)](sums)

        step()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        us = replay_time(graph, repeats) * 1e6
        if not best or us < best["us"]:
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                graph.replay()
                torch.cuda.synchronize()
            reads = [e.device_time for e in prof.events() if e.device_type.name == "CUDA" and "_read_kernel" in e.name]
            best = {"us": us, "plan": f"{block}/{warps}w", "reads_us": reads}
        del graph
    return best


def measure(rt: runtime.Runtime, batch: int, context: int, bandwidth: float, repeats: int) -> dict[str, object]:
    ids = start_sequences(rt, batch, context)
    rt.decode(ids, [1] * batch)  # captures this batch's graph
    real_nodes = {r["node"]: r for r in node_times(rt, ids)}
    sizes = [s for s in node_bytes(rt, ids, context) if s[0] in real_nodes]  # views launch nothing
    kernels = kernel_times(rt, ids, top=0)[0]
    graph = rt.graphs.graphs[next(b for b in rt.graphs.buckets if b >= batch)][0]
    real_us = replay_time(graph, repeats) * 1e6
    floor_MB = step_floor(rt, batch, context).total / 1e6
    floor_us = floor_MB * 1e6 / bandwidth * 1e6
    for s in ids:
        rt.release(s)
    streams = time_ideal([s for _, _, s in sizes], 0, repeats)
    with_empties = time_ideal([s for _, _, s in sizes], max(kernels["calls"] - len(sizes), 0), repeats)
    nodes = []
    for (name, target, nbytes), ideal in zip(sizes, streams["reads_us"], strict=True):
        real = real_nodes[name]
        nodes.append({"node": name, "target": target, "MB": round(nbytes / 1e6, 2), "real_us": real["us"],
                      "real_kernels": len(real["kernels"]), "ideal_us": round(ideal, 1)})
    return {"batch": batch, "context": context, "floor_us": round(floor_us, 1), "floor_MB": round(floor_MB, 1),
            "bytes_MB": round(sum(s for _, _, s in sizes) / 1e6, 1), "real_us": round(real_us, 1),
            "real_kernels": kernels["calls"], "streams": len(sizes),
            "ideal_streams_us": round(streams["us"], 1), "ideal_streams_plan": streams["plan"],
            "ideal_with_empties_us": round(with_empties["us"], 1), "nodes": nodes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    rt = slice_runtime(args.out, args.layers, max(batches), args.context + 64)
    bandwidth = copy_bandwidth(2 << 30, 10)
    results = [measure(rt, b, args.context, bandwidth, args.repeats) for b in batches]
    (args.out / "launch_floor.json").write_text(json.dumps({"copy_bandwidth_Bps": bandwidth, "results": results},
                                                           indent=1))
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s, context {args.context}\n")
    print("| batch | MB moved | floor us | ideal reads us (x floor) | + empty kernels us (x floor) | "
          "real replay us (x floor) | kernels: reads / real |")
    print("|--:|--:|--:|--:|--:|--:|--:|")
    for r in results:
        f = r["floor_us"]
        print(f"| {r['batch']} | {r['bytes_MB']:,.0f} | {f:.1f} | {r['ideal_streams_us']:.1f} "
              f"({r['ideal_streams_us'] / f:.2f}x) | {r['ideal_with_empties_us']:.1f} "
              f"({r['ideal_with_empties_us'] / f:.2f}x) | {r['real_us']:.1f} ({r['real_us'] / f:.2f}x) | "
              f"{r['streams']} / {r['real_kernels']} |")
    for r in results:
        print(f"\nbatch {r['batch']}: nodes that move bytes, the largest gap first (real: an eager step's kernels)")
        print("| node | target | MB | real us (kernels) | ideal read us | real - ideal |")
        print("|---|---|--:|--:|--:|--:|")
        gap = lambda n: n["real_us"] - n["ideal_us"]  # noqa: E731
        for n in sorted(r["nodes"], key=lambda n: -gap(n)):
            print(f"| {n['node'][:40]} | {n['target'].removeprefix('k3.')[:36]} | {n['MB']:.1f} | "
                  f"{n['real_us']} ({n['real_kernels']}) | {n['ideal_us']} | {gap(n):.1f} |")


if __name__ == "__main__":
    main()
