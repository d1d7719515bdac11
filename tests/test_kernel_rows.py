"""The row kernels (runtime/kernels/rows.py) against the k3 ops' torch references, under
the Triton interpreter without a GPU (conftest sets TRITON_INTERPRET)."""

from __future__ import annotations

import pytest
import torch

import k3compile.ops  # noqa: F401  (registers torch.ops.k3)
from k3compile.runtime.kernels import aot, rows

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 96), (1, 3584), (0, 64)])
def test_rms_norm_matches_the_reference(shape, dtype):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=gen) * 3).to(dtype).to(DEVICE)
    w = (torch.rand(shape[-1], generator=gen) + 0.5).to(dtype).to(DEVICE)
    got = rows.rms_norm(x, w, 1e-5)
    want = torch.ops.k3.rms_norm(x.cpu(), w.cpu(), 1e-5)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    torch.testing.assert_close(got.cpu(), want, **tol)


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
@pytest.mark.parametrize("T", [1, 3])
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
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(got.float(), want, **tol)
    torch.testing.assert_close(ref.float(), want, **tol)
    outside = torch.ones(N, dtype=torch.bool)
    outside[rank * n:(rank + 1) * n] = False
    assert torch.equal(got[:, outside], acc.cpu()[:, outside])  # copied bit for bit


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match="weight of shape"):
        rows.rms_norm(torch.zeros(2, 8), torch.zeros(4), 1e-5)
    with pytest.raises(ValueError, match="does not fit"):
        rows.add_rank_block(torch.zeros(2, 8), torch.zeros(3, 4), torch.tensor(0), -1)
    with pytest.raises(ValueError, match="does not fit"):
        rows.add_rank_block_linear(torch.zeros(2, 8), torch.zeros(2, 5), torch.zeros(4, 6), torch.tensor(0))


def test_row_kernels_compile_for_amd_targets():
    for target in ("gfx950", "gfx942"):
        norm = aot.compile_for_target(
            rows._rms_norm_kernel,
            {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "width": "i32", "eps": "fp32", "BLOCK": "constexpr"},
            {"BLOCK": 4096}, target)
        add = aot.compile_for_target(
            rows._add_rank_block_kernel,
            {"acc_ptr": "*bf16", "block_ptr": "*bf16", "start_ptr": "*i64", "out_ptr": "*bf16", "width": "i32",
             "n": "i32", "BLOCK": "constexpr"},
            {"BLOCK": rows.ADD_BLOCK}, target)
        assert norm.fits and add.fits and not norm.spills and not add.spills
