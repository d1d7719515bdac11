"""Single-token KDA decode chain on one GPU: the fused kernel against the unfused chain and
fla-core's kernels, all under CUDA graphs, with the bytes floor from measured copy bandwidth.

    python benchmarks/kda_decode.py --out /tmp/kda-bench [--batches 1,8,64,256] [--reps 20]
    python benchmarks/kda_decode.py --out /tmp/kda-sweep --sweep     # launch-plan sweep only

Shapes: K3 per rank at TP8 (12 heads, D = DV = 128, conv kernel 4), bf16 activations, fp32
state, ``--slots`` state slots (512). Variants, each captured in a torch.cuda.CUDAGraph:

(a) ``fused``: ``kda_decode_fused``, one launch, as ``k3::kda_decode_fused`` launches it (with
    programmatic dependent launch on CUDA sm_90+; also timed without it), and a sweep over
    its value tile BV;
(b) ``unfused``: ``kda_decode_chain_reference`` (k3compile/ops/kda_fused.py), the repo's eager
    torch ops in model order;
(c) ``fla_stack``, what serving engines run today: fla's ``causal_conv1d_update`` on q|k|v in
    one launch (it takes no slot indices: the conv-cache rows of the batch are gathered before
    and scattered after, in fla's [S, C, K] cache layout), ``fused_recurrent_kda_fwd`` with the
    gate, q/k L2 norm and beta sigmoid in the kernel and the state updated in place through
    ``ssm_state_indices`` (older fla without them: gather/scatter the state, noted in the JSON),
    then fla's ``rms_norm_gated`` with a sigmoid gate;
(d) ``fla_recurrent``: the fla recurrent kernel alone, on already convolved q, k, v.

A graph holds ``slots // batch`` consecutive decode steps, each on a different set of slots,
so one replay touches every state slot once (403 MB at 512 slots, far over the 50 MB L2), as
the layers of a real decode step touch their own states; the time per step is the replay
time over the steps, median of ``--reps`` replays. Activations are reused by every step
(they come from the projection GEMM just before, so they are in L2 in a real step too).

Before timing, every fused variant and the fla stack are checked against the unfused chain on
the GPU (output, recurrent state, conv states); a fused mismatch aborts the run. fla-core is
optional: without it (c) and (d) are skipped with a note. Prints markdown tables; writes
``results.json`` to ``--out``.

``--sweep`` times the fused kernel alone under a grid of launch plans (``sweep_plans``: value
tile, value tiles per program, state tiles in flight, warps, evict-first hint on the state)
plus the launcher's default, each at every batch, the same way (CUDA graphs over all 512
slots), after checking every plan against the unfused chain in fp32 and bf16 at every batch.
It prints, per batch, every plan's us and % of copy bandwidth, fastest first, and the
fastest plan per batch; writes ``sweep.json``. One H200 run of it sets the launcher's
defaults (``choose_block_v``, ``MAX_TILES_PER_PROGRAM``, ``num_warps_for``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import json
from collections.abc import Callable
from pathlib import Path

import torch
import triton

from gpu_timing import copy_bandwidth, graph_time  # benchmarks/ is the script's directory
from k3compile.ops.kda_fused import kda_decode_chain_reference
from k3compile.runtime.kernels.kda_decode import kda_decode_fused
from k3compile.runtime.kernels.kda_decode_plans import (
    bytes_moved,
    launch_config,
    supports_pdl,
)

HEADS, HEAD_DIM, CONV_K = 12, 128, 4
LOWER_BOUND, EPS = -5.0, 1e-5
STATE_NAMES = ("conv_state_q", "conv_state_k", "conv_state_v", "state")
BLOCK_VS = (8, 16, 32, 64, 128)  # the launcher picks 16..128; 8 shows whether more programs help at batch 1


# --------------------------------------------------------------------------- inputs


def make_problem(
    batch: int, slots: int, device: torch.device, seed: int = 0, act: torch.dtype = torch.bfloat16
) -> dict[str, object]:
    """Weights, states and one step's activations (in ``act``) at K3 per-rank shapes:
    kda_decode_fused's keyword arguments without ``slots``."""
    gen = torch.Generator(device=device).manual_seed(seed)
    H, D, K, C = HEADS, HEAD_DIM, CONV_K, HEADS * HEAD_DIM
    bf16 = act

    def randn(*shape: int, dtype: torch.dtype = torch.float32, std: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=device) * std).to(dtype)

    return {
        "q": randn(batch, C, dtype=bf16), "k": randn(batch, C, dtype=bf16), "v": randn(batch, C, dtype=bf16),
        "conv_weight_q": randn(C, K, std=0.5), "conv_weight_k": randn(C, K, std=0.5),
        "conv_weight_v": randn(C, K, std=0.5),
        "conv_state_q": randn(slots, C, K - 1, dtype=bf16), "conv_state_k": randn(slots, C, K - 1, dtype=bf16),
        "conv_state_v": randn(slots, C, K - 1, dtype=bf16),
        "a": randn(batch, C, dtype=bf16), "A_log": randn(H, std=0.5), "dt_bias": randn(C),
        "lower_bound": LOWER_BOUND, "beta": randn(batch, H, dtype=bf16),
        "state": randn(slots, H, D, D, std=0.05), "scale": D**-0.5,
        "gate": randn(batch, C, dtype=bf16), "norm_weight": 1.0 + randn(D, std=0.1), "eps": EPS,
    }


