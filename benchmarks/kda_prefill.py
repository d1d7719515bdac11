"""KDA prefill at one TP8 rank's shapes (12 heads, D = DV = 128, bf16 q / k / v): the
Triton kernels of ``runtime/kernels/kda_prefill.py`` against fla-core's ``chunk_kda`` and
the op's torch reference. CUDA GPU only.

    python benchmarks/kda_prefill.py [--tokens 4096 32768] [--batches 1 8] [--reference-max 8192]

Each case is ``batch`` sequences of ``tokens`` each, packed (cu_seqlens), from random
initial states, with K3's gate (lower bound -5). Timed eagerly (prefill is not captured in
a CUDA graph), CUDA events, median of 5 after a warm-up; the state copy each call starts
from is outside the timed span. Correctness first: the kernels' output and final states
against the reference (up to ``--reference-max`` tokens) and against fla.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

import k3compile.ops  # noqa: F401  (registers torch.ops.k3)
from k3compile.ops.kda import kda_gate, kda_prefill_reference
from k3compile.runtime.kernels import kda_prefill as kp

H, D, DV, LOWER = 12, 128, 128, -5.0


def inputs(batch: int, tokens: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    T = batch * tokens
    r = lambda *s: torch.randn(*s, generator=gen, device="cuda")  # noqa: E731
    g = kda_gate(r(T, H, D), r(H) * 0.5, r(H * D), LOWER)
    return {"q": r(T, H, D).bfloat16(), "k": r(T, H, D).bfloat16(), "v": r(T, H, DV).bfloat16(), "g": g,
            "beta": torch.rand(T, H, generator=gen, device="cuda"),
            "state": r(batch, H, D, DV) * 0.1,
            "cu": torch.arange(0, T + 1, tokens, device="cuda", dtype=torch.int32),
            "slots": torch.arange(batch, device="cuda")}


def ours(x: dict[str, torch.Tensor], state: torch.Tensor) -> torch.Tensor:
    return kp.kda_prefill(x["q"], x["k"], x["v"], x["g"], x["beta"], state, x["cu"], x["slots"], D**-0.5)


def reference(x: dict[str, torch.Tensor], state: torch.Tensor) -> torch.Tensor:
    return kda_prefill_reference(x["q"], x["k"], x["v"], x["g"], x["beta"], state, x["cu"], x["slots"], D**-0.5)


def fla_chunk(x: dict[str, torch.Tensor], state: torch.Tensor) -> torch.Tensor:
    from fla.ops.kda import chunk_kda

    o, final = chunk_kda(x["q"][None], x["k"][None], x["v"][None], x["g"][None], x["beta"][None], scale=D**-0.5,
                         initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True,
                         cu_seqlens=x["cu"].long())
    state.copy_(final)
    return o[0]


def timed(fn, x: dict[str, torch.Tensor], repeats: int = 5) -> float:
    """ms per call, median; each call from a fresh copy of the initial states."""
    times = []
    for i in range(repeats + 1):
        state = x["state"].clone()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(x, state)
        stop.record()
        stop.synchronize()
        if i:
            times.append(start.elapsed_time(stop))
    return statistics.median(times)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 32768])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--reference-max", type=int, default=8192)
    args = ap.parse_args()
    try:
        import fla  # noqa: F401
        peers = {"fla chunk_kda": fla_chunk}
    except ImportError as e:
        print(f"fla-core unavailable ({e}): its column is skipped")
        peers = {}
    gen = torch.Generator(device="cuda").manual_seed(0)
    for batch in args.batches:
        for tokens in args.tokens:
            x = inputs(batch, tokens, gen)
            row: dict[str, object] = {"batch": batch, "tokens": tokens}
            s_ours = x["state"].clone()
            o = ours(x, s_ours)
            if batch * tokens <= args.reference_max:
                s_ref = x["state"].clone()
                o_ref = reference(x, s_ref)
                row["err_vs_reference"] = (rel_err(o, o_ref), rel_err(s_ours, s_ref))
                row["reference_ms"] = round(timed(reference, x, 1), 2)
            for name, fn in peers.items():
                s_peer = x["state"].clone()
                o_peer = fn(x, s_peer)
                row[f"err_vs_{name.split()[0]}"] = (rel_err(o, o_peer), rel_err(s_ours, s_peer))
                row[f"{name} ms"] = round(timed(fn, x), 3)
            row["k3 ms"] = round(timed(ours, x), 3)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
