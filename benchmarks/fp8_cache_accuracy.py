"""Logits with an FP8 MLA cache against the bf16 cache, through the compiled model (issue #20).

    python benchmarks/fp8_cache_accuracy.py --preset tiny --context 2048          # CPU
    python benchmarks/fp8_cache_accuracy.py --preset k3-tp8-rank --target h200    # GPU, real shapes

Writes a checkpoint of ``--preset`` (MXFP4 experts, random weights), compiles it twice for
``--target`` in bf16, once with ``--kv-cache-dtype auto`` (a bf16 cache) and once with
``fp8``, loads both, prefills the same ``--sequences`` random prompts of ``--context``
tokens and runs ``--steps`` decode steps with the same (teacher-forced, random) tokens,
so both models see one history and differ only in how their MLA caches hold it. Per
sequence and step (the prompt's last token, then each decode step): the logits' error
relative to the bf16 cache's largest |logit| (max over the vocabulary) and mean |error|
over mean |logit|, and whether the top token agrees; printed with the top-2 margin of
the bf16 logits where it does not. Every MLA layer reads its history back from the cache
in prefill too, so the prompt's logits see the FP8 rounding as well.

Output: a summary on stdout and ``fp8_cache_accuracy_<preset>.json`` in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from k3compile import runtime
from k3compile.checkpoint.generate import GenerateOptions, generate_model_dir
from k3compile.compiler import CompileOptions, optimize
from k3compile.config import PRESETS


def run(out_dir: Path, prompts: list[list[int]], steps: list[list[int]], device: str) -> torch.Tensor:
    """[1 + len(steps), sequences, vocab] fp32 logits: the prompts' last tokens, then each step."""
    options = runtime.RuntimeOptions(max_sequences=len(prompts), max_context=len(prompts[0]) + len(steps) + 1,
                                     device=device)
    rt = runtime.load(out_dir, rank=0, world_size=1, options=options)
    ids, first = rt.prefill(prompts)
    logits = [first.float().cpu()] + [rt.decode(ids, tokens).float().cpu() for tokens in steps]
    rt.close()
    return torch.stack(logits)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--target", default="cpu")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--context", type=int, default=2048, help="prompt tokens per sequence")
    parser.add_argument("--sequences", type=int, default=4)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cfg = PRESETS[args.preset]
    gen = torch.Generator().manual_seed(args.seed)
    vocab = cfg.vocab_size
    prompts = torch.randint(0, vocab, (args.sequences, args.context), generator=gen).tolist()
    steps = torch.randint(0, vocab, (args.steps, args.sequences), generator=gen).tolist()

    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        model = generate_model_dir(cfg, Path(tmp) / "model", GenerateOptions(experts="mxfp4", seed=args.seed))
        print(f"wrote {args.preset} in {time.perf_counter() - start:.0f} s")
        logits = {}
        for kv in ("auto", "fp8"):
            start = time.perf_counter()
            out = optimize(model, Path(tmp) / kv, CompileOptions(target=args.target, dtype="bfloat16", kv_cache_dtype=kv))
            logits[kv] = run(out.out_dir, prompts, steps, device)
            print(f"{kv}: compiled and ran in {time.perf_counter() - start:.0f} s")
    ref, got = logits["auto"], logits["fp8"]
    err = (got - ref).abs()
    rel_max = err.amax(-1) / ref.abs().amax(-1)  # [1 + steps, sequences]
    rel_mean = err.mean(-1) / ref.abs().mean(-1)
    agree = got.argmax(-1) == ref.argmax(-1)
    top2 = ref.topk(2, dim=-1).values
    margin = (top2[..., 0] - top2[..., 1]) / ref.abs().amax(-1)
    summary = {
        "preset": args.preset, "target": args.target, "device": device, "context": args.context,
        "sequences": args.sequences, "steps": args.steps, "rows": rel_max.numel(),
        "rel_max_error": {"max": rel_max.max().item(), "median": rel_max.median().item(),
                          "mean": rel_max.mean().item()},
        "rel_mean_error": {"max": rel_mean.max().item(), "mean": rel_mean.mean().item()},
        "top1_agreement": agree.float().mean().item(),
        "disagreements_top2_margin": margin[~agree].tolist(),
        "prompt_last_token_rel_max_error": rel_max[0].tolist(),
    }
    print(json.dumps(summary, indent=1))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"fp8_cache_accuracy_{args.preset}.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
