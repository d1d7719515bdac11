"""Fused KDA decode kernel: against the unfused chain of k3 ops (Triton interpreter on CPU),
argument checks, the launch plan, and AOT compilation for gfx950 / gfx942 / sm_90 at K3 shapes.

Triton modes. ``@triton.jit`` makes an interpreter wrapper or a compilable function when the
decorator runs, reading TRITON_INTERPRET then, and triton.language's own jit functions
(``tl.sum``, ``tl.sigmoid``) are made when triton is first imported. So, as in every test file
that imports Triton, TRITON_INTERPRET is set at the top, before Triton is imported (no GPU).
The interpreter tests need the kernel and triton.language both interpreted; AOT compilation
needs a compilable kernel (aot compiles in a subprocess when triton.language is interpreted).
When another module of the session imported Triton before the variable was set, the kernel is
interpreted but triton.language is not, and neither works here: those tests then run in one
child pytest per mode, started with the right environment, and pass here if their twins
passed there.

Tolerances: tests/tolerances.py (KDA_Y, KDA_STATE, KDA_STATE_FLIP; why each, at ``_check_step``).
K3's per-rank shapes (12 heads, D = DV = 128) run with each plan the launcher picks
(``test_k3_per_rank_shapes_with_the_launchers_plans``), on tests/fast_interpreter.py.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is first imported

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402
from fast_interpreter import fast_interpreter  # noqa: E402
from tolerances import (  # noqa: E402
    KDA_STATE, KDA_STATE_FLIP, KDA_Y, assert_close_scaled, assert_within, reference_scale, unit_roundoff,
)

from k3compile.ops.kda_fused import kda_decode_chain_reference  # noqa: E402
from k3compile.runtime.kernels import aot  # noqa: E402
from k3compile.runtime.kernels import kda_decode as kda  # noqa: E402
from k3compile.runtime.kernels import kda_decode_kernel as kk  # noqa: E402
from k3compile.runtime.kernels import kda_decode_plans as kp  # noqa: E402

STATE_NAMES = ("conv_state_q", "conv_state_k", "conv_state_v", "state")

KERNEL_INTERPRETED = not isinstance(kk.kda_decode_kernel, JITFunction)
# What each mode needs, and whether this process has it.
CAN_INTERPRET = KERNEL_INTERPRETED and aot._language_interpreted()
CAN_COMPILE = not KERNEL_INTERPRETED or aot._language_interpreted()
_CHILD_ENV = "K3_TEST_KDA_DECODE_CHILD"
# The tests that need one mode (each starts with runs_here); a child runs only these.
_MODE_TESTS = {"interpret": "test_fused_matches_unfused_chain or test_op_kernel_prepares_its_arguments or "
                           "test_k3_per_rank_shapes or test_proj_op_runs_one_gemm_over_consecutive_weights",
               "compile": "test_aot_compiles_and_fits or test_pdl_reads_only_the_state_before_waiting"}
_child_runs: dict[str, tuple[dict[str, str], str]] = {}


def _run_child(mode: str) -> tuple[dict[str, str], str]:
    """Run the tests of ``mode`` in a child pytest set up for it: ({test name: outcome}, output)."""
    env = {**os.environ, _CHILD_ENV: "1"}
    if mode == "interpret":
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)
    cmd = [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", str(Path(__file__).resolve()),
           "-k", _MODE_TESTS[mode]]
    # From the tests folder: ``python -m pytest`` puts its cwd first on sys.path, and the
    # repository root would shadow an installed (non-editable) k3compile with the source
    # folder, which lacks k3compile.runtime and k3compile.passes.
    proc = subprocess.run(cmd, check=False, cwd=Path(__file__).parent, env=env, capture_output=True, text=True,
                          timeout=600)
    output = proc.stdout + proc.stderr
    lines = re.finditer(r"^(PASSED|FAILED|ERROR) (.+?)(?: - .*)?$", output, re.MULTILINE)
    # Keyed by the test's name within this file: the child's node ids are relative to its
    # own working directory, the parent's to wherever pytest was started.
    outcomes = {m.group(2).split("::", 1)[-1]: m.group(1) for m in lines}
    return outcomes, output


def runs_here(request: pytest.FixtureRequest, mode: str) -> bool:
    """True if this process can run a test of ``mode`` ("interpret" or "compile"). Otherwise
    the test has run in a child pytest of that mode (asserted passed here): return."""
    if CAN_INTERPRET if mode == "interpret" else CAN_COMPILE:
        return True
    if os.environ.get(_CHILD_ENV):
        pytest.fail(f"the child pytest for {mode} cannot {mode} either")
    if mode not in _child_runs:
        _child_runs[mode] = _run_child(mode)
    outcomes, output = _child_runs[mode]
    outcome = outcomes.get(request.node.nodeid.split("::", 1)[-1])
    assert outcome == "PASSED", f"{request.node.nodeid}: {outcome} in the child pytest\n{output[-8000:]}"
    return False


# GPUs (and torch) round fp32 -> bf16 to nearest even, Triton 3.9's interpreter truncates:
# the chain rounds to the model dtype at three places, so without conftest's
# interpreter_rounds_like_gpus the bf16 comparison could only be loose.
pytestmark = pytest.mark.usefixtures("interpreter_rounds_like_gpus")


@pytest.fixture(scope="module", autouse=True)
def interpreter_reduces_in_a_tree():
    """The kernel's paired sums (``tl.reduce`` with its own combine function) cost Triton's
    interpreter one Python call per element: tests/fast_interpreter.py calls it once per
    halving instead (a K3-shape launch at batch 1: 120 -> 13 s under load). Integer
    overflow checks stay on here (the K3-shape test turns them off)."""
    with fast_interpreter(overflow_checks=True):
        yield


# --------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class Case:
    batch: int
    heads: int
    head_dim: int
    head_dim_v: int
    block_v: int | None  # None: the launcher's choice (BV == DV on CPU)
    dtype: torch.dtype
    num_slots: int = 8
    conv_kernel: int = 4
    # the other launch choices (None: the launcher's); the interpreter ignores num_warps, but
    # the launcher must still pass it through
    tiles_per_program: int | None = None
    num_stages: int | None = None
    num_warps: int | None = None
    evict_state: bool | None = None

    def launch(self) -> dict[str, object]:
        return {"block_v": self.block_v, "tiles_per_program": self.tiles_per_program, "num_stages": self.num_stages,
                "num_warps": self.num_warps, "evict_state": self.evict_state}

    def id(self) -> str:
        plan = "".join(f"-{short}{value}" for short, value in (
            ("NT", self.tiles_per_program), ("NS", self.num_stages), ("W", self.num_warps),
            ("EV", self.evict_state)) if value is not None)
        return (f"B{self.batch}-H{self.heads}-D{self.head_dim}x{self.head_dim_v}-BV{self.block_v}{plan}-"
                f"{str(self.dtype).removeprefix('torch.')}")


def make_inputs(case: Case, seed: int) -> tuple[dict[str, object], list[dict[str, torch.Tensor]]]:
    """Weights and states (shared by both paths) and two decode steps of per-token inputs.
    Slots: a random subset of the state rows in random order."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int, dtype: torch.dtype = torch.float32, std: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).to(dtype)

    B, H, D, DV, K, S, act = (case.batch, case.heads, case.head_dim, case.head_dim_v, case.conv_kernel,
                              case.num_slots, case.dtype)
    fixed: dict[str, object] = {
        "conv_weight_q": randn(H * D, K, std=0.5),
        "conv_weight_k": randn(H * D, K, std=0.5),
        "conv_weight_v": randn(H * DV, K, std=0.5),
        "conv_state_q": randn(S, H * D, K - 1, dtype=act),
        "conv_state_k": randn(S, H * D, K - 1, dtype=act),
        "conv_state_v": randn(S, H * DV, K - 1, dtype=act),
        "A_log": randn(H, std=0.5),
        "dt_bias": randn(H * D),
        "lower_bound": -5.0,
        "state": randn(S, H, D, DV, std=0.3),
        "slots": torch.randperm(S, generator=gen)[:B],
        "scale": D**-0.5,
        "norm_weight": 1.0 + randn(DV, std=0.2),
        "eps": 1e-5,
    }
    steps = [
        {"q": randn(B, H * D, dtype=act), "k": randn(B, H * D, dtype=act), "v": randn(B, H * DV, dtype=act),
         "a": randn(B, H * D, dtype=act), "beta": randn(B, H, dtype=act), "gate": randn(B, H * DV, dtype=act)}
        for _ in range(2)
    ]
    return fixed, steps


