"""Row kernels of the MoE tail: RMSNorm and adding a rank's block into a partial sum.

The torch references of ``k3::rms_norm`` and ``k3::add_rank_block`` are several kernels
each on a GPU (cast, square, mean, rsqrt, two multiplies, cast back; arange, add,
index_add): at decode, where a row is a few KB, each launch costs more than its bytes.
These are one launch each, one program per row (and per column block for the add):

- ``rms_norm(x, w, eps)``: ``x * rsqrt(mean(x^2) + eps) * w`` in fp32, stored in x's dtype;
  the row (K3: 3584 or 7168 wide) is held in registers in one pass.
- ``add_rank_block(acc, block, start)``: ``out = acc``, plus ``block`` at columns
  ``[start, start + n)`` of the last dim; ``start`` is read on the device (a per-rank
  buffer), so the launch is the same on every rank and can be captured in a CUDA graph.
- ``add_rank_block_linear(acc, x, weight, start)``: the block computed as ``x @ weight^T``
  and added as above. Up to ``SPLITK_MAX_T`` rows of x (decode batches) it is the split-K
  kernel below, one launch; beyond, or for mixed x/weight dtypes, the vendor GEMM
  (cuBLAS / hipBLASLt) then the add (``add_rank_block_linear_vendor``).

Split-K rows GEMV + add (``_rows_gemv_add_kernel``). At K3's TP8 shapes the rows are
896 x 3584 bf16 (6.4 MB, ~1.6 us at 4.2 TB/s) and the vendor GEMV takes ~8 us on an H200:
896 rows give it too few thread blocks to keep enough loads in flight. A Triton GEMV with
one program per row tile (no K split) was slower still (17.8 us at batch 1) and was removed.
This kernel fills the GPU by splitting K too:

- grid ``(row tiles of BLOCK_N, 1 + K splits, row tiles of x of BLOCK_T)``; K is cut in tiles
  of BLOCK_K and each split takes ``ceil(tiles / split_k)`` consecutive tiles, so a split
  count that does not divide K is handled (the last split is shorter; a requested count
  that would leave splits empty is lowered, see :func:`splitk_plan`), and K need not be a
  multiple of BLOCK_K (masked loads). Each program reads its [BLOCK_N, chunk] weight tile
  once, in contiguous BLOCK_K-wide loads, and computes the partial dot products of all the
  x rows of its tile: on FMA units (T = 1: the products accumulated in a [BLOCK_N, BLOCK_K]
  fp32 tile, reduced over K once at the end; T <= 16: one x row at a time against the
  weight tile, reduced per K tile) or with ``tl.dot`` (x rows padded to a tile of 16 to 64
  rows: tensor cores). The weight tile stays in its vector-load layout on the FMA paths.
- Partials are combined in fp32 in one launch: each program stores its [BLOCK_T, BLOCK_N]
  partial to a workspace [splits, T, n], then takes a ticket from a per-(row tile, x tile)
  arrival counter (``atomic_add``, acq_rel, after a barrier so all of the program's stores
  precede the release). The program that arrives last sums the ``splits`` partials in split
  order (so the result does not depend on which program arrived last: deterministic), adds
  acc's block, stores ``out`` in acc's dtype and resets the counter to 0 (counters stay zero
  between launches: CUDA-graph replays need no memset). With one split there is no
  workspace and no counter.
- ``out`` is a new tensor (the op must not mutate acc): one more program per (row tile, x
  tile), at split index 0 of the grid, copies its share of acc's other ``N - n`` columns to
  out, so the op stays one launch. They are programs of their own because their addresses
  depend on ``start`` (a device load) and a GPU issues a warp's instructions in order: in the
  GEMV programs the weight loads would wait behind that load and the copy's.
- The GEMV result is kept in fp32 until the add (the torch reference rounds ``x @ W^T`` to
  x's dtype first); ``out = round(acc + x @ W^T)``.

Workspace: the partials are a fresh ``torch.empty`` per call (from the graph's pool under
capture); the arrival counters are a per-device buffer shared by launches, so do not run
two of these kernels concurrently on different streams of one device, and run the op once
before capturing a CUDA graph (the first launch on a device allocates the counters; the
runtime and benchmarks warm up before capturing).

RMSNorm is not fused into the GEMV: in the compiled graph it is a separate ``k3.rms_norm``
node feeding ``k3.add_rank_block_linear`` (``passes/dedup_replicated_linear.py``); fusing
it (each program recomputing 1/rms of its x rows, 7 KB from L2) needs a new op carrying
the norm weight and eps, and the pass matching the norm: a graph change, not done here.

:func:`register_kernels` makes them the GPU implementations of the k3 ops
(``k3compile.runtime.kernels.register_gpu_kernels`` calls it when the runtime runs on a
GPU; the ops' torch references stay the CPU implementations and the numerical truth,
unless the runtime is asked for these kernels on the CPU, under Triton's interpreter).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.jit import JITFunction

from k3compile.runtime.kernels import counted
from k3compile.runtime.kernels.aot import TRITON_DTYPES
from k3compile.runtime.kernels.counters import ArrivalCounters
from k3compile.runtime.kernels.targets import AMD_TARGETS, device_target


@triton.jit
def rms_norm_row(x_ptr, w_ptr, y_ptr, width, eps, BLOCK: tl.constexpr):
    """One row of ``width`` values at ``x_ptr`` RMS-normalised with the weight at ``w_ptr``
    into ``y_ptr``: fp32 in registers, ``x * (1 / sqrt(sum(x^2) / width + eps)) * w``,
    rounded once to y's dtype."""
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    x = tl.load(x_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / width + eps)
    tl.store(y_ptr + cols, (x * inv * w).to(y_ptr.dtype.element_ty), mask=mask)


