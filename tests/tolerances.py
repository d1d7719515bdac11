"""The kernel tests' comparison tolerances, stated once: from the dtype, the roundings of the
kernel's path and the scale of the values, not fixed constants.

A kernel's result ``got`` is compared with a torch reference ``want`` (fp32 math on the same
inputs, or the op's reference where it rounds at the same points), and must satisfy

    |got - want| <= roundings x u(dtype) x scale          (element-wise)

- ``u(dtype)``, the unit roundoff: bf16 2^-8, fp16 2^-11, fp32 2^-24. Rounding to nearest moves
  a value by at most u of its magnitude. Triton 3.9's interpreter casts fp32 -> bf16 by
  TRUNCATION (``_convert_float`` without a rounding mode; fp16 goes through numpy, to nearest):
  up to 2u, so ``truncates=True`` doubles u for bf16 where the kernel's own casts run there.
- ``roundings``: how many such steps separate the two results. A rounding the kernel makes
  and the reference does not counts 1; a rounding both make, of values that differ by fp32
  noise, counts 2 (they may land one ulp apart); fp32 arithmetic counts by its sums: a sum of
  n terms in another order moves by about sqrt(n) u of the terms' magnitude (rounding errors
  of independent signs; the worst case, n u, would be too loose to catch a wrong kernel).
- ``scale``: the magnitude of the values that were rounded, taken from the reference: its
  largest finite |value| over the whole tensor, or over each row (``dims``) where rows differ
  in scale. An attention row over one token holds values ~1, over 300 tokens ~0.1: one scale
  for the tensor would let the long rows drift by 10x their own rounding. A test may pass
  its own scale.

These are heuristic bounds (independent rounding errors, not worst cases), checked both ways:
the kernels pass them, and ``tests/kernel_mutants.py`` shows that each listed wrong kernel
fails at least one test (docs/testing.md, "Kernel mutants"). Equal infinities compare equal
(an empty context's lse is -inf); NaN in ``got`` where ``want`` is not NaN fails (the
launchers NaN-fill outputs under the interpreter: an element no program wrote).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

UNIT_ROUNDOFF: dict[torch.dtype, float] = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}


@dataclass(frozen=True)
class Roundings:
    """The roundings of one kernel path: with bf16 / fp16 values, and with fp32 ones."""

    low: float
    fp32: float

    def __call__(self, dtype: torch.dtype) -> float:
        return self.fp32 if dtype == torch.float32 else self.low


# --------------------------------------------------------------------------- each kernel path
# (observed: the largest |got - want| / (u x scale) of the tests, the interpreter, CPU)

#: MLA o, per (token, head) row: the probabilities are rounded to the model dtype before the
#: value product (with an FP8 cache, times the row's value scale first) and o once to q's
#: dtype (the interpreter rounding to nearest as GPUs do: conftest's
#: interpreter_rounds_like_gpus); fp32 inputs: exact products, fp32 sums of W <= 576 score products and of the
#: context's values (observed 16 at W = 72).
MLA_O = Roundings(low=2, fp32=64)
#: MLA lse (fp32 on every path) against max |lse|: the scores' sums of W products
#: (sqrt(576) = 24; observed 3).
MLA_LSE = 24
#: Fused KDA output y, per head row, against the chain of k3 ops (which rounds where the
#: kernel does: conv outputs, o, y): a one-ulp flip of o and of y (2 each) and of one conv
#: output (2); the interpreter rounds to nearest here (test_kernel_kda_decode's fixture).
#: fp32: ~10 operations per value in another order, sums over D and DV (observed 14 at D = 16).
KDA_Y = Roundings(low=6, fp32=64)
#: Fused KDA state (fp32), against max |state|: sums over D <= 128 in another order
#: (sqrt(128) ~ 11; observed 4). Plus, with bf16 / fp16 activations, KDA_STATE_FLIP.
KDA_STATE = 16
#: ... and a conv output of the model dtype that rounds one ulp apart (2u) moves the delta
#: rule's update beta k u^T by 2u of the update's magnitude (K3 shapes: about one such flip
#: per batch-8 step; observed 2,000 u(fp32) of max |state| there).
KDA_STATE_FLIP = 2
#: Row kernels (RMSNorm, x @ W^T + acc) against fp32 references: one rounding of the output,
#: the norm and the product kept in fp32 (bf16 under the interpreter: truncated, observed
#: 1.7); fp32: sums of up to 3584 terms (sqrt ~ 60; observed 4).
ROWS = Roundings(low=1, fp32=64)
#: The Attention Residuals mix against an fp32 reference, per row: one rounding of the output
#: (bf16 under the interpreter: truncated); fp32: the scores' sums over the row in another
#: order, through exp into every weight.
ATTN_RES = Roundings(low=1, fp32=64)
#: The mix + RMSNorm against the op's reference, which rounds the mix where the kernel does:
#: a one-ulp flip of the mix (2) carried through the norm, and the output's rounding (1).
ATTN_RES_NORM = Roundings(low=3, fp32=64)
#: SiTU-GLU against its reference, per element against max |want| of its row: the output's
#: rounding (1) and fp32 tanh / sigmoid / exp a few fp32 roundings apart from torch's.
SITU = Roundings(low=1, fp32=16)
#: A sigmoid kernel (the MLA input kernel's gate) against fp32 torch.sigmoid, per element
#: against max |want| of its row: the output's rounding (1; bf16 under the interpreter:
#: truncated); fp32: exp and a division a few roundings apart from torch's.
SIGMOID = Roundings(low=1, fp32=8)
#: The op reference of add_rank_block_linear rounds x @ W^T to x's dtype before the add:
#: one rounding more.
ROWS_OP_REFERENCE = Roundings(low=2, fp32=64)
#: Routing weights (fp32), per weight: sigmoid (exp, add, divide), the sum of top_k of them
#: and the renormalising division.
ROUTE_WEIGHTS = 8
#: DCP rescale (fp32 out), per row: the LSE weight exp(lse - logsumexp) from a few fp32
#: operations on LSEs of magnitude ~3 (~3 u each), times the row.
DCP_RESCALE = 8
#: DCP merge, per row: the same weights and the members' sum in fp32, then one rounding to
#: the model dtype (bf16 under the interpreter: truncated).
DCP_MERGE = Roundings(low=1, fp32=8)


def unit_roundoff(dtype: torch.dtype, truncates: bool = False) -> float:
    """u(dtype); twice that for bf16 when the casts truncate (Triton's interpreter)."""
    return UNIT_ROUNDOFF[dtype] * (2.0 if truncates and dtype == torch.bfloat16 else 1.0)


def reference_scale(want: Tensor, dims: int | tuple[int, ...] | None = None) -> Tensor:
    """The largest finite |value| of ``want``, over ``dims`` (kept, for broadcasting) or all."""
    magnitude = torch.where(torch.isfinite(want), want.abs(), torch.zeros_like(want)).double()
    if dims is None:
        return magnitude.max() if magnitude.numel() else torch.zeros((), dtype=torch.float64)
    return magnitude.amax(dim=dims, keepdim=True)


def assert_within(got: Tensor, want: Tensor, bound: Tensor | float, what: str, how: str = "") -> None:
    """|got - want| <= bound element-wise (float64), else an AssertionError naming ``what``,
    how many elements fail, the worst one (index, values, excess) and ``how`` the bound was made."""
    got64, want64 = got.detach().cpu().double(), want.detach().cpu().double()
    if got64.shape != want64.shape:
        raise AssertionError(f"{what}: shape {tuple(got64.shape)} != reference {tuple(want64.shape)}")
    bound64 = torch.as_tensor(bound, dtype=torch.float64).cpu().expand_as(want64)
    unwritten = got64.isnan() & ~want64.isnan()
    if unwritten.any():
        raise AssertionError(f"{what}: {int(unwritten.sum())} of {got64.numel()} elements are NaN where the "
                             f"reference is not (NaN-poisoned outputs: unwritten?), first at "
                             f"{tuple(i.item() for i in unwritten.nonzero()[0])}")
    same = (got64 == want64) | (got64.isnan() & want64.isnan())  # equal infinities too
    diff = torch.where(same, torch.zeros_like(got64), (got64 - want64).abs())
    bad = ~(diff <= bound64)
    if bad.any():
        excess = torch.where(bad, diff - bound64, torch.full_like(diff, -1.0)).nan_to_num(float("inf"))
        i = tuple(int(j) for j in torch.unravel_index(excess.argmax(), excess.shape))
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {got64.numel()} elements outside the tolerance{' ' + how if how else ''}; "
            f"worst at {i}: got {got64[i].item():.6g}, want {want64[i].item():.6g}, "
            f"|diff| {diff[i].item():.3g} > {bound64[i].item():.3g}")


def assert_close_scaled(got: Tensor, want: Tensor, dtype: torch.dtype, *, roundings: float = 1.0,
                        dims: int | tuple[int, ...] | None = None, truncates: bool = False,
                        scale: Tensor | float | None = None, what: str = "output") -> None:
    """|got - want| <= roundings x u(dtype) x scale (the module docstring); ``scale`` defaults
    to the reference's largest finite |value|, over ``dims`` (per row) or the whole tensor."""
    u = unit_roundoff(dtype, truncates)
    if scale is None:
        scale = reference_scale(want.detach().cpu(), dims)
        where = f"max |want| over dims {dims}" if dims is not None else "max |want|"
    else:
        where = "the test's scale"
    how = (f"{roundings:g} roundings x u({str(dtype).removeprefix('torch.')}) = {u:.3g}"
           f"{' (x2: truncating casts)' if truncates and dtype == torch.bfloat16 else ''} x {where}")
    assert_within(got, want, roundings * u * torch.as_tensor(scale, dtype=torch.float64), what, how)