def _with_own_states(fixed: dict[str, object]) -> dict[str, object]:
    return {name: value.clone() if name in STATE_NAMES else value for name, value in fixed.items()}


# --------------------------------------------------------------------------- fused vs unfused

CASES = [
    Case(batch=1, heads=3, head_dim=16, head_dim_v=16, block_v=4, dtype=torch.float32),  # 4 value tiles
    Case(batch=3, heads=3, head_dim=32, head_dim_v=32, block_v=8, dtype=torch.bfloat16),  # 4 value tiles
    Case(batch=5, heads=3, head_dim=32, head_dim_v=32, block_v=None, dtype=torch.float32),  # 1 tile per head
    Case(batch=5, heads=2, head_dim=16, head_dim_v=32, block_v=8, dtype=torch.bfloat16),  # DV != D
    Case(batch=3, heads=2, head_dim=16, head_dim_v=16, block_v=8, dtype=torch.float16),
    # several value tiles per program: one program per head (it normalises its own row) ...
    Case(batch=3, heads=2, head_dim=16, head_dim_v=32, block_v=8, dtype=torch.float32, tiles_per_program=4),
    Case(batch=2, heads=3, head_dim=16, head_dim_v=16, block_v=4, dtype=torch.bfloat16, tiles_per_program=4,
         num_stages=3, num_warps=1),
    # ... two tiles per head, both kept in registers for the norm, 2 stages or 1 ...
    Case(batch=3, heads=2, head_dim=16, head_dim_v=16, block_v=8, dtype=torch.bfloat16, tiles_per_program=2,
         num_stages=2),
    Case(batch=2, heads=3, head_dim=16, head_dim_v=32, block_v=16, dtype=torch.float32, tiles_per_program=2,
         num_stages=1),
    # ... or several programs per head of several tiles each (arrival counter), 1 stage
    Case(batch=3, heads=2, head_dim=16, head_dim_v=32, block_v=4, dtype=torch.float32, tiles_per_program=2,
         num_stages=1, num_warps=8),
    Case(batch=4, heads=2, head_dim=32, head_dim_v=32, block_v=8, dtype=torch.bfloat16, tiles_per_program=2,
         num_stages=2, evict_state=True),
]


