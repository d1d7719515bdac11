"""MLA decode with an FP8 latent cache against a bf16 one, at K3's per-rank shapes (issue #20).

    python benchmarks/mla_decode_fp8.py --out /tmp/mla_fp8            # the table
    python benchmarks/mla_decode_fp8.py --out /tmp/mla_fp8 --sweep    # + FP8 launch variants
    python benchmarks/mla_decode_fp8.py --out /tmp/mla_fp8 --l2-resident --batches 4,16 --contexts 1024,4096

What it measures, in one run on one GPU:

1. Correctness first (a mismatch aborts): the FP8 cache-write kernel against the op's
   torch reference, byte for byte; the split-KV kernel (every launch this run times), the
   generic decode kernel and the prefill kernel over an FP8 cache (ragged contexts 0 to
   4097, permuted 64-token blocks) against the op's reference on the dequantised values.
2. Copy bandwidth (benchmarks/gpu_timing.py): the HBM bandwidth kernels can reach.
3. For heads (K3 at TP8: 12, padded to 16; DCP2 gathers 24, padded to 32) x batch x
   context, every sequence full, the caches in randomly permuted blocks: the split-KV
   kernel over a bf16 cache (576 x 2 = 1152 bytes per token, its default launch) and over
   an FP8 cache (592 bytes per token: 576 codes, two fp32 scales, 8 bytes of padding; its
   default launch and, with ``--sweep``, the variants of ``--fp8-tiles``), each with q
   zero-padded into a static buffer as the pad-heads pass emits it, in CUDA graphs over
   enough cache copies that every call reads its KV from HBM (benchmarks/mla_decode.py).
   Per row: us per call, the cache bytes read over that time as a fraction of the copy
   bandwidth (the floor: bytes / copy bandwidth), and bf16 time / FP8 time.
   ``--l2-resident`` keeps one copy, so that a cache smaller than L2 is read from there:
   what the kernels cost when bytes are not the limit (their compute ceiling).

Output: a markdown table on stdout and ``mla_decode_fp8.json`` in ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch
from gpu_timing import copy_bandwidth, graph_time
from mla_decode import TARGET, LATENT, SCALE, WIDTH, RaggedCase, cache_copies, close, padded, padded_split_kv

from k3compile.mla_cache_fp8 import fp8_row_width, quantize_rows
from k3compile.ops.mla import mla_cache_write_reference, mla_decode_reference
from k3compile.runtime.kernels import mla_attention as ak
from k3compile.runtime.kernels import mla_split_kv as sk
from k3compile.runtime.kernels.mla_cache_write import mla_cache_write

FP8 = torch.float8_e4m3fn
ROW_BYTES = {"bf16": WIDTH * 2, "fp8": fp8_row_width(WIDTH)}
#: FP8 launch variants, "rows x warps x stages", "t" for KV tiles by tensor descriptors
FP8_TILES = "32x4x3t,32x8x3t,32x8x2t,16x8x3t,16x8x2t,16x4x3t,16x4x3,32x8x3"


def to_fp8(cache: torch.Tensor) -> torch.Tensor:
    nb, bs, w = cache.shape
    return quantize_rows(cache.view(-1, w), LATENT, FP8).view(nb, bs, -1)


def fp8_configs(heads: int, tiles: str) -> list[sk.SplitKVConfig]:
    default = sk.split_kv_config(TARGET, heads, torch.bfloat16, FP8)
    configs = [default]
    for item in filter(None, tiles.split(",")):
        tma = item.endswith("t")
        block_n, warps, stages = map(int, item.rstrip("t").split("x"))
        c = dataclasses.replace(default, block_n=block_n, num_warps=max(warps, default.num_warps),
                                num_stages=stages, tma=tma)
        configs += [c] if c not in configs else []
    return configs


def describe(c: sk.SplitKVConfig) -> str:
    return f"{c.block_n}x{c.num_warps}x{c.num_stages}{'t' if c.tma else ''} (h{c.block_h})"


def check_correctness(case: RaggedCase, configs: dict[int, list[sk.SplitKVConfig]], gen: torch.Generator) -> dict:
    """Max errors vs the reference over the FP8 cache; SystemExit on a mismatch."""
    report: dict[str, dict] = {}
    kv = torch.randn(37, WIDTH, generator=gen, device="cuda").bfloat16()
    slots = torch.randperm(case.cache.numel() // WIDTH, generator=gen, device="cuda")[:37]
    want = torch.zeros(*case.cache.shape[:2], fp8_row_width(WIDTH), dtype=FP8, device="cuda")
    got = want.clone()
    mla_cache_write_reference(want, kv, slots, LATENT)
    mla_cache_write(got, kv, slots, LATENT)
    report["cache_write"] = {"ok": torch.equal(got.view(torch.uint8), want.view(torch.uint8))}

    cache8 = to_fp8(case.cache)
    for heads, cfgs in configs.items():
        q = torch.randn(len(case.lens), heads, WIDTH, generator=gen, device="cuda").bfloat16()
        ref_o, ref_lse = mla_decode_reference(q.float(), cache8, case.table, case.seq_lens, SCALE, LATENT)
        q_pad = torch.zeros(len(case.lens), padded(heads), WIDTH, dtype=q.dtype, device="cuda") \
            if padded(heads) != heads else None
        runs = {f"split_kv {describe(c)}": (lambda c=c: padded_split_kv(q, q_pad, cache8, case.table, case.seq_lens,
                                                                        config=c)) for c in cfgs}
        runs["generic"] = lambda: ak.mla_decode_generic(q, cache8, case.table, case.seq_lens, SCALE, LATENT)
        for name, run in runs.items():
            o, lse = run()
            lse_err = (lse - ref_lse).nan_to_num(posinf=1e9, neginf=-1e9).abs().max().item()
            report[f"{heads} heads, {name}"] = {
                "o_max_err": (o.float() - ref_o).abs().max().item(), "lse_max_err": lse_err,
                "ok": close(o, ref_o) and lse_err < 1e-3 and torch.equal(lse.isinf(), ref_lse.isinf())}
    new = [0, 1, 40, 100, 3, 9]
    cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    qp = torch.randn(sum(new), 12, WIDTH, generator=gen, device="cuda").bfloat16()
    o, lse = ak.mla_prefill_absorbed(qp, cache8, cu, case.table, case.seq_lens, SCALE, LATENT)
    seq = torch.repeat_interleave(torch.arange(len(new)), torch.tensor(new)).cuda()
    pos = torch.cat([torch.arange(n - k, n) for n, k in zip(case.lens, new, strict=True)]).cuda()
    ref_o, ref_lse = mla_decode_reference(qp.float(), cache8, case.table[seq], (pos + 1).int(), SCALE, LATENT)
    report["prefill"] = {"o_max_err": (o.float() - ref_o).abs().max().item(),
                         "lse_max_err": (lse - ref_lse).abs().max().item()}
    report["prefill"]["ok"] = close(o, ref_o) and report["prefill"]["lse_max_err"] < 1e-3
    bad = [name for name, r in report.items() if not r["ok"]]
    if bad:
        print(json.dumps(report, indent=1))
        raise SystemExit(f"FP8 kernels disagree with the reference: {bad}")
    return report


def bench_shape(heads: int, batch: int, context: int, configs: list[sk.SplitKVConfig], args,
                gen: torch.Generator, l2_bytes: int, sms: int, bandwidth: float) -> list[dict]:
    blocks_per_seq = -(-context // args.block_size)
    num_blocks = batch * blocks_per_seq
    table = torch.randperm(num_blocks, generator=gen, device="cuda").view(batch, blocks_per_seq).int()
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, heads, WIDTH, generator=gen, device="cuda").bfloat16()
    q_pad = torch.zeros(batch, padded(heads), WIDTH, dtype=q.dtype, device="cuda") if padded(heads) != heads else None
    rows = []
    for kind, launches in (("bf16", [sk.split_kv_config(TARGET, padded(heads))]), ("fp8", configs)):
        kv_bytes = batch * context * ROW_BYTES[kind]
        copies = 1 if args.l2_resident else cache_copies(kv_bytes, l2_bytes)
        caches = []
        for _ in range(copies):
            c = torch.randn(num_blocks, args.block_size, WIDTH, generator=gen, device="cuda", dtype=torch.bfloat16)
            caches.append(to_fp8(c) if kind == "fp8" else c)
            del c
        for i, config in enumerate(launches):
            splits = sk.choose_num_splits(batch, padded(heads), blocks_per_seq * args.block_size, sms, config)
            seconds = graph_time([lambda c=c, config=config, splits=splits: padded_split_kv(
                q, q_pad, c, table, seq_lens, num_splits=splits, config=config) for c in caches], args.repeats)
            rows.append({"heads": heads, "batch": batch, "context": context, "cache": kind, "default": i == 0,
                         "launch": describe(config), "splits": splits, "seconds": seconds, "kv_bytes": kv_bytes,
                         "of_copy_bw": kv_bytes / seconds / bandwidth, "floor_s": kv_bytes / bandwidth})
        del caches
        torch.cuda.empty_cache()
    bf16 = next(r["seconds"] for r in rows if r["cache"] == "bf16")
    for r in rows:
        r["bf16_over_this"] = bf16 / r["seconds"]
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| heads | batch | context | cache | launch | splits | us | floor us | of copy BW | bf16 / this |",
             "|--:|--:|--:|---|---|--:|--:|--:|--:|--:|"]
    for r in rows:
        mark = "" if r["default"] else " (variant)"
        lines.append(f"| {r['heads']} | {r['batch']} | {r['context']} | {r['cache']} | {r['launch']}{mark} | "
                     f"{r['splits']} | {r['seconds'] * 1e6:.1f} | {r['floor_s'] * 1e6:.1f} | {r['of_copy_bw']:.0%} | "
                     f"{r['bf16_over_this']:.2f}x |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--heads", default="12,24", help="MLA heads per rank (K3 at TP8: 12; DCP2 gathers 24)")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--contexts", default="32768,131072")
    parser.add_argument("--block-size", type=int, default=64, help="tokens per cache block (h200's default)")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--copy-mib", type=int, default=2048)
    parser.add_argument("--sweep", action="store_true", help="also time the FP8 launch variants of --fp8-tiles")
    parser.add_argument("--fp8-tiles", default=FP8_TILES)
    parser.add_argument("--l2-resident", action="store_true",
                        help="one cache copy, so that a cache smaller than L2 stays there: the kernels' compute ceiling")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    sms, l2_bytes = props.multi_processor_count, getattr(props, "L2_cache_size", 50 * 2**20)
    heads = [int(h) for h in args.heads.split(",")]
    configs = {h: fp8_configs(padded(h), args.fp8_tiles if args.sweep else "") for h in heads}

    correctness = check_correctness(RaggedCase(args.block_size, gen), configs, gen)
    bandwidth = copy_bandwidth(args.copy_mib * 2**20, args.repeats)
    rows = [r for h in heads for b in map(int, args.batches.split(",")) for c in map(int, args.contexts.split(","))
            for r in bench_shape(h, b, c, configs[h], args, gen, l2_bytes, sms, bandwidth)]
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bandwidth / 1e12:.2f} TB/s; correctness ok "
          f"({len(correctness)} checks)\n")
    print(table(rows))
    (args.out / "mla_decode_fp8.json").write_text(json.dumps(
        {"device": torch.cuda.get_device_name(), "copy_bandwidth": bandwidth, "torch": torch.__version__,
         "correctness": correctness, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
