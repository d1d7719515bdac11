"""The MLA kernels over an FP8 cache (k3compile/mla_cache_fp8.py) at small shapes, against
the op's reference on the dequantised values, and the FP8 cache write kernel byte for byte
against the op's reference. K3's per-rank shapes over an FP8 cache, and every FP8 launch's
AOT report, are in tests/test_kernel_mla_decode.py; tolerances as there."""

from __future__ import annotations

import pytest
import torch
from mla_cases import DEVICE, case, check, poison_past_contexts, reference, without_poison

from k3compile.runtime.kernels import mla_attention as ak
from k3compile.runtime.kernels import mla_split_kv as sk

pytestmark = [
    pytest.mark.usefixtures("faster_interpreter", "interpreter_rounds_like_gpus"),
    pytest.mark.filterwarnings("ignore:(divide by zero|invalid value) encountered:RuntimeWarning"),
]


#: both FP8 cache formats; fnuz compiles only for AMD GPUs (and runs under the interpreter)
FP8_FORMATS = [torch.float8_e4m3fn, pytest.param(torch.float8_e4m3fnuz, marks=pytest.mark.skipif(
    DEVICE == "cuda" and not torch.version.hip, reason="float8_e4m3fnuz is a gfx942 format"))]


@pytest.mark.parametrize("fmt", FP8_FORMATS, ids=str)
@pytest.mark.parametrize("H", [16, 48])
def test_split_kv_fp8_cache_matches_the_reference(fmt, H):
    """FP8 caches of both formats (k3compile/mla_cache_fp8.py) with bf16 queries: the
    reference attends to the dequantised values; the kernel's only extra rounding is each
    row's scale times its score (fp32), so MLA_O and MLA_LSE hold as for a bf16 cache."""
    q, cache, table, seq_lens, scale = case(H, 64, 8, [0, 1, 37, 70], block_size=16, seed=H, kv_dtype=fmt)
    assert cache.dtype == fmt and cache.shape[-1] == 72 + 16
    got = sk.mla_decode_split_kv(q, cache, table, seq_lens, scale, 64, num_splits=3, num_sms=4)
    assert (got[0][0] == 0).all() and torch.isneginf(got[1][0]).all()
    check(got, reference(q, cache, table, seq_lens, scale, 64))


def test_split_kv_fp8_cache_takes_queries_beyond_fp16s_range():
    """Over an FP8 cache the products run in fp16 (the codes are exact there): queries up to
    ~10^6, far past fp16's 65504, are moved into its range by a power of two that the
    scores get back; without it they would be inf."""
    q, cache, table, seq_lens, scale = case(16, 64, 8, [5, 40], block_size=16, seed=2, kv_dtype=torch.float8_e4m3fn)
    q = (q.float() * 3e5).bfloat16()
    got = sk.mla_decode_split_kv(q, cache, table, seq_lens, scale, 64, num_splits=2)
    assert torch.isfinite(got[0]).all() and torch.isfinite(got[1]).all()
    check(got, reference(q, cache, table, seq_lens, scale, 64))


@pytest.mark.parametrize("block_size", [32, 64])
def test_split_kv_fp8_cache_by_tensor_descriptors(block_size):
    """FP8 rows by tensor descriptors: the k_pe descriptor ends at the values (the scale
    bytes after them read as 0 in the padded tile), the scales come by pointer; NaN bytes
    in every row past the contexts stay out. 64 + 16 values: 96-byte rows (TMA needs
    16-byte aligned rows; the tiny presets' 40 + 16 bytes take the pointer gathers)."""
    q, cache, table, seq_lens, scale = case(16, 64, 16, [0, 1, 31, 33, 100], block_size, seed=block_size,
                                            kv_dtype=torch.float8_e4m3fn)
    cache = poison_past_contexts(cache, table, seq_lens)
    tma = sk.SplitKVConfig(block_h=16, block_n=32, num_warps=4, num_stages=3, programs_per_sm=1, tma=True)
    assert sk._kv_descriptors(cache, 64, 32) is not None
    check(sk.mla_decode_split_kv(q, cache, table, seq_lens, scale, 64, num_splits=3, config=tma),
          reference(q, without_poison(cache), table, seq_lens, scale, 64))


@pytest.mark.parametrize("fmt", FP8_FORMATS, ids=str)
def test_generic_and_prefill_fp8_cache(fmt):
    q, cache, table, seq_lens, scale = case(3, 64, 8, [0, 1, 29], block_size=8, seed=3, kv_dtype=fmt)
    check(ak.mla_decode_generic(q, cache, table, seq_lens, scale, 64), reference(q, cache, table, seq_lens, scale, 64))
    new = [5, 29]
    _, cache, table, seq_lens, scale = case(3, 64, 8, [20, 29], block_size=8, seed=4, kv_dtype=fmt)
    q = torch.randn(sum(new), 3, 72, generator=torch.Generator().manual_seed(4)).bfloat16().to(DEVICE)
    cu = torch.tensor([0, 5, 34], dtype=torch.int32, device=DEVICE)
    seq = torch.repeat_interleave(torch.arange(2), torch.tensor(new))
    pos = torch.cat([torch.arange(15, 20), torch.arange(0, 29)])
    check(ak.mla_prefill_absorbed(q, cache, cu, table, seq_lens, scale, 64),
          reference(q, cache, table.cpu()[seq], (pos + 1).int(), scale, 64))


@pytest.mark.parametrize("fmt", FP8_FORMATS, ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_cache_write_kernel_matches_the_reference_bit_for_bit(fmt, dtype):
    """The one-launch FP8 cache write (k3::mla_cache_write's kernel) writes the rows the
    op's reference writes, byte for byte: codes, both scales, the zero padding; only its
    slots; an all-zero latent and values far below their row's largest (subnormal codes)
    included. K3 widths (512 latent + 64 k_pe)."""
    gen = torch.Generator().manual_seed(8)
    kv = torch.randn(7, 576, generator=gen)
    kv[:, 512:] *= 40
    kv[2, :512] = 0
    kv[4, :8] *= 1e-4
    kv = kv.to(dtype).to(DEVICE)
    slots = torch.tensor([3, 17, 8, 0, 30, 12, 21], device=DEVICE)
    want = torch.full((4, 8, 592), 0x5A, dtype=torch.uint8).view(fmt).to(DEVICE)  # bytes the write must keep
    got = want.clone()
    from k3compile.ops.mla import mla_cache_write_reference
    from k3compile.runtime.kernels.mla_cache_write import mla_cache_write

    mla_cache_write_reference(want, kv, slots, 512)
    mla_cache_write(got, kv, slots, 512)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
