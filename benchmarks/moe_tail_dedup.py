"""One rank's latent-MoE tail at K3's TP8 shapes, before and after the dedup pass.

    python benchmarks/moe_tail_dedup.py --out /tmp/moe_tail [--sweep]

The tail as the compiled graphs run it (the k3 ops and aten calls of the decode program):

    before:  y = k3.rms_norm(routed, w_norm)                       [B, 3584]
             out = aten.linear(y, W_up [7168, 3584]) + shared       [B, 7168]  (shared: all-reduced)
    after:   y = k3.rms_norm(routed, w_norm)
             acc = k3.add_rank_block_linear(shared_partial, y, W_up[rows of rank 3] [896, 3584], start)
             (the all-reduce that follows exists in both graphs and is not timed)

Each is timed twice: with the k3 ops' torch references (RMSNorm and add_rank_block are
several small kernels each; add_rank_block_linear is cuBLAS' GEMV then add_rank_block)
and with the runtime's row kernels registered for them (``runtime/kernels/rows.py``: one
launch each; the rows GEMV and the add are one launch of the split-K kernel up to
``rows.SPLITK_MAX_T`` rows, the vendor GEMM + the add beyond), as the runtime runs on a GPU.
Every variant runs under a CUDA graph that holds the tails of ``--layers`` distinct layers
back to back (distinct weights, more bytes than the 50 MB L2 of an H200), so each call
reads its weights from HBM as in a real decode step; time per layer = median graph time /
layers. Peers in the same run: a bare cuBLAS GEMV of the full and of the 896-row weight,
the rows op alone (``add_rank_block_linear`` as registered) and the old rows path (vendor
GEMV + the one-launch add, ``rows.add_rank_block_linear_vendor``). The floor is the bytes
each variant must move (weights + activations) over the copy bandwidth measured in the
same run. Correctness is checked first: after == before (bf16, rows added before the
all-reduce of a single rank = the same sum), and at every batch the rows op (registered
and vendor) against the fp32 torch reference.

``--sweep``: then, at every batch, the split-K kernel under each configuration of a grid
(FMA and tl.dot paths x rows per program x K splits x warps, ``--sweep-block-k`` K columns
per load), each checked against the fp32 reference before it is timed, against the vendor
GEMV + add in the same run; prints us per config (sorted), the best per batch and the
whole tail ("after") with the best config, so one run tells which config to make the
default (``rows.SPLITK_CONFIG_T1`` / ``rows.SPLITK_CONFIG``) and where the vendor GEMM
should take over (``rows.SPLITK_MAX_T``).

Output: markdown tables on stdout and ``moe_tail.json`` (and ``moe_tail_sweep.json``) in ``--out``.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from gpu_timing import (  # benchmarks/ is the script's directory
    copy_bandwidth,
    graph_time,
)
from k3compile.runtime.kernels import register_gpu_kernels, rows

import k3compile.ops  # noqa: F401  (registers torch.ops.k3)

HIDDEN, LATENT, TP, RANK = 7168, 3584, 8, 3
ROWS = HIDDEN // TP
EPS = 1e-5
DEVICE = "cuda"
ROWS_TOL = 1e-2  # max abs error of the rows op / max |reference|, bf16 output

SWEEP_BLOCK_N = (16, 32, 64)
SWEEP_SPLIT_K = (4, 7, 14, 28)  # 3584 / 128 = 28 K tiles: 7, 4, 2, 1 tiles per split
SWEEP_WARPS = (2, 4, 8)
# FMA configs with more fp32 values of the [block_n, block_k] tile per thread are skipped: with
# the K tiles of a split unrolled, 128 already spilled to the stack for sm_90 (ptxas).
FMA_ACC_PER_THREAD = 64


def make_layers(n: int, gen: torch.Generator) -> list[dict[str, torch.Tensor]]:
    bf16 = {"device": DEVICE, "dtype": torch.bfloat16}
    return [
        {"w_norm": torch.rand(LATENT, generator=gen, **bf16) + 0.5,
         "w_up": torch.randn(HIDDEN, LATENT, generator=gen, **bf16) * LATENT**-0.5}
        for _ in range(n)
    ]


def tail_before(routed, shared, layer):
    y = torch.ops.k3.rms_norm(routed, layer["w_norm"], EPS)
    return F.linear(y, layer["w_up"]) + shared


def tail_after(routed, partial, layer, start, rows_op=None):
    """``rows_op`` (acc, x, weight, start) in place of k3.add_rank_block_linear (the sweep)."""
    y = torch.ops.k3.rms_norm(routed, layer["w_norm"], EPS)
    return (rows_op or torch.ops.k3.add_rank_block_linear)(partial, y, layer["w_rows"], start)


def tail_bytes(batch: int, rows_: int) -> int:
    """Weights read + activations read and written (bf16) by one tail."""
    weights = rows_ * LATENT * 2 + LATENT * 2
    acts = batch * LATENT * 2 * 2 + batch * HIDDEN * 2 * 2  # routed in, y out+in; shared in, out
    return weights + acts


def rows_error(rows_op, shared: torch.Tensor, y: torch.Tensor, layer, start: torch.Tensor) -> float:
    """Relative error of ``rows_op(shared, y, W_rows, start)`` against the fp32 torch reference
    (inf when it modified shared or changed columns outside the rank's block)."""
    before = shared.clone()
    got = rows_op(shared, y, layer["w_rows"], start)
    block = slice(RANK * ROWS, (RANK + 1) * ROWS)
    want = shared.to(torch.float32, copy=True)
    want[:, block] += y.float() @ layer["w_rows"].float().T
    outside = torch.ones(HIDDEN, dtype=torch.bool, device=shared.device)
    outside[block] = False
    if not torch.equal(shared, before) or not torch.equal(got[:, outside], shared[:, outside]):
        return float("inf")
    return ((got.float() - want).abs().max() / want.abs().max()).item()


def sweep_configs(batch: int, block_ks: list[int]) -> list[rows.SplitKConfig]:
    """The sweep grid at one batch, one config per distinct launch (FMA only up to SPLITK_MAX_T
    rows and without a weight tile that would spill)."""
    configs, seen = [], set()
    for dot, bn, sk, nw, bk in itertools.product((False, True), SWEEP_BLOCK_N, SWEEP_SPLIT_K, SWEEP_WARPS, block_ks):
        if not dot and (batch > rows.SPLITK_MAX_T or bn * bk > FMA_ACC_PER_THREAD * 32 * nw):
            continue
        cfg = rows.SplitKConfig(block_n=bn, split_k=sk, num_warps=nw, block_k=bk, dot=dot)
        plan = rows.splitk_plan(batch, HIDDEN, ROWS, LATENT, cfg)
        key = (plan.grid, plan.num_warps, tuple(sorted(plan.constexprs.items())))
        if key not in seen:
            seen.add(key)
            configs.append(cfg)
    return configs


def us(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e6:.1f}"


def run_sweep(args, layers, inputs, start, table_rows) -> dict:
    """Time every split-K config at every batch against the vendor GEMV + add; see the module doc."""
    block_ks = [int(k) for k in args.sweep_block_k.split(",")]
    before = {r["batch"]: r["before"] for r in table_rows}
    result = {"grid": {"block_n": SWEEP_BLOCK_N, "split_k": SWEEP_SPLIT_K, "num_warps": SWEEP_WARPS,
                       "block_k": block_ks}, "batches": []}
    summary = []
    for b, (routed, shared) in inputs.items():
        y = torch.ops.k3.rms_norm(routed, layers[0]["w_norm"], EPS)

        def time_rows(rows_op, y=y, shared=shared):
            return graph_time([functools.partial(rows_op, shared, y, l["w_rows"], start) for l in layers], args.repeats)

        vendor = time_rows(rows.add_rank_block_linear_vendor)
        registered = time_rows(torch.ops.k3.add_rank_block_linear)
        entries = []
        configs = sweep_configs(b, block_ks)
        print(f"batch {b}: {len(configs)} configs", file=sys.stderr, flush=True)
        for cfg in configs:
            op = functools.partial(rows.add_rank_block_linear_splitk, config=cfg)
            plan = rows.splitk_plan(b, HIDDEN, ROWS, LATENT, cfg)
            entry = {"config": str(cfg), "dot": cfg.dot, "block_n": cfg.block_n, "split_k": cfg.split_k,
                     "splits": plan.splits, "num_warps": cfg.num_warps, "block_k": cfg.block_k,
                     "programs": plan.programs, "rel_error": None, "time": None, "error": None}
            try:
                entry["rel_error"] = rows_error(op, shared, y, layers[0], start)
                if entry["rel_error"] > ROWS_TOL:
                    entry["error"] = f"wrong result: relative error {entry['rel_error']:.2e}"
                else:
                    entry["time"] = time_rows(op)
            except Exception as e:  # noqa: BLE001  (a config that does not compile or launch: reported, not fatal)
                entry["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            entries.append(entry)
        timed = sorted((e for e in entries if e["time"] is not None), key=lambda e: e["time"])
        failed = [e for e in entries if e["error"] is not None]
        best = timed[0] if timed else None
        after_best = None
        if best is not None:
            cfg = rows.SplitKConfig(best["block_n"], best["split_k"], best["num_warps"], best["block_k"], best["dot"])
            op = functools.partial(rows.add_rank_block_linear_splitk, config=cfg)
            after_best = graph_time([functools.partial(tail_after, routed, shared, l, start, op) for l in layers],
                                    args.repeats)
        result["batches"].append({"batch": b, "vendor": vendor, "registered": registered, "configs": entries,
                                  "best": best, "after_best": after_best, "before": before.get(b)})

        print(f"\n### split-K sweep, batch {b}: rows op ({ROWS} x {LATENT} GEMV + add) us per layer; vendor GEMV + add "
              f"{us(vendor)} us, registered op {us(registered)} us\n")
        print("| path | block_n | split_k (effective) | block_k | warps | programs | us | vendor / this |")
        print("|---|---|---|---|---|---|---|---|")
        for e in timed:
            print(f"| {'dot' if e['dot'] else 'fma'} | {e['block_n']} | {e['split_k']} ({e['splits']}) "
                  f"| {e['block_k']} | {e['num_warps']} | {e['programs']} | {us(e['time'])} "
                  f"| {vendor / e['time']:.2f}x |")
        for e in failed:
            print(f"| {'dot' if e['dot'] else 'fma'} | {e['block_n']} | {e['split_k']} ({e['splits']}) "
                  f"| {e['block_k']} | {e['num_warps']} | {e['programs']} | FAILED: {e['error']} | |")
        summary.append((b, vendor, registered, best, after_best, before.get(b), len(failed)))

    print("\n### split-K sweep summary (us per layer)\n")
    print("| batch | vendor GEMV + add | registered op | best split-K config | best | vendor / best "
          "| tail after, best config | tail before | before / after | failed configs |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for b, vendor, registered, best, after_best, before_b, n_failed in summary:
        if best is None:
            print(f"| {b} | {us(vendor)} | {us(registered)} | none ran | - | - | - | {us(before_b)} | - | {n_failed} |")
            continue
        ratio = f"{before_b / after_best:.2f}x" if before_b and after_best else "-"
        print(f"| {b} | {us(vendor)} | {us(registered)} | {best['config']} | {us(best['time'])} "
              f"| {vendor / best['time']:.2f}x | {us(after_best)} | {us(before_b)} | {ratio} | {n_failed} |")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--layers", type=int, default=24, help="distinct layers per graph (bytes beyond L2)")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--sweep", action="store_true", help="also time the split-K kernel over a config grid")
    ap.add_argument("--sweep-block-k", default="128", help="K columns per load in the sweep, e.g. 64,128,256")
    args = ap.parse_args()
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    layers = make_layers(args.layers, gen)
    for layer in layers:
        layer["w_rows"] = layer["w_up"][RANK * ROWS:(RANK + 1) * ROWS].contiguous()
    start = torch.tensor(RANK * ROWS, device=DEVICE)

    # Correctness: one rank's view. Its partial plus its rows at their place, summed with
    # the other ranks' partials plus their rows, equals the full tail; on one rank,
    # with partial = shared and the other ranks' rows added too, the result must match.
    routed = torch.randn(8, LATENT, generator=gen, device=DEVICE, dtype=torch.bfloat16)
    shared = torch.randn(8, HIDDEN, generator=gen, device=DEVICE, dtype=torch.bfloat16)
    def check() -> float:
        full = tail_before(routed, shared, layers[0]).float()
        acc = shared
        for r in range(TP):
            w = {"w_norm": layers[0]["w_norm"], "w_rows": layers[0]["w_up"][r * ROWS:(r + 1) * ROWS]}
            acc = tail_after(routed, acc, w, torch.tensor(r * ROWS, device=DEVICE))
        err = (acc.float() - full).abs().max().item() / full.abs().max().item()
        if err > 2e-2:
            raise SystemExit(f"after != before: relative error {err:.3e}")
        return err

    err = check()

    bandwidth = copy_bandwidth(1 << 30, 20)
    device_name = torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE
    results = {"device": device_name, "torch": torch.__version__, "triton": triton.__version__,
               "copy_bandwidth": bandwidth, "check_rel_error": err, "layers": args.layers, "rows": [],
               "splitk_max_t": rows.SPLITK_MAX_T, "splitk_config_t1": str(rows.SPLITK_CONFIG_T1),
               "splitk_config": str(rows.SPLITK_CONFIG)}
    batches = [int(b) for b in args.batches.split(",")]
    inputs = {b: (torch.randn(b, LATENT, generator=gen, device=DEVICE, dtype=torch.bfloat16),
                  torch.randn(b, HIDDEN, generator=gen, device=DEVICE, dtype=torch.bfloat16)) for b in batches}

    def time_tails(b: int) -> tuple[float, float]:
        routed, shared = inputs[b]
        before = graph_time([functools.partial(tail_before, routed, shared, l) for l in layers], args.repeats)
        after = graph_time([functools.partial(tail_after, routed, shared, l, start) for l in layers], args.repeats)
        return before, after

    reference = {b: time_tails(b) for b in batches}  # the k3 ops' torch references
    register_gpu_kernels()  # from here on the k3 ops run the runtime's kernels (the row kernels here)
    results["check_rel_error_row_kernels"] = check()
    for b in batches:
        routed, shared = inputs[b]
        y = torch.ops.k3.rms_norm(routed, layers[0]["w_norm"], EPS)
        for name, op in (("registered", torch.ops.k3.add_rank_block_linear),
                         ("vendor", rows.add_rank_block_linear_vendor)):
            rel = rows_error(op, shared, y, layers[0], start)
            if rel > ROWS_TOL:
                raise SystemExit(f"rows op ({name}) at batch {b} != fp32 reference: relative error {rel:.3e}")
            results[f"check_rows_{name}_b{b}"] = rel

        def time_rows(fn, *fixed):
            return graph_time([functools.partial(fn, *fixed, l) for l in layers], args.repeats)

        before, after = time_tails(b)
        results["rows"].append({
            "batch": b, "before": before, "after": after,
            "before_ref": reference[b][0], "after_ref": reference[b][1],
            "gemv_full": time_rows(lambda y, l: F.linear(y, l["w_up"]), y),
            "gemv_rows": time_rows(lambda y, l: F.linear(y, l["w_rows"]), y),
            "fused_rows": time_rows(lambda s, y, l: torch.ops.k3.add_rank_block_linear(s, y, l["w_rows"], start),
                                    shared, y),
            "vendor_rows": time_rows(lambda s, y, l: rows.add_rank_block_linear_vendor(s, y, l["w_rows"], start),
                                     shared, y),
            "floor_before": tail_bytes(b, HIDDEN) / bandwidth, "floor_after": tail_bytes(b, ROWS) / bandwidth,
        })

    print(f"{results['device']}, torch {results['torch']}, triton {results['triton']}, copy bandwidth "
          f"{bandwidth / 1e12:.2f} TB/s, {args.layers} layers per graph, check rel. error {err:.1e}; rows op: "
          f"split-K up to batch {rows.SPLITK_MAX_T} (batch 1: {rows.SPLITK_CONFIG_T1}; 2+: {rows.SPLITK_CONFIG}), "
          "vendor GEMM + add beyond\n")
    print("| batch | before us | after us | speedup | before, torch ref ops us | after, torch ref ops us "
          "| speedup | floor before us | floor after us | after / floor | cuBLAS GEMV 7168 rows us | 896 rows us "
          "| 896 rows + add (registered op) us | 896 rows vendor GEMV + add us |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results["rows"]:
        print(f"| {r['batch']} | {us(r['before'])} | {us(r['after'])} | {r['before'] / r['after']:.2f}x "
              f"| {us(r['before_ref'])} | {us(r['after_ref'])} | {r['before_ref'] / r['after_ref']:.2f}x "
              f"| {us(r['floor_before'])} | {us(r['floor_after'])} | {r['after'] / r['floor_after']:.1f}x "
              f"| {us(r['gemv_full'])} | {us(r['gemv_rows'])} | {us(r['fused_rows'])} | {us(r['vendor_rows'])} |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "moe_tail.json").write_text(json.dumps(results, indent=2))

    if args.sweep:
        sweep = run_sweep(args, layers, inputs, start, results["rows"])
        sweep.update(device=results["device"], torch=results["torch"], triton=results["triton"], layers=args.layers)
        (args.out / "moe_tail_sweep.json").write_text(json.dumps(sweep, indent=2))


if __name__ == "__main__":
    main()
