"""The row kernels (runtime/kernels/rows.py) against the k3 ops' torch references, under
the Triton interpreter without a GPU (conftest sets TRITON_INTERPRET).

Tolerances (tests/tolerances.py: ROWS): against fp32 references on the same values, the
kernels round once, the output (the norm and x @ W^T stay fp32; bf16 under Triton 3.9's
interpreter by truncation: twice u); fp32 rows differ by the order of their sums. The
``poisoned`` fixture NaN-fills what the launchers allocate (outputs, split-K partials), so
an element no program writes fails.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from fast_interpreter import fast_interpreter
from tolerances import ROWS, ROWS_OP_REFERENCE, Roundings, assert_close_scaled

from k3compile.runtime.kernels import aot, rows

import k3compile.ops  # noqa: F401  (registers torch.ops.k3)


pytestmark = pytest.mark.usefixtures("faster_interpreter")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def poisoned(monkeypatch):
    """Floating-point tensors from torch.empty / empty_like start as NaN during the test
    (the launchers allocate outputs and partials with them)."""
    empty, empty_like = torch.empty, torch.empty_like

    def nan(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *args, **kwargs: nan(empty(*args, **kwargs)))
    monkeypatch.setattr(torch, "empty_like", lambda *args, **kwargs: nan(empty_like(*args, **kwargs)))


def check(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, dims: int | None = None, what: str = "out",
          roundings: Roundings = ROWS):
    """The kernel's output against an fp32 reference: ROWS, bf16 truncated when interpreted."""
    assert_close_scaled(got, want, dtype, roundings=roundings(dtype), dims=dims, truncates=rows._INTERPRETED,
                        what=what)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 96), (1, 3584), (0, 64)])