@counted
@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, width, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    rms_norm_row(x_ptr + row * width, w_ptr, y_ptr + row * width, width, eps, BLOCK)


@counted
@triton.jit
def _add_rank_block_kernel(acc_ptr, block_ptr, start_ptr, out_ptr, width, n, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    start = tl.load(start_ptr)
    acc = tl.load(acc_ptr + row * width + cols, mask=mask, other=0.0).to(tl.float32)
    inside = mask & (cols >= start) & (cols < start + n)
    add = tl.load(block_ptr + row * n + (cols - start), mask=inside, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * width + cols, (acc + add).to(out_ptr.dtype.element_ty), mask=mask)


@counted
@triton.jit
def _rows_gemv_add_kernel(
    acc_ptr,  # [T, N]
    x_ptr,  # [T, K]
    w_ptr,  # [n, K]
    start_ptr,  # 0-d int64: first column of the block in acc
    out_ptr,  # [T, N], acc's dtype
    ws_ptr,  # [SPLIT_K, T, n] fp32 partials (unused when SPLIT_K == 1)
    counter_ptr,  # [>= row tiles * x tiles] int32, zero between launches (unused when SPLIT_K == 1)
    T, N, n, K,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TILES: tl.constexpr,
    SPLIT_K: tl.constexpr, UNROLL: tl.constexpr, EVEN_K: tl.constexpr, USE_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, FP32_DOT: tl.constexpr, COPY_PER: tl.constexpr, COPY_BLOCK: tl.constexpr,
):
    """Program (row tile, 0 or 1 + K split, x row tile); programs (., 0, .) copy acc's
    columns outside the block, COPY_PER of them per row tile, COPY_BLOCK at a time.
    BLOCK_T == 1: FMA, products accumulated over the chunk and reduced over K once at the
    end. USE_DOT: tl.dot on [BLOCK_N, BLOCK_K] x [BLOCK_K, BLOCK_T] tiles (BLOCK_T >= 16);
    else FMA, one x row at a time, reduced over each K tile. FP32_DOT: dots on fp32 copies
    of the operands, only under TRITON_INTERPRET, whose tl.dot multiplies bf16 bit patterns
    (triton#11584). TILES: K tiles of BLOCK_K per split (UNROLL of them unrolled); EVEN_K:
    no K masks needed."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)  # 0: copy acc's other columns; 1 + s: K split s
    pid_t = tl.program_id(2)
    start = tl.load(start_ptr).to(tl.int32)
    ts = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = ts < T
    if pid_k == 0:
        # out = acc outside the block: the row tile's share (COPY_PER) of the N - n other
        # columns, in programs of their own so that no weight load waits behind start's.
        for c in range(0, COPY_PER, COPY_BLOCK):
            c_local = c + tl.arange(0, COPY_BLOCK)
            j = pid_n * COPY_PER + c_local
            cols = j + tl.where(j >= start, n, 0)
            copy_mask = t_mask[:, None] & ((c_local < COPY_PER) & (j < N - n))[None, :]
            copy_off = ts[:, None] * N + cols[None, :]
            tl.store(out_ptr + copy_off, tl.load(acc_ptr + copy_off, mask=copy_mask), mask=copy_mask)
    else:
        # This split's partial of the block, [BLOCK_N, BLOCK_T]: BLOCK_N rows of w, one K
        # chunk, the x rows of the tile.
        split = pid_k - 1
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_mask = rows < n
        ks = split * (TILES * BLOCK_K) + tl.arange(0, BLOCK_K)
        w_ptrs = w_ptr + rows[:, None] * K + ks[None, :]
        # FMA paths: x rows are read through [BLOCK_N, BLOCK_K] pointers (every row of the
        # tile at the same x address: L1 hits) so that x gets the weight tile's layout; a
        # [BLOCK_K] or [1, BLOCK_K] x gets a layout of its own and a conversion through
        # shared memory, with barriers, per tile (or drags the weight tile into it).
        x_bcast = (rows * 0)[:, None] + ks[None, :]
        if BLOCK_T == 1:
            acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        else:
            part = tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32)
        for i in tl.range(TILES, loop_unroll_factor=UNROLL):  # unrolled: the chunk's loads in flight together
            k_in = ((ks + i * BLOCK_K) < K)[None, :]
            if EVEN_K:
                w = tl.load(w_ptrs + i * BLOCK_K, mask=row_mask[:, None], other=0.0)
            else:
                w = tl.load(w_ptrs + i * BLOCK_K, mask=row_mask[:, None] & k_in, other=0.0)
            if BLOCK_T == 1:
                x1 = tl.load(x_ptr + pid_t * K + x_bcast + i * BLOCK_K, mask=k_in, other=0.0)
                acc2 += w.to(tl.float32) * x1.to(tl.float32)  # reduced over K after the loop
            elif USE_DOT:
                x_ptrs = x_ptr + ts[None, :] * K + (ks + i * BLOCK_K)[:, None]  # x^T tile [BLOCK_K, BLOCK_T]
                xT = tl.load(x_ptrs, mask=t_mask[None, :] & ((ks + i * BLOCK_K) < K)[:, None], other=0.0)
                if FP32_DOT:
                    part = tl.dot(w.to(tl.float32), xT.to(tl.float32), part, input_precision="ieee")
                else:
                    part = tl.dot(w, xT, part, input_precision=DOT_PRECISION)
            else:
                # One x row at a time against the weight tile, reduced per K tile (a 3D
                # [BLOCK_T, BLOCK_N, BLOCK_K] product is laid out without vector loads).
                wf = w.to(tl.float32)
                for t in tl.static_range(BLOCK_T):
                    row_t = pid_t * BLOCK_T + t
                    x_row = tl.minimum(row_t, T - 1)  # rows past T: a valid row, never stored
                    xt = tl.load(x_ptr + x_row * K + x_bcast + i * BLOCK_K, mask=k_in, other=0.0)
                    dot_t = tl.sum(wf * xt.to(tl.float32), axis=1)
                    part += tl.where(ts[None, :] == row_t, dot_t[:, None], 0.0)
        if BLOCK_T == 1:
            part = tl.sum(acc2, axis=1)[:, None]
        mask = row_mask[:, None] & t_mask[None, :]
        out_off = ts[None, :] * N + start + rows[:, None]

        # out block = acc block + sum of the partials, by the only or the last-arriving split.
        if SPLIT_K == 1:
            a = tl.load(acc_ptr + out_off, mask=mask, other=0.0).to(tl.float32)
            tl.store(out_ptr + out_off, (a + part).to(out_ptr.dtype.element_ty), mask=mask)
        else:
            ws_off = ts[None, :] * n + rows[:, None]
            tl.store(ws_ptr + split * T * n + ws_off, part, mask=mask)
            tl.debug_barrier()  # all threads' stores precede the release below
            counter = counter_ptr + pid_t * tl.num_programs(0) + pid_n
            arrived = tl.atomic_add(counter, 1, sem="acq_rel")
            if arrived == SPLIT_K - 1:
                tl.debug_barrier()
                total = tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32)
                for s in range(SPLIT_K):  # split order, whoever arrived last: deterministic
                    total += tl.load(ws_ptr + s * T * n + ws_off, mask=mask, other=0.0, cache_modifier=".cg")
                a = tl.load(acc_ptr + out_off, mask=mask, other=0.0).to(tl.float32)
                tl.store(out_ptr + out_off, (a + total).to(out_ptr.dtype.element_ty), mask=mask)
                tl.store(counter, 0)


#: TRITON_INTERPRET was set when this module was imported: @triton.jit made interpreter wrappers
_INTERPRETED = not isinstance(_rows_gemv_add_kernel, JITFunction)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    width = x.shape[-1]
    if weight.shape != (width,):
        raise ValueError(f"rms_norm: weight of shape {tuple(weight.shape)} for rows of width {width}")
    x2 = x.reshape(-1, width).contiguous()
    y = torch.empty_like(x2)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, weight.contiguous(), y, width, eps, BLOCK=triton.next_power_of_2(width))
    return y.view(x.shape)


ADD_BLOCK = 1024


def add_rank_block(acc: Tensor, block: Tensor, start: Tensor, dim: int) -> Tensor:
    if dim not in (-1, acc.dim() - 1):
        raise ValueError(f"add_rank_block: the kernel adds along the last dim, got dim={dim}")
    width, n = acc.shape[-1], block.shape[-1]
    if block.shape[:-1] != acc.shape[:-1] or n > width:
        raise ValueError(f"add_rank_block: block {tuple(block.shape)} does not fit acc {tuple(acc.shape)}")
    acc2, block2 = acc.reshape(-1, width).contiguous(), block.reshape(-1, n).contiguous()
    out = torch.empty_like(acc2)
    if acc2.shape[0]:
        grid = (acc2.shape[0], triton.cdiv(width, ADD_BLOCK))
        _add_rank_block_kernel[grid](acc2, block2, start.reshape(1), out, width, n, BLOCK=ADD_BLOCK)
    return out.view(acc.shape)


# --------------------------------------------------------------------------- split-K rows GEMV + add

SPLITK_MAX_T = 16
"""``add_rank_block_linear`` runs the split-K kernel up to this many rows of x (decode
batches); beyond it the vendor GEMM, whose K reduction and tiling win once the product
has enough rows to fill the GPU (to be confirmed on an H200: ``benchmarks/moe_tail_dedup.py
--sweep`` times the kernel against it at batch 1, 8 and 64)."""


@dataclass(frozen=True)
class SplitKConfig:
    """One launch configuration of ``_rows_gemv_add_kernel``.

    block_n: weight rows per program (power of two; >= 16 with ``dot``). split_k: K
    splits asked for (the effective count can be lower, see :func:`splitk_plan`). block_k:
    K columns per load (power of two, >= 16). dot: tensor-core ``tl.dot`` with the x rows
    padded to a tile of 16 to 64, else FMA (at most SPLITK_MAX_T rows)."""

    block_n: int = 32
    split_k: int = 14
    num_warps: int = 4
    block_k: int = 128
    dot: bool = False

    def __str__(self) -> str:
        return (f"{'dot' if self.dot else 'fma'} block_n={self.block_n} split_k={self.split_k} "
                f"block_k={self.block_k} warps={self.num_warps}")


# 896 x 3584 rows on 132 SMs: 56 row tiles x 14 splits = 784 programs (~6 per SM), each
# streaming a 16 x 256 bf16 weight tile. T = 1 on FMA units (x not padded to 16 rows);
# more rows on tensor cores (one mma per 16 rows, where FMA reduces the tile per row).
# From the H200 sweep (benchmarks/moe_tail_dedup.py --sweep, 896 x 3584 bf16, BENCHMARKS.md):
# batch 1: FMA, 16 rows, 14 splits, 8 warps 5.0 us (vendor GEMV + add 9.4 us); batch 8:
# tl.dot, 16 rows, 14 splits, 2 warps 6.8 us (vendor 9.8 us).
SPLITK_CONFIG_T1 = SplitKConfig(block_n=16, split_k=14, num_warps=8, block_k=128, dot=False)
SPLITK_CONFIG = SplitKConfig(block_n=16, split_k=14, num_warps=2, block_k=128, dot=True)


#: K splits on AMD targets: 28 (one 128-column tile each at K = 3584) keeps the H200's ~6
#: programs per compute unit on 256 / 304 CUs (56 row tiles x (28 splits + the copy
#: column) = 1,624 programs; 14 splits would leave ~3 per CU). Derived from the CU counts,
#: not measured (decision 65).
AMD_SPLIT_K = 28


def choose_splitk_config(T: int, target: str = "sm_90") -> SplitKConfig:
    """The default configuration for x with T rows (T <= SPLITK_MAX_T) on ``target``."""
    config = SPLITK_CONFIG_T1 if T == 1 else SPLITK_CONFIG
    return replace(config, split_k=AMD_SPLIT_K) if target in AMD_TARGETS else config


@dataclass(frozen=True)
class SplitKPlan:
    """A configuration resolved for one shape: the launch grid and the kernel's constexprs."""

    grid: tuple[int, int, int]  # (row tiles, 1 + effective K splits, x row tiles)
    splits: int
    num_warps: int
    constexprs: dict[str, object]

    @property
    def programs(self) -> int:
        return math.prod(self.grid)

    @property
    def counters(self) -> int:
        return self.grid[0] * self.grid[2]


MAX_UNROLL = 8  # K tiles of one split unrolled in the kernel's loop (more: a loop over unrolled groups)


def _is_power_of_two(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


def splitk_plan(T: int, N: int, n: int, K: int, cfg: SplitKConfig, dtype: torch.dtype = torch.bfloat16,
                interpreted: bool = _INTERPRETED) -> SplitKPlan:
    """Grid and constexprs of the split-K kernel for acc [T, N], x [T, K], weight [n, K].

    K is cut in ``ceil(K / block_k)`` tiles and each split takes ``ceil(tiles / split_k)``
    of them: the effective split count is ``ceil(tiles / per_split)``, at most ``split_k``
    (e.g. K=3584, block_k=128: 28 tiles; split_k=8 -> 4 tiles per split, 7 splits)."""
    if not (_is_power_of_two(cfg.block_n) and _is_power_of_two(cfg.block_k) and cfg.block_k >= 16):
        raise ValueError(f"split-K config {cfg}: block_n must be a power of two and block_k a power of two >= 16")
    if cfg.split_k < 1 or not _is_power_of_two(cfg.num_warps):
        raise ValueError(f"split-K config {cfg}: split_k must be >= 1 and num_warps a power of two")
    if cfg.dot:
        if cfg.block_n < 16:
            raise ValueError(f"split-K config {cfg}: the tl.dot path needs block_n >= 16")
        block_t = min(max(16, triton.next_power_of_2(T)), 64)
    else:
        if T > SPLITK_MAX_T:
            raise ValueError(f"split-K config {cfg}: the FMA path takes at most {SPLITK_MAX_T} rows of x, got {T}")
        block_t = triton.next_power_of_2(T)
    k_tiles = triton.cdiv(K, cfg.block_k)
    per_split = triton.cdiv(k_tiles, cfg.split_k)
    splits = triton.cdiv(k_tiles, per_split)
    grid = (triton.cdiv(n, cfg.block_n), 1 + splits, triton.cdiv(T, block_t))
    copy_per = triton.cdiv(N - n, grid[0])  # columns of acc outside the block copied per row tile
    copy_block = max(16, min(triton.next_power_of_2(copy_per), 4096 // block_t))
    constexprs = {
        "BLOCK_T": block_t, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k, "TILES": per_split,
        "SPLIT_K": splits, "UNROLL": min(per_split, MAX_UNROLL), "EVEN_K": K % (per_split * cfg.block_k) == 0,
        "USE_DOT": cfg.dot,
        # fp32 inputs: exact products (the default tf32 would drop 13 mantissa bits)
        "DOT_PRECISION": "ieee" if dtype == torch.float32 else None, "FP32_DOT": interpreted,
        "COPY_PER": copy_per, "COPY_BLOCK": copy_block,
    }
    return SplitKPlan(grid, splits, cfg.num_warps, constexprs)


_counters = ArrivalCounters("add_rank_block_linear")


def _check_linear_shapes(acc: Tensor, x: Tensor, weight: Tensor) -> None:
    width, (n, K) = acc.shape[-1], weight.shape
    if x.shape[-1] != K or x.shape[:-1] != acc.shape[:-1] or n > width:
        raise ValueError(f"add_rank_block_linear: x {tuple(x.shape)} @ weight {tuple(weight.shape)}^T "
                         f"does not fit acc {tuple(acc.shape)}")


def add_rank_block_linear_splitk(
    acc: Tensor, x: Tensor, weight: Tensor, start: Tensor, config: SplitKConfig | None = None
) -> Tensor:
    """``acc`` plus ``x @ weight^T`` at columns [start, start + n), in one launch of the
    split-K kernel; a new tensor (acc is not modified). ``config`` defaults to
    :func:`choose_splitk_config`."""
    _check_linear_shapes(acc, x, weight)
    if x.dtype != weight.dtype:
        raise ValueError(f"add_rank_block_linear: x is {x.dtype} but weight is {weight.dtype}")
    (n, K), N = weight.shape, acc.shape[-1]
    acc2, x2, w = acc.reshape(-1, N).contiguous(), x.reshape(-1, K).contiguous(), weight.contiguous()
    T = x2.shape[0]
    if max(T * N, T * K, n * K) >= 2**31:
        raise ValueError("add_rank_block_linear: the split-K kernel indexes with 32-bit offsets")
    out = torch.empty_like(acc2)
    if T == 0:
        return out.view(acc.shape)
    plan = splitk_plan(T, N, n, K, config or choose_splitk_config(T, device_target(acc.device)), x.dtype)
    if plan.splits > 1:
        ws = torch.empty((plan.splits, T, n), dtype=torch.float32, device=acc.device)
        counters = _counters.get(acc.device, plan.counters)
    else:
        ws = counters = out  # not read
    _rows_gemv_add_kernel[plan.grid](
        acc2, x2, w, start.reshape(1), out, ws, counters, T, N, n, K,
        **plan.constexprs, num_warps=plan.num_warps, num_stages=1,
    )
    return out.view(acc.shape)


def add_rank_block_linear_vendor(acc: Tensor, x: Tensor, weight: Tensor, start: Tensor) -> Tensor:
    """The vendor GEMV/GEMM (``F.linear``: cuBLAS / hipBLASLt), then the one-launch add."""
    _check_linear_shapes(acc, x, weight)
    return add_rank_block(acc, torch.nn.functional.linear(x, weight), start, -1)


def add_rank_block_linear(acc: Tensor, x: Tensor, weight: Tensor, start: Tensor) -> Tensor:
    """Split-K kernel up to SPLITK_MAX_T rows of x, else the vendor GEMM + add."""
    _check_linear_shapes(acc, x, weight)
    T = x.numel() // max(x.shape[-1], 1)
    if 0 < T <= SPLITK_MAX_T and x.dtype == weight.dtype:
        return add_rank_block_linear_splitk(acc, x, weight, start)
    return add_rank_block_linear_vendor(acc, x, weight, start)




def splitk_aot_signature(
    dtype: torch.dtype = torch.bfloat16, config: SplitKConfig | None = None, T: int = 1,
    N: int = 7168, n: int = 896, K: int = 3584, target: str = "sm_90",
) -> tuple[dict[str, str], dict[str, object], int]:
    """(signature, constexprs, num_warps) of the split-K kernel as ``add_rank_block_linear``
    launches it on ``target`` for bf16 K3 TP8 shapes by default (for ``aot.compile_for_target``)."""
    t = TRITON_DTYPES[dtype]
    plan = splitk_plan(T, N, n, K, config or choose_splitk_config(T, target), dtype, interpreted=False)
    pointers = {"start_ptr": "*i64", "ws_ptr": "*fp32", "counter_ptr": "*i32"}
    signature = {
        arg: pointers.get(arg, f"*{t}") if arg.endswith("_ptr") else "i32" if arg in ("T", "N", "n", "K")
        else "constexpr"
        for arg in _rows_gemv_add_kernel.arg_names
    }
    return signature, dict(plan.constexprs), plan.num_warps


def register_kernels(device_type: str) -> None:
    """Use these kernels for ``k3::rms_norm``, ``k3::add_rank_block`` and
    ``k3::add_rank_block_linear`` on ``device_type`` tensors (registering again replaces
    the same functions)."""
    from k3compile.ops import norm, partial

    norm.rms_norm.register_kernel(device_type)(rms_norm)
    partial.add_rank_block.register_kernel(device_type)(add_rank_block)
    partial.add_rank_block_linear.register_kernel(device_type)(add_rank_block_linear)