def with_own_states(problem: dict[str, object]) -> dict[str, object]:
    return {n: v.clone() if n in STATE_NAMES else v for n, v in problem.items()}


# --------------------------------------------------------------------------- fla peer


class FlaPeer:
    """fla-core's decode kernels with our state tensor, set up once per problem."""

    def __init__(self, problem: dict[str, object]):
        from fla.modules.causal_conv1d import causal_conv1d_update
        from fla.modules.norm.fused_norm_gate import rms_norm_gated
        from fla.ops.kda import fused_recurrent as fla_recurrent

        self.conv_update, self.norm = causal_conv1d_update, rms_norm_gated
        self.recurrent_indexed = fla_recurrent.fused_recurrent_kda_fwd  # what vLLM calls at decode
        self.recurrent_public = fla_recurrent.fused_recurrent_kda
        self.indexed_state = fla_indexed_state()
        p = problem
        self.p = p
        # fla's conv cache keeps the last K inputs per channel ([S, C, K]); ours the last K-1.
        stored = torch.cat([p["conv_state_q"], p["conv_state_k"], p["conv_state_v"]], dim=1)
        self.conv_cache = torch.cat([torch.zeros_like(stored[..., :1]), stored], dim=2).contiguous()
        self.conv_weight = torch.cat([p["conv_weight_q"], p["conv_weight_k"], p["conv_weight_v"]], dim=0)
        self.qkv = torch.cat([p["q"], p["k"], p["v"]], dim=1)

    def recurrent_step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """fused_recurrent_kda_fwd on convolved q, k, v [B, H, D]: gate, L2 norms, beta sigmoid
        in the kernel; returns o [B, H, DV]."""
        p, B = self.p, q.shape[0]
        kwargs = dict(
            q=q.view(B, 1, HEADS, HEAD_DIM), k=k.view(B, 1, HEADS, HEAD_DIM), v=v.view(B, 1, HEADS, HEAD_DIM),
            g=p["a"].view(B, 1, HEADS, HEAD_DIM), beta=p["beta"].view(B, 1, HEADS), A_log=p["A_log"],
            dt_bias=p["dt_bias"], scale=p["scale"], use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
            use_beta_sigmoid_in_kernel=True, lower_bound=p["lower_bound"],
        )
        if self.indexed_state:
            o, _ = self.recurrent_indexed(initial_state=p["state"], inplace_final_state=True,
                                          ssm_state_indices=slots, **kwargs)
        else:
            o, final = self.recurrent_public(initial_state=p["state"][slots], output_final_state=True, **kwargs)
            p["state"].index_copy_(0, slots, final)
        return o.view(B, HEADS, HEAD_DIM)

    def stack_step(self, slots: torch.Tensor) -> torch.Tensor:
        """conv (one launch for q|k|v) + recurrent + gated RMSNorm."""
        p, B, C = self.p, self.qkv.shape[0], HEADS * HEAD_DIM
        cache = self.conv_cache[slots]
        y, _ = self.conv_update(self.qkv, cache, weight=self.conv_weight, activation="silu")
        self.conv_cache.index_copy_(0, slots, cache)
        q, k, v = y[:, :C], y[:, C:2 * C], y[:, 2 * C:]
        o = self.recurrent_step(q.contiguous(), k.contiguous(), v.contiguous(), slots)
        return self.norm(o, p["gate"].view(B, HEADS, HEAD_DIM), p["norm_weight"], None, activation="sigmoid",
                         eps=p["eps"])

    def conv_states(self) -> list[torch.Tensor]:
        """The cache in our layout (the last K-1 inputs), per q, k, v."""
        return list(self.conv_cache[..., 1:].split(HEADS * HEAD_DIM, dim=1))


