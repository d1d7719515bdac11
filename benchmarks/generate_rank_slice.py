"""Time writing a real-shape checkpoint: one TP8 rank of K3 at TP1 (preset k3-tp8-rank).

What ``k3compile init-model --preset k3-tp8-rank --layers N OUT`` does, in-process, into a
temporary directory that is deleted afterwards. Prints the wall time, the bytes written
and where the time went: drawing values (random bytes for the MXFP4 routed experts, randn
for the rest, conversion to the storage dtype) vs writing the safetensors shards.

    python benchmarks/generate_rank_slice.py                 # 4 layers, mxfp4 experts, ~8 GB
    python benchmarks/generate_rank_slice.py --layers 2 --experts bf16 --dir /big/disk

The default slice writes about 8 GB: check the free space of --dir (default: the system's
temp dir) first.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from k3compile.checkpoint.generate import GenerateOptions, GenerateStats, generate_model_dir
from k3compile.config import get_preset, with_layers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="k3-tp8-rank")
    parser.add_argument("--layers", type=int, default=None, help="default: the preset's own (4 for k3-tp8-rank)")
    parser.add_argument("--experts", choices=("bf16", "mxfp4"), default=None, help="default: the preset's format")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shard-bytes", type=int, default=2 << 30)
    parser.add_argument("--dir", default=None, help="where the temporary model dir goes")
    parser.add_argument("--keep", action="store_true", help="keep the written model dir (its path is printed)")
    args = parser.parse_args()

    cfg = get_preset(args.preset)
    if args.layers is not None:
        cfg = with_layers(cfg, args.layers)
    parent = Path(tempfile.mkdtemp(prefix="k3-rank-slice-", dir=args.dir))
    out = parent / "model"
    free = shutil.disk_usage(parent).free
    print(f"preset {args.preset}, {cfg.num_hidden_layers} layers {''.join(k[0] for k in cfg.layer_kinds)}, "
          f"experts {args.experts or cfg.expert_format}, seed {args.seed}, torch threads {torch.get_num_threads()}, "
          f"{free / 1e9:.1f} GB free in {parent}")
    stats = GenerateStats()
    start = time.perf_counter()
    try:
        generate_model_dir(cfg, out, GenerateOptions(args.experts, args.seed, args.shard_bytes), stats=stats)
        wall = time.perf_counter() - start
        on_disk = sum(p.stat().st_size for p in out.iterdir())
    finally:
        if args.keep:
            print(f"kept {out}")
        else:
            shutil.rmtree(parent, ignore_errors=True)
    other = stats.total_s - stats.draw_s - stats.write_s
    print(f"total        {wall:8.1f} s")
    print(f"  draws      {stats.draw_s:8.1f} s  (random values in their storage dtype: routed experts "
          f"{stats.draw_experts_s:.1f} s, the rest {stats.draw_s - stats.draw_experts_s:.1f} s)")
    print(f"  writes     {stats.write_s:8.1f} s  ({stats.bytes / max(stats.write_s, 1e-9) / 1e9:.2f} GB/s; "
          f"{stats.shards} shards, index, config.json)")
    print(f"  other      {other:8.1f} s  (meta model, bookkeeping)")
    print(f"bytes        {on_disk:,} on disk ({on_disk / 1e9:.2f} GB), {stats.bytes:,} of tensors, "
          f"{stats.tensors:,} tensors")
    print(f"rss peak     {_peak_rss_gb():.2f} GB")


def _peak_rss_gb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9 if os.name == "posix" else float("nan")


if __name__ == "__main__":
    main()
