"""The FP8 layout of the MLA latent cache (``--kv-cache-dtype fp8``): one row per token.

An FP8 E4M3 cache tensor ``[num_blocks, block_size, W + 16]`` (W = L + R, K3: 512 latent
+ 64 k_pe = 576) holds, per token, ``W + 16`` bytes (K3: 592, against 1152 in bf16; rows
stay 16-byte aligned for vector and bulk loads)::

    [ W values, fp8 | latent scale, fp32 | k_pe scale, fp32 | 8 zero bytes ]
      0 ... W-1        W ... W+3            W+4 ... W+7        W+8 ... W+15

value = fp8 x scale: the latent part (the first L values) and the k_pe part (the last R)
each carry their own per-token scale, amax / the format's largest finite value, set when
the token is written (``k3::mla_cache_write`` quantises, once per written token) and never
changed. Per token, so that no calibration or checkpoint scale is needed (the K3
checkpoint carries none) and a write never rescales earlier tokens; per part, because
the RMS-normalised latent and the unnormalised k_pe differ in range. Each scale is a
per-row factor of a dot product, so kernels apply it to the scores and probabilities
of a KV tile, not to its elements (docs/decisions.md, decision 45, has the measurements
behind the choice).

The FP8 formats: OCP ``float8_e4m3fn`` (largest 448; gfx950 and sm_90 convert it in
hardware) and ``float8_e4m3fnuz`` (largest 240; what gfx942 converts). The cache
tensor's dtype says which: the format is self-describing.
"""

from __future__ import annotations

import torch
from torch import Tensor

#: the FP8 cache formats, by torch's name (the name a manifest uses)
FP8_CACHE_DTYPES: dict[str, torch.dtype] = {"float8_e4m3fn": torch.float8_e4m3fn,
                                            "float8_e4m3fnuz": torch.float8_e4m3fnuz}
#: bytes per token after the W values: two fp32 scales and 8 zero bytes
SCALE_BYTES = 16


def is_fp8_dtype(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` is one of the FP8 cache formats."""
    return dtype in FP8_CACHE_DTYPES.values()


def is_fp8_cache(kv_cache: Tensor) -> bool:
    """Whether ``kv_cache`` has the FP8 layout (its dtype is an FP8 format)."""
    return is_fp8_dtype(kv_cache.dtype)


def fp8_row_width(width: int) -> int:
    """Bytes (FP8 elements) per token of an FP8 cache of ``width`` values per token."""
    if width % 4:
        raise ValueError(f"an FP8 MLA cache needs a width that is a multiple of 4 (fp32 scales), got {width}")
    return width + SCALE_BYTES


def cache_value_width(kv_cache: Tensor) -> int:
    """Values per token (W = L + R) of a bf16 / fp32 or FP8 cache."""
    return kv_cache.shape[-1] - SCALE_BYTES if is_fp8_cache(kv_cache) else kv_cache.shape[-1]


def quantize_rows(kv: Tensor, latent_dim: int, dtype: torch.dtype) -> Tensor:
    """kv [T, W] -> [T, W + 16] FP8 rows of ``dtype`` (the layout above)."""
    if not is_fp8_dtype(dtype):
        raise ValueError(f"quantize_rows: {dtype} is not an FP8 cache format ({', '.join(FP8_CACHE_DTYPES)})")
    T, W = kv.shape
    fmax = torch.finfo(dtype).max
    x = kv.float()
    parts = (x[:, :latent_dim], x[:, latent_dim:])
    amax = torch.stack([p.abs().amax(dim=-1) for p in parts], dim=-1)
    # correctly rounded amax / fmax on every device (torch's CUDA division by a Python
    # scalar multiplies by its reciprocal, one rounding more: kernels divide exactly)
    scales = (amax / torch.full_like(amax, fmax)).clamp_min(torch.finfo(torch.float32).tiny)  # all zero: codes 0
    codes = torch.cat([(p / s[:, None]).clamp(-fmax, fmax) for p, s in zip(parts, scales.unbind(-1))], dim=-1)
    rows = torch.zeros(T, fp8_row_width(W), dtype=torch.uint8, device=kv.device)
    rows[:, :W] = codes.to(dtype).view(torch.uint8)
    rows[:, W : W + 8] = scales.contiguous().view(torch.uint8)
    return rows.view(dtype)


def dequantize_rows(rows: Tensor, latent_dim: int) -> Tensor:
    """FP8 rows [..., W + 16] -> their values [..., W] in fp32."""
    W = rows.shape[-1] - SCALE_BYTES
    scales = rows.view(torch.uint8)[..., W : W + 8].contiguous().view(torch.float32)  # [..., 2]
    values = rows[..., :W].float()
    return torch.cat([values[..., :latent_dim] * scales[..., :1], values[..., latent_dim:] * scales[..., 1:]], dim=-1)


def cache_rows_as_values(rows: Tensor, latent_dim: int) -> Tensor:
    """Gathered cache rows [..., W or W + 16] as fp32 values [..., W], whatever the cache's layout."""
    return dequantize_rows(rows, latent_dim) if is_fp8_cache(rows) else rows.float()
