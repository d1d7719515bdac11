"""Where a fused KDA decode step's time goes at large batch, and what programmatic
dependent launch (PDL) changes.

    python benchmarks/kda_decode_pieces.py [--batches 64,256] [--reps 30]

Same harness as benchmarks/kda_decode.py: K3 per-rank shapes (12 heads, D = DV = 128),
bf16 activations, 512 fp32 state slots; a CUDA graph holds ``512 // batch`` steps, each on
its own slots, replays timed from their first kernel. Per batch, us per step of:

- ``torch add_``: an in-place add over a contiguous block of the step's state bytes (the
  streaming floor of benchmarks/stream_floor.py);
- ``state rmw``: a Triton kernel of the fused kernel's shape that only moves its state:
  one program per (sequence, head) finds its [D, DV] tile through the slot, reads it and
  writes it scaled; with and without PDL (the read before the wait); ``contiguous``: the
  same on consecutive slots without the slot lookup;
- ``delta core``: the same plus the delta rule itself, from precomputed q, k, decay, beta,
  v (no short conv, no norms, no gated RMSNorm), on 4 and 8 warps; with and without PDL;
- ``fused``: ``kda_decode_fused`` at its defaults, with and without PDL;
- ``gemm`` / ``gemm + fused``: a served step's order, the q projection GEMM (x [B, 7168] @
  W [7168, 1536] into q, cuBLAS; the steps take turns over 4 copies of W, so that W comes
  from HBM as each layer's own does) then the fused kernel, with and without PDL on the
  kernel: what PDL can win when the kernel before is not another KDA step.

Before timing, the PDL launches are checked inside CUDA graphs: a graph of every step
with the launcher's PDL plan and one with the same plan without PDL, replayed once each
on copies of the same problem, must leave identical states, conv states and outputs
(bitwise: the same kernel math), with and without the GEMM before each step. (``fused``
without PDL is the launcher's plan without it: one tile per head row where PDL takes
two.) Prints one line per measurement.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from collections.abc import Callable

import torch
import triton
import triton.language as tl
from gpu_timing import (  # benchmarks/ is the script's directory
    copy_bandwidth,
    graph_time,
)
from k3compile.runtime.kernels.kda_decode import kda_decode_fused
from k3compile.runtime.kernels.kda_decode_plans import (
    bytes_moved,
    launch_config,
)
from kda_decode import (
    CONV_K,
    HEAD_DIM,
    HEADS,
    STATE_NAMES,
    make_problem,
    with_own_states,
)

HIDDEN = 7168  # K3 hidden size: the q projection's input
GEMM_WEIGHT_COPIES = 4  # 4 x 22 MB of q projection weights: over the 50 MB L2


@triton.jit
def _state_rmw_kernel(state_ptr, slots_ptr, H: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                      PDL: tl.constexpr, INDIRECT: tl.constexpr):
    i_h = tl.program_id(0)
    if INDIRECT:
        slot = tl.load(slots_ptr + tl.program_id(1)).to(tl.int64)
    else:  # the program's own block: the slot's dependent load gone
        slot = tl.load(slots_ptr).to(tl.int64) + tl.program_id(1)
    ptrs = state_ptr + (slot * H + i_h) * (D * DV) + tl.arange(0, D)[:, None] * DV + tl.arange(0, DV)[None, :]
    s = tl.load(ptrs)
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(ptrs, s * 0.5 + 1.0)  # stays bounded however often it runs


@triton.jit
def _add_pair(a0, a1, b0, b1):
    return a0 + b0, a1 + b1


@triton.jit
def _delta_core_kernel(state_ptr, slots_ptr, q_ptr, k_ptr, decay_ptr, v_ptr, beta_ptr, out_ptr,
                       H: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, PDL: tl.constexpr):
    """The fused kernel's step 3 alone on [B, H, D] q, k, decay (fp32), v [B, H, DV], beta [B, H]."""
    i_h = tl.program_id(0)
    i_b = tl.program_id(1)
    slot = tl.load(slots_ptr + i_b).to(tl.int64)
    dk, dv = tl.arange(0, D), tl.arange(0, DV)
    ptrs = state_ptr + (slot * H + i_h) * (D * DV) + dk[:, None] * DV + dv[None, :]
    s = tl.load(ptrs)
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = i_b * H + i_h
    q = tl.load(q_ptr + row * D + dk)
    k = tl.load(k_ptr + row * D + dk)
    decay = tl.load(decay_ptr + row * D + dk)
    v = tl.load(v_ptr + row * DV + dv)
    beta = tl.load(beta_ptr + row)
    s = s * decay[:, None]
    sk, sq = tl.reduce((s * k[:, None], s * q[:, None]), 0, _add_pair)
    u = v - sk
    tl.store(ptrs, s + (beta * k)[:, None] * u[None, :])
    tl.store(out_ptr + row * DV + dv, sq + beta * tl.sum(k * q, axis=0) * u)


