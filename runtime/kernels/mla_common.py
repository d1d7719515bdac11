"""What the MLA kernels share (``mla_split_kv.py``, ``mla_attention.py``; the family's
overview and its op registration are in ``mla_decode.py``): the declaration of what a
kernel accepts (:class:`MLAKernel`), the head tile, the padded widths, the input checks
of the launchers, and how a kernel specialisation is described for the AOT checks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.jit import JITFunction

from k3compile.mla_cache_fp8 import cache_value_width, is_fp8_cache
from k3compile.ops import mla as mla_ops
from k3compile.runtime.kernels.aot import KernelLaunch
from k3compile.runtime.kernels.targets import on_nvidia

LOG2E = 1.4426950408889634
_LN2 = tl.constexpr(0.6931471805599453)  # kernels may only read constexpr globals

#: the smallest head tile of the split-KV kernel (its head counts are multiples of it: the
#: contract of ``k3::mla_decode_split_kv``, defined with the op), and the rows per
#: matrix-unit tile of the prefill kernel: 16 (token, head) rows
HEAD_TILE = mla_ops.SPLIT_KV_HEAD_MULTIPLE


@triton.jit
def _interpreter_probe():
    """Never launched: what ``@triton.jit`` makes of a function when the MLA modules are imported."""


#: TRITON_INTERPRET was set when these modules were imported: @triton.jit made interpreter wrappers
_INTERPRETED = not isinstance(_interpreter_probe, JITFunction)


@triton.jit
def _fp8_row_scales(kv_row, W: tl.constexpr, valid):
    """The latent and k_pe scales of FP8 cache rows (k3compile/mla_cache_fp8.py: two fp32
    after each row's W values); ``kv_row`` points at the rows' first values. Rows not
    ``valid`` read 0 (their values are masked to 0 too)."""
    scales = (kv_row + W).to(tl.pointer_type(tl.float32), bitcast=True)
    return tl.load(scales, mask=valid, other=0.0), tl.load(scales + 1, mask=valid, other=0.0)


# ---------------------------------------------------------------------------------------
# Declarations
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MLAKernel:
    """What one MLA kernel accepts; target tables and the pad-heads pass read these.

    ``qk_dim`` / ``value_dim`` are the widest shapes the kernel is built and AOT-checked
    for (K3: 576 / 512); narrower latent (value) and k_pe parts use smaller tiles."""

    name: str
    phase: str  # "decode" | "prefill"
    head_multiple: int  # num_heads must be a multiple of this
    dtypes: tuple[torch.dtype, ...]  # of q, and of the cache unless it is FP8 (k3compile/mla_cache_fp8.py)
    qk_dim: int
    value_dim: int
    splits_kv: bool  # parallel over the context (batch 1 fills the GPU)
    launch: Callable[..., tuple[Tensor, Tensor]] = field(repr=False, compare=False)

    def reason_rejected(self, num_heads: int, dtype: torch.dtype, qk_dim: int, value_dim: int) -> str | None:
        if num_heads < 1 or num_heads % self.head_multiple:
            return f"{self.name} needs a head count that is a multiple of {self.head_multiple}, got {num_heads}"
        if dtype not in self.dtypes:
            return f"{self.name} supports dtypes {[str(d) for d in self.dtypes]}, got {dtype}"
        if not 0 < value_dim <= self.value_dim:
            return f"{self.name} supports value_dim in 1..{self.value_dim}, got {value_dim}"
        if not 0 <= qk_dim - value_dim <= self.qk_dim - self.value_dim:
            return (f"{self.name} needs qk_dim - value_dim (the k_pe part) in 0..{self.qk_dim - self.value_dim}, "
                    f"got {qk_dim} - {value_dim}")
        return None

    def accepts(self, num_heads: int, dtype: torch.dtype, qk_dim: int, value_dim: int) -> bool:
        return self.reason_rejected(num_heads, dtype, qk_dim, value_dim) is None


_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ---------------------------------------------------------------------------------------
# Launch configuration (shared by the launchers and the AOT check)
# ---------------------------------------------------------------------------------------


def _widths(qk_dim: int, value_dim: int) -> dict[str, int]:
    L, R = value_dim, qk_dim - value_dim
    return {"L": L, "R": R, "BLOCK_L": max(16, triton.next_power_of_2(L)), "BLOCK_R": max(16, triton.next_power_of_2(R))}


def _dot_constexprs(dtype: torch.dtype, interpreted: bool) -> dict[str, object]:
    # fp32 inputs: exact products (the default tf32 would drop 13 mantissa bits)
    return {"DOT_PRECISION": "ieee" if dtype == torch.float32 else None, "FP32_DOT": interpreted}


def _signature(fn, pointers: dict[str, str], constexprs: dict[str, object],
               typed: dict[str, str] | None = None) -> dict[str, str]:
    """Triton types of fn's arguments: the named pointers, ``typed`` as given (tensor
    descriptors), constexprs, scale_log2 fp32, i32 rest."""
    typed = typed or {}

    def ty(a: str) -> str:
        return f"*{pointers[a]}" if a in pointers else typed[a] if a in typed else \
            "constexpr" if a in constexprs else "fp32" if a == "scale_log2" else "i32"
    return {a: ty(a) for a in fn.arg_names}


#: strides that are multiples of 16 elements at K3's shapes (W = 576, L = 512, H a multiple
#: of 16, block size 64): query rows, cache blocks and rows, output rows, expanded keys
_DIVISIBLE_STRIDES = ("stride_qb", "stride_qt", "stride_qh", "stride_kvb", "stride_kvt",
                      "stride_ob", "stride_ot", "stride_oh", "stride_os", "stride_pb", "stride_ph", "stride_ps",
                      "stride_kvp", "stride_kvh", "stride_pep")


def _kernel_launch(name: str, fn, ptrs: dict[str, str], c: dict[str, object], num_warps: int,
                   num_stages: int = 1, typed: dict[str, str] | None = None,
                   pointers_over_2gib: tuple[str, ...] = ()) -> KernelLaunch:
    """``fn`` as a launcher specialises it (pointer types ``ptrs``, constexprs ``c``), for
    AOT checks with aot.compile_for_target; its strides of ``_DIVISIBLE_STRIDES`` marked so;
    ``pointers_over_2gib``: its pointers to a layer's cache pool (KernelLaunch)."""
    return KernelLaunch(name, fn, _signature(fn, ptrs, c, typed), c, num_warps, num_stages,
                        tuple(a for a in fn.arg_names if a in _DIVISIBLE_STRIDES), pointers_over_2gib)


