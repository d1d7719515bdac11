"""MXFP4 weights as stored by compressed-tensors (``mxfp4-pack-quantized``).

Kimi K3 stores every routed-expert projection (``w1``, ``w2``, ``w3``) of logical
shape ``[rows, cols]`` (``cols`` = input dim) as two uint8 tensors:

* ``weight_packed`` ``[rows, cols // 2]``: two 4-bit E2M1 codes per byte. The LOW
  nibble is the even column, the HIGH nibble the following odd column.
* ``weight_scale`` ``[rows, cols // 32]``: one E8M0 byte per group of 32 consecutive
  input columns. Byte ``b`` means ``2 ** (b - 127)``; ``b = 0`` is ``2 ** -127``
  and ``b = 0xFF`` is NaN (never valid in a weight).

An E2M1 code is ``s e e m``: bit 3 is the sign, the low three bits index the
magnitudes ``{0, 0.5, 1, 1.5, 2, 3, 4, 6}``. There is no infinity or NaN; code
``0x8`` is negative zero.

Worked example, one group with scale byte 128 (``2 ** 1``)::

    byte 0x21 -> low nibble 0x1 = +0.5, high nibble 0x2 = +1.0
              -> elements [0.5 * 2, 1.0 * 2] = [1.0, 2.0]
    byte 0xF9 -> low nibble 0x9 = -0.5, high nibble 0xF = -6.0
              -> elements [-1.0, -12.0]

Every decoded value is an E2M1 value (2-bit significand) times ``2**(b - 127)``,
so its magnitude is 0 or lies in ``[2**-128, 6 * 2**127]``. That is exact in fp32
and bf16 (both have fp32's exponent range, with subnormals down to 2**-149 and
2**-133) except where it overflows to infinity: ``|code value| >= 2`` with byte
254, or ``>= 4`` with byte 253 (the largest finite product is ``1.5 * 2**127``).
fp16 output is allowed but is only exact for scales near 1.

Quantisation (``pack_mxfp4``) follows the OCP MX v1.0 recipe: shared exponent
``e = floor(log2(amax)) - 2`` (2 is the largest E2M1 exponent), elements
``w / 2**e`` rounded to the nearest E2M1 value with ties to the even code,
saturating at +-6.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import torch

__all__ = [
    "GROUP_SIZE",
    "E2M1_VALUES",
    "E8M0_NAN",
    "unpack_mxfp4",
    "pack_mxfp4",
    "check_mxfp4_shapes",
    "is_routed_expert",
]

GROUP_SIZE = 32
"""Input-dim elements sharing one E8M0 scale byte."""

#: The weights a K3 checkpoint stores in this format: its routed experts' projections (the
#: ``targets`` of ``config.MXFP4_QUANTIZATION_CONFIG``).
_ROUTED_EXPERT = re.compile(r"(?:^|\.)block_sparse_moe\.experts\.\d+\.w[123]\.weight$")


def is_routed_expert(name: str) -> bool:
    """Whether checkpoint tensor ``name`` (prefixed or not) is a routed expert's logical
    ``w1``/``w2``/``w3`` ``.weight`` (stored as ``.weight_packed`` + ``.weight_scale`` when MXFP4)."""
    return _ROUTED_EXPERT.search(name) is not None

E8M0_NAN = 0xFF
"""The one E8M0 encoding that is not a power of two."""

E8M0_BIAS = 127
_E8M0_MIN_EXP = -127  # byte 0
_E8M0_MAX_EXP = 127  # byte 254
_E2M1_EMAX = 2  # 6 = 1.5 * 2**2

# Code -> value for all 16 nibbles. Indexing a table handles sign, subnormal
# (code 1 = 0.5) and negative zero (code 8) in one gather, with no bit arithmetic.
E2M1_VALUES: tuple[float, ...] = (
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
    -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
)  # fmt: skip
_E2M1_LUT = torch.tensor(E2M1_VALUES, dtype=torch.float32)

# Byte -> 2**(byte - 127). Built from math.ldexp, which is exact, so the table has
# no libm rounding (exp2 of an integer is exact on common platforms, but this does
# not depend on it); 2**-127 is an fp32 subnormal, still exact.
_E8M0_LUT = torch.tensor(
    [math.ldexp(1.0, b - E8M0_BIAS) for b in range(E8M0_NAN)] + [math.nan],
    dtype=torch.float32,
)

# Midpoints between consecutive E2M1 magnitudes. A magnitude strictly above k of
# them rounds to code k; a magnitude exactly on a midpoint is a tie.
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
# Ties where the upper neighbour has the even code (0.75: codes 1|2, 1.75: 3|4,
# 3.5: 5|6); at the other midpoints the lower neighbour is even, which the
# "strictly above" count already picks.
_E2M1_TIES_UP = (0.75, 1.75, 3.5)


def _shape_str(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(int(d)) for d in shape) + "]"


def _check_pair(packed_shape: Sequence[int], scale_shape: Sequence[int]) -> int:
    """Validate packed/scale shapes against each other; return the logical last dim."""
    packed_shape, scale_shape = tuple(packed_shape), tuple(scale_shape)
    if len(packed_shape) == 0 or len(scale_shape) == 0:
        raise ValueError(
            f"mxfp4: weight_packed {_shape_str(packed_shape)} and weight_scale "
            f"{_shape_str(scale_shape)} must have at least one dimension"
        )
    if packed_shape[:-1] != scale_shape[:-1]:
        raise ValueError(
            f"mxfp4: leading dims differ: weight_packed {_shape_str(packed_shape)} vs "
            f"weight_scale {_shape_str(scale_shape)} (all dims but the last must match)"
        )
    n = packed_shape[-1] * 2
    if n != scale_shape[-1] * GROUP_SIZE:
        raise ValueError(
            f"mxfp4: last dims disagree: weight_packed {_shape_str(packed_shape)} holds "
            f"{n} elements per row but weight_scale {_shape_str(scale_shape)} covers "
            f"{scale_shape[-1]} groups of {GROUP_SIZE} = {scale_shape[-1] * GROUP_SIZE}"
        )
    return n


def check_mxfp4_shapes(
    packed_shape: Sequence[int],
    scale_shape: Sequence[int],
    logical_shape: Sequence[int],
) -> None:
    """Check a checkpoint's ``weight_packed``/``weight_scale`` against the logical shape.

    ``logical_shape`` is the dequantised weight's shape (``[rows, cols]`` for an
    expert projection, ``cols`` being the input dim). Expected: packed
    ``[..., cols // 2]`` and scale ``[..., cols // 32]`` with identical leading
    dims. Raises ``ValueError`` naming the tensor and dimension that is wrong.
    """
    logical = tuple(int(d) for d in logical_shape)
    packed = tuple(int(d) for d in packed_shape)
    scale = tuple(int(d) for d in scale_shape)
    if len(logical) == 0:
        raise ValueError("mxfp4: logical shape must have at least one dimension")
    cols = logical[-1]
    if cols % GROUP_SIZE != 0:
        raise ValueError(
            f"mxfp4: logical shape {_shape_str(logical)} has last dim {cols}, "
            f"not a multiple of the group size {GROUP_SIZE}"
        )
    want_packed = (*logical[:-1], cols // 2)
    want_scale = (*logical[:-1], cols // GROUP_SIZE)
    if packed != want_packed:
        raise ValueError(
            f"mxfp4: weight_packed has shape {_shape_str(packed)}, expected "
            f"{_shape_str(want_packed)} for logical shape {_shape_str(logical)} "
            f"(two E2M1 values per byte along the last dim)"
        )
    if scale != want_scale:
        raise ValueError(
            f"mxfp4: weight_scale has shape {_shape_str(scale)}, expected "
            f"{_shape_str(want_scale)} for logical shape {_shape_str(logical)} "
            f"(one E8M0 byte per {GROUP_SIZE} elements along the last dim)"
        )


def unpack_mxfp4(
    packed: torch.Tensor,
    scale: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Dequantise MXFP4: packed uint8 ``[..., n/2]``, scale uint8 ``[..., n/32]`` -> ``[..., n]``.

    Exact for bf16/fp32 output (see the module docstring). On ``meta`` tensors
    only the shapes are checked and an empty meta tensor is returned, so model
    construction can size buffers without reading weights. Raises ``ValueError``
    on wrong dtypes, inconsistent shapes or a NaN (0xFF) scale byte.
    """
    if packed.dtype != torch.uint8:
        raise ValueError(f"mxfp4: weight_packed must be uint8, got {packed.dtype}")
    if scale.dtype != torch.uint8:
        raise ValueError(
            f"mxfp4: weight_scale must be uint8 (raw E8M0 bytes), got {scale.dtype}"
        )
    if not dtype.is_floating_point:
        raise ValueError(f"mxfp4: output dtype must be floating point, got {dtype}")
    if packed.device != scale.device:
        raise ValueError(
            f"mxfp4: weight_packed is on {packed.device} but weight_scale on {scale.device}"
        )
    n = _check_pair(packed.shape, scale.shape)
    out_shape = (*packed.shape[:-1], n)
    if packed.device.type == "meta":
        return torch.empty(out_shape, dtype=dtype, device="meta")

    # NaN scales would silently poison a whole group of 32 weights; a checkpoint
    # with one is corrupt, so fail loudly instead.
    nan_mask = scale == E8M0_NAN
    if bool(nan_mask.any()):
        first = tuple(int(i) for i in nan_mask.nonzero()[0])
        raise ValueError(
            f"mxfp4: weight_scale holds {int(nan_mask.sum())} NaN byte(s) (0xFF), "
            f"first at index {first}"
        )

    lut = _E2M1_LUT.to(packed.device)
    # Low nibble first: stacking (low, high) on a new last axis and flattening it
    # puts element 2i before 2i+1.
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(out_shape)
    values = lut[codes.long()]  # fp32
    group_scale = _E8M0_LUT.to(packed.device)[scale.long()]  # fp32 [..., n/32]
    # Product of a 2-bit significand and a power of two: exact in fp32 (unless it
    # overflows), so the final cast loses nothing for bf16/fp32.
    values = values.view(*scale.shape, GROUP_SIZE) * group_scale.unsqueeze(-1)
    return values.reshape(out_shape).to(dtype)


def pack_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise a float tensor ``[..., n]`` (``n % 32 == 0``) to MXFP4 (OCP MX rules).

    Per group of 32 along the last dim: ``e = floor(log2(amax)) - 2`` clamped to
    the E8M0 range ``[-127, 127]``; elements ``w / 2**e`` rounded to the nearest
    E2M1 value, ties to the even code, saturating at +-6 (OCP's floor-based scale
    lets ``amax / 2**e`` reach up to 8, so the group's largest elements may clip).

    Conventions chosen here:

    * An all-zero group (``amax == 0``) gets scale byte 0 (``2**-127``): this is
      ``floor(log2(0)) = -inf`` clamped to the E8M0 range.
    * Signs are kept on values that round to zero: ``-0.0`` and tiny negatives
      become code ``0x8`` (negative zero), as compressed-tensors' packer does.
    * Ties go to the even code (IEEE round-half-even, as OCP specifies), e.g.
      0.75 -> 1.0, 1.25 -> 1.0, 5.0 -> 4.0. compressed-tensors' reference packer
      instead breaks ties toward the smaller magnitude; the two differ only on
      exact midpoints.

    Returns ``(packed uint8 [..., n/2], scale uint8 [..., n/32])``. Values already
    on the MX grid whose group maximum uses code 6 or 7 (magnitude 4 or 6) round
    trip bit-exactly through ``unpack_mxfp4``. Raises ``ValueError`` on a
    non-float tensor, ``n`` not a multiple of 32, or non-finite values.
    """
    if not w.dtype.is_floating_point:
        raise ValueError(f"mxfp4: pack_mxfp4 needs a floating-point tensor, got {w.dtype}")
    if w.dim() == 0 or w.shape[-1] % GROUP_SIZE != 0:
        raise ValueError(
            f"mxfp4: last dim of shape {_shape_str(w.shape)} must be a multiple of "
            f"{GROUP_SIZE} (one scale per {GROUP_SIZE} elements)"
        )
    if w.device.type == "meta":
        raise ValueError("mxfp4: pack_mxfp4 needs data; got a meta tensor")
    if not bool(torch.isfinite(w).all()):
        raise ValueError("mxfp4: pack_mxfp4 input holds inf or NaN; MXFP4 cannot encode it")

    # fp32 holds every bf16/fp16 value exactly; fp64 input keeps fp64 so nothing
    # is rounded before quantisation.
    work = torch.float64 if w.dtype == torch.float64 else torch.float32
    n = w.shape[-1]
    lead = w.shape[:-1]
    x = w.to(work).reshape(*lead, n // GROUP_SIZE, GROUP_SIZE)

    amax = x.abs().amax(dim=-1)  # [..., G]
    # frexp gives amax = m * 2**p with m in [0.5, 1), so floor(log2(amax)) = p - 1
    # exactly, subnormals included (log2 then floor can misround near powers of 2).
    _, p = torch.frexp(amax)
    e = (p.to(torch.int32) - 1 - _E2M1_EMAX).clamp(_E8M0_MIN_EXP, _E8M0_MAX_EXP)
    e = torch.where(amax == 0, torch.full_like(e, _E8M0_MIN_EXP), e)
    scale_bytes = (e + E8M0_BIAS).to(torch.uint8)

    # Multiply by 2**-e from the exact table (2**-e is in [2**-127, 2**127], all
    # representable in fp32): a power-of-two multiply is exact unless it
    # underflows, and underflow only hits values far below the 0.25 rounding step.
    inv = _E8M0_LUT.to(device=w.device, dtype=work)[(E8M0_BIAS - e).long()]
    y = x * inv.unsqueeze(-1)

    mag = y.abs()
    mids = torch.tensor(_E2M1_MIDPOINTS, dtype=work, device=w.device)
    # bucketize(right=False) counts midpoints strictly below mag: nearest value,
    # ties to the lower neighbour; saturates at 7 (= 6.0) above the last midpoint.
    code = torch.bucketize(mag, mids, right=False)
    ties_up = torch.zeros_like(mag, dtype=torch.bool)
    for t in _E2M1_TIES_UP:
        ties_up |= mag == t
    code = code + ties_up.to(code.dtype)
    code = code | (torch.signbit(y).to(code.dtype) << 3)

    code = code.reshape(*lead, n).to(torch.uint8)
    packed = code[..., 0::2] | (code[..., 1::2] << 4)
    return packed.contiguous(), scale_bytes.contiguous()
