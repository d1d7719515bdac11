"""The SiTU-GLU kernel (runtime/kernels/activations.py) against ``k3::situ_and_mul``'s torch
reference, under the Triton interpreter without a GPU (conftest sets TRITON_INTERPRET), and
its compiles for every GPU target. Tolerance: tests/tolerances.py, SITU."""

from __future__ import annotations

import pytest
import torch
from test_kernel_rows import poisoned  # noqa: F401  (fixture)
from tolerances import SITU, assert_close_scaled

from k3compile.ops.activations import situ_glu
from k3compile.runtime.kernels import activations, aot, kernel_launches, reset_kernel_launches
from k3compile.runtime.kernels.rows import _INTERPRETED

pytestmark = pytest.mark.usefixtures("faster_interpreter")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TARGETS = ("sm_90", "gfx950", "gfx942")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("rows", "width"), [(1, 384), (3, 2304), (5, 1100), (0, 64)])
def test_matches_the_reference(rows, width, dtype):
    """Values across tanh's two branches (|v| below and above 0.3 after the betas' scaling)
    and large gates (the sigmoid's overflow-free form)."""
    gen = torch.Generator().manual_seed(rows * 7 + width)
    gate = (torch.randn(rows, width, generator=gen) * 6).to(dtype)
    up = (torch.randn(rows, width, generator=gen) * 30).to(dtype)
    reset_kernel_launches()
    got = activations.situ_and_mul(gate.to(DEVICE), up.to(DEVICE), 4.0, 25.0)
    assert got.dtype == dtype and got.shape == (rows, width)
    assert kernel_launches().get("_situ_and_mul_kernel", 0) == (1 if rows else 0)
    want = situ_glu(gate, up, 4.0, 25.0)  # fp32, before the reference's final rounding
    assert_close_scaled(got.cpu(), want, dtype, roundings=SITU(dtype), dims=-1, truncates=_INTERPRETED)


def test_row_strided_inputs_are_read_in_place():
    """gate and up as column blocks of one [T, 2I] tensor (a merged gate / up projection)."""
    gen = torch.Generator().manual_seed(3)
    both = torch.randn(4, 2 * 96, generator=gen).to(DEVICE)
    gate, up = both[:, :96], both[:, 96:]
    assert gate.stride() == (192, 1)
    got = activations.situ_and_mul(gate, up, 4.0, 25.0)
    want = activations.situ_and_mul(gate.contiguous(), up.contiguous(), 4.0, 25.0)
    assert torch.equal(got, want)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match=r"situ_and_mul: gate \[2, 8\] and up \[2, 4\] must have one shape"):
        activations.situ_and_mul(torch.zeros(2, 8), torch.zeros(2, 4), 4.0, 25.0)


def aot_requests() -> dict[tuple, aot.CompileRequest]:
    """The kernel for every target, bf16 (compiled in the session's one batch: conftest's aot_reports)."""
    return {t: activations.aot_launch().request(t) for t in TARGETS}


def test_compiles_for_every_target_without_spills(aot_reports):
    for target in TARGETS:
        res = aot_reports[target]
        assert res.fits and res.spills == 0 and 0 < res.registers <= 64 and res.shared_bytes == 0, (target, res)


def test_proj_runs_one_gemm_over_consecutive_weights():
    """``k3::situ_and_mul_proj``'s kernel path: gate and up weights laid out as consecutive
    rows of one buffer (as the runtime loads them) or separate, against the reference."""
    from k3compile.runtime.weight_layout import consecutive_rows

    gen = torch.Generator().manual_seed(4)
    both = torch.randn(2 * 96, 40, generator=gen) * 0.3
    x = torch.randn(3, 40, generator=gen)
    want = situ_glu(torch.nn.functional.linear(x, both[:96]), torch.nn.functional.linear(x, both[96:]), 4.0, 25.0)
    laid_out = both.to(DEVICE).split(96)
    assert consecutive_rows(laid_out) is not None
    for weights in (laid_out, [w.clone() for w in laid_out]):
        got = activations.situ_and_mul_proj(x.to(DEVICE), *weights, 4.0, 25.0)
        assert_close_scaled(got.cpu(), want, torch.float32, roundings=SITU(torch.float32) + 4, dims=-1)
