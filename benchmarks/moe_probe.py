"""Probe the routed-expert kernels' launch plans at one TP8 rank's shapes (CUDA only).

    python benchmarks/moe_probe.py time --batches 1 16 64 256 --plans PLAN ...
    python benchmarks/moe_probe.py run --T 1 --plan PLAN     # a few eager calls, for ncu
    python benchmarks/moe_probe.py kernels --batches 1 16 64 --plans PLAN ...   # time per kernel

PLAN is ``pair|grouped:BLOCK_M:w13 n,k,warps,stages:w2 n,k,warps,stages`` (e.g.
``pair:16:16,128,1,4:16,128,1,3``), or ``dequant`` (``moe_dequant.py``, eager: it reads the
experts' pair counts on the host, so no graph; ``time`` only). ``time`` prints each plan's time per call (CUDA graph
of ``--calls`` calls with their own routing, as benchmarks/moe_layer.py) over the floor of
the distinct experts' bytes, and the routing kernel's time at several warp counts;
``kernels`` the same graphs' device time per kernel and call (``torch.profiler`` over
replays). ``dequant`` times ``moe_dequant.dequantize`` on one group of experts' W1 and W2
(what the dequantised path launches per group) against ``zero_`` of its output (the write
alone) and a bf16 copy of it, and the floor of its bytes at the copy bandwidth.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from gpu_timing import copy_bandwidth, eager_time, graph_time
from moe_layer import D, E, TOP_K, make_weights
from k3compile.runtime.kernels import moe, moe_dequant, routing

import k3compile.ops  # noqa: F401


def parse_plan(text: str) -> moe.MoePlan:
    kind, block_m, w13, w2 = text.split(":")
    gemm = lambda s: moe.GemmPlan(*(int(v) for v in s.split(",")))  # noqa: E731
    return moe.MoePlan(kind == "grouped", int(block_m), gemm(w13), gemm(w2))


def inputs(T: int, calls: int, gen: torch.Generator) -> list[tuple[torch.Tensor, ...]]:
    out = []
    for _ in range(calls):
        logits = torch.randn(T, E, generator=gen, device="cuda")
        w, ids = routing.sigmoid_topk_route(logits, torch.zeros(E, device="cuda"), TOP_K, True, 1.0)
        z = torch.randn(T, D, generator=gen, device="cuda").bfloat16()
        out.append((z, w, ids))
    return out


def kernel_times(fns: list, calls: int, replays: int = 10) -> list[tuple[str, float]]:
    """(kernel, device microseconds) for each launch of one call in launch order, averaged
    over the calls of ``replays`` replays of one graph (``torch.profiler``)."""
    graph_time(fns, 1)  # compiles the kernels
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    events = sorted((ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda ev: ev.time_range.start)
    per_call = len(events) // (replays * calls)
    return [(events[i].name[:32], round(sum(ev.device_time for ev in events[i::per_call]) / (replays * calls), 1))
            for i in range(per_call)]


def dequant_times(w: dict[str, torch.Tensor], bandwidth: float) -> list[dict]:
    """Microseconds per call of the dequantisation kernel and its peers (module docstring)."""
    group = moe_dequant.EXPERT_GROUP
    rows = []
    for name in ("w1", "w2"):
        packed, scale = w[f"{name}_packed"][:group], w[f"{name}_scale"][:group]
        out = moe_dequant.dequantize(packed, scale, torch.bfloat16)
        other = torch.empty_like(out)
        floor = (packed.numel() + scale.numel() + out.numel() * out.element_size()) / bandwidth
        for what, fn in (("dequantize", lambda: moe_dequant.dequantize(packed, scale, torch.bfloat16)),
                         ("zero_ (write only)", out.zero_), ("bf16 copy", lambda: out.copy_(other))):
            t = graph_time([fn] * 4, 20)
            rows.append({"weight": name, "shape": list(out.shape), "what": what, "us": round(t * 1e6, 1),
                         "x_floor": round(t / floor, 2)})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["time", "run", "kernels", "dequant"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--T", type=int, default=1)
    ap.add_argument("--plans", nargs="+", default=[])
    ap.add_argument("--plan", default=None)
    ap.add_argument("--calls", type=int, default=8)
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = make_weights(gen)
    per_expert = sum(t.numel() for t in w.values()) // E
    weights = [w[k] for k in ("w1_packed", "w1_scale", "w3_packed", "w3_scale", "w2_packed", "w2_scale")]
    if args.mode == "run":
        plan = parse_plan(args.plan)
        for z, wt, ids in inputs(args.T, 6, gen):
            moe.moe_experts_mxfp4(z, wt, ids, *weights, 4.0, 25.0, plan=plan)
        torch.cuda.synchronize()
        return
    if args.mode == "kernels":
        for T in args.batches:
            sets = inputs(T, args.calls, gen)
            for text in args.plans:
                plan = parse_plan(text)
                fns = [lambda s=s: moe.moe_experts_mxfp4(*s, *weights, 4.0, 25.0, plan=plan) for s in sets]
                print(json.dumps({"T": T, "plan": text, "kernels_us": kernel_times(fns, args.calls)}), flush=True)
        return
    bandwidth = copy_bandwidth(2 << 30, 10)
    if args.mode == "dequant":
        print(json.dumps({"bandwidth": bandwidth, "rows": dequant_times(w, bandwidth)}))
        return
    rows = []
    for T in args.batches:
        sets = inputs(T, args.calls, gen)
        distinct = sum(int(torch.unique(ids).numel()) for _, _, ids in sets) / len(sets)
        floor = distinct * per_expert / bandwidth
        for text in args.plans:
            if text == "dequant":
                fns = [lambda s=s: moe_dequant.moe_experts_dequantized(*s, *weights, 4.0, 25.0) for s in sets]
                t = sum(eager_time(fn, 10) for fn in fns) / len(fns) / 1e3
            else:
                plan = parse_plan(text)
                if not plan.grouped and T * TOP_K > 4096:
                    continue
                fns = [lambda s=s: moe.moe_experts_mxfp4(*s, *weights, 4.0, 25.0, plan=plan) for s in sets]
                t = graph_time(fns, 20)
            rows.append({"T": T, "plan": text, "us": round(t * 1e6, 1), "x_floor": round(t / floor, 2)})
            print(json.dumps(rows[-1]), flush=True)
        logits = [torch.randn(T, E, generator=gen, device="cuda") for _ in range(args.calls)]
        bias = torch.zeros(E, device="cuda")
        for warps in (1, 2, 4, 8):
            def route(x, warps=warps):
                wt = torch.empty(T, TOP_K, device="cuda")
                ids = torch.empty(T, TOP_K, dtype=torch.int64, device="cuda")
                routing._route_kernel[(T,)](x, bias, wt, ids, E, E, 1.0, TOP_K=TOP_K, K_POW2=TOP_K, BLOCK_E=1024,
                                        RENORMALIZE=True, num_warps=warps)
            t = graph_time([lambda x=x: route(x) for x in logits], 20)
            rows.append({"T": T, "plan": f"route w{warps}", "us": round(t * 1e6, 1)})
            print(json.dumps(rows[-1]), flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "moe_probe.json"), "w") as f:
            json.dump({"bandwidth": bandwidth, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
