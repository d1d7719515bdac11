"""The FP8 MLA cache write: ``k3::mla_cache_write`` into an FP8 cache in one launch.

The op's torch reference quantises with ~10 small kernels (two amaxes, divisions, clamps,
a concatenation, the cast, the row assembly, the indexed copy); decode runs it once per
MLA layer per step. Here one program per new token reads its W values, takes the amax of
its latent and of its k_pe part, and writes its FP8 row in place (k3compile/mla_cache_fp8.py):
the codes (value / scale, rounded to nearest even, saturated to the format's largest
finite value), the two fp32 scales (amax / largest) and the zero padding. Divisions are
correctly rounded (``div_rn``), as torch's, so the row equals the reference's bit for bit.

A float (bf16 / fp32) cache keeps the reference: its write is one indexed copy.
:func:`register_kernels` makes :func:`mla_cache_write` the op's implementation on a
device type.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from k3compile.mla_cache_fp8 import SCALE_BYTES, cache_value_width, is_fp8_cache
from k3compile.ops import mla as mla_ops
from k3compile.runtime.kernels import counted
from k3compile.runtime.kernels.aot import TRITON_DTYPES, KernelLaunch
from k3compile.runtime.kernels.mla_common import check_fp8_cache_device


@counted
@triton.jit
def _mla_cache_write_fp8_kernel(kv_ptr, slot_ptr, cache_ptr, stride_kv, stride_slot, L: tl.constexpr,
                                W: tl.constexpr, ROW: tl.constexpr, BLOCK_W: tl.constexpr, FMAX: tl.constexpr):
    """Program t: token t's row kv[t, :W] to its cache slot, as FP8 codes and two scales."""
    t = tl.program_id(0)
    cols = tl.arange(0, BLOCK_W)
    in_row = cols < W
    x = tl.load(kv_ptr + t.to(tl.int64) * stride_kv + cols, mask=in_row, other=0.0).to(tl.float32)
    latent = cols < L
    amax_lat = tl.max(tl.where(latent, tl.abs(x), 0.0), axis=0)
    amax_pe = tl.max(tl.where(latent, 0.0, tl.abs(x)), axis=0)
    tiny = 1.1754943508222875e-38  # fp32's smallest normal: an all-zero part keeps codes 0
    scale_lat = tl.maximum(tl.math.div_rn(amax_lat, FMAX), tiny)
    scale_pe = tl.maximum(tl.math.div_rn(amax_pe, FMAX), tiny)
    codes = tl.math.div_rn(x, tl.where(latent, scale_lat, scale_pe))
    codes = tl.minimum(tl.maximum(codes, -FMAX), FMAX)
    row = cache_ptr + tl.load(slot_ptr + t * stride_slot) * ROW  # ROW = W + 16 bytes
    tl.store(row + cols, codes.to(cache_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=in_row)
    scales = (row + W).to(tl.pointer_type(tl.float32), bitcast=True)
    tl.store(scales, scale_lat)
    tl.store(scales + 1, scale_pe)
    tl.store((scales + 2) + tl.arange(0, 2), tl.zeros([2], tl.float32))  # the row's 8 zero bytes


def mla_cache_write(kv_cache: Tensor, kv: Tensor, slot_mapping: Tensor, latent_dim: int) -> None:
    """``k3::mla_cache_write`` on a GPU: one launch for an FP8 cache, the reference's indexed
    copy for a float one. kv [T, W]; slot_mapping [T] flat slots (block * block_size + offset)."""
    if not is_fp8_cache(kv_cache):
        return mla_ops.mla_cache_write_reference(kv_cache, kv, slot_mapping, latent_dim)
    check_fp8_cache_device("mla_cache_write", kv_cache)
    W = cache_value_width(kv_cache)
    T = kv.shape[0]
    if kv.dim() != 2 or kv.shape[1] != W or slot_mapping.shape != (T,):
        raise ValueError(f"mla_cache_write: kv {tuple(kv.shape)} and slot_mapping {tuple(slot_mapping.shape)} "
                         f"do not match a cache of {W} values per token")
    if not kv_cache.is_contiguous():
        raise ValueError("mla_cache_write: the FP8 cache must be contiguous (its rows are addressed by slot)")
    if T == 0:
        return None
    kv = kv if kv.stride(-1) == 1 else kv.contiguous()
    _mla_cache_write_fp8_kernel[(T,)](kv, slot_mapping, kv_cache, kv.stride(0), slot_mapping.stride(0),
                                      **_constexprs(W, latent_dim, kv_cache.dtype))
    return None


def _constexprs(width: int, latent_dim: int, fmt: torch.dtype) -> dict[str, object]:
    return {"L": latent_dim, "W": width, "ROW": width + SCALE_BYTES, "BLOCK_W": triton.next_power_of_2(width),
            "FMAX": float(torch.finfo(fmt).max)}


def register_kernels(device_type: str) -> None:
    """Make :func:`mla_cache_write` the ``device_type`` implementation of ``k3::mla_cache_write``."""
    mla_ops.mla_cache_write.register_kernel(device_type)(mla_cache_write)


def aot_launch(fmt: torch.dtype, width: int = 576, latent_dim: int = 512,
               dtype: torch.dtype = torch.bfloat16) -> KernelLaunch:
    """The FP8 cache write as the launcher specialises it for an FP8 format ``fmt`` (K3: 576
    values, 512 latent, bf16 latents), for AOT checks."""
    c = _constexprs(width, latent_dim, fmt)
    signature = {"kv_ptr": f"*{TRITON_DTYPES[dtype]}", "slot_ptr": "*i64", "cache_ptr": f"*{TRITON_DTYPES[fmt]}",
                 "stride_kv": "i32", "stride_slot": "i32", **{k: "constexpr" for k in c}}
    return KernelLaunch(f"mla_cache_write_{TRITON_DTYPES[fmt]}", _mla_cache_write_fp8_kernel, signature, c, 4,
                        pointers_over_2gib=("cache_ptr",))
