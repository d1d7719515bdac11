"""Inductor's freezing on the decode program: the ``k3-tp8-rank`` slice's step with and
without it, in one process (CUDA only).

    python benchmarks/inductor_freezing.py --out DIR [--layers 4] [--batches 1,16,64] [--contexts 1024]

Freezing (``torch._inductor.config.freezing``) makes the parameters constants of the
compiled graph, which lets Inductor fold computations on them; among its patterns, matmuls
that share an input (q / k / v, gate / up) become one matmul on concatenated weights.
Writes and compiles the slice once, then per setting loads the runtime (decode lowered by
Inductor), records the device memory it holds, runs ``k3compile.bench.run_bench``, and
greedy-decodes one prompt (the tokens of both settings are compared). Output: the bench
tables and ``inductor_freezing.json`` in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch._inductor.config as inductor_config

from k3compile import runtime
from k3compile.bench import BenchOptions, run_bench
from k3compile.checkpoint.generate import GenerateOptions, generate_model_dir
from k3compile.cli.bench import print_report
from k3compile.compiler import CompileOptions, optimize
from k3compile.config import PRESETS, with_layers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--contexts", default="1024")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    counts = lambda text: tuple(int(v) for v in text.split(",") if v)  # noqa: E731
    model_dir = generate_model_dir(with_layers(PRESETS["k3-tp8-rank"], args.layers), args.out / "slice",
                                   GenerateOptions(seed=0))
    artifact = optimize(model_dir, args.out / "slice.k3c", CompileOptions(dtype="bfloat16", target="h200")).out_dir
    options = BenchOptions(counts(args.batches), counts(args.contexts), (), args.steps)
    sequences, tokens = options.capacity()
    result: dict[str, object] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    prompt = [[(7 * i + 3) % 1000 + 1 for i in range(16)]]
    for freezing in (False, True):
        inductor_config.freezing = freezing
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        start = time.perf_counter()
        rt = runtime.load(artifact, 0, 1, runtime.RuntimeOptions(max_sequences=sequences, max_context=tokens,
                                                                 device="cuda", lowering="inductor"))
        greedy = rt.generate(prompt, 8)[0]  # the first decode steps compile and capture
        load_s = time.perf_counter() - start
        held = torch.cuda.memory_allocated() - base
        report = run_bench(rt, options, lambda label: print(label, flush=True))
        print(f"freezing={freezing}: load + first generate {load_s:.1f} s, {held / 2**30:.2f} GiB held, "
              f"greedy {greedy}", flush=True)
        print_report(report)
        result[f"freezing_{freezing}"] = {"load_and_first_generate_s": round(load_s, 1), "held_gib": held / 2**30,
                                          "greedy": greedy, **report.to_dict()}
        rt.close()
        del rt
    result["same_greedy_tokens"] = result["freezing_False"]["greedy"] == result["freezing_True"]["greedy"]
    (args.out / "inductor_freezing.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
