"""Device time and kernels of every node of one eager decode step of the ``k3-tp8-rank``
slice: where a layer's time goes, op by op (``k3compile bench --profile`` sums it by
layer type).

    python benchmarks/decode_nodes.py --out DIR [--layers 4] [--batches 1,64] [--context 1024]

Each node runs inside a profiler range (an ``fx.Interpreter``); a range's device time is
the sum of its kernels. Printed per batch: the nodes of each layer type largest first, with
their kernels. Output also as ``decode_nodes.json`` in ``--out``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch import fx
from torch.profiler import ProfilerActivity, profile

from k3compile import runtime
from k3compile.bench import fill_random_history, start_sequences
from k3compile.checkpoint.generate import GenerateOptions, generate_model_dir
from k3compile.compiler import CompileOptions, optimize
from k3compile.config import PRESETS, with_layers
from k3compile.placement.groups import node_groups


class _NodeRanges(fx.Interpreter):
    def run_node(self, n: fx.Node) -> object:
        if n.op != "call_function":
            return super().run_node(n)
        with torch.profiler.record_function(f"k3node:{n.name}"):
            return super().run_node(n)


def node_times(rt: runtime.Runtime, ids: list[int]) -> list[dict[str, object]]:
    module = rt.graph_modules["decode"]
    groups = {n.name: g for n, (g, _, _) in node_groups(n for n in module.graph.nodes
                                                          if n.op == "call_function").items()}
    targets = {n.name: str(n.target) for n in module.graph.nodes}
    runner = _NodeRanges(module)
    step = lambda: rt.step(ids, [[1]] * len(ids), module=lambda *args: runner.run(*args))  # noqa: E731
    step()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    rows = []
    for e in prof.events():
        if e.device_type.name != "CPU" or not e.name.startswith("k3node:"):
            continue
        name = e.name.removeprefix("k3node:")
        kernels: list[str] = []
        stack = [e]
        while stack:
            x = stack.pop()
            kernels += [k.name[:60] for k in x.kernels]
            stack += x.cpu_children
        if kernels:
            rows.append({"node": name, "target": targets[name], "group": groups.get(name, "?"),
                         "us": round(e.device_time_total, 1), "kernels": kernels})
    return rows


def slice_runtime(out: Path, layers: int, sequences: int, tokens: int, lowering: str | None = None) -> runtime.Runtime:
    """The ``k3-tp8-rank`` slice of ``layers`` layers written under ``out``, compiled for
    h200 in bf16 and loaded on the GPU for ``sequences`` x ``tokens``, random history filled."""
    cfg = with_layers(PRESETS["k3-tp8-rank"], layers)
    model_dir = generate_model_dir(cfg, out / "slice", GenerateOptions(seed=0))
    artifact = optimize(model_dir, out / "slice.k3c", CompileOptions(dtype="bfloat16", target="h200")).out_dir
    rt = runtime.load(artifact, 0, 1, runtime.RuntimeOptions(max_sequences=sequences, device="cuda",
                                                             max_context=tokens, lowering=lowering))
    fill_random_history(rt, torch.Generator(device="cuda").manual_seed(0))
    return rt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--context", type=int, default=1024)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    rt = slice_runtime(args.out, args.layers, max(batches), args.context + 64, lowering="eager")
    result = {}
    for batch in batches:
        ids = start_sequences(rt, batch, args.context)
        rows = node_times(rt, ids)
        for s in ids:
            rt.release(s)
        result[batch] = rows
        print(f"\nbatch {batch}: {sum(r['us'] for r in rows):.1f} us in {sum(len(r['kernels']) for r in rows)} kernels")
        for group in dict.fromkeys(r["group"] for r in rows):
            mine = sorted((r for r in rows if r["group"] == group), key=lambda r: -r["us"])
            print(f"  {group}: {sum(r['us'] for r in mine):.1f} us, {sum(len(r['kernels']) for r in mine)} kernels")
            for r in mine:
                print(f"    {r['us']:8.1f}  {r['node'][:40]:40s} {r['target'][:40]:40s} {', '.join(r['kernels'])[:150]}")
    (args.out / "decode_nodes.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
