"""One MoE layer's routed experts at one TP8 rank of K3 (E=896, top_k=16, D=3584, I=384),
MXFP4 weights: the Triton kernels against today's paths and the HBM floor. CUDA GPU only.

    python benchmarks/moe_layer.py [--out DIR] [--batches 1 16 64 256] [--no-sweep] [--repeats 30]

Weights are generated on the device as the checkpoint stores them: packed E2M1 codes
(uniform random bytes) and E8M0 scales (random bytes 117..121, so weights are O(1/sqrt(D))).
Router logits are random fp32 with a random bias; z is random bf16. Per batch T:

(a) the new path: ``sigmoid_topk_route`` + ``moe_experts_mxfp4`` (runtime/kernels/moe.py,
    default plan), and each part alone;
(b) today's path: the torch reference ``k3compile.ops.moe._experts_reference`` on dense bf16
    weights dequantised from the same bytes (7.4 GB): under a CUDA graph it visits all 896
    experts (few replays), and eagerly (host sync, only the picked experts);
(c) ``torch._grouped_mm`` on the bf16 weights (pairs sorted by expert with torch ops), captured
    in a graph when it captures, else timed eagerly (the table says which);
(d) the floor: bytes of the distinct experts picked (codes + scales of w1, w3, w2) plus z,
    weights, ids and the output, over the device-to-device copy bandwidth of this run.

Timed with CUDA graphs (benchmarks/gpu_timing.py): one graph holds ``--calls`` calls, each
with its own router logits and z, so consecutive calls pick different experts and read them
from HBM (at batch 1 one call's 35 MB would otherwise stay in the 50 MB L2 across replays);
time per call = median graph time / calls. The floor of a call is its own picked bytes.

Correctness first, on the device: the new path (default plan, and both pair-major and grouped
forced) against (b) eager on the same routing, max |diff| / max |ref| printed and asserted
below 2e-2.

Sweep (unless ``--no-sweep``): at every T, both paths, one kernel's tiles varied at a time
(w13, then w2, then the grouped block_m) around the target's defaults; prints the best plan per
path and T and the crossover T from which grouped wins; set ``moe.PLANS`` from it.

Output: a compact table last on stdout; everything as ``moe_layer.json`` in ``--out``
(default $OUT).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
from gpu_timing import copy_bandwidth, graph_time  # benchmarks/ is the script's directory
from k3compile.runtime.kernels import moe, register_gpu_kernels, routing

import k3compile.ops  # noqa: F401  (registers torch.ops.k3)
from k3compile.checkpoint.mxfp4 import unpack_mxfp4
from k3compile.ops.activations import situ_glu
from k3compile.ops.moe import _experts_reference

E, TOP_K, D, I = 896, 16, 3584, 384
BETA, LINEAR_BETA, SCALING = 4.0, 25.0, 2.5
DEVICE = "cuda"
TOL = 2e-2

# Sweep grid: (block_n, block_k, num_warps, num_stages). BLOCK_K 256 doubles the registers
# of w13 on sm_90 (240+, see the AOT reports): kept to one candidate.
SWEEP_W13 = [(16, 128, 4, 4), (16, 128, 4, 6), (32, 128, 4, 4), (32, 128, 8, 4), (64, 128, 4, 4),
             (64, 128, 8, 3), (16, 256, 4, 3), (128, 128, 8, 3)]
SWEEP_W2 = [(64, 128, 4, 3), (32, 128, 4, 3), (16, 128, 4, 3), (64, 128, 8, 3), (128, 128, 8, 3)]
SWEEP_BLOCK_M = [16, 32, 64]


def make_weights(gen: torch.Generator) -> dict[str, torch.Tensor]:
    def codes(*shape):
        return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8, device=DEVICE)

    def scales(*shape):
        return torch.randint(117, 122, shape, generator=gen, dtype=torch.uint8, device=DEVICE)

    return {"w1_packed": codes(E, I, D // 2), "w1_scale": scales(E, I, D // 32),
            "w3_packed": codes(E, I, D // 2), "w3_scale": scales(E, I, D // 32),
            "w2_packed": codes(E, D, I // 2), "w2_scale": scales(E, D, I // 32)}


def dense(packed: torch.Tensor, scale: torch.Tensor, chunk: int = 64) -> torch.Tensor:
    """bf16 [E, rows, cols] from the packed bytes, a few experts at a time (the fp32
    intermediates of unpack_mxfp4 for all 896 experts would not fit)."""
    out = torch.empty((*packed.shape[:-1], packed.shape[-1] * 2), dtype=torch.bfloat16, device=DEVICE)
    for e in range(0, packed.shape[0], chunk):
        out[e:e + chunk] = unpack_mxfp4(packed[e:e + chunk], scale[e:e + chunk], torch.bfloat16)
    return out


def expert_bytes(w: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in w.values()) // E


def grouped_mm_experts(z, weights, ids, w1t, w3t, w2t):
    """(c): pairs sorted by expert with torch ops (no host sync), torch._grouped_mm on the
    bf16 weights, the SiTU-GLU in fp32, the weighted sum by index_add_."""
    T, K = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    ones = torch.ones_like(flat, dtype=torch.int32)
    counts = torch.zeros(E, dtype=torch.int32, device=z.device).scatter_add_(0, flat.int(), ones)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    tokens = order // K
    x = z[tokens]
    gate = torch._grouped_mm(x, w1t, offs=offs)
    up = torch._grouped_mm(x, w3t, offs=offs)
    h = situ_glu(gate, up, BETA, LINEAR_BETA).to(z.dtype)
    y = torch._grouped_mm(h, w2t, offs=offs).float() * weights.reshape(-1)[order, None]
    return torch.zeros(T, D, dtype=torch.float32, device=z.device).index_add_(0, tokens, y).to(z.dtype)


def rel_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def plan_of(grouped: bool, block_m: int, w13, w2) -> moe.MoePlan:
    return moe.MoePlan(grouped, block_m, moe.GemmPlan(*w13), moe.GemmPlan(*w2))


def grouped_plan(T: int, target: str) -> moe.MoePlan:
    """The grouped plan the launcher would pick at T, or past the threshold if T is below it."""
    return moe.choose_plan(max(T * TOP_K, moe.PLANS[target].grouped_min_pairs), target)


def sweep_plans(base: moe.MoePlan) -> list[moe.MoePlan]:
    """One kernel varied at a time around ``base``."""
    plans = [base]
    plans += [replace(base, w13=moe.GemmPlan(*c)) for c in SWEEP_W13]
    plans += [replace(base, w2=moe.GemmPlan(*c)) for c in SWEEP_W2]
    if base.grouped:
        plans += [replace(base, block_m=m) for m in SWEEP_BLOCK_M]
    unique = []
    for p in plans:
        if p not in unique:
            unique.append(p)
    return unique


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ["OUT"]) if os.environ.get("OUT") else None)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--calls", type=int, default=8, help="calls per graph, each with its own routing")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--no-sweep", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("moe_layer.py needs a CUDA GPU")
    t_start = time.time()
    register_gpu_kernels()
    target = moe.device_target(torch.device(DEVICE))
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    w = make_weights(gen)
    wl = list(w.values())
    per_expert = expert_bytes(w)
    w1d, w3d, w2d = (dense(w[f"{n}_packed"], w[f"{n}_scale"]) for n in ("w1", "w3", "w2"))
    bias = torch.randn(E, generator=gen, device=DEVICE) * 0.05
    bandwidth = copy_bandwidth(1 << 30, 20)
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}: copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write), target plans {target}, "
          f"{torch.cuda.memory_allocated() / 2**30:.1f} GiB allocated", file=sys.stderr, flush=True)
    results = {"device": props.name, "target": target, "copy_bandwidth": bandwidth, "torch": torch.__version__,
               "triton": __import__("triton").__version__, "shapes": {"E": E, "top_k": TOP_K, "D": D, "I": I},
               "default_plans": asdict(moe.PLANS[target]), "batches": []}
    table = []

    for T in args.batches:
        calls = [(torch.randn(T, E, generator=gen, device=DEVICE),
                  torch.randn(T, D, generator=gen, device=DEVICE).to(torch.bfloat16)) for _ in range(args.calls)]
        routed = [routing.sigmoid_topk_route(lg, bias, TOP_K, True, SCALING) for lg, _ in calls]
        distinct = [int(torch.unique(ids).numel()) for _, ids in routed]
        act = T * D * 2 * 2 + T * TOP_K * (4 + 8)
        floor = statistics.mean(d * per_expert + act for d in distinct) / bandwidth  # bytes over copy bandwidth
        row = {"T": T, "distinct_experts": distinct, "floor_s": floor}

        # correctness: new path (default, pair-major and grouped forced) vs (b) eager
        (z0, (wt0, ids0)) = calls[0][1], routed[0]
        ref = _experts_reference(z0, wt0, ids0, w1d, w3d, w2d, BETA, LINEAR_BETA)
        errs = {}
        for name, plan in (("default", None), ("pair", moe.PLANS[target].pair), ("grouped", grouped_plan(T, target))):
            errs[name] = rel_error(moe.moe_experts_mxfp4(z0, wt0, ids0, *wl, BETA, LINEAR_BETA, plan=plan), ref)
        print(f"T={T}: rel error vs the bf16 reference {errs}", file=sys.stderr, flush=True)
        assert all(e < TOL for e in errs.values()), errs
        row["rel_error"] = errs

        def experts(i, plan=None):
            z, (wt, ids) = calls[i][1], routed[i]
            return lambda: moe.moe_experts_mxfp4(z, wt, ids, *wl, BETA, LINEAR_BETA, plan=plan)

        def both(i):
            (lg, z) = calls[i]
            return lambda: torch.ops.k3.moe_experts_mxfp4(
                z, *torch.ops.k3.sigmoid_topk_route(lg, bias, TOP_K, True, SCALING), *wl, BETA, LINEAR_BETA)

        n = range(args.calls)
        row["route_s"] = graph_time([(lambda lg=lg: routing.sigmoid_topk_route(lg, bias, TOP_K, True, SCALING))
                                     for lg, _ in calls], args.repeats)
        row["experts_s"] = graph_time([experts(i) for i in n], args.repeats)
        row["route_experts_s"] = graph_time([both(i) for i in n], args.repeats)
        row["default_plan"] = str(moe.choose_plan(T * TOP_K, target))

        z0, wt0, ids0 = calls[0][1], *routed[0]
        row["reference_graph_s"] = graph_time([lambda: _experts_reference(z0, wt0, ids0, w1d, w3d, w2d, BETA,
                                                                          LINEAR_BETA)], 3)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(3):
            _experts_reference(z0, wt0, ids0, w1d, w3d, w2d, BETA, LINEAR_BETA)
        torch.cuda.synchronize()
        row["reference_eager_s"] = (time.perf_counter() - t0) / 3

        row["grouped_mm_s"], row["grouped_mm_mode"] = None, "unavailable"
        if hasattr(torch, "_grouped_mm"):
            w1t, w3t, w2t = (x.transpose(1, 2) for x in (w1d, w3d, w2d))
            gm = [lambda i=i: grouped_mm_experts(calls[i][1], *routed[i], w1t, w3t, w2t) for i in n]
            try:
                row["grouped_mm_rel_error"] = rel_error(gm[0](), ref)
                try:
                    row["grouped_mm_s"], row["grouped_mm_mode"] = graph_time(gm, args.repeats), "graph"
                except Exception as exc:  # noqa: BLE001  (report, time eagerly)
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(args.repeats):
                        for f in gm:
                            f()
                    torch.cuda.synchronize()
                    row["grouped_mm_s"] = (time.perf_counter() - t0) / (args.repeats * len(gm))
                    row["grouped_mm_mode"] = f"eager ({type(exc).__name__})"
            except Exception as exc:  # noqa: BLE001
                row["grouped_mm_mode"] = f"failed: {type(exc).__name__}: {str(exc)[:200]}"

        if not args.no_sweep:
            row["sweep"] = {}
            for path, base in (("pair", moe.PLANS[target].pair), ("grouped", grouped_plan(T, target))):
                entries = []
                for plan in sweep_plans(base):
                    entry = {"plan": str(plan), "time_s": None}
                    try:
                        entry["rel_error"] = rel_error(
                            moe.moe_experts_mxfp4(z0, wt0, ids0, *wl, BETA, LINEAR_BETA, plan=plan), ref)
                        if entry["rel_error"] < TOL:
                            entry["time_s"] = graph_time([experts(i, plan) for i in n], args.repeats)
                    except Exception as exc:  # noqa: BLE001  (a plan that does not compile or run)
                        entry["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                    entries.append(entry)
                    print(f"  T={T} {path} {plan}: {entry}", file=sys.stderr, flush=True)
                timed = [e for e in entries if e["time_s"] is not None]
                best = min(timed, key=lambda e: e["time_s"]) if timed else None
                row["sweep"][path] = {"entries": entries, "best": best}
        results["batches"].append(row)
        table.append(row)
        print(f"T={T} done at {time.time() - t_start:.0f} s", file=sys.stderr, flush=True)

    if not args.no_sweep:
        crossover = None
        for row in table:
            best = row["sweep"]
            if best["grouped"]["best"] and best["pair"]["best"] and \
                    best["grouped"]["best"]["time_s"] < best["pair"]["best"]["time_s"]:
                crossover = row["T"]
                break
        results["crossover_T"] = crossover
        print("\nbest plan per batch (sweep):")
        for row in table:
            for path in ("pair", "grouped"):
                b = row["sweep"][path]["best"]
                if b:
                    print(f"  T={row['T']:4d} {path:8s} {b['time_s'] * 1e6:8.1f} us  {b['plan']}")
        threshold = moe.PLANS[target].grouped_min_pairs
        print(f"  grouped first wins at T = {crossover} (of {args.batches}); "
              f"today's threshold: {threshold} pairs = T {threshold // TOP_K}")

    def us(s):
        return "-" if s is None else f"{s * 1e6:.1f}"

    print("\n| T | distinct | floor us | route | experts | route+experts (x floor) | ref graph | ref eager | "
          "grouped_mm (x floor) | rel err |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in table:
        gm, fl = r["grouped_mm_s"], r["floor_s"]
        gm_text = us(gm) if gm is None else f"{us(gm)} ({gm / fl:.2f}, {r['grouped_mm_mode']})"
        print(f"| {r['T']} | {statistics.mean(r['distinct_experts']):.0f} | {us(fl)} | {us(r['route_s'])} | "
              f"{us(r['experts_s'])} | {us(r['route_experts_s'])} ({r['route_experts_s'] / fl:.2f}) | "
              f"{us(r['reference_graph_s'])} | {us(r['reference_eager_s'])} | {gm_text} | "
              f"{max(r['rel_error'].values()):.1e} |")
    print(f"\n{time.time() - t_start:.0f} s in all; peak memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "moe_layer.json").write_text(json.dumps(results, indent=1, default=str))
        print(f"wrote {args.out / 'moe_layer.json'}")


if __name__ == "__main__":
    main()