def delta_core_inputs(batch: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Unit-norm q and k, decay and beta in (0, 1): the update stays bounded over replays."""
    gen = torch.Generator(device=device).manual_seed(batch)
    q, k = (torch.nn.functional.normalize(torch.randn(batch, HEADS, HEAD_DIM, generator=gen, device=device), dim=-1)
            for _ in range(2))
    return {"q": q, "k": k, "decay": torch.rand(batch, HEADS, HEAD_DIM, generator=gen, device=device) * 0.5 + 0.5,
            "v": torch.randn(batch, HEADS, HEAD_DIM, generator=gen, device=device),
            "beta": torch.rand(batch, HEADS, generator=gen, device=device),
            "out": torch.empty(batch, HEADS, HEAD_DIM, device=device)}


def q_projection(batch: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(batch + 1)
    x = torch.randn(batch, HIDDEN, generator=gen, device=device).bfloat16()
    w = (torch.randn(HIDDEN, HEADS * HEAD_DIM, generator=gen, device=device) * HIDDEN**-0.5).bfloat16()
    return x, w


def graph_outputs(problem: dict, slot_sets: torch.Tensor, plan: dict, gemm: tuple | None) -> list[torch.Tensor]:
    """Replay once a graph of every step (the GEMM into q first if given) launched with
    ``plan`` (kda_decode_fused's launch keywords); returns the states, conv states and each
    step's output."""
    outs = [torch.empty(slot_sets.shape[1], HEADS, HEAD_DIM, dtype=problem["q"].dtype, device=problem["q"].device)
            for _ in slot_sets]

    def steps() -> None:
        for i, slots in enumerate(slot_sets):
            if gemm is not None:
                torch.mm(*gemm, out=problem["q"])
            kda_decode_fused(**problem, slots=slots, out=outs[i], **plan)

    steps()  # compile outside the capture (states move one step; both runs do the same)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        steps()
    graph.replay()
    torch.cuda.synchronize()
    return [problem[n] for n in STATE_NAMES] + outs


def check_pdl_in_graphs(batch: int, slot_sets: torch.Tensor, device: torch.device) -> None:
    """The launcher's PDL plan against the same plan without PDL: bit for bit."""
    base = make_problem(batch, 512, device, seed=batch)
    units = torch.cuda.get_device_properties(device).multi_processor_count
    plan = dataclasses.asdict(launch_config(batch, HEADS, HEAD_DIM, HEAD_DIM, units, pdl=True))  # launch keywords
    for gemm in (None, q_projection(batch, device)):
        plain = graph_outputs(with_own_states(base), slot_sets, {**plan, "pdl": False}, gemm)
        with_pdl = graph_outputs(with_own_states(base), slot_sets, {**plan, "pdl": True}, gemm)
        if not all(torch.equal(a, b) for a, b in zip(plain, with_pdl, strict=True)):
            raise SystemExit(f"batch {batch}: PDL launches {'after a GEMM ' if gemm else ''}in a CUDA graph "
                             f"changed the states or outputs")
    print(f"batch {batch}: PDL in CUDA graphs leaves states and outputs bit-identical (with and without the GEMM)",
          flush=True)


def time_pieces(batch: int, slots: int, reps: int, device: torch.device, bandwidth: float) -> None:
    """Check PDL in graphs, then print every piece's us per step at one batch."""
    steps = slots // batch
    slot_sets = torch.randperm(slots, device=device)[: steps * batch].view(steps, batch)
    check_pdl_in_graphs(batch, slot_sets, device)
    floor = bytes_moved(batch, HEADS, HEAD_DIM, HEAD_DIM, CONV_K, 2) / bandwidth

    def report(name: str, fns: list) -> float:
        t = graph_time(fns, reps)
        print(f"batch {batch} {name}: {t * 1e6:.1f} us, {100 * floor / t:.0f}% of copy bw", flush=True)
        return t

    problem = make_problem(batch, slots, device, seed=batch)
    state = problem["state"]
    blocks = state.view(-1, HEAD_DIM * HEAD_DIM).split(batch * HEADS)  # consecutive slots, a step's bytes each
    report("torch add_", [functools.partial(torch.Tensor.add_, blocks[i], 1.0) for i in range(steps)])
    core = delta_core_inputs(batch, device)
    slot_starts = [torch.tensor([i * batch], device=device) for i in range(steps)]
    grid = (HEADS, batch)
    for pdl in (False, True):
        tag = " pdl" if pdl else ""
        launch = {"num_warps": 4, "launch_pdl": True} if pdl else {"num_warps": 4}
        rmw = _state_rmw_kernel[grid]
        report(f"state rmw{tag}", [functools.partial(rmw, state, s, HEADS, HEAD_DIM, HEAD_DIM, pdl, True, **launch)
                                   for s in slot_sets])
        report(f"state rmw contiguous{tag}", [
            functools.partial(rmw, state, s, HEADS, HEAD_DIM, HEAD_DIM, pdl, False, **launch) for s in slot_starts])
        for warps in (4, 8):
            report(f"delta core {warps} warps{tag}", [
                functools.partial(_delta_core_kernel[grid], state, s, core["q"], core["k"], core["decay"], core["v"],
                                  core["beta"], core["out"], HEADS, HEAD_DIM, HEAD_DIM, pdl,
                                  **{**launch, "num_warps": warps}) for s in slot_sets])
        for evict in (False, True):
            report(f"fused{' evict-first' if evict else ''}{tag}", [
                functools.partial(kda_decode_fused, **problem, slots=s, pdl=pdl, evict_state=evict)
                for s in slot_sets])
    x, w = q_projection(batch, device)
    ws = [w.clone() for _ in range(GEMM_WEIGHT_COPIES)]  # as each layer has its own: read from HBM
    gemms = [functools.partial(torch.mm, x, ws[i % len(ws)], out=problem["q"]) for i in range(steps)]
    t_gemm = report("gemm", gemms)
    for pdl in (False, True):
        fused = [functools.partial(kda_decode_fused, **problem, slots=s, pdl=pdl) for s in slot_sets]
        t = report(f"gemm + fused{' pdl' if pdl else ''}", [functools.partial(_in_turn, g, f)
                                                             for g, f in zip(gemms, fused, strict=True)])
        print(f"batch {batch} fused after the gemm{' (pdl)' if pdl else ''}: {(t - t_gemm) * 1e6:.1f} us, "
              f"{100 * floor / (t - t_gemm):.0f}% of copy bw", flush=True)


def _in_turn(*fns: Callable[[], object]) -> None:
    for fn in fns:
        fn()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="64,256")
    parser.add_argument("--slots", type=int, default=512)
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    device = torch.device("cuda", torch.cuda.current_device())
    bandwidth = copy_bandwidth(1 << 30, 10)
    print(f"{torch.cuda.get_device_name(device)}; copy bandwidth {bandwidth / 1e9:.0f} GB/s", flush=True)
    for batch in (int(b) for b in args.batches.split(",")):
        time_pieces(batch, args.slots, args.reps, device, bandwidth)


if __name__ == "__main__":
    main()
