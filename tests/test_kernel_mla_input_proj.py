"""The MLA input kernel (runtime/kernels/mla_input_proj.py) against ``k3::mla_input_proj``'s
torch reference, under the Triton interpreter without a GPU (conftest sets TRITON_INTERPRET),
and its compiles for every GPU target. Tolerances: tests/tolerances.py, ROWS (the norms) and
SIGMOID (the gate); k_pe is copied bit for bit."""

from __future__ import annotations

import pytest
import torch
from test_kernel_rows import poisoned  # noqa: F401  (fixture)
from tolerances import ROWS, SIGMOID, assert_close_scaled

from k3compile.runtime.kernels import aot, kernel_launches, mla_input_proj, reset_kernel_launches
from k3compile.runtime.kernels.rows import _INTERPRETED
from k3compile.runtime.weight_layout import consecutive_rows

pytestmark = pytest.mark.usefixtures("faster_interpreter")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TARGETS = ("sm_90", "gfx950", "gfx942")
k3 = torch.ops.k3


def _norm_weights(Q: int, L: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.rand(Q, generator=gen) + 0.5, torch.rand(L, generator=gen) + 0.5


def _check(got: tuple, q, c, g, q_norm, kv_norm, L: int, dtype: torch.dtype) -> None:
    """(q_c, kv, gate) against fp32 references on the same (rounded) products."""
    q_c, kv, gate = (t.cpu() for t in got)
    assert [t.dtype for t in (q_c, kv, gate)] == [dtype] * 3
    want_q = k3.rms_norm(q.float(), q_norm.float(), 1e-6)
    want_latent = k3.rms_norm(c[:, :L].float(), kv_norm.float(), 1e-5)
    roundings = {"roundings": ROWS(dtype), "dims": -1, "truncates": _INTERPRETED}
    assert_close_scaled(q_c, want_q, dtype, what="q_c", **roundings)
    assert_close_scaled(kv[:, :L], want_latent, dtype, what="latent", **roundings)
    assert torch.equal(kv[:, L:], c[:, L:].cpu())
    assert_close_scaled(gate, torch.sigmoid(g.float()), dtype, roundings=SIGMOID(dtype), dims=-1,
                        truncates=_INTERPRETED, what="gate")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("T", "Q", "L", "R", "G"), [(1, 32, 32, 8, 64), (3, 96, 40, 8, 2100), (0, 32, 32, 8, 64)])
def test_matches_the_reference_on_a_row_strided_product(poisoned, T, Q, L, R, G, dtype):  # noqa: F811
    """q, c, g as column blocks of one [T, Q + L + R + G] product, as the merged GEMM gives
    them; G = 2100 spans three gate programs, the last one partly; large gate values (the
    sigmoid's overflow-free form); the last row's mean square near eps."""
    gen = torch.Generator().manual_seed(T * 100 + G)
    product = torch.randn(T, Q + L + R + G, generator=gen) * 3
    product[:, Q + L + R:] *= 10
    if T > 1:
        product[-1, :Q + L] *= 1e-3
    product = product.to(dtype)
    q_norm, kv_norm = (w.to(dtype) for w in _norm_weights(Q, L, gen))
    q, c, g = product.to(DEVICE).split([Q, L + R, G], dim=-1)
    assert q.stride(0) == c.stride(0) == g.stride(0) == Q + L + R + G
    reset_kernel_launches()
    got = mla_input_proj.mla_input_consumers(q, c, g, q_norm.to(DEVICE), kv_norm.to(DEVICE), 1e-6, 1e-5, L)
    assert kernel_launches().get("_mla_input_proj_kernel", 0) == (1 if T else 0)
    assert [tuple(t.shape) for t in got] == [(T, Q), (T, L + R), (T, G)]
    cpu = product.split([Q, L + R, G], dim=-1)
    _check(got, *cpu, q_norm, kv_norm, L, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_op_runs_one_gemm_over_consecutive_weights(dtype):
    """``k3::mla_input_proj``'s kernel path with its weights laid out as consecutive rows of
    one buffer (as the runtime loads them) or separate, against the op's reference."""
    gen = torch.Generator().manual_seed(5)
    Q, L, R, G, K = 24, 16, 8, 48, 40
    rows = (torch.randn(Q + L + R + G, K, generator=gen) * K**-0.5).to(dtype)
    x = torch.randn(3, K, generator=gen).to(dtype)
    q_norm, kv_norm = (w.to(dtype) for w in _norm_weights(Q, L, gen))
    laid_out = rows.to(DEVICE).split([Q, L + R, G])
    assert consecutive_rows(laid_out) is not None
    for weights in (laid_out, [w.clone() for w in laid_out]):
        got = mla_input_proj.mla_input_proj(x.to(DEVICE), *weights, q_norm.to(DEVICE), kv_norm.to(DEVICE),
                                            1e-6, 1e-5, L)
        if dtype == torch.float32:  # against the consumers of the same GEMM's products (k_pe bit for bit)
            merged = consecutive_rows(weights)
            products = (torch.nn.functional.linear(x.to(DEVICE), merged).split([Q, L + R, G], dim=-1)
                        if merged is not None else [torch.nn.functional.linear(x.to(DEVICE), w) for w in weights])
            _check(got, *(p.cpu() for p in products), q_norm, kv_norm, L, dtype)
        else:  # the GEMM's bf16 rounding of the product may differ from ours by an ulp: against the op
            ref = k3.mla_input_proj(x, *(w.cpu() for w in weights), q_norm, kv_norm, 1e-6, 1e-5, L)
            for a, b, what in zip(got, ref, ("q_c", "kv", "gate"), strict=True):
                assert_close_scaled(a.cpu(), b.float(), dtype, roundings=4, dims=-1, truncates=_INTERPRETED,
                                    what=what)


def test_bad_arguments_are_named():
    q, c, g = torch.zeros(2, 8), torch.zeros(2, 12), torch.zeros(2, 16)
    with pytest.raises(ValueError, match=r"mla_input_proj: products q \[2, 8\], c \[2, 12\], g \[2, 16\] with "
                                         r"norm weights \[8\], \[4\] and kv_lora_rank 12 do not fit"):
        mla_input_proj.mla_input_consumers(q, c, g, torch.ones(8), torch.ones(4), 1e-6, 1e-6, 12)


def test_registered_for_cuda():
    from k3compile.runtime.kernels import register_gpu_kernels

    register_gpu_kernels()  # "cuda" only: registering for "cpu" in this process is refused by conftest
    assert torch._C._dispatch_has_kernel_for_dispatch_key("k3::mla_input_proj", "CUDA")
    assert not torch._C._dispatch_has_kernel_for_dispatch_key("k3::mla_input_proj", "CPU")


def aot_requests() -> dict[str, aot.CompileRequest]:
    """The kernel at K3's widths in bf16 for every target (the session's one batch: conftest's aot_reports)."""
    return {t: mla_input_proj.aot_launch().request(t) for t in TARGETS}


def test_compiles_for_every_target_without_spills(aot_reports):
    for target in TARGETS:
        res = aot_reports[target]
        assert res.fits and res.spills == 0, (target, res)
