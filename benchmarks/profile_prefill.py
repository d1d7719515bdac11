"""Where one prefill's device time goes: kernels of ``Runtime.prefill`` on a compiled
artifact, by kernel name, largest first (CUDA GPU only).

    python benchmarks/profile_prefill.py ARTIFACT [--prompt-len 1024] [--top 20]

The prompt is random token ids; one prefill warms up (Triton compiles), the next is profiled.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from k3compile import runtime


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--top", type=int, default=20)
    args = ap.parse_args()
    rt = runtime.load(args.artifact, 0, 1, runtime.RuntimeOptions(max_sequences=1, max_context=args.prompt_len + 8,
                                                                  device="cuda"))
    prompt = torch.randint(0, rt.cfg.vocab_size, (args.prompt_len,)).tolist()

    def prefill() -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        (seq,), _ = rt.prefill([prompt])
        torch.cuda.synchronize()
        rt.release(seq)
        return time.perf_counter() - start

    prefill()
    wall = [prefill() for _ in range(3)]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        prefill()
    totals: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            totals.setdefault(e.name[:90], []).append(e.device_time / 1e3)
    rows = sorted(((sum(t), len(t), name) for name, t in totals.items()), reverse=True)
    print(json.dumps({"prefill_ms": [round(w * 1e3, 2) for w in wall],
                      "kernel_ms": round(sum(r[0] for r in rows), 3), "launches": sum(r[1] for r in rows)}))
    for ms, calls, name in rows[:args.top]:
        print(f"{ms:9.3f} ms {calls:5d}  {name}")


if __name__ == "__main__":
    main()
