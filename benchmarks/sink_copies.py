"""The staging copies of the GEMM dispatch, before and after the sink_copies pass.

    python benchmarks/sink_copies.py --out /tmp/sink

Two measurements on one GPU:

1. The tiny K3 through the runtime, compiled without and with ``sink_copies``: the
   kernels of one eager decode step at batch 1 counted with torch.profiler (all CUDA
   kernels, and the copy/fill kernels among them), tokens compared, and the decode step
   time at batch 1 under CUDA graphs (median of steps, end to end as the runtime runs
   it).
2. The dispatched KDA output projection at K3's TP8 per-rank shape (input [B, 12*128],
   weight [7168, 1536] bf16) at batch 1 and 8: the exported graph's staging copy
   (``new_zeros`` + ``slice_scatter``) followed by the GEMV, vs the GEMV alone (what
   the fallback costs once the copy has moved), under a CUDA graph over 69 layers (one
   per KDA layer), per layer.

Output: JSON on stdout and ``sink_copies.json`` in ``--out``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from k3compile import runtime
from k3compile.checkpoint.generate import GenerateOptions, generate_model_dir
from k3compile.compiler import CompileOptions, optimize
from k3compile.config import PRESETS
from k3compile.model.gemm import TILE_ROWS

from gpu_timing import graph_time  # benchmarks/ is the script's directory
from runtime_cuda_graphs import time_decode

KDA_LAYERS, HIDDEN, LOCAL_IN = 69, 7168, 12 * 128
COPY_KERNEL_WORDS = ("copy", "fill", "scatter", "zero")


def step_kernels(rt: runtime.Runtime) -> tuple[int, int, int]:
    """(all CUDA kernels, copy/fill kernels, fused KDA decode kernels) of one eager decode
    step at batch 1."""
    ids, logits = rt.prefill([[1, 2, 3]])
    tokens = logits.argmax(-1).tolist()
    rt.decode(ids, tokens)  # warm-up
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        rt.decode(ids, tokens)
        torch.cuda.synchronize()
    for s in ids:
        rt.release(s)
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    copies = [k for k in kernels if any(w in k.lower() for w in COPY_KERNEL_WORDS)]
    return len(kernels), len(copies), sum("kda_decode" in k for k in kernels)


def dispatch_microbench(batch: int, repeats: int) -> dict[str, float]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = [torch.randn(HIDDEN, LOCAL_IN, generator=gen, device="cuda", dtype=torch.bfloat16)
               for _ in range(KDA_LAYERS)]
    x = torch.randn(batch, LOCAL_IN, generator=gen, device="cuda", dtype=torch.bfloat16)
    rows = batch + (-batch) % TILE_ROWS

    def staged_then_gemv(w):
        staged = torch.slice_scatter(x.new_zeros(rows, LOCAL_IN), x, 0, 0, batch)  # what the fallback paid for
        return F.linear(x, w), staged

    with_copy = graph_time([lambda w=w: staged_then_gemv(w) for w in weights], repeats)
    gemv_only = graph_time([lambda w=w: F.linear(x, w) for w in weights], repeats)
    return {"batch": batch, "with_copy_us": with_copy * 1e6, "gemv_only_us": gemv_only * 1e6,
            "saved_per_layer_us": (with_copy - gemv_only) * 1e6,
            "saved_per_step_us": (with_copy - gemv_only) * 1e6 * KDA_LAYERS}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=50)
    args = ap.parse_args()
    model_dir = generate_model_dir(PRESETS["tiny"], args.out / "tiny", GenerateOptions(seed=1, experts="mxfp4"))
    result: dict[str, object] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    tokens = {}
    for name, disable in (("before", ("sink_copies",)), ("after", ())):
        artifact = optimize(model_dir, args.out / f"tiny-{name}.k3c",
                            CompileOptions(dtype="float32", target="h200", disable=disable)).out_dir
        opts = dict(max_sequences=8, max_context=256, device="cuda")
        eager = runtime.load(artifact, 0, 1, runtime.RuntimeOptions(**opts, cuda_graphs=False))
        graphs = runtime.load(artifact, 0, 1, runtime.RuntimeOptions(**opts, cuda_graphs=True))
        kernels, copies, kda = step_kernels(eager)
        tokens[name] = graphs.generate([[5, 9, 100, 7], [17]], 16)
        step = time_decode(graphs, 1, args.steps, torch.cuda.synchronize)
        result[name] = {"kernels_per_step": kernels, "copy_kernels_per_step": copies,
                        "fused_kda_kernels_per_step": kda, "decode_ms_batch1": step * 1e3}
    result["tokens_equal"] = tokens["before"] == tokens["after"]
    result["k3_o_proj_dispatch"] = [dispatch_microbench(b, args.repeats) for b in (1, 8)]
    print(json.dumps(result, indent=1))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sink_copies.json").write_text(json.dumps(result, indent=2))
    if not result["tokens_equal"]:
        raise SystemExit("tokens differ between the artifacts")


if __name__ == "__main__":
    main()