# ---------------------------------------------------------------------------------------
# Launcher checks and outputs
# ---------------------------------------------------------------------------------------


def _check_inputs(kernel: MLAKernel, q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor,
                  value_dim: int) -> None:
    if q.dim() != 3 or kv_cache.dim() != 3:
        raise ValueError(f"{kernel.name}: q must be 3-D and kv_cache [num_blocks, block_size, W], "
                         f"got {tuple(q.shape)} and {tuple(kv_cache.shape)}")
    if q.shape[-1] != cache_value_width(kv_cache):
        raise ValueError(f"{kernel.name}: q width {q.shape[-1]} != cache width {cache_value_width(kv_cache)}")
    check_fp8_cache_device(kernel.name, kv_cache)
    if q.dtype != kv_cache.dtype and not is_fp8_cache(kv_cache):
        raise ValueError(f"{kernel.name}: q ({q.dtype}) and kv_cache ({kv_cache.dtype}) must have one dtype "
                         "(or the cache an FP8 one)")
    reason = kernel.reason_rejected(q.shape[1], q.dtype, q.shape[-1], value_dim)
    if reason is not None:
        raise ValueError(reason)
    if block_table.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise ValueError(f"{kernel.name}: block_table and seq_lens must be int32")
    N = seq_lens.shape[0]
    if block_table.dim() != 2 or block_table.shape[0] != N or seq_lens.dim() != 1:
        raise ValueError(f"{kernel.name}: block_table must be [N, max_blocks] and seq_lens [N], "
                         f"got {tuple(block_table.shape)} and {tuple(seq_lens.shape)}")
    if kv_cache.stride(-1) != 1:
        raise ValueError(f"{kernel.name}: kv_cache rows must be contiguous (the cache is never copied)")


def check_fp8_cache_device(name: str, kv_cache: Tensor) -> None:
    """An fnuz FP8 cache (the mi300x target's) on an NVIDIA GPU is a ValueError: only AMD
    GPUs (and the interpreter) convert that format."""
    if kv_cache.dtype == torch.float8_e4m3fnuz and on_nvidia(kv_cache.device):
        raise ValueError(f"{name}: a float8_e4m3fnuz MLA cache (the mi300x target's) runs on AMD GPUs only; "
                         "compile the model for this GPU's target")


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """Uninitialised outputs and scratch; NaN-filled under the interpreter, so that tests
    see any element a kernel fails to write (on a GPU the fill would cost a launch)."""
    t = torch.empty(shape, dtype=dtype, device=device)
    return t.fill_(float("nan")) if _INTERPRETED else t


def _check_decode_batch(name: str, q: Tensor, seq_lens: Tensor) -> None:
    if q.dim() == 3 and seq_lens.dim() == 1 and q.shape[0] != seq_lens.shape[0]:
        raise ValueError(f"{name}: q has {q.shape[0]} sequences, seq_lens {seq_lens.shape[0]}")
