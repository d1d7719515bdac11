"""KDA prefill at one TP8 rank's shapes (12 heads, D = DV = 128, bf16 q / k / v): the
Triton kernels of ``runtime/kernels/kda_prefill.py`` against fla-core's ``chunk_kda`` and
the op's torch reference. CUDA GPU only.

    python benchmarks/kda_prefill.py [--tokens 4096 32768] [--batches 1 8] [--reference-max 8192]
        [--groups 0 8 16] [--profile] [--sweep] [--state-sweep] [--prep-sweep] [--phases] [--host]
        [--part-costs] [--modules FILE ...]

Each case is ``batch`` sequences of ``tokens`` each, packed (cu_seqlens), from random
initial states, with K3's gate (lower bound -5). Timed eagerly (prefill is not captured in
a CUDA graph), CUDA events, median of 5 after a warm-up; the state copy each call starts
from is outside the timed span. Correctness first: the kernels' output and final states
against the reference (up to ``--reference-max`` tokens) and against fla. "k3 ms" is the
launcher's own choice of chunk groups (``kda_prefill_scan.group_size``, reported as
"groups"); "device-bound ms" times the same calls from their first kernel (the stream
spins while the host queues the call): what the host adds before that kernel is the
difference. ``--groups`` also times given group sizes (0: none). ``--profile``: device ms
per kernel of one call of ours and of fla's (torch profiler). ``--sweep``: ours at other
launch settings (the preparation's warps and W / U~ columns per block, the state pass's
warps, stages and state columns per program; the modules' tables patched for the call), ms
per setting. ``--state-sweep``: ours at other state-pass settings (warps, stages, the group
summaries' stages, state columns per program), each with the launcher's and every
``--groups`` size: ms per call and the state pass's device ms. ``--prep-sweep``: the
preparation's device ms at other warps, register caps (``maxnreg``) and A / Aq head-dim
slices. ``--phases``: the preparation's device time up to the end of each of its four
phases (norms and G, A and Aq, the inverse, W / U~), from copies of its kernel that return
there. ``--host``: the host's time to enqueue one call, the functions it spends it in, and
when each kernel ran on the device from the call's start. ``--part-costs``: the
preparation's device ms with each of its parts replaced by a stand-in (what the part
costs). ``--modules FILE ...``: whole calls of other versions of kda_prefill.py (e.g. a
commit's, from ``git show``) in the same process.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import inspect
import json
import statistics
import sys
import tempfile

import torch
import triton
from gpu_timing import eager_time

import k3compile.ops  # noqa: F401  (registers torch.ops.k3)
from k3compile.ops.kda import kda_gate, kda_prefill_reference
from k3compile.runtime.kernels import kda_prefill as kp
from k3compile.runtime.kernels import kda_prefill_scan as scan
from k3compile.runtime.kernels import packed_chunks
from k3compile.runtime.kernels.targets import compute_units

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


def ours(x: dict[str, torch.Tensor], state: torch.Tensor, group_chunks: int | None = None) -> torch.Tensor:
    return kp.kda_prefill(x["q"], x["k"], x["v"], x["g"], x["beta"], state, x["cu"], x["slots"], D**-0.5,
                          group_chunks=group_chunks)


def reference(x: dict[str, torch.Tensor], state: torch.Tensor) -> torch.Tensor:
    return kda_prefill_reference(x["q"], x["k"], x["v"], x["g"], x["beta"], state, x["cu"], x["slots"], D**-0.5)


def fla_chunk(x: dict[str, torch.Tensor], state: torch.Tensor) -> torch.Tensor:
    from fla.ops.kda import chunk_kda

    o, final = chunk_kda(x["q"][None], x["k"][None], x["v"][None], x["g"][None], x["beta"][None], scale=D**-0.5,
                         initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True,
                         cu_seqlens=x["cu"].long())
    state.copy_(final)
    return o[0]


#: GPU cycles the stream spins before a "device-bound" timed call (about 1 ms on an H200):
#: longer than the host takes to reach a call's first kernel
COVER_CYCLES = 2_000_000


def timed(fn, x: dict[str, torch.Tensor], repeats: int = 5, covered: bool = False) -> float:
    """ms per call, median; each call from a fresh copy of the initial states. ``covered``:
    timed from the call's first kernel (``gpu_timing.eager_time``'s ``cover_cycles``)."""
    return eager_time(lambda state: fn(x, state), repeats, setup=x["state"].clone,
                      cover_cycles=COVER_CYCLES if covered else 0)


#: --sweep's settings: (preparation warps and W / U~ columns, state-pass warps, its stages, state columns
#: per program)
SWEEP = [(4, 32, 8, 2, 32), (4, 64, 4, 2, 64), (8, 64, 8, 2, 32), (4, 64, 4, 2, 32), (4, 64, 8, 1, 64)]
#: --state-sweep's settings: (state-pass warps, its stages, the group summaries' stages, state columns per
#: program), each with every --groups size
STATE_SWEEP = [(4, 3, 2, 64), (4, 3, 3, 64), (4, 2, 2, 64), (4, 3, 1, 64), (4, 2, 1, 64), (4, 3, 2, 32)]


@contextlib.contextmanager
def launch_settings(prep_warps: int, w_block: int, scan_warps: int, stages: int, block_x: int):
    """The H200's (sm_90) launch tables of kda_prefill / kda_prefill_scan set for the block's calls."""
    saved = dict(kp.WARPS["sm_90"]), kp.W_BLOCK, dict(kp.SCAN_STAGES), dict(scan.BLOCK_X)
    kp.WARPS["sm_90"]["prep"], kp.W_BLOCK, kp.WARPS["sm_90"]["scan"] = prep_warps, w_block, scan_warps
    kp.SCAN_STAGES["sm_90"], scan.BLOCK_X["sm_90"] = stages, block_x
    try:
        yield
    finally:
        kp.WARPS["sm_90"], kp.W_BLOCK, kp.SCAN_STAGES, scan.BLOCK_X = saved


#: the kernels --state-sweep sums as the state pass's time
STATE_KERNELS = ("_kda_state_pass_kernel", "_kda_group_scan_kernel")


@contextlib.contextmanager
def state_settings(warps: int, stages: int, summary_stages: int, block_x: int):
    """The H200's state-pass warps, stages, group-summary stages and state columns set for the block's calls."""
    saved = kp.WARPS["sm_90"]["scan"], kp.SCAN_STAGES["sm_90"], kp.SUMMARY_STAGES["sm_90"], scan.BLOCK_X["sm_90"]
    kp.WARPS["sm_90"]["scan"], kp.SCAN_STAGES["sm_90"], kp.SUMMARY_STAGES["sm_90"], scan.BLOCK_X["sm_90"] = (
        warps, stages, summary_stages, block_x)
    try:
        yield
    finally:
        kp.WARPS["sm_90"]["scan"], kp.SCAN_STAGES["sm_90"], kp.SUMMARY_STAGES["sm_90"], scan.BLOCK_X["sm_90"] = saved


#: --prep-sweep's settings: (preparation warps, its register cap per thread or None, head-dim columns per
#: slice of its A / Aq products)
PREP_SWEEP = [(4, 168, 32), (4, None, 32), (4, 168, 64), (4, None, 64), (4, 128, 32)]


@contextlib.contextmanager
def prep_settings(warps: int, max_registers: int | None, head_slice: int):
    """The H200's preparation warps, register cap and A / Aq head-dim slice set for the block's calls."""
    saved = kp.WARPS["sm_90"]["prep"], kp.PREP_MAX_REGISTERS["sm_90"], kp.HEAD_SLICE["sm_90"]
    kp.WARPS["sm_90"]["prep"], kp.PREP_MAX_REGISTERS["sm_90"], kp.HEAD_SLICE["sm_90"] = warps, max_registers, head_slice
    try:
        yield
    finally:
        kp.WARPS["sm_90"]["prep"], kp.PREP_MAX_REGISTERS["sm_90"], kp.HEAD_SLICE["sm_90"] = saved


def kernel_ms(fn, x: dict[str, torch.Tensor]) -> dict[str, float]:
    """Device ms per kernel name of one call (after the timed ones: compiled and warm)."""
    from torch.profiler import ProfilerActivity, profile

    state = x["state"].clone()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(x, state)
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            totals[e.name[:60]] = totals.get(e.name[:60], 0.0) + e.device_time / 1e3
    return {k: round(v, 3) for k, v in sorted(totals.items(), key=lambda kv: -kv[1])[:12]}


#: the preparation's phase comments, in kda_prefill._kda_chunk_prep_kernel's source
PHASES = ("    # 2. A and Aq", "    # 3. T = (I + A)^-1", "    # 4. W, U~")


def module_copy(name: str, src: str):
    """``src`` (a kda_prefill.py) imported as module ``name`` from a temporary file (Triton
    compiles a kernel from its source file), its kernels not counted (``counted`` refuses
    two kernels of one name)."""
    path = f"{tempfile.mkdtemp()}/{name}.py"
    with open(path, "w") as f:
        f.write(src.replace("@counted\n@triton.jit", "@triton.jit"))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def edited(src: str, edits: list[tuple[str, str]]) -> str:
    """``src`` with each (old, new) replaced; each old must occur once."""
    for old, new in edits:
        assert src.count(old) == 1, f"{old!r} not found once in kda_prefill.py"
        src = src.replace(old, new)
    return src


@functools.cache
def stopped_prep_kernels() -> dict[int, object]:
    """Copies of the preparation kernel that return before phase 2, 3 and 4 (keys 1-3), once
    per process."""
    src = inspect.getsource(kp)
    return {stop: module_copy(f"kda_prefill_stopped_{stop}",
                              edited(src, [(marker, "    return\n" + marker)]))._kda_chunk_prep_kernel
            for stop, marker in enumerate(PHASES, start=1)}


def part_stand_ins(src: str) -> dict[str, list[tuple[str, str]]]:
    """--part-costs: parts of the preparation (``src``: kda_prefill.py) replaced by a stand-in
    of the same shape, as edits of its source (the results are wrong; only the
    preparation's time is read)."""
    inverse = src[src.index(PHASES[1]):src.index(PHASES[2])]
    skip_stores = [(f"        tl.store({p} + base", f"        if d0 < 0:\n            tl.store({p} + base")
                   for p in ("ke_ptr", "qg_ptr")]
    return {
        "the decays' cumsum": [("tl.cumsum(tl.load(g_ptr + qk_off, mask=valid[:, None], other=0.0), axis=0)",
                                "tl.load(g_ptr + qk_off, mask=valid[:, None], other=0.0)")],
        "A / Aq products": [("for d0 in range(0, D, BD):\n        dks", "for d0 in range(0, 0, BD):\n        dks")],
        "the keys' decays but one a slice": [("tl.exp2(tl.minimum(g_ref[None, :] - g_c, MAX_EXP2))",
                                              "tl.exp2(tl.minimum(-g_c, MAX_EXP2))")],
        "the inverse": [(inverse, "    block = rows[:, None] * BT + cols[None, :]\n\n")],
        "W / U~ products": [("w = tl.dot(Tw, (k_d * eG_d).to(w_ptr.dtype.element_ty).to(dot_ty), "
                             "input_precision=DOT_PRECISION)", "w = k_d * eG_d"),
                            ("u = tl.dot(Tw, v_e.to(w_ptr.dtype.element_ty).to(dot_ty), input_precision=DOT_PRECISION)",
                             "u = v_e.to(tl.float32)")],
        "q e^G and beta k e^{G_last - G}": skip_stores,
    }


def part_costs(x: dict[str, torch.Tensor]) -> dict[str, float]:
    """The preparation's device ms whole and with each of :func:`part_stand_ins` replaced:
    the difference is what the part costs where the programs overlap."""
    full = kp._kda_chunk_prep_kernel
    row = {"prep ms": min(kernel_ms(ours, x)["_kda_chunk_prep_kernel"] for _ in range(3))}
    src = inspect.getsource(kp)
    try:
        for i, (part, edits) in enumerate(part_stand_ins(src).items()):
            kp._kda_chunk_prep_kernel = module_copy(f"kda_prefill_part_{i}", edited(src, edits))._kda_chunk_prep_kernel
            ours(x, x["state"].clone())  # compile
            row[f"without {part} ms"] = min(kernel_ms(ours, x)["_kda_chunk_prep_kernel"] for _ in range(3))
    finally:
        kp._kda_chunk_prep_kernel = full
    return row


def module_rows(x: dict[str, torch.Tensor], paths: list[str]) -> dict[str, dict[str, float]]:
    """Whole calls of other kda_prefill.py files (e.g. ``git show REV:runtime/kernels/kda_prefill.py``)
    beside the installed one, in this process: their outputs' and states' error against the
    installed one's, ms per call, from the first kernel, and the preparation's device ms."""
    s_ours = x["state"].clone()
    o_ours = ours(x, s_ours)
    rows = {}
    for i, path in enumerate(paths):
        with open(path) as f:
            module = module_copy(f"kda_prefill_file_{i}", f.read())
        fn = lambda x, s: module.kda_prefill(x["q"], x["k"], x["v"], x["g"], x["beta"], s,  # noqa: E731
                                             x["cu"], x["slots"], D**-0.5)
        s_file = x["state"].clone()
        o_file = fn(x, s_file)
        rows[path] = {"err_vs_installed": (rel_err(o_file, o_ours), rel_err(s_file, s_ours)),
                      "ms": round(timed(fn, x), 3), "device-bound ms": round(timed(fn, x, covered=True), 3),
                      "prep ms": kernel_ms(fn, x)["_kda_chunk_prep_kernel"]}
    return rows


def phase_ms(x: dict[str, torch.Tensor]) -> dict[str, float]:
    """Device ms of the preparation up to the end of each phase (the later launches of
    those calls read unfinished workspaces; only the preparation is timed)."""
    full = kp._kda_chunk_prep_kernel
    row = {}
    try:
        for stop, kernel in [*stopped_prep_kernels().items(), (4, full)]:
            kp._kda_chunk_prep_kernel = kernel
            ours(x, x["state"].clone())  # compile
            row[f"prep to phase {stop} ms"] = kernel_ms(ours, x)["_kda_chunk_prep_kernel"]
    finally:
        kp._kda_chunk_prep_kernel = full
    return row


def enqueue_ms(fn, repeats: int = 5, setup=tuple) -> float:
    """The host's ms to run ``fn(*setup())`` (launches only: nothing in it synchronises), the
    median of ``repeats``, each after the device drained; ``setup`` untimed."""
    import time

    times = []
    for _ in range(repeats):
        args = setup()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(*args)
        times.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def host_time(x: dict[str, torch.Tensor], repeats: int = 5) -> dict[str, object]:
    """The host's time to enqueue one call of ours and, of that, the chunk table's, and the
    functions with the most own time (cProfile)."""
    import cProfile
    import pstats

    T = x["q"].shape[0]
    call = enqueue_ms(lambda state: ours(x, state), repeats, setup=lambda: (x["state"].clone(),))
    table = enqueue_ms(lambda: packed_chunks.chunk_table(x["cu"], T, kp.CHUNK), 20)
    prof = cProfile.Profile()
    state = x["state"].clone()
    torch.cuda.synchronize()
    prof.enable()
    ours(x, state)
    prof.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(prof).stats  # {(file, line, name): (calls, _, own s, cumulative s, _)}
    top = sorted(stats.items(), key=lambda kv: -kv[1][2])[:12]
    return {"enqueue ms": round(call, 3), "chunk table us": round(table * 1e3, 1),
            "own ms": {f"{k[0].rsplit('/', 1)[-1]}:{k[1]} {k[2]}": round(v[2] * 1e3, 3) for k, v in top},
            "kernels (start, end us from the call's start)": timeline(x)}


def timeline(x: dict[str, torch.Tensor]) -> list[tuple[str, int, int]]:
    """Each kernel of one call of ours: its name and its start and end on the device, in us
    from the host's entry into the call (torch profiler, CPU and CUDA)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    state = x["state"].clone()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function("kda_prefill call"):
            ours(x, state)
        torch.cuda.synchronize()
    events = prof.events()
    t0 = min(e.time_range.start for e in events if e.name == "kda_prefill call")
    kernels = sorted((e for e in events if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
    return [(e.name[:40], round(e.time_range.start - t0), round(e.time_range.end - t0)) for e in kernels]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 32768])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--reference-max", type=int, default=8192)
    ap.add_argument("--sweep", action="store_true", help="ours at other warps / stages / state tiles")
    ap.add_argument("--profile", action="store_true", help="device time per kernel of ours and fla's")
    ap.add_argument("--prep-sweep", action="store_true", help="the preparation at other warps / register caps")
    ap.add_argument("--phases", action="store_true", help="the preparation's time up to each phase")
    ap.add_argument("--groups", type=int, nargs="*", default=[], help="chunk-group sizes to time too (0: none)")
    ap.add_argument("--state-sweep", action="store_true",
                    help="ours at other state-pass settings, each with the launcher's and every --groups size")
    ap.add_argument("--host", action="store_true", help="the host's enqueue time of one call, and where it goes")
    ap.add_argument("--part-costs", action="store_true", help="the preparation with each of its parts replaced")
    ap.add_argument("--modules", nargs="*", default=[], help="other kda_prefill.py files to time beside")
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
                row[f"{name} device-bound ms"] = round(timed(fn, x, covered=True), 3)
            value_tiles = DV // min(scan.BLOCK_X["sm_90"], DV)
            row["groups"] = scan.group_size(batch, H, value_tiles, packed_chunks.worst_chunks(tokens * batch, batch, kp.CHUNK),
                                            compute_units(x["q"].device))
            row["k3 ms"] = round(timed(ours, x), 3)
            row["k3 device-bound ms"] = round(timed(ours, x, covered=True), 3)
            for G in args.groups:
                row[f"k3 groups={G} ms"] = round(timed(lambda x, s: ours(x, s, G), x), 3)
            if args.sweep:
                for setting in SWEEP:
                    with launch_settings(*setting):
                        row["k3 prep w{} /{} scan w{} stages {} x{} ms".format(*setting)] = round(timed(ours, x), 3)
            print(json.dumps(row), flush=True)
            if args.state_sweep:
                for setting in STATE_SWEEP:
                    with state_settings(*setting):
                        for G in [None, *args.groups]:
                            run = lambda x, s: ours(x, s, G)  # noqa: E731
                            case = {"state_sweep": setting, "groups": G, "batch": batch, "tokens": tokens}
                            try:
                                case["ms"] = round(timed(run, x), 3)
                            except triton.runtime.errors.OutOfResources as e:
                                print(json.dumps({**case, "error": str(e)[:80]}), flush=True)
                                continue
                            state = sum(v for k, v in kernel_ms(run, x).items() if k.startswith(STATE_KERNELS))
                            print(json.dumps({**case, "state ms": round(state, 3)}), flush=True)
            if args.host:
                print(json.dumps({"host": True, "batch": batch, "tokens": tokens, **host_time(x)}), flush=True)
            if args.prep_sweep:
                for setting in PREP_SWEEP:
                    with prep_settings(*setting):
                        ours(x, x["state"].clone())  # compile
                        prep = kernel_ms(ours, x)["_kda_chunk_prep_kernel"]
                    print(json.dumps({"prep_sweep": setting, "batch": batch, "tokens": tokens, "prep ms": prep}),
                          flush=True)
            if args.part_costs:
                print(json.dumps({"part_costs": True, "batch": batch, "tokens": tokens, **part_costs(x)}), flush=True)
            if args.modules:
                print(json.dumps({"modules": True, "batch": batch, "tokens": tokens, **module_rows(x, args.modules)}),
                      flush=True)
            if args.phases:
                print(json.dumps({"phases": True, "batch": batch, "tokens": tokens, **phase_ms(x)}), flush=True)
            if args.profile:
                for name, fn in {"k3": ours, **peers}.items():
                    print(json.dumps({"profile": name, "batch": batch, "tokens": tokens, **kernel_ms(fn, x)}), flush=True)


if __name__ == "__main__":
    main()