def fla_indexed_state() -> bool:
    """Whether fla's recurrent KDA kernel reads and writes state rows by index (in place)."""
    from fla.ops.kda import fused_recurrent as fla_recurrent

    params = inspect.signature(fla_recurrent.fused_recurrent_kda_fwd).parameters
    return "ssm_state_indices" in params and "inplace_final_state" in params


def fla_available() -> str | None:
    """A note naming fla-core and how its peer runs, or None (printed) when it is unusable."""
    try:
        import fla

        indexed = fla_indexed_state()
    except Exception as e:  # not installed, or built for another torch
        print(f"fla-core unavailable ({type(e).__name__}: {e}): peers (c) and (d) skipped")
        return None
    how = ("state updated in place via ssm_state_indices" if indexed
           else "old fla: state gathered/scattered around the kernel")
    return f"fla-core {getattr(fla, '__version__', '?')}: {how}; conv cache rows gathered/scattered"


# --------------------------------------------------------------------------- checks


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def check_fused(batch: int, slots: int, block_v: int | None, act: torch.dtype, device: torch.device,
                plan: dict[str, object] | None = None, problem: dict[str, object] | None = None) -> dict:
    """Fused (``block_v``, or the launch ``plan``: kda_decode_fused's launch keywords) vs the
    unfused chain on the GPU, on ``problem`` if given (not modified); raises SystemExit on a
    mismatch.

    fp32 activations: every value within 1e-4. bf16: both paths round the conv outputs to bf16,
    and a last-bit difference of the fp32 conv sums (FMA, summation order) can round one of the
    ~4600 values per sequence the other way, moving one state row or column by ~1e-3; so at most
    1% of the state may differ by more than 1e-4 (a real bug moves nearly all of it).
    """
    if problem is None:
        problem = make_problem(batch, slots, device, seed=batch, act=act)
    plan = {"block_v": block_v} if plan is None else plan
    slot_ids = torch.randperm(slots, device=device)[:batch]
    fused, ref = with_own_states(problem), with_own_states(problem)
    y = kda_decode_fused(**fused, slots=slot_ids, **plan)
    y_ref = kda_decode_chain_reference(**ref, slots=slot_ids)
    state_off = ((fused["state"] - ref["state"]).abs() > 1e-4 + 1e-4 * ref["state"].abs()).float().mean().item()
    errs = {"out": max_err(y, y_ref), "state": max_err(fused["state"], ref["state"]), "state_off": state_off}
    conv_equal = all(torch.equal(fused[n], ref[n]) for n in STATE_NAMES[:3])
    tol = 1e-4 if act == torch.float32 else 2e-2
    ok = conv_equal and torch.allclose(y.float(), y_ref.float(), rtol=tol, atol=tol)
    ok = ok and (state_off == 0 if act == torch.float32 else state_off < 0.01)
    if not ok:
        raise SystemExit(f"fused kernel mismatch at batch {batch}, {plan}, {act}: {errs}, "
                         f"conv states equal: {conv_equal}")
    return errs


def check_fla(batch: int, slots: int, device: torch.device) -> dict[str, float]:
    """The fla stack vs the unfused chain (max abs errors; the caller flags a mismatch)."""
    problem = make_problem(batch, slots, device, seed=batch)
    slot_ids = torch.randperm(slots, device=device)[:batch]
    ref = with_own_states(problem)
    peer = FlaPeer(with_own_states(problem))
    y = peer.stack_step(slot_ids)
    y_ref = kda_decode_chain_reference(**ref, slots=slot_ids)
    ours = [ref[n][slot_ids] for n in STATE_NAMES[:3]]
    conv_err = max(max_err(a[slot_ids], b) for a, b in zip(peer.conv_states(), ours, strict=True))
    return {"out": max_err(y, y_ref), "state": max_err(peer.p["state"], ref["state"]), "conv_state": conv_err}


