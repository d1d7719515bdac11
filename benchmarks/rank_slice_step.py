"""Whole decode steps of the ``k3-tp8-rank`` slice (one TP8 rank's real shapes at TP1)
through the runtime under CUDA graphs, against the step's HBM floor: ``k3compile bench``
on a freshly written and compiled slice.

    python benchmarks/rank_slice_step.py --out DIR [--layers 4] [--batches 1,16,64]
        [--contexts 1024,32768] [--prompt-lens 1024] [--peers eager,compile] [--kv-cache-dtype fp8]
        [--lowerings inductor,eager] [--dense-baseline] [--disable PASS,...]

Steps: write the slice (MXFP4 experts), compile it for ``h200`` in bf16, load it with
caches for the largest batch and context, then :func:`k3compile.bench.run_bench` (what
``k3compile bench`` runs; its module docstring says what is timed and what the floor
counts), once per ``--lowerings`` entry (the same artifact, run compiled by Inductor and
op by op). ``--dense-baseline`` also times the artifact compiled without ``mxfp4_experts``
(dense bf16 experts, the per-expert torch reference) at batch 1. Output: the bench tables
on stdout and ``rank_slice_step.json`` in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from k3compile import runtime
from k3compile.bench import BenchOptions, run_bench
from k3compile.checkpoint.generate import GenerateOptions, generate_model_dir
from k3compile.cli.bench import print_report
from k3compile.compiler import CompileOptions, optimize
from k3compile.config import PRESETS, with_layers


def bench(artifact: Path, options: BenchOptions, lowering: str | None = None) -> dict[str, object]:
    start = time.perf_counter()
    sequences, tokens = options.capacity()
    rt = runtime.load(artifact, 0, 1, runtime.RuntimeOptions(max_sequences=sequences, max_context=tokens,
                                                             device="cuda", lowering=lowering))
    load_s = time.perf_counter() - start
    report = run_bench(rt, options, lambda label: print(label, flush=True))
    rt.close()
    print_report(report)
    return {"load_and_capture_s": round(load_s, 1), **report.to_dict()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--contexts", default="1024,32768")
    parser.add_argument("--prompt-lens", default="1024")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--peers", default="", help="eager and/or compile: the reference model, timed alongside")
    parser.add_argument("--kv-cache-dtype", default="auto", help="the MLA cache: auto (bf16) or fp8")
    parser.add_argument("--lowerings", default="inductor", help="inductor and/or eager, one bench each")
    parser.add_argument("--dense-baseline", action="store_true")
    parser.add_argument("--disable", default="", help="passes to leave out of the compile, comma-separated")
    args = parser.parse_args()
    counts = lambda text: tuple(int(v) for v in text.split(",") if v)  # noqa: E731
    result: dict[str, object] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}

    cfg = with_layers(PRESETS["k3-tp8-rank"], args.layers)
    start = time.perf_counter()
    model_dir = generate_model_dir(cfg, args.out / "slice", GenerateOptions(seed=0))
    result["generate_s"] = round(time.perf_counter() - start, 1)
    start = time.perf_counter()
    options = CompileOptions(dtype="bfloat16", target="h200", kv_cache_dtype=args.kv_cache_dtype,
                             disable=tuple(p for p in args.disable.split(",") if p))
    artifact = optimize(model_dir, args.out / "slice.k3c", options).out_dir
    result["compile_s"] = round(time.perf_counter() - start, 1)
    print(json.dumps(result), flush=True)

    peers = tuple(p for p in args.peers.split(",") if p)
    for lowering in args.lowerings.split(","):
        result[f"bench_{lowering}"] = bench(artifact, BenchOptions(counts(args.batches), counts(args.contexts),
                                                                   counts(args.prompt_lens), args.steps, peers=peers),
                                            lowering)
        torch.cuda.empty_cache()
    if args.dense_baseline:
        dense = optimize(model_dir, args.out / "dense.k3c", CompileOptions(dtype="bfloat16", target="h200",
                                                                           disable=("mxfp4_experts",))).out_dir
        contexts = counts(args.contexts)[:1]
        result["dense_experts_batch1"] = bench(dense, BenchOptions((1,), contexts, (), 3, profile=False))
    (args.out / "rank_slice_step.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
