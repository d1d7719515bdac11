"""The MoE input kernels (runtime/kernels/moe_input.py) against ``k3::moe_input_proj``'s
torch reference, under the Triton interpreter without a GPU (conftest sets TRITON_INTERPRET),
and their compiles for every GPU target. z is the fp32 product rounded to bf16 (bit for
bit: the kernel rounds to nearest even by hand under the interpreter); h within
tests/tolerances.py's SITU of the SiTU-GLU of the bf16-rounded gate / up; the routing is
the routing kernel's on the logits' columns, read in place."""

from __future__ import annotations

import pytest
import torch
from test_kernel_rows import poisoned  # noqa: F401  (fixture)
from tolerances import SITU, assert_close_scaled

from k3compile.runtime.kernels import kernel_launches, moe_input, reset_kernel_launches, routing
from k3compile.runtime.weight_layout import consecutive_rows

pytestmark = pytest.mark.usefixtures("faster_interpreter")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TARGETS = ("sm_90", "gfx950", "gfx942")
k3 = torch.ops.k3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("T", "E", "Z", "I"), [(1, 16, 64, 32), (3, 24, 1100, 1030), (0, 16, 64, 32)])
def test_consumers_match_the_reference_on_one_product(poisoned, T, E, Z, I, dtype):  # noqa: F811
    """The [T, E + Z + 2 I] fp32 product as the merged GEMM gives it; Z = 1100 and I = 1030
    span two programs each, the last one partly; large gate / up values (tanh's far branch)."""
    gen = torch.Generator().manual_seed(T * 10 + Z)
    product = torch.randn(T, E + Z + 2 * I, generator=gen)
    product[:, E + Z:] *= 8
    bias = torch.randn(E, generator=gen) * 0.1
    reset_kernel_launches()
    weights, ids, z, h = moe_input.moe_input_consumers(product.to(DEVICE), (E, Z, I, I), bias.to(DEVICE), 4, True,
                                                       2.0, 4.0, 25.0, dtype)
    launches = kernel_launches()
    assert (launches.get("_moe_input_kernel", 0), launches.get("_route_kernel", 0)) == ((1, 1) if T else (0, 0))
    logits, zf, g, u = product.split([E, Z, I, I], dim=1)
    want_w, want_ids = k3.sigmoid_topk_route(logits, bias, 4, True, 2.0)
    assert torch.equal(ids.cpu(), want_ids)
    torch.testing.assert_close(weights.cpu(), want_w, rtol=2e-6, atol=1e-7)
    assert z.dtype == h.dtype == dtype and tuple(z.shape) == (T, Z) and tuple(h.shape) == (T, I)
    assert torch.equal(z.cpu(), zf.to(dtype))
    want_h = k3.situ_and_mul(g.to(dtype), u.to(dtype), 4.0, 25.0)
    assert_close_scaled(h.cpu(), want_h.float(), dtype, roundings=SITU(dtype), dims=-1, truncates=False, what="h")


def test_routing_reads_row_strided_logits_in_place(poisoned):  # noqa: F811
    gen = torch.Generator().manual_seed(3)
    wide = torch.randn(5, 40, generator=gen).to(DEVICE)
    bias = torch.randn(24, generator=gen).to(DEVICE) * 0.1
    strided, dense = wide[:, :24], wide[:, :24].contiguous()
    assert strided.stride() == (40, 1)
    got = routing.sigmoid_topk_route(strided, bias, 6, True, 1.0)
    want = routing.sigmoid_topk_route(dense, bias, 6, True, 1.0)
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_op_over_consecutive_or_separate_weights(poisoned, dtype):  # noqa: F811
    """``k3::moe_input_proj``'s kernel path with the weights laid out as consecutive rows
    (one GEMM), or separate (the ops one by one), against the op's reference."""
    gen = torch.Generator().manual_seed(5)
    E, Z, I, K = 16, 48, 24, 40
    rows = (torch.randn(E + Z + 2 * I, K, generator=gen) * K**-0.5).to(dtype)
    x = torch.randn(3, K, generator=gen).to(dtype)
    bias = torch.randn(E, generator=gen) * 0.1
    laid_out = rows.to(DEVICE).split([E, Z, I, I])
    assert consecutive_rows(laid_out) is not None
    parts = rows.split([E, Z, I, I])
    want = k3.moe_input_proj(x, parts[0], bias, *parts[1:], 4, True, 1.0, 4.0, 25.0)
    for weights in (laid_out, [w.clone() for w in laid_out]):
        got = moe_input.moe_input_proj(x.to(DEVICE), weights[0], bias.to(DEVICE), *weights[1:], 4, True, 1.0,
                                       4.0, 25.0)
        assert torch.equal(got[1].cpu(), want[1])
        torch.testing.assert_close(got[0].cpu(), want[0], rtol=1e-5, atol=1e-6)
        for a, b, what in zip(got[2:], want[2:], ("z", "h"), strict=True):
            assert a.dtype == dtype
            assert_close_scaled(a.cpu(), b.float(), dtype, roundings=SITU(dtype) + 4, dims=-1,
                                truncates=False, what=what)


def test_bad_products_are_named():
    with pytest.raises(ValueError, match=r"moe_input_proj: product torch.bfloat16 \[2, 40\] \(column stride 1\) "
                                         r"does not hold fp32 router / down / gate / up columns \(8, 16, 8, 8\)"):
        moe_input.moe_input_consumers(torch.zeros(2, 40, dtype=torch.bfloat16), (8, 16, 8, 8), torch.zeros(8), 2,
                                      True, 1.0, 4.0, 25.0, torch.bfloat16)


def test_registered_for_cuda():
    from k3compile.runtime.kernels import register_gpu_kernels

    register_gpu_kernels()  # "cuda" only: registering for "cpu" in this process is refused by conftest
    assert torch._C._dispatch_has_kernel_for_dispatch_key("k3::moe_input_proj", "CUDA")


def aot_requests() -> dict:
    return {t: moe_input.aot_launch().request(t) for t in TARGETS}


def test_compiles_for_every_target_without_spills(aot_reports):
    for target in TARGETS:
        res = aot_reports[target]
        assert res.fits and res.spills == 0, (target, res)