# --------------------------------------------------------------------------- timing


def graph_time_per_step(step: Callable[[int], object], steps: int, reps: int) -> float:
    """Seconds per step: ``steps`` calls captured in one CUDA graph, median over replays."""
    return graph_time([functools.partial(step, i) for i in range(steps)], reps)


def time_batch(batch: int, slots: int, reps: int, device: torch.device, use_fla: bool) -> dict[str, object]:
    """Per-step seconds of every variant at one batch size (one shared problem, states mutate)."""
    steps = max(1, slots // batch)
    slot_sets = torch.randperm(slots, device=device)[: steps * batch].view(steps, batch)
    problem = make_problem(batch, slots, device, seed=batch)
    times: dict[str, float] = {}
    pdl = supports_pdl(device)  # as k3::kda_decode_fused launches it
    times["fused"] = graph_time_per_step(lambda i: kda_decode_fused(**problem, slots=slot_sets[i], pdl=pdl), steps,
                                         reps)
    times["fused_no_pdl"] = graph_time_per_step(lambda i: kda_decode_fused(**problem, slots=slot_sets[i]), steps,
                                                reps) if pdl else None
    for bv in BLOCK_VS:
        times[f"fused_bv{bv}"] = graph_time_per_step(
            lambda i, bv=bv: kda_decode_fused(**problem, slots=slot_sets[i], block_v=bv), steps, reps)
    times["unfused"] = graph_time_per_step(
        lambda i: kda_decode_chain_reference(**problem, slots=slot_sets[i]), steps, reps)
    if use_fla:
        peer = FlaPeer(problem)
        times["fla_stack"] = graph_time_per_step(lambda i: peer.stack_step(slot_sets[i]), steps, reps)
        qc, kc, vc = (t.view(batch, HEADS, HEAD_DIM) for t in (problem["q"], problem["k"], problem["v"]))
        times["fla_recurrent"] = graph_time_per_step(
            lambda i: peer.recurrent_step(qc, kc, vc, slot_sets[i]), steps, reps)
    return {"steps_per_graph": steps, "times_s": times}


# --------------------------------------------------------------------------- report


def run_checks(batches: list[int], slots: int, device: torch.device, fla_note: str | None) -> tuple[dict, str | None]:
    """Fused (every tile width) and fla stack vs the reference at every batch; returns the max
    errors and the fla note (None: no fla peer; it names a mismatch or an fla API failure)."""
    checks: dict[str, object] = {}
    for b in batches:
        for act in (torch.float32, torch.bfloat16):
            for bv in (None, *BLOCK_VS):
                checks[f"fused_b{b}_bv{bv or 'auto'}_{act}"] = check_fused(b, slots, bv, act, device)
            if supports_pdl(device):
                checks[f"fused_b{b}_pdl_{act}"] = check_fused(b, slots, None, act, device, plan={"pdl": True})
        if fla_note is None:
            continue
        try:
            errs = checks[f"fla_b{b}"] = check_fla(b, slots, device)
        except Exception as e:  # an fla API this script does not know: drop the peer
            print(f"fla peer dropped: {type(e).__name__}: {e}")
            return checks, None
        if errs["out"] > 2e-2 or errs["state"] > 1e-4 or errs["conv_state"] > 0:
            fla_note += f"; MISMATCH of the fla stack vs the reference at batch {b}: {errs}"
    return checks, fla_note


def measure(batch: int, slots: int, reps: int, device: torch.device, use_fla: bool, units: int,
            bandwidth: float) -> dict[str, object]:
    """One table row: times of every variant, the launch plan and the bytes floor."""
    timed = time_batch(batch, slots, reps, device, use_fla)
    t = timed["times_s"]
    floor_bytes = bytes_moved(batch, HEADS, HEAD_DIM, HEAD_DIM, CONV_K, 2)
    config = launch_config(batch, HEADS, HEAD_DIM, HEAD_DIM, units, pdl=supports_pdl(device))  # what "fused" ran
    return {
        "batch": batch, "block_v": config.block_v, "tiles_per_program": config.tiles_per_program,
        "programs": batch * HEADS * config.programs_per_head(HEAD_DIM),
        "steps_per_graph": timed["steps_per_graph"], "floor_bytes": floor_bytes, "floor_s": floor_bytes / bandwidth,
        "fraction_of_copy_bw": floor_bytes / bandwidth / t["fused"], **{f"{k}_s": v for k, v in t.items()},
    }


def us(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e6:.1f}"


def markdown(rows: list[dict[str, object]]) -> str:
    """The comparison table and the tile-width sweep."""
    lines = [
        "| batch | BV | programs | floor us | fused us | fused at % of copy bw | fused without PDL us | unfused us "
        "| fla stack us | fla recurrent us | unfused / fused | fla stack / fused |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        fla_s, fused = r.get("fla_stack_s"), r["fused_s"]
        tiles = r.get("tiles_per_program", 1)
        cells = [r["batch"], f"{r['block_v']} x {tiles}" if tiles > 1 else r["block_v"], r["programs"], us(r["floor_s"]), us(fused),
                 f"{100 * r['fraction_of_copy_bw']:.0f}%", us(r.get("fused_no_pdl_s")), us(r["unfused_s"]), us(fla_s),
                 us(r.get("fla_recurrent_s")), f"{r['unfused_s'] / fused:.1f}x",
                 "-" if fla_s is None else f"{fla_s / fused:.2f}x"]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    lines += ["", "fused kernel by value tile, without PDL (us per step):", "",
              "| batch | " + " | ".join(f"BV={bv}" for bv in BLOCK_VS) + " |",
              "|---|" + "---|" * len(BLOCK_VS)]
    for r in rows:
        lines.append(f"| {r['batch']} | " + " | ".join(us(r[f"fused_bv{bv}_s"]) for bv in BLOCK_VS) + " |")
    return "\n".join(lines)


# --------------------------------------------------------------------------- launch-plan sweep


def sweep_plans() -> list[dict[str, object]]:
    """Launch plans for --sweep (kda_decode_fused keywords; ``{}`` is the launcher's default).

    One tile per program: value tiles 8 to 128 with 1 to 8 warps, 16 to 64 state values per
    thread. Several tiles per program (q/k work once per program; with all of a head's tiles,
    no arrival counter): tiles 16 to 64, 2 to 8 per program, 16 or 32 state values per thread
    and tile, 1 or 2 tiles in flight (3 too at 16 values). And the default plans at the
    H200's batches (tile 16 and 32) with the evict-first hint on the state."""
    values = HEAD_DIM // 32  # state values per thread and value column, per warp
    plans: list[dict[str, object]] = [{}]
    for bv in (8, 16, 32, 64, 128):
        for warps in (1, 2, 4, 8):
            if 16 <= values * bv // warps <= 64:
                plans.append({"block_v": bv, "tiles_per_program": 1, "num_warps": warps})
    for bv in (16, 32, 64):
        for tiles in (2, 4, 8):
            for warps in (1, 2, 4, 8):
                per_thread = values * bv // warps
                if bv * tiles > HEAD_DIM or per_thread not in (16, 32):
                    continue
                for stages in (1, 2, 3) if per_thread == 16 and tiles >= 4 else (1, 2):
                    plans.append({"block_v": bv, "tiles_per_program": tiles, "num_stages": stages,
                                  "num_warps": warps})
    for bv in (16, 32):
        plans.append({"block_v": bv, "tiles_per_program": 1, "evict_state": True})
    return plans + register_cap_plans()


def register_cap_plans() -> list[dict[str, object]]:
    """Value tiles 32 to 128 on 4 warps with a register cap (``max_registers``, CUDA's
    maxnreg): more resident programs per SM, so more state reads in flight and programs in
    different phases (read, update, write), at the price of spills."""
    caps = {32: (56, 64), 64: (80, 96, 104), 128: (128, 160)}
    return [{"block_v": bv, "tiles_per_program": 1, "num_warps": 4, "max_registers": r}
            for bv, rs in caps.items() for r in rs]


def evict_plans() -> list[dict[str, object]]:
    """The evict-first hint on and off, on whole rows (tile 128) and tile 64, 4 warps: the
    launcher turns it on for whole rows only below two programs per CU."""
    return [{"block_v": bv, "tiles_per_program": 1, "num_warps": 4, "evict_state": e}
            for bv in (128, 64) for e in (True, False)]


def pdl_plans() -> list[dict[str, object]]:
    """Programmatic dependent launch on whole rows and tile 64, with the warps and register
    caps that decide how many programs an SM holds: whole rows on 4 warps need 198 registers
    (2 programs per SM), on 8 warps 141 (1 program; 2 at 128 or fewer), tile 64 on 4 warps 125
    (4 programs). And a head's row as several tiles per program, all in flight: two of 64
    (the launcher's plan under PDL) or four of 32."""
    plans: list[dict[str, object]] = [{"pdl": True}]
    for bv, warps, caps in ((128, 4, (None, 168)), (128, 8, (None, 128, 120)), (64, 4, (None, 96))):
        for cap in caps:
            for pdl in (False, True):
                plan = {"block_v": bv, "tiles_per_program": 1, "num_warps": warps, "pdl": pdl}
                plans.append(plan if cap is None else {**plan, "max_registers": cap})
    for bv, tiles, stages in ((64, 2, 2), (32, 4, 3), (32, 4, 2)):
        for pdl in (False, True):
            plans.append({"block_v": bv, "tiles_per_program": tiles, "num_stages": stages, "num_warps": 4,
                          "pdl": pdl})
    return plans


def plan_name(plan: dict[str, object]) -> str:
    if not plan:
        return "default"
    short = {"block_v": "BV", "tiles_per_program": "NT", "num_stages": "NS", "num_warps": "W", "max_registers": "R"}
    name = " ".join(f"{short[k]}{v}" for k, v in plan.items() if k in short)
    return name + (" evict-first" if plan.get("evict_state") else "") + (" pdl" if plan.get("pdl") else "")


def run_sweep(batches: list[int], slots: int, reps: int, device: torch.device, units: int,
              bandwidth: float, plans: list[dict[str, object]]) -> list[dict[str, object]]:
    """Check every plan at every batch (fp32 and bf16), then time each (bf16): one row per
    (batch, plan) with the resolved launch config."""
    for b in batches:
        for act in (torch.float32, torch.bfloat16):
            problem = make_problem(b, slots, device, seed=b, act=act)
            for plan in plans:
                check_fused(b, slots, None, act, device, plan=plan, problem=problem)
        print(f"batch {b}: {len(plans)} plans match the unfused chain (fp32 and bf16)", flush=True)
    rows = []
    for b in batches:
        floor_bytes = bytes_moved(b, HEADS, HEAD_DIM, HEAD_DIM, CONV_K, 2)
        times = time_plans(b, slots, reps, device, plans, floor_bytes / bandwidth)
        for plan, t in zip(plans, times, strict=True):
            config = launch_config(b, HEADS, HEAD_DIM, HEAD_DIM, units, **plan)
            rows.append({"batch": b, "plan": plan_name(plan), "config": dataclasses.asdict(config),
                         "programs": b * HEADS * config.programs_per_head(HEAD_DIM), "time_s": t,
                         "floor_s": floor_bytes / bandwidth, "fraction_of_copy_bw": floor_bytes / bandwidth / t})
    return rows


def time_plans(batch: int, slots: int, reps: int, device: torch.device, plans: list[dict[str, object]],
               floor_s: float) -> list[float]:
    """Per-step seconds of the fused kernel under each launch plan (one shared problem, as
    time_batch); prints each as it comes, so that a run cut short still reports."""
    steps = max(1, slots // batch)
    slot_sets = torch.randperm(slots, device=device)[: steps * batch].view(steps, batch)
    problem = make_problem(batch, slots, device, seed=batch)
    times = []
    for plan in plans:
        t = graph_time_per_step(lambda i, plan=plan: kda_decode_fused(**problem, slots=slot_sets[i], **plan), steps,
                                reps)
        print(f"  batch {batch} {plan_name(plan)}: {us(t)} us, {100 * floor_s / t:.0f}% of copy bw", flush=True)
        times.append(t)
    return times


def sweep_markdown(rows: list[dict[str, object]]) -> str:
    """Per batch: every plan, fastest first (default marked); then the fastest plan per batch."""
    lines, best = [], []
    for b in dict.fromkeys(r["batch"] for r in rows):
        batch_rows = sorted((r for r in rows if r["batch"] == b), key=lambda r: r["time_s"])
        default = next(r for r in batch_rows if r["plan"] == "default")
        c = default["config"]
        title = (f"batch {b} (default = BV{c['block_v']} NT{c['tiles_per_program']} NS{c['num_stages']} "
                 f"W{c['num_warps']}{' evict-first' if c['evict_state'] else ''}: {us(default['time_s'])} us):")
        lines += [title, "", "| plan | programs | us | % of copy bw | default / plan |", "|---|---|---|---|---|"]
        for r in batch_rows:
            lines.append(f"| {r['plan']} | {r['programs']} | {us(r['time_s'])} | "
                         f"{100 * r['fraction_of_copy_bw']:.0f}% | {default['time_s'] / r['time_s']:.2f}x |")
        lines.append("")
        top = batch_rows[0]
        best.append(f"| {b} | {top['plan']} | {us(top['time_s'])} | {100 * top['fraction_of_copy_bw']:.0f}% | "
                    f"{us(default['time_s'])} | {100 * default['fraction_of_copy_bw']:.0f}% |")
    lines += ["fastest plan per batch:", "", "| batch | plan | us | % of copy bw | default us | default % |",
              "|---|---|---|---|---|---|", *best]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--batches", default="1,8,64,256")
    parser.add_argument("--slots", type=int, default=512)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--sweep", action="store_true", help="time a grid of launch plans of the fused kernel only")
    parser.add_argument("--sweep-only", choices=("register-caps", "evict", "pdl"),
                        help="with --sweep: only these plans (and the default)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA (or ROCm) GPU")
    device = torch.device("cuda", torch.cuda.current_device())
    batches = [int(b) for b in args.batches.split(",")]
    units = torch.cuda.get_device_properties(device).multi_processor_count
    torch.manual_seed(0)
    if args.sweep:
        bandwidth = copy_bandwidth(1 << 30, 10)
        only = {"register-caps": register_cap_plans, "evict": evict_plans, "pdl": pdl_plans}.get(args.sweep_only)
        plans = [{}, *only()] if only else sweep_plans()
        rows = run_sweep(batches, args.slots, args.reps, device, units, bandwidth, plans)
        print(f"\n{torch.cuda.get_device_name(device)}, {units} SMs/CUs; copy bandwidth {bandwidth / 1e9:.0f} GB/s; "
              f"{len(plans)} launch plans, bf16 activations\n")
        print(sweep_markdown(rows))
        result = {"device": torch.cuda.get_device_name(device), "compute_units": units, "torch": torch.__version__,
                  "triton": triton.__version__, "copy_bandwidth_Bps": bandwidth, "slots": args.slots,
                  "reps": args.reps, "rows": rows}
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "sweep.json").write_text(json.dumps(result, indent=1))
        print(f"\nwrote {args.out / 'sweep.json'}")
        return
    fla_note = fla_available()
    checks, fla_note = run_checks(batches, args.slots, device, fla_note)
    bandwidth = copy_bandwidth(1 << 30, 10)
    rows = [measure(b, args.slots, args.reps, device, fla_note is not None, units, bandwidth) for b in batches]

    print(f"\n{torch.cuda.get_device_name(device)}, {units} SMs/CUs; copy bandwidth {bandwidth / 1e9:.0f} GB/s; "
          f"{fla_note or 'fla-core peers skipped'}\n")
    print(markdown(rows))
    result = {
        "device": torch.cuda.get_device_name(device), "compute_units": units, "torch": torch.__version__,
        "triton": triton.__version__, "fla": fla_note, "copy_bandwidth_Bps": bandwidth,
        "shape": {"heads": HEADS, "head_dim": HEAD_DIM, "conv_kernel": CONV_K, "slots": args.slots,
                  "activations": "bf16", "state": "fp32"},
        "reps": args.reps, "checks_max_abs_err": checks, "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=1))
    print(f"\nwrote {args.out / 'results.json'}")


if __name__ == "__main__":
    main()
