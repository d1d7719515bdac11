"""ONNX export of the tiny presets' decode and prefill programs: export time and file size (CPU).

    python benchmarks/export_onnx.py [--presets tiny tiny-h24 tiny-linear] [--phases decode prefill] [--out DIR]

Each preset: a generated checkpoint (MXFP4 experts; tiny-linear bf16), compiled for
``cpu`` and for ``h200`` in float32, exported with ``k3compile.export.export_onnx`` at the
default cache capacity (4 sequences, 256 tokens); one line of JSON per export.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from k3compile.checkpoint.generate import GenerateOptions, generate_model_dir
from k3compile.compiler import CompileOptions, optimize
from k3compile.config import PRESETS
from k3compile.export import ExportOptions, export_onnx


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", nargs="+", default=["tiny", "tiny-h24", "tiny-linear"])
    ap.add_argument("--phases", nargs="+", default=["decode"], choices=["decode", "prefill"])
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = args.out or Path(tmp)
        for preset in args.presets:
            experts = "bf16" if preset == "tiny-linear" else "mxfp4"
            model = generate_model_dir(PRESETS[preset], root / preset, GenerateOptions(experts=experts, seed=1))
            for target in ("cpu", "h200"):
                artifact = root / f"{preset}-{target}.k3c"
                optimize(model, artifact, CompileOptions(target=target, dtype="float32"))
                for phase in args.phases:
                    result = export_onnx(artifact, root / f"{preset}-{target}-{phase}.onnx", ExportOptions(phase=phase))
                    print(json.dumps({"preset": preset, "target": target, "phase": phase,
                                      "export_s": round(result.seconds, 1),
                                      "file_mib": round(result.file_bytes / 2**20, 2),
                                      "caches": len(result.cache_outputs)}), flush=True)


if __name__ == "__main__":
    main()