@pytest.mark.parametrize("case", CASES, ids=Case.id)
def test_fused_matches_unfused_chain(request: pytest.FixtureRequest, case: Case) -> None:
    """Two consecutive steps (the second runs on the first one's states and reused arrival
    counters): output and all four states after each step; rows of unused slots untouched;
    the first step writes into a NaN-filled output buffer."""
    if not runs_here(request, "interpret"):
        return
    fixed, steps = make_inputs(case, seed=case.batch * 100 + case.head_dim)
    fused, ref = _with_own_states(fixed), _with_own_states(fixed)
    for i, step in enumerate(steps):
        _check_step(case, step, fused, ref, i, first=i == 0)
    _check_slots(case, fixed, fused)


def _check_step(case: Case, step: dict[str, torch.Tensor], fused: dict[str, object], ref: dict[str, object],
                i: int, first: bool = False) -> None:
    """One decode step on both paths (``fused`` and ``ref`` hold each path's states, updated
    in place): y per head row (KDA_Y), the state (KDA_STATE of max |state| plus, with bf16 /
    fp16 activations, KDA_STATE_FLIP of the update's magnitude: the chain's reference run
    once more with beta = 0 gives the decayed state without the update), the conv states bit
    for bit. The ``first`` step writes into a NaN-filled output buffer."""
    out = torch.full((case.batch, case.heads, case.head_dim_v), float("nan"), dtype=case.dtype) if first else None
    decayed = _with_own_states(ref)
    y = kda.kda_decode_fused(**step, **fused, out=out, **case.launch())
    y_ref = kda_decode_chain_reference(**step, **ref)
    kda_decode_chain_reference(**{**step, "beta": torch.full_like(step["beta"], -1e4)}, **decayed)
    if out is not None:
        assert y is out
    assert y.dtype == case.dtype and y.shape == (case.batch, case.heads, case.head_dim_v)
    assert_close_scaled(y, y_ref, case.dtype, roundings=KDA_Y(case.dtype), dims=-1, what=f"y after step {i}")
    update = reference_scale(ref["state"] - decayed["state"])
    bound = (KDA_STATE * unit_roundoff(torch.float32) * reference_scale(ref["state"])
             + KDA_STATE_FLIP * unit_roundoff(case.dtype) * update)
    assert_within(fused["state"], ref["state"], bound, f"state after step {i}",
                  f"({KDA_STATE} u(fp32) x max |state| + {KDA_STATE_FLIP} u({case.dtype}) x max |update| {update:.3g})")
    for name in ("conv_state_q", "conv_state_k", "conv_state_v"):
        assert torch.equal(fused[name], ref[name]), f"{name} after step {i}"


def _check_slots(case: Case, fixed: dict[str, object], fused: dict[str, object]) -> None:
    """Rows of unused slots untouched, every used slot's rows updated."""
    unused = sorted(set(range(case.num_slots)) - set(fixed["slots"].tolist()))
    for name in STATE_NAMES:
        assert torch.equal(fused[name][unused], fixed[name][unused]), name
        assert not torch.equal(fused[name][fixed["slots"]], fixed[name][fixed["slots"]]), name


def test_op_kernel_prepares_its_arguments(request: pytest.FixtureRequest) -> None:
    """What the runtime registers for ``k3::kda_decode_fused`` (``kda_decode_fused_op``)
    casts bf16 weights to fp32 and reads row-strided activations in place (no copies):
    the result equals the reference chain on the same (fp32-cast) weights."""
    if not runs_here(request, "interpret"):
        return
    case = Case(batch=3, heads=2, head_dim=16, head_dim_v=32, block_v=None, dtype=torch.float32)
    fixed, steps = make_inputs(case, seed=11)
    weights = ("conv_weight_q", "conv_weight_k", "conv_weight_v", "A_log", "dt_bias", "norm_weight")
    low = {name: fixed[name].bfloat16() for name in weights}
    fused = {**_with_own_states(fixed), **low}
    ref = {**_with_own_states(fixed), **{name: w.float() for name, w in low.items()}}
    step = steps[0]
    strided = {name: torch.cat([t, t], dim=1)[:, : t.shape[1]] for name, t in step.items()}
    assert not strided["q"].is_contiguous()
    y = kda.kda_decode_fused_op(**strided, **fused)
    y_ref = kda_decode_chain_reference(**step, **ref)
    assert_close_scaled(y, y_ref, torch.float32, roundings=KDA_Y(torch.float32), dims=-1, what="y")
    assert_close_scaled(fused["state"], ref["state"], torch.float32, roundings=KDA_STATE, what="state")
    for name in ("conv_state_q", "conv_state_k", "conv_state_v"):
        assert torch.equal(fused[name], ref[name]), name


