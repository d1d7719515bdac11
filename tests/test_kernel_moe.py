"""Routed-expert kernels (runtime/kernels/moe.py) under the Triton interpreter, against the
k3 ops' torch references and a test-local fp64 mirror of the kernels' rounding points; their
launch plans; AOT compilation of every default specialisation for gfx950, gfx942, sm_90.

Tolerances (the rule and u(dtype), the unit roundoff bf16 2^-8, fp16 2^-11, fp32 2^-24, are
tests/tolerances.py's; the experts' bounds are derived here, per output element):
- Against the MIRROR (_mirror: fp64 math with the kernel's rounding points: bf16 z and h as
  matrix operands, h first stored in z's dtype, nothing else rounded) the bound is derived
  per output element: |got - mirror| <= u(out) (|mirror| + A) + A. The first term is the
  kernel's one rounding of the output. A bounds what the kernel's fp32 arithmetic can move
  the unrounded output: fp32 sums (gamma_n = n 2^-24 times the sum of |terms|, for W1 z, W3 z,
  W2 h and the k sum), the SiTU evaluated in fp32 (2^-16 |h|, generous: tanh and sigmoid
  from exp), and, for every h element whose fp64 value lies closer to a rounding boundary
  (of z's dtype or of bf16) than its error bound propagated through the SiTU's derivatives,
  one bf16 step (<= 2^-7 |h|) times |W2[:, i]| times the slot's weight: such an element may
  round the other way in the kernel. Everything else must round as the mirror does.
- Against the OP'S REFERENCE (k3::moe_experts_mxfp4 on the CPU: exact weights, matmuls
  in z's dtype) u = u(z's dtype), at least 2^-16 (fp16 / fp32 operands enter the kernel's
  matrix unit as two bf16 parts, ~16 bits; the mirror adds 2^-16 of every product's
  magnitude to its bound for them instead of rounding them to bf16): the
  reference rounds W1 z and W3 z before the SiTU (log-derivative <= ~3) and each slot's
  W2 h, besides h and the output: about six roundings of relative size u on terms of size
  <= max|out|, independent signs, so |got - ref| <= 2u |ref| + 8u max|ref| (8u: ~1.3x their
  worst root-sum-square; a heuristic bound, the mirror's is the rigorous one).
The mutant check (test_tolerances_catch_a_dropped_slot) shows that dropping one routed
slot moves every token's outputs far beyond both; tests/kernel_mutants.py runs wrong
kernels (E2M1 nibbles swapped, E8M0 exponent off by one, SiTU betas swapped, routing
without renormalisation or with the bias in its weights) against these tests.
Routing weights (fp32): ROUTE_WEIGHTS roundings of each weight.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is first imported

import pytest  # noqa: E402
from tolerances import ROUTE_WEIGHTS, assert_close_scaled, assert_within  # noqa: E402
from tolerances import UNIT_ROUNDOFF as U  # noqa: E402

import k3compile.ops  # noqa: E402,F401  (registers torch.ops.k3)
from k3compile.checkpoint.mxfp4 import unpack_mxfp4  # noqa: E402
from k3compile.ops import moe as moe_ops  # noqa: E402
from k3compile.runtime.kernels import aot, moe, routing  # noqa: E402
from k3compile.validation import one_thread  # noqa: E402


pytestmark = pytest.mark.usefixtures("faster_interpreter")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BETA, LINEAR_BETA = 4.0, 25.0

# --------------------------------------------------------------------------- routing


def _coarse(gen: torch.Generator, shape, lo: int, hi: int, step: float) -> torch.Tensor:
    """Values on a grid: ties are common, non-ties far apart (no ulp-level near-ties)."""
    return torch.randint(lo, hi, shape, generator=gen).float() * step


# E = 896: 4 rows of 256 lanes; E = 200: 4 rows of 64, the last with 8 experts (fewer than k)
@pytest.mark.parametrize(("T", "E", "k"), [(1, 64, 6), (5, 64, 6), (5, 64, 1), (3, 896, 16), (4, 200, 16)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_route_matches_the_reference(T, E, k, renormalize):
    gen = torch.Generator().manual_seed(T * 1000 + E + k)
    logits = _coarse(gen, (T, E), -6, 6, 0.5)  # 12 distinct values: many ties per row
    bias = _coarse(gen, (E,), -2, 3, 0.25)  # nonzero, also on a grid: biased ties survive
    for dtype in (torch.float32, torch.bfloat16):  # the grid is exact in bf16
        x = logits.to(dtype)
        w, ids = routing.sigmoid_topk_route(x.to(DEVICE), bias.to(DEVICE), k, renormalize, 2.5)
        rw, rids = moe_ops.sigmoid_topk_route(x, bias, k, renormalize, 2.5)
        assert w.dtype == torch.float32 and ids.dtype == torch.int64 and ids.shape == (T, k)
        assert torch.equal(ids.cpu(), rids)  # ties: the lower expert id first, as the stable sort
        assert_close_scaled(w, rw, torch.float32, roundings=ROUTE_WEIGHTS, scale=rw.abs(), what="weights")


def test_route_ties_go_to_lower_ids_and_leading_dims_are_kept():
    logits = torch.zeros(2, 3, 32)
    w, ids = routing.sigmoid_topk_route(logits.to(DEVICE), torch.zeros(32, device=DEVICE), 4, True, 1.0)
    assert ids.shape == (2, 3, 4) and torch.equal(ids.cpu(), torch.arange(4).expand(2, 3, 4))
    assert_close_scaled(w, torch.full((2, 3, 4), 0.25), torch.float32, roundings=ROUTE_WEIGHTS, what="weights")


# --------------------------------------------------------------------------- experts: data and references


def _weights(gen: torch.Generator, E: int, D: int, I: int) -> tuple[torch.Tensor, ...]:
    """w1, w3 [E, I, D] and w2 [E, D, I] as packed codes (uniform bytes) + scales that vary
    per group of 32 (bytes 118..126: 2^-9 .. 2^-1), in the op's argument order."""
    def pair(rows: int, cols: int):
        return (torch.randint(0, 256, (E, rows, cols // 2), generator=gen, dtype=torch.uint8),
                torch.randint(118, 127, (E, rows, cols // 32), generator=gen, dtype=torch.uint8))
    return (*pair(I, D), *pair(I, D), *pair(D, I))


MANTISSA = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}
F32 = 2.0**-24


def _near_boundary(x: torch.Tensor, dtype: torch.dtype, slack: torch.Tensor) -> torch.Tensor:
    """Where rounding x (fp64) to ``dtype`` may go the other way for a value within ``slack``
    of x: x lies within slack of the midpoint between its rounding r and r's neighbour on
    x's side (half as far below a power of two)."""
    if dtype == torch.float32:
        return torch.zeros_like(x, dtype=torch.bool)
    r = x.to(dtype).double()
    ulp = torch.exp2(torch.floor(torch.log2(r.abs().clamp_min(2.0**-126))) - MANTISSA[dtype])
    power_of_two = r.abs() == torch.exp2(torch.floor(torch.log2(r.abs().clamp_min(2.0**-126))))
    spacing = torch.where(power_of_two & (x.abs() < r.abs()), ulp / 2, ulp)
    return (x - r).abs() >= spacing / 2 - slack


@one_thread()
def _mirror(z, weights, ids, w, drop_slot: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp64 with the kernel's rounding points: bf16 z and h as matrix operands (h first
    stored in z's dtype), everything else exact; ``drop_slot``: that k slot left out.

    Also returns ALLOWANCE, a bound on how far the kernel's fp32 arithmetic may move each
    output from this: fp32 sums (gamma_n = n 2^-24 of the sum of |terms|), the SiTU in fp32
    (2^-16 |h|, generous), and, for each h element whose fp64 value is closer than that
    bound (propagated through the SiTU's derivatives) to a rounding boundary of h's
    dtype or of bf16, one bf16 step (<= 2^-7 |h|) times |W2[:, i]| times the slot weight."""
    w1, w3, w2 = (unpack_mxfp4(w[i], w[i + 1], torch.float32).double() for i in (0, 2, 4))
    # fp16 / fp32 operands enter as two bf16 parts: relative error <= 2^-16, not rounded to bf16
    two_parts = z.dtype != torch.bfloat16
    split_err = 2.0**-16 if two_parts else 0.0
    zb = z.double() if two_parts else z.to(torch.bfloat16).double()
    (T, K), (E, D, I) = ids.shape, w2.shape
    tok = torch.arange(T)[:, None]

    def per_pair(w13: torch.Tensor, x: torch.Tensor) -> torch.Tensor:  # [T, K, I]: W[ids[t, k]] @ x[t]
        return (x @ w13.reshape(E * I, D).T).view(T, E, I)[tok, ids]

    g, u = per_pair(w1, zb), per_pair(w3, zb)
    dg, du = ((D * F32 * 1.01 + split_err) * per_pair(w.abs(), zb.abs()) for w in (w1, w3))
    b, bl = BETA, LINEAR_BETA
    tg, sg, tu = torch.tanh(g / b), torch.sigmoid(g), torch.tanh(u / bl)
    gate, up = b * tg * sg, bl * tu
    h = gate * up
    dgate = (1 - tg**2) * sg + b * tg * sg * (1 - sg)
    dh = (dgate * up).abs() * dg + (gate * (1 - tu**2)).abs() * du + 2.0**-16 * h.abs()
    stored = h.to(z.dtype).double()
    flips = _near_boundary(h, z.dtype, dh)
    if not two_parts:
        flips |= _near_boundary(stored, torch.bfloat16, dh)
    hr = stored if two_parts else stored.to(torch.bfloat16).double()
    step = torch.where(flips, 2.0**-7 * (h.abs() + dh) * 1.01, 0.0)
    y, y_err = torch.zeros(T, K, D, dtype=torch.float64), torch.zeros(T, K, D, dtype=torch.float64)
    for e in ids.unique().tolist():
        m = ids == e
        y[m] = hr[m] @ w2[e].T
        y_err[m] = step[m] @ w2[e].abs().T + (I * F32 + split_err) * (hr[m].abs() @ w2[e].abs().T)
    wk = weights.double()[:, :, None].clone()
    if drop_slot is not None:
        wk[:, drop_slot] = 0
    allowance = (wk * (y_err + (K + 1) * F32 * (y.abs() + y_err))).sum(1)
    return (wk * y).sum(1), allowance


def _mirror_tol(ref_allowance: tuple[torch.Tensor, torch.Tensor], dtype: torch.dtype) -> tuple[torch.Tensor, float]:
    ref, allowance = ref_allowance
    return U[dtype] * (ref.abs() + allowance) + allowance, 0.0


def _op_tol(ref: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, float]:
    u = max(U[dtype], 2.0**-16)  # fp16 / fp32 operands as two bf16 parts: ~16 bits
    return 2 * u * ref.abs(), 8 * u * ref.abs().max().item()


def _within(got: torch.Tensor, ref: torch.Tensor, tol: tuple[torch.Tensor, float]) -> torch.Tensor:
    rel, abs_ = tol
    return (got.double() - ref.double()).abs() <= rel.double() + abs_


def _check(got: torch.Tensor, ref: torch.Tensor, tol: tuple[torch.Tensor, float], what: str) -> None:
    rel, abs_ = tol
    assert_within(got, ref, rel.double() + abs_, what)


@pytest.fixture
def poisoned(monkeypatch):
    """Every output and workspace of the launchers starts as NaN (ints: a huge value), so an
    element no program writes fails the comparison (or reads out of bounds)."""
    def empty(shape, dtype, device):
        fill = float("nan") if dtype.is_floating_point else 2**30
        return torch.full(shape, fill, dtype=dtype, device=device)
    monkeypatch.setattr(moe, "_empty", empty)


def _gemm(n: int, k: int) -> moe.GemmPlan:
    return moe.GemmPlan(n, k, 4, 2)


# Test plans: "wide" tiles cover the small D / I in one program column (the interpreter's
# cost is per program), "tiled" ones split rows and K steps (tile indexing).
PAIR_WIDE = moe.MoePlan(False, 16, _gemm(64, 128), _gemm(256, 128))
PAIR_TILED = moe.MoePlan(False, 16, _gemm(32, 128), _gemm(128, 32))
PAIR_FMA = moe.MoePlan(False, 1, _gemm(32, 128), _gemm(64, 64))  # vector units, no matrix unit
GROUPED_16 = moe.MoePlan(True, 16, _gemm(32, 128), _gemm(128, 64))
GROUPED_64 = moe.MoePlan(True, 64, _gemm(64, 128), _gemm(256, 128))
# (D, I): D = 256: w13 reads scales as words (2 K steps of 128), w2 as bytes (I = 64);
# D = 64 / I = 128: w13 as bytes, w2 as words.
SHAPE_A, SHAPE_B = (256, 64), (64, 128)


def _ids(pattern: str, T: int, E: int, K: int, gen: torch.Generator) -> torch.Tensor:
    if pattern == "random":  # distinct per token, shared across tokens
        return torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    if pattern == "repeats":  # a token picks one expert twice; neighbours share experts
        ids = torch.randint(0, 3, (T, K), generator=gen)
        ids[:, 1] = ids[:, 0]
        return ids
    if pattern == "same_set":  # every token the same set of experts, in a token-dependent order
        base = torch.tensor([3, 11, 7, 0][:K])
        return torch.stack([base[torch.randperm(K, generator=gen)] for _ in range(T)])
    if pattern == "one_expert":
        return torch.full((T, K), 5)
    if pattern == "each_once":  # T * K == E
        return torch.randperm(E, generator=gen).view(T, K)
    raise ValueError(pattern)


def _run_case(T, K, shape, plan, pattern, dtype=torch.bfloat16, E=16, seed=0, check_op=True):
    gen = torch.Generator().manual_seed(seed)
    D, I = shape
    w = _weights(gen, E, D, I)
    z = torch.randn(T, D, generator=gen).to(dtype)
    ids = _ids(pattern, T, E, K, gen)
    weights = torch.rand(T, K, generator=gen) + 0.05
    got = moe.moe_experts_mxfp4(z.to(DEVICE), weights.to(DEVICE), ids.to(DEVICE), *(t.to(DEVICE) for t in w),
                                BETA, LINEAR_BETA, plan=plan).cpu()
    assert got.dtype == dtype and got.shape == (T, D) and torch.isfinite(got).all()
    mirror = _mirror(z, weights, ids, w)
    _check(got, mirror[0], _mirror_tol(mirror, dtype), "experts vs the fp64 mirror")
    if check_op:
        with one_thread():
            ref = moe_ops.moe_experts_mxfp4(z, weights, ids, *w, BETA, LINEAR_BETA)
        _check(got, ref, _op_tol(ref, dtype), "experts vs the op's reference")
    return z, weights, ids, w, got


@pytest.mark.parametrize(("T", "K", "shape", "plan", "pattern"), [
    (1, 4, SHAPE_A, PAIR_TILED, "random"),
    (2, 4, SHAPE_B, PAIR_TILED, "repeats"),
    (7, 4, SHAPE_A, PAIR_WIDE, "same_set"),
    (16, 2, SHAPE_B, PAIR_WIDE, "random"),
    (1, 4, SHAPE_A, PAIR_FMA, "random"),
    (3, 4, SHAPE_B, PAIR_FMA, "repeats"),
])
def test_pair_major_matches_both_references(poisoned, T, K, shape, plan, pattern):
    _run_case(T, K, shape, plan, pattern, seed=T)


@pytest.mark.parametrize(("T", "shape", "plan", "pattern"), [
    (3, SHAPE_A, GROUPED_16, "random"),
    (33, SHAPE_B, GROUPED_16, "repeats"),
    (33, SHAPE_A, GROUPED_64, "one_expert"),  # one expert: 3 blocks of 64, the rest of the grid unused
    (4, SHAPE_B, GROUPED_16, "each_once"),
    (5, SHAPE_A, GROUPED_64, "same_set"),
])
def test_grouped_matches_both_references(poisoned, T, shape, plan, pattern):
    _run_case(T, 4, shape, plan, pattern, seed=100 + T)


# w13 in K splits: D = 256 is 4 steps of 64, so 3 splits take 2, 2 and none (an empty split
# still arrives at the counter).
PAIR_SPLIT = moe.MoePlan(False, 16, moe.GemmPlan(32, 64, 4, 2, split_k=3), _gemm(128, 32))
PAIR_FMA_SPLIT = moe.MoePlan(False, 1, moe.GemmPlan(32, 64, 4, 1, split_k=3), _gemm(64, 32))
GROUPED_SPLIT = moe.MoePlan(True, 16, moe.GemmPlan(32, 64, 4, 2, split_k=2), _gemm(128, 64))


@pytest.mark.parametrize("plan", [PAIR_SPLIT, PAIR_FMA_SPLIT, GROUPED_SPLIT], ids=["pair", "pair_fma", "grouped"])
def test_split_k_w13_matches_and_leaves_its_counters_at_zero(poisoned, plan):
    _run_case(5, 4, SHAPE_A, plan, "repeats", seed=31)
    _run_case(3, 4, SHAPE_A, plan, "random", seed=32, check_op=False)  # the same counters again
    assert not moe._counters.get(torch.device(DEVICE), 1).any()


def test_large_batches(poisoned):
    """T = 256 grouped (1024 pairs, several blocks per expert); the pair-major
    path at T = 64 with top_k = 1 (each of its programs costs the interpreter ~30 ms)."""
    _run_case(256, 4, SHAPE_A, GROUPED_64, "random", seed=7, check_op=False)
    _run_case(64, 1, SHAPE_B, PAIR_WIDE, "random", seed=8, check_op=False)


@pytest.mark.parametrize(("dtype", "plan"), [(torch.float32, PAIR_WIDE), (torch.float16, GROUPED_16),
                                            (torch.float32, PAIR_FMA), (torch.float16, PAIR_FMA)])
def test_fp32_and_fp16_inputs_multiply_in_two_bf16_parts(poisoned, dtype, plan):
    """(The vector path multiplies them as they are, in fp32: within the same bounds.)"""
    _run_case(3, 4, SHAPE_A, plan, "random", dtype=dtype, seed=11)


def test_scales_off_a_word_boundary_take_the_byte_path(poisoned):
    """w2's scales (I = 128: read as words) as a view one byte into a buffer: bytes, right."""
    gen = torch.Generator().manual_seed(61)
    D, I = SHAPE_B
    w = list(_weights(gen, 16, D, I))
    shifted = torch.empty(w[5].numel() + 1, dtype=torch.uint8)[1:].view(w[5].shape)
    shifted.copy_(w[5])
    assert shifted.data_ptr() % 4 and shifted.is_contiguous()
    # a misaligned word load faults on a GPU but not in the interpreter: check the choice itself
    assert moe._scale_words(I, 128, w[5]) and not moe._scale_words(I, 128, shifted)
    z = torch.randn(2, D, generator=gen).bfloat16()
    ids, weights = _ids("random", 2, 16, 4, gen), torch.rand(2, 4, generator=gen)
    if DEVICE == "cuda":  # the same misaligned view, on the GPU
        shifted = torch.empty(w[5].numel() + 1, dtype=torch.uint8, device=DEVICE)[1:].view(w[5].shape)
        shifted.copy_(w[5])
    got = moe.moe_experts_mxfp4(*(t.to(DEVICE) for t in (z, weights, ids, *w[:5])), shifted, BETA, LINEAR_BETA,
                                plan=PAIR_WIDE).cpu()
    mirror = _mirror(z, weights, ids, w)
    _check(got, mirror[0], _mirror_tol(mirror, z.dtype), "experts vs the fp64 mirror")


def test_codes_off_a_word_boundary_take_the_matrix_unit(poisoned):
    """The vector path reads codes as int32 words: a view of w2's codes one byte into a
    buffer runs the same tiles on the matrix unit (block_m 16), still right."""
    gen = torch.Generator().manual_seed(62)
    D, I = SHAPE_A
    w = [t.to(DEVICE) for t in _weights(gen, 16, D, I)]
    shifted = torch.empty(w[4].numel() + 1, dtype=torch.uint8, device=DEVICE)[1:].view(w[4].shape)
    shifted.copy_(w[4])
    assert shifted.data_ptr() % 4 and shifted.is_contiguous()
    z = torch.randn(2, D, generator=gen).bfloat16()
    ids, weights = _ids("random", 2, 16, 4, gen), torch.rand(2, 4, generator=gen)
    args = [t.to(DEVICE) for t in (z, weights, ids)]
    got = moe.moe_experts_mxfp4(*args, *w[:4], shifted, w[5], BETA, LINEAR_BETA, plan=PAIR_FMA).cpu()
    same_tiles_on_the_matrix_unit = moe.MoePlan(False, 16, PAIR_FMA.w13, PAIR_FMA.w2)
    assert torch.equal(got, moe.moe_experts_mxfp4(*args, *w, BETA, LINEAR_BETA,
                                                  plan=same_tiles_on_the_matrix_unit).cpu())


@pytest.mark.parametrize("plan", [PAIR_WIDE, PAIR_FMA, GROUPED_16], ids=["pair", "pair_fma", "grouped"])
def test_padded_rows_leave_real_rows_unchanged(poisoned, plan):
    """A CUDA-graph bucket pads the batch with rows that route anywhere (here: all to the
    real rows' busiest expert) and whose outputs are ignored."""
    z, weights, ids, w, got = _run_case(3, 4, SHAPE_A, plan, "random", seed=21, check_op=False)
    gen = torch.Generator().manual_seed(22)
    zp = torch.cat([z, torch.randn(2, z.shape[1], generator=gen).to(z.dtype)])
    idsp = torch.cat([ids, torch.full((2, 4), int(ids[0, 0]))])
    weightsp = torch.cat([weights, torch.rand(2, 4, generator=gen)])
    padded = moe.moe_experts_mxfp4(*(t.to(DEVICE) for t in (zp, weightsp, idsp, *w)), BETA, LINEAR_BETA,
                                   plan=plan).cpu()
    if plan.grouped:  # the real pairs may sit in other columns of their blocks
        mirror = _mirror(z, weights, ids, w)
        _check(padded[:3], mirror[0], _mirror_tol(mirror, z.dtype), "real rows vs the fp64 mirror")
    else:
        assert torch.equal(padded[:3], got)


def test_routing_feeds_the_experts(poisoned):
    """Route coarse-grid logits (tied scores) with the kernel, then run the experts on its
    output (grouped path) against the op references run on the references' routing."""
    gen = torch.Generator().manual_seed(31)
    E, K, T = 16, 4, 5
    logits, bias = _coarse(gen, (T, E), -4, 4, 0.5), _coarse(gen, (E,), -2, 2, 0.125)
    weights, ids = routing.sigmoid_topk_route(logits.to(DEVICE), bias.to(DEVICE), K, True, 2.5)
    rw, rids = moe_ops.sigmoid_topk_route(logits, bias, K, True, 2.5)
    weights, ids = weights.cpu(), ids.cpu()
    assert torch.equal(ids, rids)
    w = _weights(gen, E, *SHAPE_B)
    z = torch.randn(T, SHAPE_B[0], generator=gen).bfloat16()
    ref = moe_ops.moe_experts_mxfp4(z, rw, rids, *w, BETA, LINEAR_BETA)
    got = moe.moe_experts_mxfp4(*(t.to(DEVICE) for t in (z, weights, ids, *w)), BETA, LINEAR_BETA,
                                plan=GROUPED_16).cpu()
    _check(got, ref, _op_tol(ref, z.dtype), "experts vs the op's reference")


def test_tolerances_catch_a_dropped_slot():
    """The mutant: an implementation that loses one k slot fails both tolerances by far."""
    gen = torch.Generator().manual_seed(41)
    D, I = SHAPE_A
    w = _weights(gen, 16, D, I)
    z = torch.randn(8, D, generator=gen).bfloat16()
    ids = _ids("random", 8, 16, 4, gen)
    weights = torch.rand(8, 4, generator=gen) + 0.05
    mirror = _mirror(z, weights, ids, w)
    ref = moe_ops.moe_experts_mxfp4(z, weights, ids, *w, BETA, LINEAR_BETA)
    for k in range(4):
        dropped = _mirror(z, weights, ids, w, drop_slot=k)[0].to(torch.bfloat16)
        # every token's row fails; and by a wide margin: 10x the op tolerance
        assert not _within(dropped, mirror[0], _mirror_tol(mirror, z.dtype)).all(dim=1).any()
        assert not _within(dropped, ref, _op_tol(ref, z.dtype)).all(dim=1).any()
        rel, abs_ = _op_tol(ref, z.dtype)
        assert ((dropped.double() - ref.double()).abs() - rel).max() > 10 * abs_


def test_align_tables():
    """The grouped layout (moe.align_pairs): each expert's pairs in pair order, segments
    padded to BLOCK_M with the sentinel P, per-block experts, -1 past the used blocks
    (E = 896, K3's top_k)."""
    gen = torch.Generator().manual_seed(51)
    T, K, E, block_m = 20, 16, 896, 16
    ids = torch.randint(0, 40, (T, K), generator=gen)  # crowded: several blocks for some experts
    P = T * K
    n_blocks = moe.grouped_blocks(P, E, block_m)
    sorted_pairs, block_expert = moe.align_pairs(ids.flatten().to(DEVICE), E, block_m, n_blocks)
    assert sorted_pairs.shape == (n_blocks * block_m,) and block_expert.shape == (n_blocks,)
    sorted_pairs, block_expert = sorted_pairs.cpu(), block_expert.cpu()
    want_pairs, want_experts = [], []
    flat = ids.flatten()
    for e in range(E):
        pairs = (flat == e).nonzero().flatten().tolist()
        if pairs:
            blocks = -(-len(pairs) // block_m)
            want_pairs += pairs + [P] * (blocks * block_m - len(pairs))
            want_experts += [e] * blocks
    used = len(want_experts)
    assert block_expert[:used].tolist() == want_experts and (block_expert[used:] == -1).all()
    assert sorted_pairs[:used * block_m].tolist() == want_pairs


def test_plans_and_dispatch():
    sm90 = moe.PLANS["sm_90"]
    assert moe.choose_plan(16) == sm90.pair  # batch 1
    assert moe.choose_plan(sm90.grouped_min_pairs - 1) == sm90.pair
    assert moe.choose_plan(sm90.grouped_min_pairs) == moe.choose_plan(1024 * 16) == sm90.grouped  # decode, prefill
    assert moe.choose_plan(sm90.prefill_min_pairs - 1) == sm90.grouped
    assert moe.choose_plan(sm90.prefill_min_pairs) == moe.choose_plan(32768 * 16) == sm90.prefill  # long prefill
    assert moe.grouped_blocks(1024, 896, 16) == 64 + 896 and moe.grouped_blocks(10, 896, 64) == 1 + 10
    fitted = moe._fit(moe.GemmPlan(64, 256), rows=48, kd=96)
    assert (fitted.block_n, fitted.block_k) == (64, 32)  # 96 = 3 x 32: K steps of 32
    assert moe._fit(moe.GemmPlan(128, 128), rows=384, kd=3584) == moe.GemmPlan(128, 128)
    with pytest.raises(ValueError, match="pair-major block_m must be 1"):
        moe._check_plan(moe.MoePlan(False, 32, moe.GemmPlan(16, 128), moe.GemmPlan(16, 128)))
    with pytest.raises(ValueError, match="powers of two"):
        moe._check_plan(moe.MoePlan(True, 16, moe.GemmPlan(24, 128), moe.GemmPlan(16, 128)))


def test_register_gpu_kernels_covers_the_ops_and_is_idempotent():
    """One entry point registers every runtime kernel for its k3 ops on CUDA (no GPU needed
    to register); the ops' default implementations stay the torch references elsewhere."""
    from k3compile.runtime.kernels import register_gpu_kernels

    accelerated = ("rms_norm", "add_rank_block", "add_rank_block_linear", "router_logits", "sigmoid_topk_route",
                   "moe_experts_mxfp4", "mla_decode", "mla_decode_split_kv", "kda_decode_fused",
                   "kda_decode_fused_proj", "dcp_rescale", "dcp_pack", "dcp_merge", "situ_and_mul", "situ_and_mul_proj",
                   "attn_res_mix", "attn_res_mix_norm")
    register_gpu_kernels()
    register_gpu_kernels()  # a second call changes nothing
    for name in accelerated:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"k3::{name}", "CUDA"), name
        assert not torch._C._dispatch_has_kernel_for_dispatch_key(f"k3::{name}", "CPU"), name
    with pytest.raises(ValueError, match="device_type must be one of"):
        register_gpu_kernels("tpu")
    # "cpu" (the kernels under the interpreter) is process-wide: tests/test_triton_cpu.py
    # registers it in spawned ranks only.


def test_bad_arguments_are_named():
    gen = torch.Generator().manual_seed(0)
    w = _weights(gen, 4, 64, 32)
    z, weights, ids = torch.zeros(2, 64, dtype=torch.bfloat16), torch.zeros(2, 2), torch.zeros(2, 2, dtype=torch.long)
    cases = [
        ((z.int(), weights, ids, *w), "z must be"),
        ((z, weights.int(), ids, *w), "weights must be floating point"),
        ((z, weights, ids.float(), *w), "ids int64/int32"),
        ((z, weights, ids[:1], *w), "must both be"),
        ((z, weights, ids, w[0].float(), *w[1:]), "w1_packed must be uint8"),
        ((z, weights, ids, w[0], w[1], w[2], w[3], w[4][:, :, :8], w[5]), "w2_packed must be uint8"),
        ((z, weights, ids, w[0].transpose(1, 2).contiguous().transpose(1, 2), *w[1:]), "contiguous"),
        ((z[:, :48], weights, ids, *w), "multiples of 32"),
        ((z, torch.zeros(2, 5), torch.zeros(2, 5, dtype=torch.long), *w), r"top_k=5 must be in \[1, E=4\]"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            moe.moe_experts_mxfp4(*args, BETA, LINEAR_BETA)
    with pytest.raises(ValueError, match="top_k"):
        routing.sigmoid_topk_route(torch.zeros(2, 8), torch.zeros(8), 9, True, 1.0)
    with pytest.raises(ValueError, match="bias"):
        routing.sigmoid_topk_route(torch.zeros(2, 8), torch.zeros(7), 2, True, 1.0)


# --------------------------------------------------------------------------- AOT

TARGETS = ("gfx950", "gfx942", "sm_90")


def aot_requests() -> dict[tuple[str, str], aot.CompileRequest]:
    """Every specialisation of moe.aot_requests for every target (compiled in the session's
    one batch: conftest's aot_reports)."""
    jobs = {(t, launch.name): launch.request(t) for t in TARGETS for launch in moe.aot_requests(t)}
    for t in ("gfx950", "gfx942"):  # one source: the H200's pair-major plan (vector units) compiles there too
        plans = moe.PLANS["sm_90"]
        jobs.update({(t, "sm_90 " + launch.name): launch.request(t) for launch in moe.aot_requests(t, plans=plans)
                     if "_pair_" in launch.name})
    return jobs


#: the most 32-bit words a thread of the H200's long-prefill w13 product may spill: two
#: [128, 128] fp32 accumulators (gate and up) per 8 warps (observed 118; the fastest of the
#: plans measured, BENCHMARKS.md)
PREFILL_W13_SM90_SPILLS = 128


def test_aot_every_default_specialisation_fits(aot_reports):
    for (target, name), res in aot_reports.items():
        allowed = PREFILL_W13_SM90_SPILLS if (target, name[:17]) == ("sm_90", "w13_grouped_prefi") else 0
        assert res.fits and res.spills <= allowed and res.registers, (target, name, res)
    names = {name for _, name in aot_reports}
    assert {"route", "combine"} <= names
    for target in TARGETS:  # what the launchers pick at K3's shapes, batch 1 to prefill, is compiled
        for pairs in (16, 256, 1024, 4096 * 16, 32768 * 16):
            plan = moe.choose_plan(pairs, target)
            for kind, g in (("w13", moe._fit(plan.w13, 384, 3584)), ("w2", moe._fit(plan.w2, 3584, 384))):
                assert any(n.startswith(kind) and n.endswith(str(g)) and ("grouped" in n) == plan.grouped
                           for t, n in aot_reports if t == target)
