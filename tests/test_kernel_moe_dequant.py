"""The routed experts' dequantised path (runtime/kernels/moe_dequant.py): the MXFP4
dequantisation kernel bit for bit against the checkpoint reader's, and the whole path
against ``k3::moe_experts_mxfp4``'s reference, under the Triton interpreter (on a GPU
machine, on the GPU). The path rounds where the reference does (W1 z, W3 z, h and W2 h to
bf16): only the order of the fp32 sums differs, so the MoE tests' op tolerance holds.
"""

from __future__ import annotations

import pytest
import torch
from test_kernel_moe import BETA, DEVICE, LINEAR_BETA, _check, _ids, _op_tol, _weights

import k3compile.ops  # noqa: F401  (registers torch.ops.k3)
from k3compile.checkpoint.mxfp4 import unpack_mxfp4
from k3compile.ops import moe as moe_ops
from k3compile.runtime.kernels import aot, kernel_launches, moe, moe_dequant, reset_kernel_launches

pytestmark = pytest.mark.usefixtures("interpreter_rounds_like_gpus")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dequantize_is_exact(dtype):
    """Every code and a spread of scales (bytes 100-140, and 0 = 2^-127 in fp32, whose
    products are fp32 subnormals: the interpreter flushes them in bf16), rows past one
    program's and columns past one program's bytes."""
    gen = torch.Generator().manual_seed(3)
    packed = torch.randint(0, 256, (3, 37, 160), dtype=torch.uint8, generator=gen)
    packed[0, 0, :128] = torch.arange(128, dtype=torch.uint8) * 2  # both nibbles over their 16 codes
    scale = torch.randint(100, 141, (3, 37, 10), dtype=torch.uint8, generator=gen)
    if dtype == torch.float32:
        scale[1, 2, 3] = 0
    got = moe_dequant.dequantize(packed.to(DEVICE), scale.to(DEVICE), dtype).cpu()
    assert got.shape == (3, 37, 320) and got.dtype == dtype
    assert torch.equal(got, unpack_mxfp4(packed, scale, dtype))


@pytest.mark.parametrize(("T", "pattern", "group"), [(9, "random", 5), (6, "repeats", 16), (4, "one_expert", 3)])
def test_matches_the_op_reference(T, pattern, group):
    """Tokens over groups of experts (5 and 3 of 16 experts: several groups, the last one
    short, groups without pairs skipped), an expert picked twice by one token, all pairs on
    one expert; one launch of the dequantisation per weight and group with pairs."""
    gen = torch.Generator().manual_seed(T)
    E, K, D, I = 16, 4, 256, 64
    w = _weights(gen, E, D, I)
    z = torch.randn(T, D, generator=gen).bfloat16()
    ids = _ids(pattern, T, E, K, gen)
    weights = torch.rand(T, K, generator=gen) + 0.05
    reset_kernel_launches()
    got = moe_dequant.moe_experts_dequantized(z.to(DEVICE), weights.to(DEVICE), ids.to(DEVICE),
                                              *(t.to(DEVICE) for t in w), BETA, LINEAR_BETA, group=group).cpu()
    groups_hit = len({e // group for e in ids.flatten().tolist()})
    assert kernel_launches()["_mxfp4_dequant_kernel"] == 3 * groups_hit
    assert got.dtype == torch.bfloat16 and got.shape == (T, D)
    ref = moe_ops.moe_experts_mxfp4(z, weights, ids, *w, BETA, LINEAR_BETA)
    _check(got, ref, _op_tol(ref, torch.bfloat16), "dequantised experts vs the op's reference")


def test_dispatch_by_pairs_and_dtype():
    """The registered op runs dequantised from the target's dequant_min_pairs with bf16
    activations, the fused kernels below it or for other dtypes; AMD targets never (not
    measured there)."""
    z = torch.zeros(1, 32, dtype=torch.bfloat16)
    threshold = moe.PLANS["sm_90"].dequant_min_pairs
    assert moe_dequant.dequantized_path(threshold, z) and not moe_dequant.dequantized_path(threshold - 1, z)
    assert not moe_dequant.dequantized_path(threshold, z.float())
    assert moe.PLANS["gfx950"].dequant_min_pairs is None and moe.PLANS["gfx942"].dequant_min_pairs is None


def test_refuses_other_activations():
    gen = torch.Generator().manual_seed(0)
    w = _weights(gen, 4, 64, 32)
    z = torch.randn(2, 64, generator=gen)
    with pytest.raises(ValueError, match="bf16 activations needed"):
        moe_dequant.moe_experts_dequantized(z, torch.ones(2, 2), torch.zeros(2, 2, dtype=torch.int64), *w, BETA,
                                            LINEAR_BETA)


def aot_requests() -> dict[tuple[str, str], aot.CompileRequest]:
    return {(t, launch.name): launch.request(t) for t in aot.TARGETS for launch in moe_dequant.aot_requests()}


def test_dequantize_compiles_for_every_target(aot_reports):
    assert len(aot_reports) == len(aot.TARGETS)
    for (target, name), res in aot_reports.items():
        assert res.fits and res.spills == 0, (target, name, res)
