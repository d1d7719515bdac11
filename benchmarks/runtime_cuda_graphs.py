"""The tiny K3 through the runtime on one GPU: tokens vs CPU, decode step time with and
without CUDA graphs.

    python benchmarks/runtime_cuda_graphs.py --out /tmp/k3bench

Steps: generate the tiny model, compile it (fp32), generate greedily on the CPU, on the
GPU eagerly and on the GPU with CUDA graphs (tokens must agree), then time decode steps
at several batch sizes both ways. A decode step is timed end to end as the runtime runs
it (host-side batch building, copies into the static inputs, the model, logits back),
synchronised, median of repeated steps after warm-up.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from k3compile import runtime
from k3compile.checkpoint.generate import GenerateOptions, generate_model_dir
from k3compile.compiler import CompileOptions, optimize
from k3compile.config import PRESETS

PROMPTS = [[5, 9, 100, 7, 3, 44, 21, 8, 90, 11], [17], [300, 301, 302], [2, 4]]


def time_decode(rt: runtime.Runtime, batch: int, steps: int, sync) -> float:
    ids, logits = rt.prefill([[i + 1, i + 2, i + 3] for i in range(batch)])
    tokens = logits.argmax(-1).tolist()
    for _ in range(5):  # warm-up
        tokens = rt.decode(ids, tokens).argmax(-1).tolist()
    times = []
    for _ in range(steps):
        sync()
        start = time.perf_counter()
        logits = rt.decode(ids, tokens)
        sync()
        times.append(time.perf_counter() - start)
        tokens = logits.argmax(-1).tolist()
    for s in ids:
        rt.release(s)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batches", default="1,4,8")
    args = parser.parse_args()
    model_dir = generate_model_dir(PRESETS["tiny"], args.out / "tiny", GenerateOptions(seed=1, experts="mxfp4"))
    artifact = optimize(model_dir, args.out / "tiny.k3c", CompileOptions(dtype="float32", target="h200")).out_dir
    batches = [int(b) for b in args.batches.split(",")]
    opts = runtime.RuntimeOptions(max_sequences=max(8, *batches), max_context=256)

    cpu = runtime.load(artifact, 0, 1, runtime.RuntimeOptions(**{**opts.__dict__, "device": "cpu"}))
    eager = runtime.load(artifact, 0, 1, runtime.RuntimeOptions(**{**opts.__dict__, "device": "cuda", "cuda_graphs": False}))
    graphs = runtime.load(artifact, 0, 1, runtime.RuntimeOptions(**{**opts.__dict__, "device": "cuda", "cuda_graphs": True}))
    tokens = {name: rt.generate(PROMPTS, 16) for name, rt in (("cpu", cpu), ("cuda_eager", eager), ("cuda_graphs", graphs))}
    same = tokens["cpu"] == tokens["cuda_eager"] == tokens["cuda_graphs"]

    sync = torch.cuda.synchronize
    rows = []
    for b in batches:
        t_eager = time_decode(eager, b, args.steps, sync)
        t_graph = time_decode(graphs, b, args.steps, sync)
        rows.append({"batch": b, "eager_ms": round(t_eager * 1e3, 3), "graphs_ms": round(t_graph * 1e3, 3),
                     "speedup": round(t_eager / t_graph, 2)})
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "tokens_equal": same,
              "tokens": tokens["cuda_graphs"], "decode": rows}
    print(json.dumps(result, indent=1))
    if not same:
        raise SystemExit(f"tokens differ: {json.dumps(tokens)}")


if __name__ == "__main__":
    main()
