"""Decode MLA attention with decode context parallelism: DCP2 on two GPUs vs DCP1.

    python3 -m torch.distributed.run --nproc-per-node 2 benchmarks/dcp_attention.py --out /tmp/dcp

K3's per-rank shapes at TP8 (12 heads, absorbed width 576, values 512, bf16 latent cache
in blocks of 64), each sequence full to its context. Per rank, the attention block as
the passes emit it (passes/split_mla_context.py, then passes/pad_attention_heads.py):

- DCP1: q [B, 12, 576] padded to 16 heads, the split-KV kernel over the whole context,
  the 12 real heads narrowed back.
- DCP2: all-gather of q over the two ranks ([B, 24, 576]), padded to 32 heads, the
  split-KV kernel over this rank's half of the positions, narrowed to 24; then the merge
  back to this rank's 12 heads (NCCL), either way the pass can emit it:
  ``reduce-scatter``: all-gather of the LSEs, ``k3.dcp_rescale`` (its Triton kernel),
  reduce-scatter; ``all-to-all``: ``k3.dcp_pack``, one all-to-all, ``k3.dcp_merge``.
  The local context lengths are computed once per step in the graph (shared by all MLA
  layers), so outside the timed attention.

1. Correctness first (ragged contexts, one shorter than the DCP size): the DCP2 output
   of each rank's heads, both merges, against the fp32 reference over the whole context.
2. Copy bandwidth (eager device copy) and each merge's collectives alone (the NCCL calls
   of one DCP2 attention, under a CUDA graph): the floor of DCP2 is this rank's KV bytes
   over the copy bandwidth plus the faster merge's collectives.
3. Each variant captured in a CUDA graph (several layers' worth of distinct caches so
   the KV does not stay in L2), replayed on both ranks together; time per attention =
   median graph time / calls; the slower rank is reported.

Output: a markdown table on rank 0's stdout and ``dcp_attention.json`` in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

import k3compile  # noqa: F401  (registers torch.ops.k3)
from k3compile.context_parallel import DCP_GROUP_NAME, ContextLayout
from k3compile.distributed import init_context_parallel
from k3compile.ops.mla import mla_decode_reference
from k3compile.runtime.kernels import register_gpu_kernels
from k3compile.sharding import ParallelPlan

from gpu_timing import copy_bandwidth, graph_time  # benchmarks/ is the script's directory

k3, c10d = torch.ops.k3, torch.ops._c10d_functional
HEADS, LATENT, WIDTH = 12, 512, 576
SCALE = 192 ** -0.5
BLOCK = 64
DCP = 2
L2_BYTES = 60 * 2**20  # H200: 50 MiB L2; copies of the cache until each graph reads more than this


def padded_attention(q, cache, table, lens, heads_to: int):
    """pad_attention_heads' rewrite: zero heads up to ``heads_to``, split-KV, narrow back."""
    heads = q.shape[1]
    o, lse = k3.mla_decode_split_kv(k3.pad_heads(q, heads_to), cache, table, lens, SCALE, LATENT)
    return k3.narrow_heads(o, heads), k3.narrow_heads(lse, heads)


def dcp1_attention(q, cache, table, lens):
    return padded_attention(q, cache, table, lens, 16)[0]


def dcp2_attention(q, cache, table, local_lens, merge: str = "reduce-scatter"):
    """split_mla_context's rewrite (then pad to 32 heads): this rank's 12 heads [B, 12, 512].
    ``local_lens`` (k3.dcp_local_lengths) is computed once per step in the graph, shared
    by every MLA layer, so it is not part of one layer's attention."""
    gathered = c10d.wait_tensor(c10d.all_gather_into_tensor(q, DCP, DCP_GROUP_NAME))
    q_all = gathered.view(DCP, -1, HEADS, WIDTH).permute(1, 0, 2, 3).reshape(-1, DCP * HEADS, WIDTH)
    o, lse = padded_attention(q_all, cache, table, local_lens, 32)
    if merge == "all-to-all":
        packed = k3.dcp_pack(o, lse, DCP)
        received = c10d.wait_tensor(c10d.all_to_all_single(packed, [1] * DCP, [1] * DCP, DCP_GROUP_NAME))
        return k3.dcp_merge(received, q.dtype)
    lse_all = c10d.wait_tensor(c10d.all_gather_into_tensor(lse, DCP, DCP_GROUP_NAME))
    term = k3.dcp_rescale(o, lse, lse_all, DCP)
    mine = c10d.wait_tensor(c10d.reduce_scatter_tensor(term, "sum", DCP, DCP_GROUP_NAME))
    return mine.permute(1, 0, 2).to(q.dtype)


def collectives_only(q, merge: str):
    """The NCCL calls of one DCP2 attention with ``merge``, on buffers of their sizes."""
    batch = q.shape[0]
    c10d.wait_tensor(c10d.all_gather_into_tensor(q, DCP, DCP_GROUP_NAME))
    if merge == "all-to-all":
        packed = torch.zeros(DCP, batch, HEADS, LATENT + 1, device="cuda")
        c10d.wait_tensor(c10d.all_to_all_single(packed, [1] * DCP, [1] * DCP, DCP_GROUP_NAME))
        return
    c10d.wait_tensor(c10d.all_gather_into_tensor(torch.zeros(batch, DCP * HEADS, device="cuda"), DCP,
                                                 DCP_GROUP_NAME))
    term = torch.zeros(DCP * HEADS, batch, LATENT, device="cuda")
    c10d.wait_tensor(c10d.reduce_scatter_tensor(term, "sum", DCP, DCP_GROUP_NAME))