def test_rms_norm_matches_the_reference(poisoned, shape, dtype):
    """Per row (the scale of each); the last of several rows has a mean square near eps."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen) * 3
    if shape[0] > 1:
        x[-1] *= 1e-3
    x = x.to(dtype).to(DEVICE)
    w = (torch.rand(shape[-1], generator=gen) + 0.5).to(dtype).to(DEVICE)
    got = rows.rms_norm(x, w, 1e-5)
    assert got.dtype == dtype
    check(got, torch.ops.k3.rms_norm(x.cpu().float(), w.cpu().float(), 1e-5), dtype, dims=-1)


@pytest.mark.parametrize("rank", [0, 3, 7])
def test_add_rank_block_matches_the_reference(rank):
    gen = torch.Generator().manual_seed(rank)
    width, tp, rows_ = 2048 + 64, 8, 3  # not a multiple of the kernel's column block
    n = width // tp
    acc = torch.randn(rows_, width, generator=gen).to(DEVICE)
    block = torch.randn(rows_, n, generator=gen).to(DEVICE)
    start = torch.tensor(rank * n, device=DEVICE)
    got = rows.add_rank_block(acc, block, start, -1)
    want = acc.cpu().clone()
    want[:, rank * n:(rank + 1) * n] += block.cpu()
    torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0)
    torch.testing.assert_close(torch.ops.k3.add_rank_block(acc.cpu(), block.cpu(), start.cpu(), -1), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 3, rows.SPLITK_MAX_T + 1])  # split-K kernel, then the vendor GEMM + add
@pytest.mark.parametrize("rank", [0, 3, 7])
def test_add_rank_block_linear_matches_the_reference(rank, T, dtype):
    gen = torch.Generator().manual_seed(rank * 10 + T)
    # N: not a multiple of the add kernel's column block.
    N, tp, K = 8 * 100, 8, 296
    n = N // tp
    acc = torch.randn(T, N, generator=gen).to(dtype).to(DEVICE)
    x = torch.randn(T, K, generator=gen).to(dtype).to(DEVICE)
    w = (torch.randn(n, K, generator=gen) * K**-0.5).to(dtype).to(DEVICE)
    start = torch.tensor(rank * n, device=DEVICE)
    got = rows.add_rank_block_linear(acc, x, w, start).cpu()
    want = acc.cpu().float().clone()
    want[:, rank * n:(rank + 1) * n] += x.cpu().float() @ w.cpu().float().T
    ref = torch.ops.k3.add_rank_block_linear(acc.cpu(), x.cpu(), w.cpu(), start.cpu())
    assert got.dtype == ref.dtype == dtype
    # Beyond the split-K kernel's rows the vendor GEMM rounds x @ W^T before the add, as the
    # op reference does (on an H200 cuBLAS's bf16 product needs that second rounding).
    check(got, want, dtype, roundings=ROWS if T <= rows.SPLITK_MAX_T else ROWS_OP_REFERENCE)
    assert_close_scaled(ref, want, dtype, roundings=ROWS_OP_REFERENCE(dtype), what="op reference")
    outside = torch.ones(N, dtype=torch.bool)
    outside[rank * n:(rank + 1) * n] = False
    assert torch.equal(got[:, outside], acc.cpu()[:, outside])  # copied bit for bit


def _splitk_case(T, n, K, dtype, seed, tp=8, rank=5):
    gen = torch.Generator().manual_seed(seed)
    N = n * tp
    acc = torch.randn(T, N, generator=gen).to(dtype).to(DEVICE)
    x = torch.randn(T, K, generator=gen).to(dtype).to(DEVICE)
    w = (torch.randn(n, K, generator=gen) * K**-0.5).to(dtype).to(DEVICE)
    start = torch.tensor(rank * n, device=DEVICE)
    want = acc.cpu().float().clone()
    want[:, rank * n:(rank + 1) * n] += x.cpu().float() @ w.cpu().float().T
    outside = torch.ones(N, dtype=torch.bool)
    outside[rank * n:(rank + 1) * n] = False
    return acc, x, w, start, want, outside


SPLITK_CASES = [  # (config, K, effective splits)
    (rows.SplitKConfig(block_n=16, split_k=4, num_warps=4, block_k=64, dot=False), 256, 4),
    (rows.SplitKConfig(block_n=16, split_k=3, num_warps=4, block_k=32, dot=False), 256, 3),  # 8 tiles: 3, 3, 2
    (rows.SplitKConfig(block_n=32, split_k=5, num_warps=4, block_k=32, dot=False), 256, 4),  # 5 asked: 2 tiles each
    (rows.SplitKConfig(block_n=64, split_k=7, num_warps=2, block_k=32, dot=False), 296, 5),  # ragged last K tile
    (rows.SplitKConfig(block_n=16, split_k=1, num_warps=4, block_k=64, dot=False), 256, 1),  # no split: no counters
    (rows.SplitKConfig(block_n=16, split_k=4, num_warps=4, block_k=64, dot=True), 256, 4),
    (rows.SplitKConfig(block_n=32, split_k=3, num_warps=4, block_k=32, dot=True), 296, 3),  # 10 tiles: 4, 4, 2
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 3, 16])
@pytest.mark.parametrize(("cfg", "K", "splits"), SPLITK_CASES, ids=str)
def test_splitk_kernel_matches_the_reference(poisoned, cfg, K, splits, T, dtype):
    n = 64
    acc, x, w, start, want, outside = _splitk_case(T, n, K, dtype, seed=T * 100 + K)
    acc_before = acc.clone()
    plan = rows.splitk_plan(T, acc.shape[-1], n, K, cfg, dtype)
    assert plan.splits == splits and plan.grid == (n // cfg.block_n, 1 + splits, 1)  # + the copy programs
    got = rows.add_rank_block_linear_splitk(acc, x, w, start, cfg)
    assert got.dtype == dtype and got.shape == acc.shape and got.data_ptr() != acc.data_ptr()
    check(got, want, dtype)
    assert torch.equal(acc, acc_before)  # the op returns a new tensor; acc is not modified
    assert torch.equal(got.cpu()[:, outside], acc.cpu()[:, outside])  # copied bit for bit
    # Same result again (the sum over splits is in split order) and the arrival counters are
    # back to zero for the next launch.
    assert torch.equal(rows.add_rank_block_linear_splitk(acc, x, w, start, cfg), got)
    if splits > 1:
        assert not rows._counters.get(torch.device(DEVICE), 1).any()


def test_splitk_kernel_with_many_rows_on_the_dot_path():
    """T = 40 on the tensor-core path: one x tile of 64 rows (the sweep times batch 64)."""
    cfg = rows.SplitKConfig(block_n=16, split_k=2, num_warps=4, block_k=64, dot=True)
    acc, x, w, start, want, outside = _splitk_case(40, 32, 256, torch.float32, seed=7)
    got = rows.add_rank_block_linear_splitk(acc, x, w, start, cfg)
    check(got, want, torch.float32)
    assert torch.equal(got.cpu()[:, outside], acc.cpu()[:, outside])


# K3 at TP8: routed_expert_up_proj (3584 -> 7168), deduplicated, is one rank's 896 rows of it
# added into the 7168-wide partial: the shape splitk_aot_signature compiles by default.
K3_TP8_ROWS = {name: p.default for name, p in inspect.signature(rows.splitk_aot_signature).parameters.items()
               if name in ("N", "n", "K")}


@pytest.mark.parametrize("T, dot", [(1, False), (8, True)])
def test_k3_tp8_rows_gemv(poisoned, T, dot):
    """add_rank_block_linear at K3's TP8 rows (bf16 896 x 3584 into 7168 columns, rank 5) at
    batch 1 and 8, with the launcher's plan (FMA at batch 1, tl.dot from 2; 56 row tiles x
    14 K splits + 56 copy programs; asserted): the block within ROWS, the other columns
    copied bit for bit."""
    N, n, K = K3_TP8_ROWS["N"], K3_TP8_ROWS["n"], K3_TP8_ROWS["K"]
    assert (N, n, K) == (7168, 896, 3584)
    config = rows.choose_splitk_config(T)
    plan = rows.splitk_plan(T, N, n, K, config)
    assert config.dot == dot and plan.grid == (56, 1 + 14, 1) and plan.splits == 14
    acc, x, w, start, want, outside = _splitk_case(T, n, K, torch.bfloat16, seed=T, tp=N // n, rank=5)
    with fast_interpreter():  # and no integer overflow checks: offsets here stay below 2^23
        got = rows.add_rank_block_linear(acc, x, w, start)
    check(got, want, torch.bfloat16)
    assert torch.equal(got.cpu()[:, outside], acc.cpu()[:, outside])


def test_splitk_dispatch_and_defaults():
    # K3 TP8 rows at the defaults (from the H200 sweep): every K tile used, 56 row tiles x 14 splits.
    for T in (1, 8, rows.SPLITK_MAX_T):
        plan = rows.splitk_plan(T, 7168, 896, 3584, rows.choose_splitk_config(T))
        assert plan.grid == (56, 1 + 14, 1) and plan.constexprs["EVEN_K"]
    assert not rows.choose_splitk_config(1).dot and rows.choose_splitk_config(2).dot
    # AMD: one K tile a split, 56 x 28 programs (~6 a CU on 256 / 304 CUs, as on the H200's 132)
    for target in ("gfx950", "gfx942"):
        plan = rows.splitk_plan(1, 7168, 896, 3584, rows.choose_splitk_config(1, target))
        assert plan.grid == (56, 1 + 28, 1) and plan.splits == 28 and not rows.choose_splitk_config(1, target).dot
    # split_k=8 on 28 K tiles of 128: 4 tiles each, so 7 splits, none of them empty.
    assert rows.splitk_plan(1, 7168, 896, 3584, rows.SplitKConfig(split_k=8)).splits == 7


def test_bad_splitk_configs_are_named():
    with pytest.raises(ValueError, match="block_n must be a power of two"):
        rows.splitk_plan(1, 64, 8, 32, rows.SplitKConfig(block_n=24))
    with pytest.raises(ValueError, match="split_k must be >= 1"):
        rows.splitk_plan(1, 64, 8, 32, rows.SplitKConfig(split_k=0))
    with pytest.raises(ValueError, match="tl.dot path needs block_n >= 16"):
        rows.splitk_plan(1, 64, 8, 32, rows.SplitKConfig(block_n=8, dot=True))
    with pytest.raises(ValueError, match="FMA path takes at most 16 rows"):
        rows.splitk_plan(17, 64, 8, 32, rows.SplitKConfig(dot=False))
    with pytest.raises(ValueError, match="x is torch.float32 but weight is torch.bfloat16"):
        rows.add_rank_block_linear_splitk(torch.zeros(1, 16), torch.zeros(1, 4), torch.zeros(2, 4, dtype=torch.bfloat16),
                                          torch.tensor(0))


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match="weight of shape"):
        rows.rms_norm(torch.zeros(2, 8), torch.zeros(4), 1e-5)
    with pytest.raises(ValueError, match="does not fit"):
        rows.add_rank_block(torch.zeros(2, 8), torch.zeros(3, 4), torch.tensor(0), -1)
    with pytest.raises(ValueError, match="does not fit"):
        rows.add_rank_block_linear(torch.zeros(2, 8), torch.zeros(2, 5), torch.zeros(4, 6), torch.tensor(0))


TARGETS = ("gfx950", "gfx942", "sm_90")
# The split-K kernel at K3's TP8 shapes (bf16, 896 x 3584 rows) as add_rank_block_linear
# launches it at batch 1 (FMA) and 8 and 16 (tl.dot), and a wide FMA tile at batch 4.
SPLITK_AOT = [(T, None) for T in (1, 8, rows.SPLITK_MAX_T)] + [
    (4, rows.SplitKConfig(block_n=32, split_k=14, num_warps=4, block_k=128, dot=False))]


def aot_requests() -> dict[tuple, aot.CompileRequest]:
    """Every row kernel for every target (compiled in the session's one batch: conftest's aot_reports)."""
    jobs = {}
    for target in TARGETS:
        jobs["norm", target] = aot.CompileRequest(
            rows._rms_norm_kernel,
            {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "width": "i32", "eps": "fp32", "BLOCK": "constexpr"},
            {"BLOCK": 4096}, target)
        jobs["add", target] = aot.CompileRequest(
            rows._add_rank_block_kernel,
            {"acc_ptr": "*bf16", "block_ptr": "*bf16", "start_ptr": "*i64", "out_ptr": "*bf16", "width": "i32",
             "n": "i32", "BLOCK": "constexpr"},
            {"BLOCK": rows.ADD_BLOCK}, target)
        for i, (T, cfg) in enumerate(SPLITK_AOT):
            sig, constexprs, num_warps = rows.splitk_aot_signature(torch.bfloat16, cfg, T)
            jobs["splitk", i, target] = aot.CompileRequest(
                rows._rows_gemv_add_kernel, sig, constexprs, target, num_warps, 1, ("K",))
    return jobs


def test_row_kernels_compile_for_amd_targets(aot_reports):
    for target in ("gfx950", "gfx942"):
        norm, add = aot_reports["norm", target], aot_reports["add", target]
        assert norm.fits and add.fits and not norm.spills and not add.spills


def test_splitk_kernel_compiles_for_every_target(aot_reports):
    for i in range(len(SPLITK_AOT)):
        for target in TARGETS:
            res = aot_reports["splitk", i, target]
            assert res.fits and res.spills == 0, res
            assert res.shared_bytes <= 16 * 1024, res  # reductions and the dot operands' staging
