"""MLA decode kernels at K3's per-rank shapes (TP8: 12 heads; DCP: 32, 96): generic vs split-KV.

    python benchmarks/mla_decode.py --out /tmp/mla_decode            # the table
    python benchmarks/mla_decode.py --out /tmp/mla_decode --sweep    # + the split-KV launch sweep

What it measures, in one run on one GPU (needs torch >= 2.11 and triton >= 3.6):

1. Correctness first, at a moderate shape (ragged contexts including 0 and 1, permuted
   blocks): both decode kernels (the split-KV one padded from 12 heads to 16 and at the
   extra head counts, 32 by default) and the prefill kernel against the op's torch
   reference (``mla_decode_reference``, not ``torch.ops.k3.mla_decode``, which runs these
   kernels on a GPU once they are registered) on fp32 copies of the same bf16 inputs. A
   decode mismatch aborts the run.
2. Copy bandwidth: a large device-to-device copy, (bytes read + written) / time: the
   achievable HBM bandwidth of this GPU, measured in the same run.
3. For each heads x batch x context (every sequence full, bf16 latent cache 576 wide,
   paged in randomly permuted blocks): (a) the generic kernel at the real head count;
   (b) the split-KV kernel at its default launch, with q zero-padded to a multiple of
   16 heads where needed (pad into a zeroed static buffer, slice the real heads back:
   what the pad-heads pass emits); (c) the eager torch reference where it fits in
   memory. Each is captured in a CUDA graph and replayed; the graph holds enough calls
   on distinct copies of the cache that they do not fit in L2, so every call reads its
   KV from HBM. Time per call = median over repeats of (graph time / calls). Achieved
   bandwidth = KV bytes read (tokens x 576 x 2) / time, and its fraction of the
   measured copy bandwidth.
4. ``--sweep``: the split-KV kernel alone (no padding copy) at --sweep-heads x
   --sweep-batches x --sweep-contexts, over launch choices: KV tile (16/32/64 rows) x
   warps x pipeline stages, other head tiles where the head count allows, and split
   counts around the default (the cost model's choice for 1, 2, 4 resident programs per
   SM, half and twice the default, and batch x splits ~ 2x / 4x the SM count). Every
   configuration is checked against the reference (ragged contexts) before it is timed;
   one that does not fit the GPU is listed as such. Full table in
   ``mla_decode_sweep.md``, the best launch per shape printed last.

Output: markdown tables on stdout and ``mla_decode.json`` in ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from collections.abc import Callable
from pathlib import Path

# gpu_timing: benchmarks/ is the script's directory; importing k3compile registers torch.ops.k3
import torch
import triton
from gpu_timing import copy_bandwidth, graph_time
from k3compile.ops.mla import mla_decode_reference
from k3compile.runtime.kernels import mla_attention as ak
from k3compile.runtime.kernels import mla_common as mc
from k3compile.runtime.kernels import mla_split_kv as sk
from k3compile.runtime.kernels.targets import device_target

LATENT, ROPE = 512, 64
WIDTH = LATENT + ROPE
SCALE = 192 ** -0.5  # K3: (qk_nope 128 + rope 64) ** -0.5
TARGET = device_target(torch.device("cuda"))  # the launch tables of this GPU


def padded(heads: int) -> int:
    """The head count the split-KV kernel runs: the next multiple of its head tile (16)."""
    return -(-heads // mc.HEAD_TILE) * mc.HEAD_TILE


def paged_cache(batch: int, context: int, block_size: int, gen: torch.Generator, copies: int = 1):
    """``copies`` caches of ``batch`` full sequences of ``context`` tokens, blocks handed
    out in a random order (as a long-running server's allocator would), one block table."""
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq
    table = torch.randperm(num_blocks, generator=gen, device="cuda").view(batch, blocks_per_seq).int()
    caches = [torch.randn(num_blocks, block_size, WIDTH, generator=gen, device="cuda", dtype=torch.bfloat16)
              for _ in range(copies)]
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    return caches, table, seq_lens


def padded_split_kv(q: torch.Tensor, q_pad: torch.Tensor | None, cache, table, seq_lens, **kw):
    """What the pad-heads pass emits: q into a zeroed [B, 16k, W] buffer, the fast kernel,
    the real heads' outputs sliced back (views: no copy). No buffer: no padding needed."""
    if q_pad is None:
        return sk.mla_decode_split_kv(q, cache, table, seq_lens, SCALE, LATENT, **kw)
    heads = q.shape[1]
    q_pad[:, :heads].copy_(q)
    o, lse = sk.mla_decode_split_kv(q_pad, cache, table, seq_lens, SCALE, LATENT, **kw)
    return o[:, :heads], lse[:, :heads]


def close(o: torch.Tensor, ref: torch.Tensor) -> bool:
    """bf16 output: rounding of o (2^-9 relative) and of the probabilities before the
    value product (2^-9 relative each)."""
    return bool(torch.allclose(o.float(), ref, atol=2e-2, rtol=2e-2))


class RaggedCase:
    """The correctness shape: contexts 0, 1, not multiples of the block size or of any KV
    tile, over 4K; blocks in a random order."""

    def __init__(self, block_size: int, gen: torch.Generator):
        self.lens = [0, 1, 777, 3000, 64 * 5, 4097]
        blocks = [-(-n // block_size) for n in self.lens]
        self.cache = torch.randn(sum(blocks) + 4, block_size, WIDTH, generator=gen, device="cuda").bfloat16()
        order = torch.randperm(self.cache.shape[0], generator=gen, device="cuda").int()
        self.table = torch.zeros(len(self.lens), max(blocks), dtype=torch.int32, device="cuda")
        taken = 0
        for i, k in enumerate(blocks):
            self.table[i, :k] = order[taken:taken + k]
            taken += k
        self.seq_lens = torch.tensor(self.lens, dtype=torch.int32, device="cuda")
        self.gen = gen
        self._q: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def q_and_reference(self, heads: int):
        if heads not in self._q:
            q = torch.randn(len(self.lens), heads, WIDTH, generator=self.gen, device="cuda").bfloat16()
            self._q[heads] = (q, *mla_decode_reference(q.float(), self.cache.float(), self.table, self.seq_lens,
                                                       SCALE, LATENT))
        return self._q[heads]

    def errors(self, heads: int, run: Callable[..., tuple[torch.Tensor, torch.Tensor]]) -> dict:
        """run(q, cache, table, seq_lens) vs the reference: max errors and ok."""
        q, ref_o, ref_lse = self.q_and_reference(heads)
        o, lse = run(q, self.cache, self.table, self.seq_lens)
        o_err = (o.float() - ref_o).abs().max().item()
        lse_err = (lse - ref_lse).nan_to_num(posinf=1e9, neginf=-1e9).abs().max().item()
        ok = close(o, ref_o) and lse_err < 1e-3 and torch.equal(lse.isinf(), ref_lse.isinf())
        return {"o_max_err": o_err, "lse_max_err": lse_err, "ok": ok}


def check_correctness(case: RaggedCase, heads: int, extra_heads: list[int], gen: torch.Generator) -> dict:
    """Max errors vs the fp32 reference; SystemExit if a decode kernel is wrong."""
    def split_kv(h: int, **kw):
        q_pad = torch.zeros(len(case.lens), padded(h), WIDTH, dtype=torch.bfloat16, device="cuda") \
            if padded(h) != h else None
        return lambda q, c, t, s: padded_split_kv(q, q_pad, c, t, s, **kw)

    report = {
        "generic": case.errors(heads, lambda q, c, t, s: ak.mla_decode_generic(q, c, t, s, SCALE, LATENT)),
        "split_kv_padded": case.errors(heads, split_kv(heads)),
        "split_kv_padded_4_splits": case.errors(heads, split_kv(heads, num_splits=4)),
    }
    for h in extra_heads:
        report[f"split_kv_{h}_heads"] = case.errors(h, split_kv(h))
        report[f"split_kv_{h}_heads_300_splits"] = case.errors(h, split_kv(h, num_splits=300))  # many empty
    bad = [name for name, r in report.items() if not r["ok"]]

    # prefill: each new token == decode over the context up to its own position (not fatal)
    lens, cache, table = case.lens, case.cache, case.table
    new = [0, 1, 40, 100, 3, 9]
    cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    qp = torch.randn(sum(new), heads, WIDTH, generator=gen, device="cuda").bfloat16()
    o, lse = ak.mla_prefill_absorbed(qp, cache, cu, table, case.seq_lens, SCALE, LATENT)
    seq = torch.repeat_interleave(torch.arange(len(new)), torch.tensor(new)).cuda()
    pos = torch.cat([torch.arange(n - k, n) for n, k in zip(lens, new, strict=True)]).cuda()
    ref_o, ref_lse = mla_decode_reference(qp.float(), cache.float(), table[seq], (pos + 1).int(), SCALE, LATENT)
    o_err, lse_err = (o.float() - ref_o).abs().max().item(), (lse - ref_lse).abs().max().item()
    report["prefill"] = {"o_max_err": o_err, "lse_max_err": lse_err, "ok": close(o, ref_o) and lse_err < 1e-3}
    if bad:
        print(json.dumps(report, indent=1))
        raise SystemExit(f"decode kernels disagree with the reference: {bad}")
    return report


def cache_copies(kv_bytes: int, l2_bytes: int) -> int:
    """Enough cache copies that one graph's calls do not fit in L2 (cold KV every call)."""
    return min(256, max(1, math.ceil(4 * l2_bytes / kv_bytes)))


def bench_shape(heads: int, batch: int, context: int, args, gen: torch.Generator, l2_bytes: int, sms: int) -> dict:
    kv_bytes = batch * context * WIDTH * 2
    copies = cache_copies(kv_bytes, l2_bytes)
    caches, table, seq_lens = paged_cache(batch, context, args.block_size, gen, copies)
    q = torch.randn(batch, heads, WIDTH, generator=gen, device="cuda").bfloat16()
    q_pad = torch.zeros(batch, padded(heads), WIDTH, dtype=q.dtype, device="cuda") if padded(heads) != heads else None
    row = {"heads": heads, "kernel_heads": padded(heads), "batch": batch, "context": context, "kv_bytes": kv_bytes,
           "cache_copies": copies}

    def per_copy(make: Callable[[torch.Tensor], Callable[[], object]]) -> list[Callable[[], object]]:
        return [make(c) for c in caches]

    row["generic_s"] = graph_time(per_copy(lambda c: lambda: ak.mla_decode_generic(
        q, c, table, seq_lens, SCALE, LATENT)), args.repeats)
    config = sk.split_kv_config(TARGET, padded(heads))
    if args.block_n:
        config = dataclasses.replace(config, block_n=args.block_n)
    splits = sk.choose_num_splits(batch, padded(heads), table.shape[1] * args.block_size, sms, config)
    row["split_kv_config"] = dataclasses.asdict(config)
    row["split_kv_splits"] = splits
    row["split_kv_s"] = graph_time(per_copy(lambda c: lambda: padded_split_kv(
        q, q_pad, c, table, seq_lens, num_splits=splits, config=config)), args.repeats)
    row["split_kv_sweep_s"] = {
        s: graph_time(per_copy(lambda c, s=s: lambda: padded_split_kv(
            q, q_pad, c, table, seq_lens, num_splits=s, config=config)), args.repeats)
        for s in args.splits if s != splits
    }
    # the reference materialises [B, context, 576] fp32 and [B, H, context] scores
    if batch * context <= args.reference_max_tokens:
        try:
            row["reference_s"] = graph_time([lambda: mla_decode_reference(
                q, caches[0], table, seq_lens, SCALE, LATENT)], max(3, args.repeats // 10))
        except Exception as e:  # noqa: BLE001  (a peer's failure, e.g. out of memory, must not lose the kernels' numbers)
            row["reference_error"] = repr(e)
    return row


# ---------------------------------------------------------------------------------------
# --sweep: the split-KV kernel's launch choices
# ---------------------------------------------------------------------------------------

#: launch variants tried at the default head tile, "rows x warps x stages", "t" for KV tiles
#: by tensor descriptors (TMA). 32 x 4 x 3 is the sm_90 pointer default (16 heads); 1
#: stage: no software pipeline (the AMD default); 16-row tiles: deeper pipelines in less
#: memory; 64-row tiles only by TMA (the pointer kernel's 64-row tiles are refused).
SWEEP_TILES = "16x4x3,16x4x5,32x4x1,32x4x3,32x4x4,32x8x3,16x4x3t,16x4x5t,32x4x2t,32x4x3t,32x4x4t,32x8x3t,64x4x2t,64x8x2t"


def parse_tiles(spec: str) -> list[tuple[int, int, int, bool]]:
    """"32x4x3,64x4x2t" -> [(32, 4, 3, False), (64, 4, 2, True)]."""
    out = []
    for item in filter(None, spec.split(",")):
        tma = item.endswith("t")
        block_n, warps, stages = map(int, item.rstrip("t").split("x"))
        out.append((block_n, warps, stages, tma))
    return out


def sweep_configs(heads: int, tiles: str = SWEEP_TILES) -> list[sk.SplitKVConfig]:
    """The default launch first, then the KV tile / warps / stages variants at its head
    tile, then the other head tiles (16 / 32 / 64 that fit the head count, each at its
    own default launch)."""
    default = sk.split_kv_config(TARGET, heads)
    configs = [default]
    for block_n, warps, stages, tma in parse_tiles(tiles):
        # a 64-head tile needs 8 warps for its [512, 64] fp32 accumulator
        c = dataclasses.replace(default, block_n=block_n, num_warps=max(warps, default.num_warps), num_stages=stages,
                                tma=tma)
        configs += [c] if c not in configs else []
    for block_h in (16, 32, 64):
        if block_h != default.block_h and block_h <= padded(heads):
            c = dataclasses.replace(sk.split_kv_config(TARGET, block_h), block_h=block_h)
            configs += [c] if c not in configs else []
    return configs


def sweep_splits(config: sk.SplitKVConfig, is_default: bool, batch: int, heads: int, context: int,
                 sms: int) -> list[int]:
    """Split counts to time for ``config``: the cost model's choice with 1, 2 (and for the
    default launch 4) resident programs per SM; for the default also half and twice its
    own choice and the 'batch x head tiles x splits ~ 2x / 4x SMs' rule."""
    tiles = -(-context // config.block_n)
    per_sm = (1, 2, 4) if is_default else (1, 2)
    model = [sk.choose_num_splits(batch, heads, context, sms, dataclasses.replace(config, programs_per_sm=p))
             for p in per_sm]
    choice = sk.choose_num_splits(batch, heads, context, sms, config)
    extra = []
    if is_default:
        programs = batch * -(-heads // config.block_h)
        extra = [choice // 2, choice * 2, -(-2 * sms // programs), -(-4 * sms // programs)]
    out = []
    for s in [choice, *model, *extra]:
        s = max(1, min(s, tiles, 4096))
        out += [s] if s not in out else []
    return out


def describe(config: sk.SplitKVConfig) -> str:
    return f"h{config.block_h} n{config.block_n} w{config.num_warps} s{config.num_stages}" + (" tma" if config.tma else "")


def run_sweep(args, case: RaggedCase, gen: torch.Generator, l2_bytes: int, sms: int, bandwidth: float) -> list[dict]:
    rows = []
    checked: dict[tuple[int, sk.SplitKVConfig], str] = {}  # (heads, config) -> "ok" / why not
    for heads in map(int, args.sweep_heads.split(",")):
        for batch in map(int, args.sweep_batches.split(",")):
            for context in map(int, args.sweep_contexts.split(",")):
                kv_bytes = batch * context * WIDTH * 2
                caches, table, seq_lens = paged_cache(batch, context, args.block_size, gen,
                                                      cache_copies(kv_bytes, l2_bytes))
                q = torch.randn(batch, heads, WIDTH, generator=gen, device="cuda").bfloat16()
                max_context = table.shape[1] * args.block_size
                configs = sweep_configs(heads, args.sweep_tiles)
                for i, config in enumerate(configs):
                    key = (heads, config)
                    if key not in checked:  # correctness (and the compile) before any timing
                        try:
                            r = case.errors(heads, lambda q_, c, t, s, config=config: sk.mla_decode_split_kv(
                                q_, c, t, s, SCALE, LATENT, num_splits=7, config=config))
                            checked[key] = "ok" if r["ok"] else f"WRONG {r}"
                        except Exception as e:  # noqa: BLE001  (out of shared memory, a compile error: report, go on)
                            checked[key] = f"does not run: {str(e).splitlines()[0][:120]}"
                    for splits in sweep_splits(config, i == 0, batch, heads, max_context, sms):
                        row = {"heads": heads, "batch": batch, "context": context, "config": dataclasses.asdict(config),
                               "launch": describe(config), "splits": splits, "default": i == 0,
                               "default_splits": i == 0 and splits == sk.choose_num_splits(
                                   batch, heads, max_context, sms, config)}
                        if checked[key] == "ok":
                            t = graph_time([lambda c=c, s=splits, cf=config, q=q, t=table, n=seq_lens:
                                            sk.mla_decode_split_kv(q, c, t, n, SCALE, LATENT, num_splits=s, config=cf)
                                            for c in caches], args.repeats)
                            row |= {"us": t * 1e6, "GBps": kv_bytes / t / 1e9, "of_copy_bw": kv_bytes / t / bandwidth}
                        else:
                            row["error"] = checked[key]
                        rows.append(row)
                        print(f"  sweep H={heads} B={batch} ctx={context} {row['launch']} splits={splits}: "
                              + (f"{row['us']:.1f} us {row['of_copy_bw']:.0%}" if "us" in row else row["error"]),
                              flush=True)
                del caches
                torch.cuda.empty_cache()
    return rows


def sweep_tables(rows: list[dict]) -> tuple[str, str]:
    """(full table, best launch per shape)."""
    full = ["| heads | batch | context | launch (head tile, KV rows, warps, stages) | splits | us | GB/s | of copy BW |",
            "|---:|---:|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        mark = " (default)" if r["default_splits"] else ""
        timing = f"{r['us']:.1f} | {r['GBps']:.0f} | {r['of_copy_bw']:.0%}" if "us" in r else f"{r['error']} | | "
        full.append(f"| {r['heads']} | {r['batch']} | {r['context']} | {r['launch']}{mark} | {r['splits']} | {timing} |")
    best = [("| heads | batch | context | default launch, splits | us | of copy BW | best launch, splits | us | "
             "of copy BW |"), "|---:|---:|---:|---|---:|---:|---|---:|---:|"]
    shapes = dict.fromkeys((r["heads"], r["batch"], r["context"]) for r in rows)
    for shape in shapes:
        timed = [r for r in rows if (r["heads"], r["batch"], r["context"]) == shape and "us" in r]
        default = next((r for r in timed if r["default_splits"]), None)
        if not timed or default is None:
            continue
        b = min(timed, key=lambda r: r["us"])
        best.append(f"| {shape[0]} | {shape[1]} | {shape[2]} | {default['launch']}, {default['splits']} | "
                    f"{default['us']:.1f} | {default['of_copy_bw']:.0%} | {b['launch']}, {b['splits']} | "
                    f"{b['us']:.1f} | {b['of_copy_bw']:.0%} |")
    return "\n".join(full), "\n".join(best)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--heads", type=int, default=12, help="MLA heads per rank (K3 at TP8: 96 / 8)")
    parser.add_argument("--extra-heads", default="32", help="more head counts for the table (DCP: 32, 96)")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--contexts", default="1024,32768,131072")
    parser.add_argument("--block-size", type=int, default=64, help="tokens per cache block")
    parser.add_argument("--block-n", type=int, default=None, help="KV rows per tile of the split-KV kernel")
    parser.add_argument("--splits", default="", help="extra split counts to time, e.g. 32,64,128,256")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--reference-max-tokens", type=int, default=32768)
    parser.add_argument("--copy-mib", type=int, default=2048)
    parser.add_argument("--sweep", action="store_true", help="time the split-KV kernel's launch choices")
    parser.add_argument("--sweep-heads", default="16,32,96")
    parser.add_argument("--sweep-batches", default="1,16")
    parser.add_argument("--sweep-contexts", default="32768,131072")
    parser.add_argument("--sweep-tiles", default=SWEEP_TILES, help="KV rows x warps x stages[t = TMA], ...")
    parser.add_argument("--no-table", action="store_true", help="with --sweep: skip the default table")
    args = parser.parse_args()
    args.splits = [int(s) for s in args.splits.split(",") if s]
    extra_heads = [int(h) for h in args.extra_heads.split(",") if h]
    if not torch.cuda.is_available():
        raise SystemExit("needs a GPU")
    if args.sweep and any(int(h) % mc.HEAD_TILE for h in args.sweep_heads.split(",")):
        raise SystemExit(f"--sweep-heads must be multiples of {mc.HEAD_TILE} (the kernel's, unpadded)")
    gen = torch.Generator(device="cuda").manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    l2_bytes = getattr(props, "L2_cache_size", 50 * 2**20)

    case = RaggedCase(args.block_size, gen)
    correctness = check_correctness(case, args.heads, extra_heads, gen)
    bandwidth = copy_bandwidth(args.copy_mib * 2**20, args.repeats)
    rows = [] if args.no_table else [
        bench_shape(h, b, c, args, gen, l2_bytes, sms) for h in [args.heads, *extra_heads]
        for b in map(int, args.batches.split(",")) for c in map(int, args.contexts.split(","))]
    for r in rows:
        r["split_kv_GBps"] = r["kv_bytes"] / r["split_kv_s"] / 1e9
        r["split_kv_of_copy_bw"] = r["kv_bytes"] / r["split_kv_s"] / bandwidth
        r["generic_GBps"] = r["kv_bytes"] / r["generic_s"] / 1e9
        r["speedup"] = r["generic_s"] / r["split_kv_s"]
    sweep = run_sweep(args, case, gen, l2_bytes, sms, bandwidth) if args.sweep else []

    result = {
        "device": torch.cuda.get_device_name(), "sms": sms, "l2_bytes": l2_bytes,
        "torch": torch.__version__, "triton": triton.__version__, "heads": args.heads, "extra_heads": extra_heads,
        "block_size": args.block_size, "copy_bandwidth_GBps": bandwidth / 1e9, "correctness": correctness,
        "shapes": rows, "sweep": sweep,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "mla_decode.json").write_text(json.dumps(result, indent=1))

    print(f"\n{result['device']} ({sms} SMs), torch {result['torch']}, triton {result['triton']}; bf16, "
          f"block size {args.block_size}; copy bandwidth {bandwidth / 1e9:.0f} GB/s\n")
    if rows:
        print("| heads | batch | context | generic (us) | split-KV (us) | speedup | launch | splits | split-KV GB/s "
              "| of copy BW | generic GB/s | torch ref (us) |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ref = f"{r['reference_s'] * 1e6:.1f}" if "reference_s" in r else "-"
        heads = f"{r['heads']} (pad {r['kernel_heads']})" if r["heads"] != r["kernel_heads"] else str(r["heads"])
        launch = describe(sk.SplitKVConfig(**r["split_kv_config"]))
        print(f"| {heads} | {r['batch']} | {r['context']} | {r['generic_s'] * 1e6:.1f} | {r['split_kv_s'] * 1e6:.1f} | "
              f"{r['speedup']:.1f}x | {launch} | {r['split_kv_splits']} | {r['split_kv_GBps']:.0f} | "
              f"{r['split_kv_of_copy_bw']:.0%} | {r['generic_GBps']:.0f} | {ref} |")
    for r in rows:
        for s, t in r["split_kv_sweep_s"].items():
            print(f"  heads {r['heads']} batch {r['batch']} context {r['context']}: {s} splits {t * 1e6:.1f} us "
                  f"({r['kv_bytes'] / t / 1e9:.0f} GB/s)")
    if sweep:
        full, best = sweep_tables(sweep)
        (args.out / "mla_decode_sweep.md").write_text(full + "\n\n" + best + "\n")
        print(f"\nsplit-KV sweep (full table: {args.out / 'mla_decode_sweep.md'}); launch = head tile h, KV rows n, "
              f"warps w, stages s\n\n{best}")
    print(f"\ncorrectness: {json.dumps({k: v['ok'] for k, v in correctness.items()})}")


if __name__ == "__main__":
    main()