def test_proj_op_runs_one_gemm_over_consecutive_weights(request: pytest.FixtureRequest) -> None:
    """``k3::kda_decode_fused_proj``'s kernel path: with the six weights that read x (q, k, v,
    g, f_a, b) laid out as consecutive rows of one buffer (as the runtime loads them) one
    GEMM, whose columns the kernel reads in place, and f_b on its f_a columns; with separate
    weights one GEMM each. Both equal the reference (the seven linears on the CPU, then the
    chain) within the kernel's tolerance. On a GPU machine also on the GPU (cuBLAS and the
    compiled kernel)."""
    from k3compile.runtime.weight_layout import consecutive_rows

    on_gpu = torch.cuda.is_available()
    if not on_gpu and not runs_here(request, "interpret"):
        return
    dev = "cuda" if on_gpu else "cpu"

    case = Case(batch=3, heads=2, head_dim=16, head_dim_v=32, block_v=None, dtype=torch.float32)
    fixed, _ = make_inputs(case, seed=12)
    gen = torch.Generator().manual_seed(13)
    H, D, DV, hidden, rank = case.heads, case.head_dim, case.head_dim_v, 24, 8
    rows = [H * D, H * D, H * DV, H * DV, rank, H]  # q, k, v, g, f_a, b
    buffer = torch.randn(sum(rows), hidden, generator=gen) * 0.2
    laid_out = buffer.split(rows)
    assert consecutive_rows(laid_out) is not None
    separate = [w.clone() for w in laid_out]
    assert consecutive_rows(separate) is None
    f_b = torch.randn(H * D, rank, generator=gen) * 0.3
    x = torch.randn(case.batch, hidden, generator=gen)
    ref_inputs = _with_own_states(fixed)
    q, k, v, g, u, b = (torch.nn.functional.linear(x, w) for w in separate)
    y_ref = kda_decode_chain_reference(q, k, v, a=torch.nn.functional.linear(u, f_b), beta=b, gate=g,
                                       **{n: ref_inputs[n] for n in _PROJ_REST})
    on = lambda t: t.to(dev) if isinstance(t, torch.Tensor) else t  # noqa: E731
    for weights in (buffer.to(dev).split(rows), [on(w) for w in separate]):
        inputs = {n: on(t) for n, t in _with_own_states(fixed).items()}
        q_w, k_w, v_w, g_w, f_a_w, b_w = weights  # the proj op's order: ..., b, f_a, f_b
        y = kda.kda_decode_fused_proj_op(on(x), q_w, k_w, v_w, g_w, b_w, f_a_w, on(f_b),
                                         *(inputs[n] for n in _PROJ_REST))
        assert_close_scaled(y.cpu(), y_ref, torch.float32, roundings=KDA_Y(torch.float32), dims=-1, what="y")
        assert_close_scaled(inputs["state"].cpu(), ref_inputs["state"], torch.float32, roundings=KDA_STATE,
                            what="state")


# kda_decode_fused_proj's arguments after x and the seven weights
_PROJ_REST = ("conv_weight_q", "conv_weight_k", "conv_weight_v", "conv_state_q", "conv_state_k", "conv_state_v",
              "A_log", "dt_bias", "lower_bound", "state", "slots", "scale", "norm_weight", "eps")


# The plans kda_decode_plans.launch_config picks at K3's per-rank shapes (12 heads, D = DV =
# 128): (batch, the targets ("+pdl": under programmatic dependent launch) that pick it,
# (value tile, tiles per program, stages)). Triton's interpreter ignores warps, the
# evict-first hint and PDL (which needs a GPU): it runs each plan's tiles.
K3_PLANS = [
    pytest.param(1, ("sm_90", "sm_90+pdl", "gfx950", "gfx942"), (16, 1, 1), id="B1-BV16-every-target"),
    pytest.param(8, ("sm_90",), (128, 1, 1), id="B8-BV128-sm_90"),
    pytest.param(8, ("sm_90+pdl",), (64, 2, 2), id="B8-BV64x2-sm_90-pdl"),
    # the batch-1 plan's specialisation (run above at K3's shapes) at 8x the programs: 768
    # programs, ~35 s under the interpreter, a sweep
    pytest.param(8, ("gfx950", "gfx942"), (16, 1, 1), id="B8-BV16-amd", marks=pytest.mark.sweep),
]


def _k3_config(batch: int, target: str) -> kp.LaunchConfig:
    name, _, pdl = target.partition("+")
    return kp.launch_config(batch, K3_HEADS, K3_HEAD_DIM, K3_HEAD_DIM, aot.TARGETS[name].compute_units,
                            pdl=bool(pdl))


