"""MXFP4 (compressed-tensors mxfp4-pack-quantized) unpack/pack: values, not just shapes."""

import math

import pytest
import torch

from k3compile.checkpoint.mxfp4 import (
    E2M1_VALUES,
    GROUP_SIZE,
    check_mxfp4_shapes,
    pack_mxfp4,
    unpack_mxfp4,
)

GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def _one_group(first_bytes, scale_byte, dtype=torch.float32):
    """Unpack one group of 32: the given leading bytes, zero bytes after."""
    packed = torch.zeros(1, GROUP_SIZE // 2, dtype=torch.uint8)
    packed[0, : len(first_bytes)] = torch.tensor(first_bytes, dtype=torch.uint8)
    scale = torch.tensor([[scale_byte]], dtype=torch.uint8)
    return unpack_mxfp4(packed, scale, dtype)[0]


def _random_on_grid(rows, groups, gen, scale_lo=0, scale_hi=253):
    """Random codes and scale bytes whose group max magnitude code is 6 or 7.

    pack derives the exponent from the group max, so a group round-trips to the
    same bytes only if its max is 4 or 6 times the scale. Bytes stay <= 252 so
    6 * 2**(b-127) stays finite in fp32/bf16.
    """
    codes = torch.randint(0, 16, (rows, groups, GROUP_SIZE), generator=gen, dtype=torch.uint8)
    pos = torch.randint(0, GROUP_SIZE, (rows, groups, 1), generator=gen)
    big = torch.randint(6, 8, (rows, groups, 1), generator=gen, dtype=torch.uint8)
    sign = torch.randint(0, 2, (rows, groups, 1), generator=gen, dtype=torch.uint8) << 3
    codes.scatter_(-1, pos, big | sign)
    mag = codes & 0x7
    # other elements must not exceed the forced one: cap magnitudes at the max
    codes = torch.where(mag > (big & 0x7), (codes & 0x8) | (big & 0x7), codes)
    codes = codes.reshape(rows, groups * GROUP_SIZE)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    scale = torch.randint(scale_lo, scale_hi, (rows, groups), generator=gen, dtype=torch.uint8)
    return packed.contiguous(), scale


# ---------------------------------------------------------------- unpack, by hand


def test_unpack_hand_bytes():
    out = _one_group([0x21, 0xF9, 0x70, 0x08], 127)
    # 0x21: low nibble 1 = 0.5 (even element), high nibble 2 = 1.0
    assert out[:2].tolist() == [0.5, 1.0]
    # 0xF9: low 9 = -0.5, high F = -6.0
    assert out[2:4].tolist() == [-0.5, -6.0]
    # 0x70: low 0 = +0, high 7 = 6.0
    assert out[4:6].tolist() == [0.0, 6.0]
    # 0x08: low 8 = -0.0, high 0 = +0.0
    assert out[6].item() == 0.0 and math.copysign(1.0, out[6].item()) == -1.0
    assert math.copysign(1.0, out[7].item()) == 1.0
    assert torch.all(out[8:] == 0)


def test_unpack_all_codes_in_order():
    # bytes 0x10, 0x32, ... put codes 0..15 in element order
    bytes_ = [(2 * i) | ((2 * i + 1) << 4) for i in range(8)]
    out = _one_group(bytes_, 127)
    assert out[:16].tolist() == list(E2M1_VALUES)
    assert [math.copysign(1.0, v) for v in out[:16].tolist()] == [1.0] * 8 + [-1.0] * 8


def test_unpack_scale_bytes():
    assert _one_group([0x21], 128)[:2].tolist() == [1.0, 2.0]  # 2**1 doubles
    assert _one_group([0x21], 126)[:2].tolist() == [0.25, 0.5]  # 2**-1 halves
    assert _one_group([0x21], 137)[:2].tolist() == [512.0, 1024.0]
    # byte 0 is 2**-127 (an fp32 subnormal), still exact
    assert _one_group([0x77], 0)[:2].tolist() == [6.0 * 2.0**-127] * 2
    assert _one_group([0x11], 0)[0].item() == 2.0**-128
    # byte 254 = 2**127: 1.5 * 2**127 is finite, 2 * 2**127 overflows
    assert _one_group([0x43], 254)[:2].tolist() == [1.5 * 2.0**127, math.inf]


def test_unpack_groups_use_their_own_scale():
    packed = torch.full((2, 32), 0x22, dtype=torch.uint8)  # every element 1.0
    scale = torch.tensor([[127, 129], [120, 130]], dtype=torch.uint8)
    out = unpack_mxfp4(packed, scale, torch.float32)
    assert out.shape == (2, 64)
    assert torch.all(out[0, :32] == 1.0) and torch.all(out[0, 32:] == 4.0)
    assert torch.all(out[1, :32] == 2.0**-7) and torch.all(out[1, 32:] == 8.0)


def test_unpack_leading_dims_and_default_dtype():
    gen = torch.Generator().manual_seed(1)
    packed, scale = _random_on_grid(6, 3, gen)
    out3 = unpack_mxfp4(packed.view(2, 3, 48), scale.view(2, 3, 3))
    assert out3.dtype == torch.bfloat16 and out3.shape == (2, 3, 96)
    assert torch.equal(out3.view(6, 96), unpack_mxfp4(packed, scale))


def test_bf16_equals_fp32_cast():
    gen = torch.Generator().manual_seed(2)
    packed, scale = _random_on_grid(16, 8, gen)
    f32 = unpack_mxfp4(packed, scale, torch.float32)
    bf16 = unpack_mxfp4(packed, scale, torch.bfloat16)
    f64 = unpack_mxfp4(packed, scale, torch.float64)
    assert torch.isfinite(f32).all()
    assert torch.equal(bf16, f32.to(torch.bfloat16))
    # exact: bf16 and fp32 hold the same values as the fp64 reference
    assert torch.equal(bf16.to(torch.float64), f64)
    assert torch.equal(f32.to(torch.float64), f64)
    # and the fp64 reference is code * 2**(byte - 127), computed independently
    codes = torch.stack((packed & 0xF, packed >> 4), -1).view(16, 256).long()
    ref = torch.tensor(E2M1_VALUES, dtype=torch.float64)[codes]
    ref = ref * torch.pow(2.0, scale.double() - 127).repeat_interleave(GROUP_SIZE, -1)
    assert torch.equal(f64, ref)


def test_unpack_meta():
    packed = torch.empty(896, 3072, 1792, dtype=torch.uint8, device="meta")
    scale = torch.empty(896, 3072, 112, dtype=torch.uint8, device="meta")
    out = unpack_mxfp4(packed, scale)
    assert out.device.type == "meta"
    assert out.shape == (896, 3072, 3584) and out.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="last dims"):
        unpack_mxfp4(packed, scale[..., :111])


