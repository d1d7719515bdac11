"""The tiny K3 through the runtime on one GPU: tokens vs CPU, decode step time with and
without CUDA graphs.

    python benchmarks/runtime_cuda_graphs.py --out /tmp/k3bench

Steps: generate the tiny model, compile it (fp32), generate greedily on the CPU, on the
GPU eagerly and on the GPU with CUDA graphs (tokens must agree), then time decode steps
at several batch sizes both ways. Then the same model in bf16 (h200's 64-token cache
blocks: the split-KV kernel loads its KV tiles by tensor descriptors): one prefill and
decode step's logits on the GPU under CUDA graphs against the CPU's (bf16 rounding
apart), and greedy tokens equal on the GPU eagerly and under graphs. A decode step is timed end to end as the runtime runs
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
    bf16 = check_bf16(model_dir, args.out / "tiny-bf16.k3c", opts)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "tokens_equal": same,
              "tokens": tokens["cuda_graphs"], "decode": rows, "bf16": bf16}
    print(json.dumps(result, indent=1))
    if not same:
        raise SystemExit(f"tokens differ: {json.dumps(tokens)}")
    if not bf16["ok"]:
        raise SystemExit(f"bf16 check failed: {json.dumps(bf16)}")


def check_bf16(model_dir: Path, out: Path, opts: runtime.RuntimeOptions) -> dict[str, object]:
    """bf16 artifact for h200: GPU (graphs) logits of a prefill and a decode step vs the
    CPU's; greedy tokens on the GPU eagerly and under graphs."""
    artifact = optimize(model_dir, out, CompileOptions(dtype="bfloat16", target="h200")).out_dir
    runs = {d: runtime.load(artifact, 0, 1, runtime.RuntimeOptions(**{**opts.__dict__, "device": d, "cuda_graphs": g}))
            for d, g in (("cpu", False), ("cuda", True))}
    logits = {}
    for name, rt in runs.items():
        ids, prefill = rt.prefill(PROMPTS)
        decode = rt.decode(ids, prefill.argmax(-1).tolist())
        logits[name] = torch.cat([prefill.float().cpu(), decode.float().cpu()])
        for seq in ids:
            rt.release(seq)
    err = (logits["cuda"] - logits["cpu"]).abs().max().item()
    scale = logits["cpu"].abs().max().item()
    eager = runtime.load(artifact, 0, 1, runtime.RuntimeOptions(**{**opts.__dict__, "device": "cuda", "cuda_graphs": False}))
    tokens_equal = eager.generate(PROMPTS, 16) == runs["cuda"].generate(PROMPTS, 16)
    # bf16 activations: a few units in the last place of the largest logit
    return {"block_size": json.loads((artifact / "manifest.json").read_text())["block_size"],
            "logits_max_abs_err": err, "logits_max_abs": scale, "gpu_eager_graph_tokens_equal": tokens_equal,
            "ok": err <= 0.05 * scale and tokens_equal}


if __name__ == "__main__":
    main()