@pytest.mark.parametrize("batch, targets, plan", K3_PLANS)
def test_k3_per_rank_shapes_with_the_launchers_plans(request: pytest.FixtureRequest, batch: int,
                                                     targets: tuple[str, ...], plan: tuple[int, int, int]) -> None:
    """One decode step of one KDA layer at K3 TP8's per-rank shapes (bf16 activations) with
    each plan the launcher picks for these targets (asserted), into a NaN-filled output:
    against the chain as in test_fused_matches_unfused_chain (one step: the interpreter
    takes ~10 s per 100 programs)."""
    if not runs_here(request, "interpret"):
        return
    configs = [_k3_config(batch, target) for target in targets]
    assert {(c.block_v, c.tiles_per_program, c.num_stages) for c in configs} == {plan}
    config = configs[0]
    case = Case(batch, K3_HEADS, K3_HEAD_DIM, K3_HEAD_DIM, config.block_v, torch.bfloat16, num_slots=batch + 3,
                tiles_per_program=config.tiles_per_program, num_stages=config.num_stages,
                num_warps=config.num_warps, evict_state=config.evict_state)
    fixed, steps = make_inputs(case, seed=batch * 1000 + config.block_v)
    fused, ref = _with_own_states(fixed), _with_own_states(fixed)
    with fast_interpreter():  # and no integer overflow checks: no offset here comes near 2^31
        _check_step(case, steps[0], fused, ref, 0, first=True)
    _check_slots(case, fixed, fused)


