"""What sending programs to the validation ranks, and capturing again, cost (decision 44).

The notebook's compile (tiny with MXFP4 experts, TP2 / DCP2, target h200, every pass
validated on two gloo ranks), timed by step, then for each phase of the compiled
programs: torch.export save / load (the artifact format, which validation used to send)
against RankProgram pack / unpack (what it sends now); last, the same model captured
through a CaptureCache twice (an export, then a copy).

    python benchmarks/validation_transport.py
"""

from __future__ import annotations

import io
import tempfile
import time
from pathlib import Path

import torch

from k3compile.artifact_writer import save_program
from k3compile.capture import CaptureCache
from k3compile.checkpoint.generate import GenerateOptions, generate_model_dir
from k3compile.compiler import CompileOptions, optimize
from k3compile.config import PRESETS
from k3compile.distributed import RankPools
from k3compile.rank_program import RankProgram
from k3compile.sharding import ParallelPlan


def _seconds(fn) -> tuple[float, object]:
    start = time.perf_counter()
    value = fn()
    return time.perf_counter() - start, value


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="k3-transport-"))
    model_dir = generate_model_dir(PRESETS["tiny"], work / "tiny", GenerateOptions(seed=1, experts="mxfp4"))
    options = CompileOptions(tp=2, dcp=2, target="h200", dtype="float32", validate=True)
    with RankPools() as pools:
        pools.get(2)  # the ranks' start is not the compile's
        start = time.perf_counter()
        result = optimize(model_dir, work / "out", options, ranks=pools,
                          on_step=lambda step: print(f"{time.perf_counter() - start:6.1f} s  {step}"))
        print(f"validated compile: {time.perf_counter() - start:.1f} s")
    validated = [r.report.seconds for r in result.pipeline.records if r.report is not None]
    print(f"{len(validated)} pass validations: {sum(validated):.1f} s, {min(validated):.2f}-{max(validated):.2f} s each")

    print(f"{'phase':8} {'export.save':>11} {'export.load':>11} {'pack':>8} {'unpack':>8}  bytes (.pt2 / packed)")
    for phase, program in result.captured.programs.items():
        buf = io.BytesIO()
        save_s, _ = _seconds(lambda: save_program(program, buf))
        load_s, _ = _seconds(lambda: torch.export.load(io.BytesIO(buf.getvalue())))
        pack_s, packed = _seconds(lambda: RankProgram.of(program).pack())
        unpack_s, _ = _seconds(lambda: RankProgram.unpack(packed))
        print(f"{phase:8} {save_s:10.2f}s {load_s:10.2f}s {pack_s:7.3f}s {unpack_s:7.3f}s  "
              f"{len(buf.getvalue()):,} / {len(packed):,}")

    cache, plan = CaptureCache(), ParallelPlan(2, 0, dcp=2)
    for what in ("export", "copy"):
        seconds, _ = _seconds(lambda: cache.get(result.captured.config, plan, torch.float32, options.block_size))
        print(f"capture through the cache ({what}): {seconds:.2f} s")


if __name__ == "__main__":
    main()
