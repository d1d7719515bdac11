"""One rank's latent-MoE tail at K3's TP8 shapes, before and after the dedup pass.

    python benchmarks/moe_tail_dedup.py --out /tmp/moe_tail

The tail as the compiled graphs run it (the k3 ops and aten calls of the decode program):

    before:  y = k3.rms_norm(routed, w_norm)                       [B, 3584]
             out = aten.linear(y, W_up [7168, 3584]) + shared       [B, 7168]  (shared: all-reduced)
    after:   y = k3.rms_norm(routed, w_norm)
             acc = k3.add_rank_block_linear(shared_partial, y, W_up[rows of rank 3] [896, 3584], start)
             (the all-reduce that follows exists in both graphs and is not timed)

Each is timed twice: with the k3 ops' torch references (RMSNorm and add_rank_block are
several small kernels each; add_rank_block_linear is cuBLAS' GEMV then add_rank_block)
and with the runtime's row kernels registered for them (``runtime/kernels/rows.py``: one
launch each; the rows GEMV and the add are one kernel), as the runtime runs on a GPU. Every
variant runs under a CUDA graph that holds the tails of ``--layers`` distinct
layers back to back (distinct weights, more bytes than the 50 MB L2 of an H200), so each
call reads its weights from HBM as in a real decode step; time per layer = median graph
time / layers. Peers in the same run: a bare cuBLAS GEMV of the full and of the 896-row
weight, and the rows op alone (GEMV + add, ``add_rank_block_linear``). The floor is the
bytes each variant must move (weights + activations) over the
copy bandwidth measured in the same run. Correctness is checked first: after == before
(bf16, rows added before the all-reduce of a single rank = the same sum).

Output: a markdown table on stdout and ``moe_tail.json`` in ``--out``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

import k3compile.ops  # noqa: F401  (registers torch.ops.k3)
from k3compile.runtime.kernels.rows import register_cuda_kernels

from gpu_timing import copy_bandwidth, graph_time  # benchmarks/ is the script's directory

HIDDEN, LATENT, TP, RANK = 7168, 3584, 8, 3
ROWS = HIDDEN // TP
EPS = 1e-5


def make_layers(n: int, gen: torch.Generator) -> list[dict[str, torch.Tensor]]:
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    return [
        {"w_norm": torch.rand(LATENT, generator=gen, **bf16) + 0.5,
         "w_up": torch.randn(HIDDEN, LATENT, generator=gen, **bf16) * LATENT**-0.5}
        for _ in range(n)
    ]


def tail_before(routed, shared, layer):
    y = torch.ops.k3.rms_norm(routed, layer["w_norm"], EPS)
    return F.linear(y, layer["w_up"]) + shared


def tail_after(routed, partial, layer, start):
    y = torch.ops.k3.rms_norm(routed, layer["w_norm"], EPS)
    return torch.ops.k3.add_rank_block_linear(partial, y, layer["w_rows"], start)


def tail_bytes(batch: int, rows: int) -> int:
    """Weights read + activations read and written (bf16) by one tail."""
    weights = rows * LATENT * 2 + LATENT * 2
    acts = batch * LATENT * 2 * 2 + batch * HIDDEN * 2 * 2  # routed in, y out+in; shared in, out
    return weights + acts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--layers", type=int, default=24, help="distinct layers per graph (bytes beyond L2)")
    ap.add_argument("--repeats", type=int, default=50)
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    layers = make_layers(args.layers, gen)
    for layer in layers:
        layer["w_rows"] = layer["w_up"][RANK * ROWS:(RANK + 1) * ROWS].contiguous()
    start = torch.tensor(RANK * ROWS, device="cuda")

    # Correctness: one rank's view. Its partial plus its rows at their place, summed with
    # the other ranks' partials plus their rows, equals the full tail; on one rank,
    # with partial = shared and the other ranks' rows added too, the result must match.
    routed = torch.randn(8, LATENT, generator=gen, device="cuda", dtype=torch.bfloat16)
    shared = torch.randn(8, HIDDEN, generator=gen, device="cuda", dtype=torch.bfloat16)
    def check() -> float:
        full = tail_before(routed, shared, layers[0]).float()
        acc = shared
        for r in range(TP):
            w = {"w_norm": layers[0]["w_norm"], "w_rows": layers[0]["w_up"][r * ROWS:(r + 1) * ROWS]}
            acc = tail_after(routed, acc, w, torch.tensor(r * ROWS, device="cuda"))
        err = (acc.float() - full).abs().max().item() / full.abs().max().item()
        if err > 2e-2:
            raise SystemExit(f"after != before: relative error {err:.3e}")
        return err

    err = check()

    bandwidth = copy_bandwidth(1 << 30, 20)
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_bandwidth": bandwidth,
               "check_rel_error": err, "layers": args.layers, "rows": []}
    batches = [int(b) for b in args.batches.split(",")]
    inputs = {b: (torch.randn(b, LATENT, generator=gen, device="cuda", dtype=torch.bfloat16),
                  torch.randn(b, HIDDEN, generator=gen, device="cuda", dtype=torch.bfloat16)) for b in batches}

    def time_tails(b: int) -> tuple[float, float]:
        routed, shared = inputs[b]
        before = graph_time([lambda l=l: tail_before(routed, shared, l) for l in layers], args.repeats)
        after = graph_time([lambda l=l: tail_after(routed, shared, l, start) for l in layers], args.repeats)
        return before, after

    reference = {b: time_tails(b) for b in batches}  # the k3 ops' torch references
    register_cuda_kernels()  # from here on the k3 ops run the runtime's row kernels
    results["check_rel_error_row_kernels"] = check()
    for b in batches:
        routed, shared = inputs[b]
        y = torch.ops.k3.rms_norm(routed, layers[0]["w_norm"], EPS)
        before, after = time_tails(b)
        results["rows"].append({
            "batch": b, "before": before, "after": after,
            "before_ref": reference[b][0], "after_ref": reference[b][1],
            "gemv_full": graph_time([lambda l=l: F.linear(y, l["w_up"]) for l in layers], args.repeats),
            "gemv_rows": graph_time([lambda l=l: F.linear(y, l["w_rows"]) for l in layers], args.repeats),
            "fused_rows": graph_time([lambda l=l: torch.ops.k3.add_rank_block_linear(shared, y, l["w_rows"], start)
                                      for l in layers], args.repeats),
            "floor_before": tail_bytes(b, HIDDEN) / bandwidth, "floor_after": tail_bytes(b, ROWS) / bandwidth,
        })

    us = lambda s: f"{s * 1e6:.1f}"  # noqa: E731
    print(f"{results['device']}, torch {results['torch']}, copy bandwidth {bandwidth / 1e12:.2f} TB/s, "
          f"{args.layers} layers per graph, check rel. error {err:.1e}\n")
    print("| batch | before us | after us | speedup | before, torch ref ops us | after, torch ref ops us "
          "| speedup | floor before us | floor after us | after / floor | cuBLAS GEMV 7168 rows us | 896 rows us "
          "| 896 rows + add us |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results["rows"]:
        print(f"| {r['batch']} | {us(r['before'])} | {us(r['after'])} | {r['before'] / r['after']:.2f}x "
              f"| {us(r['before_ref'])} | {us(r['after_ref'])} | {r['before_ref'] / r['after_ref']:.2f}x "
              f"| {us(r['floor_before'])} | {us(r['floor_after'])} | {r['after'] / r['floor_after']:.1f}x "
              f"| {us(r['gemv_full'])} | {us(r['gemv_rows'])} | {us(r['fused_rows'])} |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "moe_tail.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
