"""MLA decode kernels at K3's per-rank shapes (TP8: 12 heads): generic vs split-KV.

    python benchmarks/mla_decode.py --out /tmp/mla_decode

What it measures, in one run on one GPU (needs torch >= 2.11 and triton >= 3.6):

1. Correctness first, at a moderate shape (ragged contexts including 0 and 1, permuted
   blocks): both decode kernels and the prefill kernel against ``torch.ops.k3.mla_decode``
   on fp32 copies of the same bf16 inputs. A decode mismatch aborts the run.
2. Copy bandwidth: a large device-to-device copy, (bytes read + written) / time: the
   achievable HBM bandwidth of this GPU, measured in the same run.
3. For each batch x context (every sequence full, bf16 latent cache 576 wide, paged in
   randomly permuted blocks): (a) the generic kernel at 12 heads; (b) the split-KV
   kernel with q zero-padded to 16 heads (pad into a zeroed static buffer, slice the 12
   real heads back: what the pad-heads pass emits); (c) the eager torch reference where
   it fits in memory. Each is captured in a CUDA graph and replayed; the graph holds
   enough calls on distinct copies of the cache that they do not fit in L2, so every
   call reads its KV from HBM. Time per call = median over repeats of (graph time /
   calls). Achieved bandwidth = KV bytes read (tokens x 576 x 2) / time, and its fraction
   of the measured copy bandwidth.

Output: a markdown table on stdout and ``mla_decode.json`` in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from pathlib import Path

import torch
import triton

import k3compile  # noqa: F401  (registers torch.ops.k3)
from k3compile.runtime.kernels import mla_decode as mk

from gpu_timing import copy_bandwidth, graph_time  # benchmarks/ is the script's directory

LATENT, ROPE = 512, 64
WIDTH = LATENT + ROPE
SCALE = 192 ** -0.5  # K3: (qk_nope 128 + rope 64) ** -0.5
PAD_HEADS = mk.HEAD_TILE


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


def padded_split_kv(q: torch.Tensor, q_pad: torch.Tensor, cache, table, seq_lens, **kw):
    """What the pad-heads pass emits: q into a zeroed [B, 16, W] buffer, the fast kernel,
    the real heads' outputs sliced back (views: no copy)."""
    heads = q.shape[1]
    q_pad[:, :heads].copy_(q)
    o, lse = mk.mla_decode_split_kv(q_pad, cache, table, seq_lens, SCALE, LATENT, **kw)
    return o[:, :heads], lse[:, :heads]


def close(o: torch.Tensor, ref: torch.Tensor) -> bool:
    """bf16 output: rounding of o (2^-9 relative) and of the probabilities before the
    value product (2^-9 relative each)."""
    return bool(torch.allclose(o.float(), ref, atol=2e-2, rtol=2e-2))


