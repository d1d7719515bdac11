"""The short-conv prefill kernels (runtime/kernels/short_conv.py) against
``k3::short_conv_prefill``'s torch reference, under the Triton interpreter without a GPU
(conftest sets TRITON_INTERPRET; on a GPU machine on the GPU).

Packed ragged sequences, shorter than the conv's history (1 and 2 tokens with K = 4) and
across the kernel's 16-token chunks, channel counts that are not a multiple of its
128-channel blocks; conv states updated in place in the given slots and nowhere else.
Tolerance: fp32 to 1e-6 of the largest output (the same sums, fused multiply-adds on a
GPU); bf16 outputs to one rounding (the interpreter truncates fp32 -> bf16); the new conv
states are copies of inputs: exact."""

from __future__ import annotations

import pytest
import torch

import k3compile.ops  # noqa: F401  (registers torch.ops.k3)
from k3compile.ops.kda import short_conv_prefill_reference
from k3compile.runtime.kernels import aot, kernel_launches, reset_kernel_launches, short_conv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("C", [200, 64])
def test_matches_the_reference_on_ragged_sequences(dtype, C):
    gen = torch.Generator().manual_seed(C)
    K = 4
    lens = [1, 2, 3, 40, 33, 5]
    slots = torch.tensor([5, 0, 7, 2, 3, 6])
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    x = torch.randn(sum(lens), C, generator=gen).to(dtype)
    weight = torch.randn(C, K, generator=gen).to(dtype)
    state = torch.randn(8, C, K - 1, generator=gen).to(dtype)
    want_state = state.clone()
    want = short_conv_prefill_reference(x, weight, want_state, cu, slots)
    got_state = state.to(DEVICE)
    reset_kernel_launches()
    got = short_conv.short_conv_prefill(x.to(DEVICE), weight.to(DEVICE), got_state, cu.to(DEVICE), slots.to(DEVICE))
    assert kernel_launches() == {"_chunk_table_kernel": 1, "_short_conv_kernel": 1, "_conv_state_kernel": 1}
    assert got.dtype == dtype
    err = float((got.cpu().float() - want.float()).abs().max() / want.float().abs().max())
    assert err <= (1e-6 if dtype == torch.float32 else 2.0**-7), err
    assert torch.equal(got_state.cpu(), want_state)  # in the slots; 1 and 4 untouched, as in the reference
    assert torch.equal(got_state.cpu()[[1, 4]], state[[1, 4]])


def test_bad_shapes_are_refused_before_any_work():
    x, weight, state = torch.randn(5, 8), torch.randn(8, 4), torch.randn(2, 8, 3)
    before = state.clone()
    with pytest.raises(ValueError, match=r"do not describe \[T, C\], \[C, K\], \[S, C, K-1\]"):
        short_conv.short_conv_prefill(x, weight, state[:, :, :2], torch.tensor([0, 5], dtype=torch.int32),
                                      torch.tensor([1]))
    assert torch.equal(state, before)


def aot_requests() -> dict[tuple[str, str], aot.CompileRequest]:
    return {(t, launch.name): launch.request(t) for t in aot.TARGETS for launch in short_conv.aot_requests()}


def test_kernels_compile_for_every_target_without_spills(aot_reports):
    """At K3's per-rank channels (1,536, K = 4, bf16): both kernels fit and do not spill."""
    assert len(aot_reports) == 2 * len(aot.TARGETS)
    for key, res in aot_reports.items():
        assert res.fits and res.spills == 0, (key, res)
