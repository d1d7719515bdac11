"""Whole decode steps of the ``k3-tp8-rank`` slice (one TP8 rank's real shapes at TP1)
through the runtime under CUDA graphs, against the step's HBM floor.

    python benchmarks/rank_slice_step.py --out DIR [--layers 4] [--batches 1,16,64]
        [--contexts 1024,32768] [--kv-cache-dtype fp8] [--dense-baseline]

Steps: write the slice (MXFP4 experts), compile it for ``h200`` in bf16, load it with
caches for the largest batch and context, fill the caches with random values, then for
each context and batch start that many sequences at that context (their cache blocks
reserved, no prefill run) and time decode steps two ways: the device time of one graph
replay (CUDA events, median) and the runtime's whole step as a caller sees it (host
batch building, input copies, replay, logits back; synchronised wall clock, median).

The floor of a step: every weight the step reads once (all dense weights; of the routed
experts, the distinct ones picked: E * (1 - (1 - k/E)^B) per MoE layer in expectation
for uniform routing, which the random router gives), the MLA history (B * context * 576
values per MLA layer) and the KDA state read and written, over the copy bandwidth
measured in the same run. ``--dense-baseline`` also times the artifact compiled without
``mxfp4_experts`` (dense bf16 experts, the per-expert torch reference) at batch 1.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from gpu_timing import copy_bandwidth
from k3compile import runtime
from k3compile.batch import KDALayerCache, MLALayerCache
from k3compile.checkpoint.generate import GenerateOptions, generate_model_dir
from k3compile.compiler import CompileOptions, optimize
from k3compile.config import PRESETS, with_layers
from k3compile.mla_cache_fp8 import is_fp8_cache, quantize_rows

GB = 1e9


def fill_caches(rt: runtime.Runtime, gen: torch.Generator) -> None:
    """Random history: MLA latents O(1) (quantised rows in an FP8 cache), KDA states small
    (as after a long prompt)."""
    for c in rt.caches:
        tensors = (c.conv_q, c.conv_k, c.conv_v, c.state) if isinstance(c, KDALayerCache) else (c.kv,)
        for t in tensors:
            if is_fp8_cache(t):
                for part in t.split(1024):  # the fp32 values of the whole cache may not fit
                    rows = part.shape[0] * part.shape[1]
                    values = torch.randn(rows, rt.cfg.mla_cache_width, generator=gen, device=t.device)
                    part.copy_(quantize_rows(values, rt.cfg.kv_lora_rank, t.dtype).view(part.shape))
                continue
            scale = 0.05 if t is getattr(c, "state", None) else 1.0
            t.copy_(torch.randn(t.shape, generator=gen, device=t.device) * scale)


def start_sequences(rt: runtime.Runtime, batch: int, context: int) -> list[int]:
    """``batch`` sequences whose first ``context - 1`` positions count as cached."""
    ids = [rt.table.new_sequence() for _ in range(batch)]
    rt.table.reserve(ids, [context - 1] * batch)
    rt.table.advance(ids, [context - 1] * batch)
    return ids


def weight_bytes(rt: runtime.Runtime) -> tuple[int, int, int]:
    """(dense weight bytes, bytes of one routed expert in one layer, MoE layers)."""
    experts = {n: t for n, t in rt.weights.items() if ".mlp.experts." in n}
    dense = sum(t.numel() * t.element_size() for n, t in rt.weights.items() if n not in experts)
    layers = {n.split(".mlp.experts.")[0] for n in experts}
    per_expert = sum(t.numel() * t.element_size() for t in experts.values()) // (len(layers) * rt.cfg.num_experts)
    return dense, per_expert, len(layers)


def step_floor_bytes(rt: runtime.Runtime, batch: int, context: int) -> dict[str, float]:
    cfg = rt.cfg
    dense, per_expert, moe_layers = weight_bytes(rt)
    E, k = cfg.num_experts, cfg.num_experts_per_token
    distinct = E * (1 - (1 - k / E) ** batch)
    mla = sum(batch * context * c.kv.shape[-1] * c.kv.element_size() for c in rt.caches if isinstance(c, MLALayerCache))
    kda = sum(2 * (c.state[0].nbytes + c.conv_q[0].nbytes * 3) for c in rt.caches if isinstance(c, KDALayerCache))
    experts = moe_layers * distinct * per_expert
    return {"dense_weights": dense, "routed_experts": experts, "mla_history": mla, "kda_state": kda * batch,
            "distinct_experts_per_layer": distinct, "total": dense + experts + mla + kda * batch}


def time_steps(rt: runtime.Runtime, ids: list[int], steps: int) -> tuple[float, float]:
    """(device ms of one graph replay, ms of the runtime's whole step), medians."""
    tokens = [1 + i for i in range(len(ids))]
    for _ in range(3):
        tokens = rt.decode(ids, tokens).argmax(-1).tolist()
    walls = []
    for _ in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        tokens = rt.decode(ids, tokens).argmax(-1).tolist()
        walls.append(time.perf_counter() - start)
    # The last step left its inputs in the static buffers: replay that graph alone.
    bucket = next(b for b in rt.graphs.buckets if b >= len(ids))
    graph = rt.graphs.graphs[bucket][0]
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    device = []
    for _ in range(steps):
        torch.cuda._sleep(1_000_000)  # the host queues the replay while the GPU waits
        begin.record()
        graph.replay()
        end.record()
        end.synchronize()
        device.append(begin.elapsed_time(end))
    return statistics.median(device), 1e3 * statistics.median(walls)


def kernel_profile(rt: runtime.Runtime, ids: list[int], top: int = 12) -> list[dict[str, object]]:
    """Device time per kernel name over one graph replay (torch.profiler), largest first."""
    from torch.profiler import ProfilerActivity, profile

    bucket = next(b for b in rt.graphs.buckets if b >= len(ids))
    graph = rt.graphs.graphs[bucket][0]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
    totals: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            totals.setdefault(e.name, []).append(e.device_time)
    rows = [{"kernel": name[:80], "us_per_step": sum(t) / 3, "calls_per_step": len(t) / 3}
            for name, t in totals.items()]
    rows.sort(key=lambda r: -r["us_per_step"])
    total = sum(r["us_per_step"] for r in rows)
    return [{"kernel": "(all)", "us_per_step": total, "calls_per_step": sum(r["calls_per_step"] for r in rows)},
            *rows[:top]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--contexts", default="1024,32768")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--kv-cache-dtype", default="auto", help="the MLA cache: auto (bf16) or fp8")
    parser.add_argument("--dense-baseline", action="store_true")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    result: dict[str, object] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}

    cfg = with_layers(PRESETS["k3-tp8-rank"], args.layers)
    start = time.perf_counter()
    model_dir = generate_model_dir(cfg, args.out / "slice", GenerateOptions(seed=0))
    result["generate_s"] = round(time.perf_counter() - start, 1)
    start = time.perf_counter()
    options = CompileOptions(dtype="bfloat16", target="h200", kv_cache_dtype=args.kv_cache_dtype)
    artifact = optimize(model_dir, args.out / "slice.k3c", options).out_dir
    result["compile_s"] = round(time.perf_counter() - start, 1)
    print(json.dumps(result), flush=True)

    start = time.perf_counter()
    # Each timed step adds a token to every sequence: room for warm-up, timed and profiled steps.
    options = runtime.RuntimeOptions(max_sequences=max(batches), max_context=max(contexts) + 2 * args.steps + 16,
                                     device="cuda")
    rt = runtime.load(artifact, 0, 1, options)
    result["load_and_capture_s"] = round(time.perf_counter() - start, 1)
    fill_caches(rt, torch.Generator(device="cuda").manual_seed(0))
    bandwidth = copy_bandwidth(2 << 30, 20)
    result["copy_bandwidth_TBps"] = round(bandwidth / 1e12, 3)

    rows = []
    for context in contexts:
        for batch in batches:
            ids = start_sequences(rt, batch, context)
            device_ms, step_ms = time_steps(rt, ids, args.steps)
            floor = step_floor_bytes(rt, batch, context)
            floor_ms = 1e3 * floor["total"] / bandwidth
            row = {"context": context, "batch": batch, "device_ms": round(device_ms, 3), "step_ms": round(step_ms, 3),
                   "floor_ms": round(floor_ms, 3), "device_over_floor": round(device_ms / floor_ms, 2),
                   "floor_GB": {k: round(v / GB, 4) if k != "distinct_experts_per_layer" else round(v, 1)
                                for k, v in floor.items()}}
            if context == contexts[0] and batch in (batches[0], batches[-1]):
                row["kernels"] = kernel_profile(rt, ids)
            rows.append(row)
            print(json.dumps(row), flush=True)
            for s in ids:
                rt.release(s)
    result["steps"] = rows
    rt.close()
    del rt
    torch.cuda.empty_cache()

    if args.dense_baseline:
        dense = optimize(model_dir, args.out / "dense.k3c", CompileOptions(dtype="bfloat16", target="h200",
                                                                           disable=("mxfp4_experts",))).out_dir
        rt = runtime.load(dense, 0, 1, runtime.RuntimeOptions(max_sequences=1, max_context=contexts[0] + 64,
                                                               device="cuda"))
        fill_caches(rt, torch.Generator(device="cuda").manual_seed(0))
        ids = start_sequences(rt, 1, contexts[0])
        device_ms, step_ms = time_steps(rt, ids, 3)
        result["dense_experts_batch1"] = {"context": contexts[0], "device_ms": round(device_ms, 3),
                                          "step_ms": round(step_ms, 3)}
        rt.close()

    (args.out / "rank_slice_step.json").write_text(json.dumps(result, indent=1))
    print(f"{'context':>8} {'batch':>5} {'device ms':>10} {'step ms':>9} {'floor ms':>9} {'x floor':>8}")
    for r in rows:
        print(f"{r['context']:>8} {r['batch']:>5} {r['device_ms']:>10.3f} {r['step_ms']:>9.3f} "
              f"{r['floor_ms']:>9.3f} {r['device_over_floor']:>8.2f}")
    if "dense_experts_batch1" in result:
        print("dense experts (today's path), batch 1:", result["dense_experts_batch1"])


if __name__ == "__main__":
    main()