def caches_for(lens: list[int], layout: ContextLayout | None, gen: torch.Generator, copies: int):
    """Global caches (layout None) or this rank's share of the same tokens: contiguous
    blocks per sequence, the same random latents on both ranks (same generator seed)."""
    out, table = [], None
    for _ in range(copies):
        seqs = [torch.randn(n, WIDTH, generator=gen, device="cuda").bfloat16() for n in lens]
        if layout is not None:
            seqs = [s[layout.rank::layout.dcp] for s in seqs]  # interleave 1: every DCP-th position
        nb = [max(1, -(-s.shape[0] // BLOCK)) for s in seqs]
        width = max(nb)
        cache = torch.zeros(sum(nb), BLOCK, WIDTH, device="cuda", dtype=torch.bfloat16)
        table = torch.zeros(len(lens), width, dtype=torch.int32, device="cuda")
        start = 0
        for i, (s, n) in enumerate(zip(seqs, nb)):
            cache.view(-1, WIDTH)[start * BLOCK : start * BLOCK + s.shape[0]] = s
            table[i, :n] = torch.arange(start, start + n, dtype=torch.int32)
            start += n
        out.append(cache)
    return out, table


def check(rank: int, offset: torch.Tensor, merge: str) -> float:
    lens = [1, 2, 3000, 4097]
    gen = torch.Generator(device="cuda").manual_seed(1)
    (full,), table = caches_for(lens, None, gen, 1)
    gen.manual_seed(1)
    (mine,), local_table = caches_for(lens, ContextLayout(DCP, 1, rank), gen, 1)
    qgen = torch.Generator(device="cuda").manual_seed(7 + rank)
    q = torch.randn(len(lens), HEADS, WIDTH, generator=qgen, device="cuda").bfloat16()
    glens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out = dcp2_attention(q, mine, local_table, k3.dcp_local_lengths(glens, offset, DCP, 1), merge)
    ref, _ = mla_decode_reference(q.float(), full.float(), table, glens, SCALE, LATENT)
    err = (out.float() - ref.float()).abs().max().item()
    if err > 2e-2:
        raise SystemExit(f"rank {rank}: DCP2 attention ({merge} merge) differs from the reference by {err}")
    return err


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(rank)
    register_gpu_kernels()  # the k3 ops below run the runtime's Triton kernels, as the engine's do
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    plan = ParallelPlan(DCP, rank, dcp=DCP)
    init_context_parallel(plan)
    layout = ContextLayout.of(plan)
    offset = torch.tensor(layout.position_offset, device="cuda")

    merges = ("reduce-scatter", "all-to-all")
    err = max(check(rank, offset, merge) for merge in merges)
    bw = copy_bandwidth(2 * 2**30, 20)
    rows = []
    for batch in (1, 16):
        for context in (32768, 131072):
            lens = [context] * batch
            glens = torch.tensor(lens, dtype=torch.int32, device="cuda")
            kv_bytes = batch * context * WIDTH * 2
            copies = max(1, -(-L2_BYTES // (kv_bytes // DCP)))
            gen = torch.Generator(device="cuda").manual_seed(3)
            q = torch.randn(batch, HEADS, WIDTH, generator=gen, device="cuda").bfloat16()
            full, table = caches_for(lens, None, gen, copies)
            t1 = graph_time([lambda c=c: dcp1_attention(q, c, table, glens) for c in full], args.repeats)
            del full
            mine, local_table = caches_for(lens, layout, gen, copies)
            local_lens = k3.dcp_local_lengths(glens, offset, DCP, 1)
            t2 = [graph_time([lambda c=c, m=m: dcp2_attention(q, c, local_table, local_lens, m) for c in mine],
                             args.repeats) for m in merges]
            del mine
            tc = [graph_time([lambda m=m: collectives_only(q, m)] * 4, args.repeats) for m in merges]
            times = torch.tensor([t1, *t2, *tc], device="cuda")
            dist.all_reduce(times, op=dist.ReduceOp.MAX)  # the slower rank sets the step time
            t1, t2_rs, t2_a2a, tc_rs, tc_a2a = times.tolist()
            floor = (kv_bytes / DCP) / bw + min(tc_rs, tc_a2a)
            rows.append({"batch": batch, "context": context, "dcp1_us": t1 * 1e6, "dcp2_us": t2_rs * 1e6,
                         "ratio": t2_rs / t1, "collectives_us": tc_rs * 1e6, "dcp2_a2a_us": t2_a2a * 1e6,
                         "ratio_a2a": t2_a2a / t1, "collectives_a2a_us": tc_a2a * 1e6,
                         "dcp2_floor_us": floor * 1e6, "dcp1_floor_us": kv_bytes / bw * 1e6, "copies": copies})
            torch.cuda.empty_cache()
    if rank == 0:
        print(f"correctness: max |DCP2 - fp32 reference| = {err:.2e}; copy bandwidth {bw / 1e12:.2f} TB/s")
        print("| batch | context | DCP1 (us) | DCP1 floor (us) | DCP2 reduce-scatter (us) | / DCP1 | its collectives "
              "(us) | DCP2 all-to-all (us) | / DCP1 | its collectives (us) | DCP2 floor (us) |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            print(f"| {r['batch']} | {r['context'] // 1024}K | {r['dcp1_us']:.1f} | {r['dcp1_floor_us']:.1f} | "
                  f"{r['dcp2_us']:.1f} | **{r['ratio']:.2f}x** | {r['collectives_us']:.1f} | "
                  f"{r['dcp2_a2a_us']:.1f} | **{r['ratio_a2a']:.2f}x** | {r['collectives_a2a_us']:.1f} | "
                  f"{r['dcp2_floor_us']:.1f} |")
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "dcp_attention.json").write_text(json.dumps(
            {"rows": rows, "copy_bandwidth": bw, "max_error": err, "gpu": torch.cuda.get_device_name()}, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