# ---------------------------------------------------------------- unpack errors


def test_unpack_bad_dtype():
    packed = torch.zeros(2, 16, dtype=torch.uint8)
    scale = torch.full((2, 1), 127, dtype=torch.uint8)
    with pytest.raises(ValueError, match="weight_packed must be uint8"):
        unpack_mxfp4(packed.to(torch.int8), scale)
    with pytest.raises(ValueError, match="weight_scale must be uint8"):
        unpack_mxfp4(packed, scale.float())
    with pytest.raises(ValueError, match="floating point"):
        unpack_mxfp4(packed, scale, torch.int32)


def test_unpack_mismatched_shapes():
    packed = torch.zeros(2, 32, dtype=torch.uint8)  # 64 elements -> 2 groups
    with pytest.raises(ValueError, match="last dims"):
        unpack_mxfp4(packed, torch.zeros(2, 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="leading dims"):
        unpack_mxfp4(packed, torch.zeros(3, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="at least one dimension"):
        unpack_mxfp4(torch.zeros((), dtype=torch.uint8), torch.zeros((), dtype=torch.uint8))


def test_unpack_nan_scale():
    packed = torch.zeros(3, 32, dtype=torch.uint8)
    scale = torch.full((3, 2), 127, dtype=torch.uint8)
    scale[1, 1] = 0xFF
    with pytest.raises(ValueError, match=r"NaN.*\(1, 1\)"):
        unpack_mxfp4(packed, scale)


# ---------------------------------------------------------------- pack


def test_pack_hand_values():
    w = torch.zeros(1, 32)
    w[0, :4] = torch.tensor([0.5, 1.0, -0.5, -6.0])
    packed, scale = pack_mxfp4(w)
    # amax 6 -> floor(log2 6) - 2 = 0 -> byte 127
    assert scale.tolist() == [[127]]
    assert packed[0, :2].tolist() == [0x21, 0xF9]
    assert torch.all(packed[0, 2:] == 0)
    # same values times 2: exponent 1, same codes
    packed2, scale2 = pack_mxfp4(w * 2)
    assert scale2.tolist() == [[128]] and torch.equal(packed2, packed)


def test_pack_ties_to_even_and_saturation():
    # group max 4.0 -> exponent 0; the midpoints follow
    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]  # even code at each tie
    w = torch.zeros(1, 32)
    w[0, 0] = 4.0
    w[0, 1 : 1 + len(mids)] = torch.tensor(mids)
    w[0, 8 : 8 + len(mids)] = -torch.tensor(mids)
    # 7.9 > 6: group max 7.9 also gives exponent 0 (floor(log2 7.9) = 2); saturates
    w[0, 20] = 7.9
    w[0, 21] = -7.0
    w[0, 22] = 0.2499  # just below the first midpoint -> 0
    w[0, 23] = 0.2501  # just above -> 0.5
    packed, scale = pack_mxfp4(w)
    assert scale.item() == 127
    out = unpack_mxfp4(packed, scale, torch.float32)[0]
    assert out[1:8].tolist() == want
    assert out[8:15].tolist() == [-v for v in want]
    assert out[20].item() == 6.0 and out[21].item() == -6.0
    assert out[22].item() == 0.0 and out[23].item() == 0.5


def test_pack_unpack_roundtrip_bit_exact():
    gen = torch.Generator().manual_seed(3)
    packed, scale = _random_on_grid(64, 16, gen)
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        w = unpack_mxfp4(packed, scale, dtype)
        p2, s2 = pack_mxfp4(w)
        assert p2.dtype == torch.uint8 and s2.dtype == torch.uint8
        assert torch.equal(s2, scale), dtype
        assert torch.equal(p2, packed), dtype
        w2 = unpack_mxfp4(p2, s2, dtype)
        assert torch.equal(w2, w)
        assert torch.equal(torch.signbit(w2), torch.signbit(w))  # -0.0 survives


def test_pack_roundtrip_scale_extremes():
    gen = torch.Generator().manual_seed(4)
    for lo, hi in ((0, 3), (250, 253)):
        packed, scale = _random_on_grid(4, 4, gen, lo, hi)
        w = unpack_mxfp4(packed, scale, torch.float32)
        assert torch.isfinite(w).all()
        p2, s2 = pack_mxfp4(w)
        assert torch.equal(s2, scale) and torch.equal(p2, packed)


def test_pack_values_off_grid_max_still_representable():
    # a grid group whose max is below 4*scale repacks to a smaller scale, same values
    w = torch.zeros(2, 32)
    w[0, 0], w[0, 1] = 3.0, -0.5  # max 3 -> exponent -1, codes 6.0 / -1.0
    w[1, 0] = 2.0**-120
    p, s = pack_mxfp4(w)
    assert s[0].item() == 126 and s[1].item() == 127 - 122
    assert torch.equal(unpack_mxfp4(p, s, torch.float32), w)


def test_pack_quantisation_error_random_normal():
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(128, 512, generator=gen, dtype=torch.float32)
    w[:8] *= 1e-30  # tiny groups: still normal scales, exponent ~ -100
    w[8:16] *= 1e30
    packed, scale = pack_mxfp4(w)
    q = unpack_mxfp4(packed, scale, torch.float32).double()
    wd = w.double()
    wg = wd.view(128, 16, 32)
    e = scale.double() - 127
    # the scale is the OCP one: 2**(floor(log2 amax) - 2)
    amax = wg.abs().amax(-1)
    assert torch.equal(e, torch.floor(torch.log2(amax)) - 2)
    step = torch.pow(2.0, e).unsqueeze(-1)
    y = (wg / step).abs()
    err = (q.view(128, 16, 32) - wg).abs() / step  # in units of the scale
    # half the E2M1 spacing around |y|: 0.25 up to 2, 0.5 up to 4, 1 up to 6;
    # beyond 6 it saturates and the error is exactly |y| - 6 (< 2)
    half = torch.where(y <= 2, 0.25, torch.where(y <= 4, 0.5, 1.0))
    sat = y > 6
    assert torch.all(err[~sat] <= half[~sat])
    assert torch.allclose(err[sat], y[sat] - 6, rtol=0, atol=1e-12)
    assert torch.all(y < 8)
    # and it is the nearest grid value, not just within the bound
    nearest = (y.unsqueeze(-1) - GRID).abs().amin(-1)
    assert torch.allclose(err, nearest, rtol=0, atol=1e-12)
    assert torch.equal(torch.signbit(q), torch.signbit(wd))


def test_pack_zero_and_negative_zero_groups():
    w = torch.zeros(1, 96)
    w[0, 32:64] = -0.0
    w[0, 64] = -1e-3  # rounds to -0 inside a group whose max is 1.0
    w[0, 65] = 1.0
    packed, scale = pack_mxfp4(w)
    # all-zero groups take scale byte 0 (floor(log2 0) = -inf, clamped to 2**-127)
    assert scale.tolist() == [[0, 0, 125]]
    assert torch.all(packed[0, :16] == 0x00)
    assert torch.all(packed[0, 16:32] == 0x88)  # negative zero codes
    assert packed[0, 32].item() == 0x68  # -0 (low), code 6: 4.0 * 2**-2 = 1.0 (high)
    out = unpack_mxfp4(packed, scale, torch.float32)[0]
    assert torch.all(out[:64] == 0)
    assert not torch.signbit(out[:32]).any() and torch.signbit(out[32:64]).all()
    assert math.copysign(1.0, out[64].item()) == -1.0 and out[65].item() == 1.0


def test_pack_shapes_and_leading_dims():
    gen = torch.Generator().manual_seed(6)
    w = torch.randn(3, 5, 64, generator=gen).to(torch.bfloat16)
    packed, scale = pack_mxfp4(w)
    assert packed.shape == (3, 5, 32) and scale.shape == (3, 5, 2)
    flat_p, flat_s = pack_mxfp4(w.reshape(15, 64))
    assert torch.equal(packed.reshape(15, 32), flat_p)
    assert torch.equal(scale.reshape(15, 2), flat_s)


def test_pack_errors():
    with pytest.raises(ValueError, match="multiple of 32"):
        pack_mxfp4(torch.zeros(4, 48))
    with pytest.raises(ValueError, match="multiple of 32"):
        pack_mxfp4(torch.zeros(()))
    with pytest.raises(ValueError, match="floating-point"):
        pack_mxfp4(torch.zeros(4, 32, dtype=torch.int32))
    bad = torch.zeros(1, 32)
    bad[0, 3] = math.nan
    with pytest.raises(ValueError, match="inf or NaN"):
        pack_mxfp4(bad)
    bad[0, 3] = math.inf
    with pytest.raises(ValueError, match="inf or NaN"):
        pack_mxfp4(bad)


# ---------------------------------------------------------------- check_mxfp4_shapes


def test_check_mxfp4_shapes():
    check_mxfp4_shapes((3072, 1792), (3072, 112), (3072, 3584))
    check_mxfp4_shapes(torch.Size([8, 4, 16]), [8, 4, 1], (8, 4, 32))
    with pytest.raises(ValueError, match=r"weight_packed has shape \[3072, 1791\]"):
        check_mxfp4_shapes((3072, 1791), (3072, 112), (3072, 3584))
    with pytest.raises(ValueError, match=r"weight_packed .*expected \[3072, 1792\]"):
        check_mxfp4_shapes((3584, 1536), (3072, 112), (3072, 3584))  # transposed
    with pytest.raises(ValueError, match=r"weight_scale has shape \[3072, 224\]"):
        check_mxfp4_shapes((3072, 1792), (3072, 224), (3072, 3584))
    with pytest.raises(ValueError, match="not a multiple of the group size"):
        check_mxfp4_shapes((4, 24), (4, 1), (4, 48))
    with pytest.raises(ValueError, match="at least one dimension"):
        check_mxfp4_shapes((), (), ())