def test_reference_chain_matches_independent_math() -> None:
    """The reference chain against the K3 math written out here, with fla's naive gate and
    recurrent step (fp32): conv + SiLU, L2 norm of q and k, one delta-rule step, gated RMSNorm."""
    from fla.ops.kda.gate import naive_kda_lowerbound_gate
    from fla.ops.kda.naive import naive_recurrent_kda

    from k3compile.ops.kda import l2norm

    case = Case(batch=3, heads=2, head_dim=16, head_dim_v=32, block_v=None, dtype=torch.float32)
    B, H, D, DV = case.batch, case.heads, case.head_dim, case.head_dim_v
    fixed, steps = make_inputs(case, seed=7)
    step, slots = steps[0], fixed["slots"]
    ref = _with_own_states(fixed)
    y = kda_decode_chain_reference(**step, **ref)

    def conv(name: str, width: int) -> torch.Tensor:
        window = torch.cat([fixed[f"conv_state_{name}"][slots], step[name][:, :, None]], dim=2)
        return torch.nn.functional.silu((window * fixed[f"conv_weight_{name}"]).sum(-1)).view(B, 1, H, width)

    g = naive_kda_lowerbound_gate(step["a"].view(B, 1, H, D), fixed["A_log"], fixed["dt_bias"], fixed["lower_bound"])
    o, S = naive_recurrent_kda(
        l2norm(conv("q", D)), l2norm(conv("k", D)), conv("v", DV), g, torch.sigmoid(step["beta"]).view(B, 1, H),
        scale=fixed["scale"], initial_state=fixed["state"][slots], output_final_state=True,
    )
    o = o[:, 0]
    expect = o * torch.rsqrt(o.square().mean(-1, keepdim=True) + fixed["eps"]) * fixed["norm_weight"]
    expect = expect * torch.sigmoid(step["gate"].view(B, H, DV))
    torch.testing.assert_close(y, expect, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ref["state"][slots], S, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- argument checks


def _good_args(case: Case = Case(2, 2, 16, 16, 8, torch.bfloat16)) -> dict[str, object]:
    fixed, steps = make_inputs(case, seed=3)
    return {**steps[0], **fixed}


BAD_INPUTS = [
    ("state-fp16", lambda a: a.update(state=a["state"].half()), "state must be float32"),
    ("state-3-D", lambda a: a.update(state=a["state"][0]), "state must be a [S, H, D, DV] tensor"),
    ("head-dim-24", lambda a: a.update(state=torch.zeros(8, 2, 24, 24)), "head dims must be powers of two"),
    ("q-transposed", lambda a: a.update(q=a["q"].t().contiguous().t()), "q must be contiguous"),
    ("k-fp32", lambda a: a.update(k=a["k"].float()), "k must be bfloat16"),
    ("v-too-narrow", lambda a: a.update(v=a["v"][:, :-1].contiguous()), "v must have shape [2, 32]"),
    ("conv-weight-bf16", lambda a: a.update(conv_weight_v=a["conv_weight_v"].bfloat16()),
     "conv_weight_v must be float32"),
    ("conv-state-K", lambda a: a.update(conv_state_k=a["conv_state_k"][..., :2].contiguous()),
     "conv_state_k must have shape [8, 32, 3]"),
    ("A_log-per-channel", lambda a: a.update(A_log=torch.zeros(32)), "A_log must have shape [2]"),
    ("slots-int32", lambda a: a.update(slots=a["slots"].int()), "slots must be int64"),
    ("slots-too-few", lambda a: a.update(slots=a["slots"][:1]), "slots must have shape [2]"),
    ("gate-on-meta", lambda a: a.update(gate=a["gate"].to("meta")), "gate is on meta"),
    ("beta-int", lambda a: a.update(beta=a["beta"].to(torch.int32)), "beta must be"),
    ("out-fp32", lambda a: a.update(out=torch.empty(2, 2, 16)), "out must be bfloat16"),
    ("block_v-12", lambda a: a.update(block_v=12), "block_v must be a power of two dividing DV=16"),
    ("block_v-32", lambda a: a.update(block_v=32), "block_v must be a power of two dividing DV=16"),
    ("tiles-3", lambda a: a.update(tiles_per_program=3), "tiles_per_program must be a power of two"),
    ("tiles-beyond-DV", lambda a: a.update(block_v=8, tiles_per_program=4),
     "block_v * tiles_per_program <= DV=16, got 4 x 8"),
    ("num_warps-3", lambda a: a.update(num_warps=3), "num_warps must be a power of two up to 16, got 3"),
    ("num_stages-0", lambda a: a.update(num_stages=0), "num_stages must be 1 to 3, got 0"),
    ("num_stages-4", lambda a: a.update(num_stages=4), "num_stages must be 1 to 3, got 4"),
    ("max_registers-300", lambda a: a.update(max_registers=300), "max_registers must be 24 to 255, got 300"),
    ("pdl-on-cpu", lambda a: a.update(pdl=True),
     "pdl (programmatic dependent launch) needs a CUDA GPU of compute capability 9.0 or newer, got cpu"),
]


@pytest.mark.parametrize("mutate, message", [b[1:] for b in BAD_INPUTS], ids=[b[0] for b in BAD_INPUTS])
def test_bad_inputs_raise_clear_errors(mutate, message: str) -> None:
    """Checked before anything is launched, in either Triton mode."""
    args = _good_args()
    mutate(args)
    before = {name: args[name].clone() for name in STATE_NAMES}
    with pytest.raises(ValueError, match=re.escape(message)):
        kda.kda_decode_fused(**args)
    for name in STATE_NAMES:  # nothing was launched
        assert torch.equal(args[name], before[name])


def test_cpu_needs_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """A compiled kernel cannot take CPU tensors: a clear error, not a driver failure."""
    if KERNEL_INTERPRETED:  # as the module would be without TRITON_INTERPRET (never launched)
        # the launcher's own reference to the kernel
        monkeypatch.setattr(kda, "kda_decode_kernel", JITFunction(kk.kda_decode_kernel.fn))
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        kda.kda_decode_fused(**_good_args())


# --------------------------------------------------------------------------- launch plan

K3_HEADS, K3_HEAD_DIM = 12, 128  # per rank at TP8


@pytest.mark.parametrize("target", ["sm_90", "gfx950", "gfx942"])
def test_launch_plan_fills_the_gpu(target: str) -> None:
    """Workgroups per launch at K3 per-rank shapes: batch 1 still launches 96 (one per value
    tile of 16); a head's whole row per program (the fastest on an H200 from batch 8) once
    the batch has half as many heads as CUs; in between, narrower tiles give every CU two
    programs."""
    units = aot.TARGETS[target].compute_units
    for batch in (1, 2, 4, 8, 16, 64, 256):
        bv = kp.choose_block_v(batch, K3_HEADS, K3_HEAD_DIM, units)
        programs = np.prod(kp.launch_grid(batch, K3_HEADS, K3_HEAD_DIM, bv))
        assert programs == batch * K3_HEADS * K3_HEAD_DIM // bv
        if 2 * batch * K3_HEADS >= units:
            assert bv == kp.MAX_BLOCK_V == K3_HEAD_DIM, (batch, bv)
            continue
        assert programs >= 2 * units or bv == kp.MIN_BLOCK_V, (batch, bv, programs)
        if bv < kp.MAX_BLOCK_V:  # the next wider tile would have left CUs without a second program
            assert programs // 2 < 2 * units
    assert kp.choose_block_v(1, K3_HEADS, K3_HEAD_DIM, units) == 16
    assert kp.choose_block_v(256, K3_HEADS, K3_HEAD_DIM, units) == 128
    if target == "sm_90":
        assert kp.choose_block_v(8, K3_HEADS, K3_HEAD_DIM, units) == 128  # 96 heads, 132 SMs


@pytest.mark.parametrize("target", ["sm_90", "gfx950", "gfx942"])
def test_default_launch_config(target: str) -> None:
    """The launcher's defaults at K3 shapes: the value tile above, one tile per program (the
    H200 sweep found no gain in more), warps for ~32 state values per thread capped at 4
    (a 64-wide tile on 8 warps was 1.4x slower), the evict-first hint only on a head's
    whole 128-wide row while the heads give fewer than two programs per CU (faster there on
    an H200, slower from batch 64; costs registers on narrow tiles)."""
    units = aot.TARGETS[target].compute_units
    for batch in (1, 8, 64, 256):
        config = kp.launch_config(batch, K3_HEADS, K3_HEAD_DIM, K3_HEAD_DIM, units)
        bv = kp.choose_block_v(batch, K3_HEADS, K3_HEAD_DIM, units)
        evict = bv == K3_HEAD_DIM and batch * K3_HEADS < 2 * units
        assert config == kp.LaunchConfig(block_v=bv, tiles_per_program=kp.MAX_TILES_PER_PROGRAM, num_warps=min(4, bv // 8),
                                          num_stages=1, evict_state=evict)
        if target == "sm_90":
            assert config.evict_state == (batch == 8), batch  # whole rows from batch 8, hint below 22 sequences
        assert config.programs_per_head(K3_HEAD_DIM) == K3_HEAD_DIM // bv
    assert kp.launch_config(1, 2, 16, 16, units).evict_state is False  # a whole row, but only 16 wide
    assert kp.launch_config(256, K3_HEADS, K3_HEAD_DIM, K3_HEAD_DIM, units, evict_state=False).evict_state is False


def test_whole_rows_as_two_tiles_under_pdl() -> None:
    """Under PDL a head's whole row is two half-width tiles, both in flight (an H200 at
    batch 64: 32.1 -> 31.0 us); narrow tiles and given choices are left alone."""
    units = aot.TARGETS["sm_90"].compute_units
    for batch in (8, 64, 256):
        config = kp.launch_config(batch, K3_HEADS, K3_HEAD_DIM, K3_HEAD_DIM, units, pdl=True)
        assert (config.block_v, config.tiles_per_program, config.num_stages, config.pdl) == (64, 2, 2, True), batch
        assert config.programs_per_head(K3_HEAD_DIM) == 1
        assert config.evict_state == (batch == 8)  # still a whole row for the hint's rule
    narrow = kp.launch_config(1, K3_HEADS, K3_HEAD_DIM, K3_HEAD_DIM, units, pdl=True)
    assert (narrow.block_v, narrow.tiles_per_program) == (16, 1)
    given = kp.launch_config(64, K3_HEADS, K3_HEAD_DIM, K3_HEAD_DIM, units, pdl=True, block_v=128)
    assert (given.block_v, given.tiles_per_program) == (128, 1)
    assert kp.launch_config(64, K3_HEADS, K3_HEAD_DIM, K3_HEAD_DIM, units).tiles_per_program == 1  # no PDL


def test_tiles_per_program_plan() -> None:
    """More tiles per program only while the batch still gives every CU two programs; the
    grid shrinks by the same factor; stages never exceed the tiles."""
    units = 132
    assert kp.choose_tiles_per_program(256, K3_HEADS, K3_HEAD_DIM, 32, units) == kp.MAX_TILES_PER_PROGRAM
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kp, "MAX_TILES_PER_PROGRAM", 8)
        assert kp.choose_tiles_per_program(256, K3_HEADS, K3_HEAD_DIM, 32, units) == 4  # 3072 programs
        assert kp.choose_tiles_per_program(64, K3_HEADS, K3_HEAD_DIM, 32, units) == 4  # 768 >= 264
        assert kp.choose_tiles_per_program(16, K3_HEADS, K3_HEAD_DIM, 32, units) == 2  # 192 would be < 264
        assert kp.choose_tiles_per_program(8, K3_HEADS, K3_HEAD_DIM, 32, units) == 1
        assert kp.choose_tiles_per_program(1, K3_HEADS, K3_HEAD_DIM, 16, units) == 1
    assert kp.launch_grid(64, K3_HEADS, K3_HEAD_DIM, 32, 4) == (1, K3_HEADS, 64)
    assert kp.launch_grid(64, K3_HEADS, K3_HEAD_DIM, 16, 2) == (4, K3_HEADS, 64)
    config = kp.launch_config(64, K3_HEADS, K3_HEAD_DIM, K3_HEAD_DIM, units, block_v=32, tiles_per_program=4,
                              num_stages=3, num_warps=2, evict_state=True)
    assert config == kp.LaunchConfig(32, 4, 2, 3, True) and config.programs_per_head(K3_HEAD_DIM) == 1
    assert kp.launch_config(64, K3_HEADS, K3_HEAD_DIM, K3_HEAD_DIM, units, block_v=32, tiles_per_program=2,
                            num_stages=3).num_stages == 2
    assert kp.launch_config(64, K3_HEADS, K3_HEAD_DIM, K3_HEAD_DIM, units, block_v=16,
                            tiles_per_program=4).num_stages == 2


def test_bytes_floor_is_the_state() -> None:
    state = 2 * K3_HEADS * K3_HEAD_DIM * K3_HEAD_DIM * 4
    one = kp.bytes_moved(1, K3_HEADS, K3_HEAD_DIM, K3_HEAD_DIM, 4, 2)
    assert one == 1_727_056 and state / one > 0.9
    assert kp.bytes_moved(64, K3_HEADS, K3_HEAD_DIM, K3_HEAD_DIM, 4, 2) / (64 * state) < 1.05


# --------------------------------------------------------------------------- AOT


AOT_TARGETS = ("gfx950", "gfx942", "sm_90")
# (block_v, tiles_per_program, num_stages, num_warps or None for num_warps_for, evict_state):
# every tile width the launcher may pick, one tile per program; the evict-first hint; then
# one-warp and multi-tile plans of the GPU sweep (benchmarks/kda_decode.py --sweep).
AOT_PLANS = (
    (16, 1, 1, None, False), (32, 1, 1, None, False), (64, 1, 1, None, False), (128, 1, 1, None, False),
    (16, 1, 1, None, True), (32, 1, 1, None, True), (128, 1, 1, None, True), (8, 1, 1, 1, False), (16, 1, 1, 1, False),
    (32, 2, 2, None, False), (32, 4, 2, None, False), (32, 4, 3, None, False), (16, 8, 2, 4, False),
    (16, 8, 3, 4, False), (16, 8, 2, 2, False), (64, 2, 2, 8, False),
    (64, 2, 2, 4, False),  # a head's row as two tiles: the plan under PDL on sm_90
)


def _plan_id(plan: tuple) -> str:
    block_v, tiles, stages, warps, evict = plan
    return f"BV{block_v}-NT{tiles}-NS{stages}-W{warps or 'auto'}" + ("-evict" if evict else "")


def _pdl_ptx_request(pdl: bool) -> aot.AsmRequest:
    """The PTX of the K3 per-rank specialisation, a head's whole row per program, with or without PDL."""
    signature, constexprs, num_warps = kp.aot_signature(
        torch.bfloat16, heads=K3_HEADS, head_dim=K3_HEAD_DIM, head_dim_v=K3_HEAD_DIM, block_v=K3_HEAD_DIM,
        num_warps=4, pdl=pdl)
    return aot.AsmRequest(aot.CompileRequest(kk.kda_decode_kernel, signature, constexprs, "sm_90", num_warps), "ptx")


def aot_requests() -> dict[object, aot.CompileRequest | aot.AsmRequest]:
    """Every AOT compilation of this file (the session compiles them in one batch: conftest's
    aot_reports); none in a process that cannot compile (its tests run in a child pytest)."""
    if not CAN_COMPILE:
        return {}
    requests: dict[object, aot.CompileRequest | aot.AsmRequest] = {}
    for target in AOT_TARGETS:
        for plan in AOT_PLANS:
            block_v, tiles, stages, warps, evict = plan
            signature, constexprs, num_warps = kp.aot_signature(
                torch.bfloat16, heads=K3_HEADS, head_dim=K3_HEAD_DIM, head_dim_v=K3_HEAD_DIM, block_v=block_v,
                tiles_per_program=tiles, num_stages=stages, num_warps=warps, evict_state=evict,
            )
            requests[target, plan] = aot.CompileRequest(kk.kda_decode_kernel, signature, constexprs, target, num_warps)
    requests["ptx", "pdl"] = _pdl_ptx_request(pdl=True)
    requests["ptx", "plain"] = _pdl_ptx_request(pdl=False)
    return requests


@pytest.mark.parametrize("target", AOT_TARGETS)
@pytest.mark.parametrize("plan", AOT_PLANS, ids=_plan_id)
def test_aot_compiles_and_fits(request: pytest.FixtureRequest, aot_reports: dict, target: str, plan: tuple) -> None:
    """K3 per-rank shapes with bf16 activations: fits, state tiles in registers, no spills."""
    if not runs_here(request, "compile"):
        return
    res = aot_reports[target, plan]
    assert res.fits, res
    assert res.shared_bytes <= 16 * 1024, res  # reductions only: the state tiles live in registers
    assert res.spills in (0, None), res


def test_pdl_reads_only_the_state_before_waiting(request: pytest.FixtureRequest, aot_reports: dict) -> None:
    """Under programmatic dependent launch (sm_90 PTX, a head's whole row per program at K3
    shapes) a program may run while the previous kernel still writes this token's
    projections: before ``griddepcontrol.wait`` it writes nothing and reads only what that
    kernel cannot be writing (slot, state tile, conv states, weights). The whole state tile
    is requested before the wait (that is the point), and no 16-byte load (state or
    weights) is left after it, only the projections' element loads."""
    if not runs_here(request, "compile"):
        return
    ptx = aot_reports["ptx", "pdl"]
    assert ptx.count("griddepcontrol.wait") == 1 and ptx.count("griddepcontrol.launch_dependents") == 1
    before, after = ptx.split("griddepcontrol.wait")
    assert "st.global" not in before and "atom." not in before
    state_loads_per_thread = K3_HEAD_DIM * K3_HEAD_DIM * 4 // 16 // (4 * 32)  # 16-byte loads, 4 warps
    assert before.count("ld.global.v4.b32") >= state_loads_per_thread
    assert "ld.global.v4" not in after
    assert after.count("ld.global") >= 6  # q, k, v, a, beta and gate, one element each per thread
    assert "griddepcontrol" not in aot_reports["ptx", "plain"]