def check_correctness(block_size: int, heads: int, gen: torch.Generator) -> dict:
    """Max errors vs the fp32 reference; SystemExit if a decode kernel is wrong."""
    lens = [0, 1, 777, 3000, 64 * 5, 4097]
    blocks = [-(-n // block_size) for n in lens]
    width = max(blocks)
    cache = torch.randn(sum(blocks) + 4, block_size, WIDTH, generator=gen, device="cuda").bfloat16()
    order = torch.randperm(cache.shape[0], generator=gen, device="cuda").int()
    table = torch.zeros(len(lens), width, dtype=torch.int32, device="cuda")
    taken = 0
    for i, k in enumerate(blocks):
        table[i, :k] = order[taken:taken + k]
        taken += k
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = torch.randn(len(lens), heads, WIDTH, generator=gen, device="cuda").bfloat16()
    ref_o, ref_lse = torch.ops.k3.mla_decode(q.float(), cache.float(), table, seq_lens, SCALE, LATENT)
    q_pad = torch.zeros(len(lens), PAD_HEADS, WIDTH, dtype=q.dtype, device="cuda")
    results = {
        "generic": mk.mla_decode_generic(q, cache, table, seq_lens, SCALE, LATENT),
        "split_kv_padded": padded_split_kv(q, q_pad, cache, table, seq_lens),
        "split_kv_padded_4_splits": padded_split_kv(q, q_pad, cache, table, seq_lens, num_splits=4),
    }
    report, bad = {}, []
    for name, (o, lse) in results.items():
        o_err = (o.float() - ref_o).abs().max().item()
        lse_err = (lse - ref_lse).nan_to_num(posinf=1e9, neginf=-1e9).abs().max().item()
        ok = close(o, ref_o) and lse_err < 1e-3 and torch.equal(lse.isinf(), ref_lse.isinf())
        report[name] = {"o_max_err": o_err, "lse_max_err": lse_err, "ok": ok}
        bad += [] if ok else [name]

    # prefill: each new token == decode over the context up to its own position (not fatal)
    new = [0, 1, 40, 100, 3, 9]
    cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    qp = torch.randn(sum(new), heads, WIDTH, generator=gen, device="cuda").bfloat16()
    o, lse = mk.mla_prefill_absorbed(qp, cache, cu, table, seq_lens, SCALE, LATENT)
    seq = torch.repeat_interleave(torch.arange(len(new)), torch.tensor(new)).cuda()
    pos = torch.cat([torch.arange(n - k, n) for n, k in zip(lens, new, strict=True)]).cuda()
    ref_o, ref_lse = torch.ops.k3.mla_decode(qp.float(), cache.float(), table[seq], (pos + 1).int(), SCALE, LATENT)
    o_err, lse_err = (o.float() - ref_o).abs().max().item(), (lse - ref_lse).abs().max().item()
    report["prefill"] = {"o_max_err": o_err, "lse_max_err": lse_err, "ok": close(o, ref_o) and lse_err < 1e-3}
    if bad:
        print(json.dumps(report, indent=1))
        raise SystemExit(f"decode kernels disagree with the reference: {bad}")
    return report


def bench_shape(batch: int, context: int, args, gen: torch.Generator, l2_bytes: int) -> dict:
    kv_bytes = batch * context * WIDTH * 2
    # enough cache copies that one graph's calls do not fit in L2 (cold KV every call)
    copies = min(256, max(1, math.ceil(4 * l2_bytes / kv_bytes)))
    caches, table, seq_lens = paged_cache(batch, context, args.block_size, gen, copies)
    q = torch.randn(batch, args.heads, WIDTH, generator=gen, device="cuda").bfloat16()
    q_pad = torch.zeros(batch, PAD_HEADS, WIDTH, dtype=q.dtype, device="cuda")
    row = {"batch": batch, "context": context, "kv_bytes": kv_bytes, "cache_copies": copies}

    def per_copy(make: Callable[[torch.Tensor], Callable[[], object]]) -> list[Callable[[], object]]:
        return [make(c) for c in caches]

    row["generic_s"] = graph_time(per_copy(lambda c: lambda: mk.mla_decode_generic(
        q, c, table, seq_lens, SCALE, LATENT)), args.repeats)
    splits = mk.choose_num_splits(batch, PAD_HEADS, table.shape[1] * args.block_size,
                                  torch.cuda.get_device_properties(0).multi_processor_count)
    row["split_kv_splits"] = splits
    row["split_kv_s"] = graph_time(per_copy(lambda c: lambda: padded_split_kv(
        q, q_pad, c, table, seq_lens, num_splits=splits, block_n=args.block_n)), args.repeats)
    row["split_kv_sweep_s"] = {
        s: graph_time(per_copy(lambda c, s=s: lambda: padded_split_kv(
            q, q_pad, c, table, seq_lens, num_splits=s, block_n=args.block_n)), args.repeats)
        for s in args.splits if s != splits
    }
    # the reference materialises [B, context, 576] fp32 and [B, H, context] scores
    if batch * context <= args.reference_max_tokens:
        try:
            row["reference_s"] = graph_time([lambda: torch.ops.k3.mla_decode(
                q, caches[0], table, seq_lens, SCALE, LATENT)], max(3, args.repeats // 10))
        except Exception as e:  # a peer's failure (e.g. out of memory) must not lose the kernels' numbers
            row["reference_error"] = repr(e)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--heads", type=int, default=12, help="MLA heads per rank (K3 at TP8: 96 / 8)")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--contexts", default="1024,32768,131072")
    parser.add_argument("--block-size", type=int, default=64, help="tokens per cache block")
    parser.add_argument("--block-n", type=int, default=None, help="KV rows per tile of the split-KV kernel")
    parser.add_argument("--splits", default="", help="extra split counts to time, e.g. 32,64,128,256")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--reference-max-tokens", type=int, default=32768)
    parser.add_argument("--copy-mib", type=int, default=2048)
    args = parser.parse_args()
    args.splits = [int(s) for s in args.splits.split(",") if s]
    if not torch.cuda.is_available():
        raise SystemExit("needs a GPU")
    gen = torch.Generator(device="cuda").manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    l2_bytes = getattr(props, "L2_cache_size", 50 * 2**20)

    correctness = check_correctness(args.block_size, args.heads, gen)
    bandwidth = copy_bandwidth(args.copy_mib * 2**20, args.repeats)
    rows = [bench_shape(b, c, args, gen, l2_bytes) for b in map(int, args.batches.split(","))
            for c in map(int, args.contexts.split(","))]
    for r in rows:
        r["split_kv_GBps"] = r["kv_bytes"] / r["split_kv_s"] / 1e9
        r["split_kv_of_copy_bw"] = r["kv_bytes"] / r["split_kv_s"] / bandwidth
        r["generic_GBps"] = r["kv_bytes"] / r["generic_s"] / 1e9
        r["speedup"] = r["generic_s"] / r["split_kv_s"]

    result = {
        "device": torch.cuda.get_device_name(), "sms": props.multi_processor_count, "l2_bytes": l2_bytes,
        "torch": torch.__version__, "triton": triton.__version__, "heads": args.heads, "padded_heads": PAD_HEADS,
        "block_size": args.block_size,
        "block_n": args.block_n or mk.default_block_n(True, "hip" if torch.version.hip else "cuda", torch.bfloat16),
        "copy_bandwidth_GBps": bandwidth / 1e9, "correctness": correctness, "shapes": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "mla_decode.json").write_text(json.dumps(result, indent=1))

    print(f"{result['device']} ({result['sms']} SMs), torch {result['torch']}, triton {result['triton']}; "
          f"{args.heads} heads (fast kernel padded to {PAD_HEADS}), bf16, block size {args.block_size}; "
          f"copy bandwidth {bandwidth / 1e9:.0f} GB/s\n")
    print("| batch | context | generic (us) | split-KV pad16 (us) | speedup | splits | split-KV GB/s | of copy BW "
          "| generic GB/s | torch ref (us) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ref = f"{r['reference_s'] * 1e6:.1f}" if "reference_s" in r else "-"
        print(f"| {r['batch']} | {r['context']} | {r['generic_s'] * 1e6:.1f} | {r['split_kv_s'] * 1e6:.1f} | "
              f"{r['speedup']:.1f}x | {r['split_kv_splits']} | {r['split_kv_GBps']:.0f} | "
              f"{r['split_kv_of_copy_bw']:.0%} | {r['generic_GBps']:.0f} | {ref} |")
    for r in rows:
        for s, t in r["split_kv_sweep_s"].items():
            print(f"  batch {r['batch']} context {r['context']}: {s} splits {t * 1e6:.1f} us "
                  f"({r['kv_bytes'] / t / 1e9:.0f} GB/s)")
    print(f"\ncorrectness: {json.dumps({k: v['ok'] for k, v in correctness.items()})}")


if __name__ == "__main__":
    main()
