"""Launch plans of the fused KDA decode kernel (``kda_decode_kernel.py``): how
``kda_decode.kda_decode_fused`` launches it, the bytes a step moves, and the kernel's
signature as launched, for AOT checks.

Launch choices (``launch_config``): ``block_v`` (``choose_block_v``: a head's whole row once
the batch has half as many heads as CUs, else the widest tile that still gives two programs
per CU), ``tiles_per_program``
(``choose_tiles_per_program``, capped at ``MAX_TILES_PER_PROGRAM``), ``num_warps``
(``num_warps_for``), ``num_stages``, ``evict_state`` (on for whole-row tiles of 64 or more
while the heads give fewer than two programs per CU), ``max_registers`` and ``pdl`` (off
unless asked for); ``benchmarks/kda_decode.py --sweep`` times a grid of them on a GPU.

``evict_state``, the kernel's evict-first cache hint on the state stream (touched once per
step), is on by default only when one program takes a head's whole row (tile 64 or wider)
and the heads fit in fewer than two programs per CU:
on an H200 (``benchmarks/kda_decode.py --sweep --sweep-only evict``) it made batch 8
faster (whole rows, 96 programs: 7.4-7.6 against 7.9 us), but since the gate and norm
weight are read with the state (fifth session) it made batch 64 and 256 slower (34.3 /
119.1 against 33.7 / 114.7 us; in the fourth session, with those reads after the update,
it had been 4% faster there). On narrow tiles its cache policy
costs registers (value tile 32, 4 warps: 80 instead of 72, 24 instead of 28 resident
warps per SM) and the data it would protect in L2 (weights, activations) is touched by
every program, so LRU keeps it anyway.

Bytes per step (``bytes_moved``), the floor a memory-bound kernel cannot beat:
fp32 state read + written once, ``2 * B * H * D * DV * 4`` (1.5 MiB per sequence at K3 per
rank: H=12, D=DV=128), plus q, k, v, a, gate and beta in the model dtype, the three conv
states read + written (``2 * B * 3 * H * D * (K-1)`` elements), the output, and the weights
once (conv weights 3 x H*D*K fp32, dt_bias, o_norm; 80 KB at K3). At batch 1 that is 1.7 MB;
the state is 91% of it and grows with the batch while the weights do not.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton

from k3compile.runtime.kernels.aot import TRITON_DTYPES
from k3compile.runtime.kernels.kda_decode_kernel import kda_decode_kernel
from k3compile.runtime.kernels.targets import on_nvidia

__all__ = [
    "MAX_BLOCK_V",
    "MAX_TILES_PER_PROGRAM",
    "MIN_BLOCK_V",
    "WHOLE_ROW_TILES",
    "LaunchConfig",
    "aot_signature",
    "bytes_moved",
    "choose_block_v",
    "choose_tiles_per_program",
    "launch_config",
    "launch_grid",
    "num_warps_for",
    "supports_pdl",
]

#: widest value tile (see choose_block_v)
MAX_BLOCK_V = 128
MIN_BLOCK_V = 16
"""Narrowest value tile the launcher picks by itself (a smaller one may be passed)."""
MAX_TILES_PER_PROGRAM = 1
"""Most value tiles per program the launcher picks by itself (see choose_tiles_per_program)."""
WHOLE_ROW_TILES = 2
"""Tiles a head's whole row is cut into under programmatic dependent launch (see launch_config)."""


def launch_grid(
    batch: int, heads: int, head_dim_v: int, block_v: int, tiles_per_program: int = 1
) -> tuple[int, int, int]:
    """The kernel's grid: (programs per head, heads, batch); a program updates
    ``tiles_per_program`` value tiles of ``block_v`` columns."""
    return (head_dim_v // (block_v * tiles_per_program), heads, batch)


def choose_block_v(batch: int, heads: int, head_dim_v: int, compute_units: int, waves: int = 2) -> int:
    """A head's whole row (up to ``MAX_BLOCK_V``) per program once the batch has at least
    half as many heads as there are compute units; below that, the widest power-of-two
    tile that still gives ``waves`` programs per compute unit (floor ``MIN_BLOCK_V``).

    One program per head row needs no arrival counter and no re-read of the row for the
    norm (two round trips less per program) and convolves q and k once per head: on an
    H200 (benchmarks/kda_decode.py, fifth session) it was the fastest tile from batch 8
    (96 programs: 7.7 us against 8.5-8.9 at tiles 16-64) and tied with tile 64 at batch 64
    (34.2 us); at batch 256 tile 64 was 2% faster (116.0 against 118.1 us). At batch 1 its
    12 programs leave the GPU idle: tile 16 (96 programs) 5.1 us against 5.6. H=12,
    DV=128 on 132 SMs: batch 1 -> 16, 8 and more -> 128.
    """
    bv = min(head_dim_v, MAX_BLOCK_V)
    if 2 * batch * heads >= compute_units:
        return bv
    while bv > MIN_BLOCK_V and batch * heads * (head_dim_v // bv) < waves * compute_units:
        bv //= 2
    return bv


def choose_tiles_per_program(
    batch: int, heads: int, head_dim_v: int, block_v: int, compute_units: int, waves: int = 2
) -> int:
    """Most value tiles per program, a power of two up to ``MAX_TILES_PER_PROGRAM``, that
    still leaves ``waves`` programs per compute unit.

    A program that updates several tiles of one head convolves and normalises that head's q
    and k once instead of once per tile, and with all of a head's tiles it needs no arrival
    counter; but it streams its tiles one after the other (``num_stages`` of them in
    flight), so it takes longer and there are fewer programs to hide latency. ``benchmarks/kda_decode.py --sweep`` measures both; until an H200 sweep
    says otherwise the cap is 1 (one tile per program, as first measured)."""
    tiles = max(1, min(MAX_TILES_PER_PROGRAM, head_dim_v // block_v))
    while tiles > 1 and batch * heads * (head_dim_v // (block_v * tiles)) < waves * compute_units:
        tiles //= 2
    return tiles


def num_warps_for(head_dim: int, block_v: int) -> int:
    """Warps for a [D, BV] fp32 state tile: about 32 state values per thread, 2 to 4 warps
    (the H200 sweep: a [128, 64] tile on 8 warps was 1.4x slower than on 4)."""
    return max(2, min(4, head_dim * block_v // (32 * 32)))


@dataclass(frozen=True)
class LaunchConfig:
    """How ``kda_decode_fused`` launches the kernel (see ``launch_config``)."""

    block_v: int  # value tile: [D, block_v] fp32 state columns in registers at a time
    tiles_per_program: int  # value tiles one program updates, one after the other
    num_warps: int
    num_stages: int  # state tiles a program has in flight (register buffers), 1 to 3
    evict_state: bool  # evict-first cache hint on the state stream (read and written once)
    #: a cap on registers per thread (CUDA only: Triton's ``maxnreg``), for more resident
    #: programs per SM at the price of spills; None: the compiler's choice
    max_registers: int | None = None
    #: programmatic dependent launch (CUDA sm_90+): programs may start while the previous
    #: kernel finishes and read the state before waiting for it (see the kernel's PDL)
    pdl: bool = False

    def programs_per_head(self, head_dim_v: int) -> int:
        return head_dim_v // (self.block_v * self.tiles_per_program)


def launch_config(
    batch: int, heads: int, head_dim: int, head_dim_v: int, compute_units: int, *,
    block_v: int | None = None, tiles_per_program: int | None = None, num_warps: int | None = None,
    num_stages: int | None = None, evict_state: bool | None = None, max_registers: int | None = None,
    pdl: bool = False,
) -> LaunchConfig:
    """The launch plan: each choice given, or the heuristic's (``choose_block_v``,
    ``choose_tiles_per_program``, ``num_warps_for``, 2 stages, the evict-first hint when
    a program takes a head's whole row of 64 or more values and the heads give fewer than
    two programs per CU (module docstring), no register cap). Raises ValueError on a
    choice the kernel cannot run.

    With ``pdl`` and neither ``block_v`` nor ``tiles_per_program`` given, a program that
    would take a head's whole row as one tile takes it as two tiles of half the width,
    both in flight (``WHOLE_ROW_TILES``): it updates and stores the first while the second
    may still arrive, and keeps both halves of o in registers for the norm. On an H200
    under PDL: batch 64 32.1 -> 31.0 us, batch 256 112.7-113.0 -> 111.4-111.7; without
    PDL batch 64 was 0.4 us slower that way, so one tile stays the plan there.

    ``num_stages``: how many of its value tiles a program has in flight, each in its own
    registers: the first ``num_stages`` are read with the conv inputs, and tile t+num_stages-1
    is read before tile t is updated (1: no read ahead). It only matters with several tiles
    per program (with one it is 1). These are the kernel's own stages: the tile loop is
    unrolled, so Triton's pipeliner (its ``num_stages``, which would stage tiles through
    shared memory and pick a layout that converts every tile) has no loop to work on."""
    if block_v is None and tiles_per_program is None and pdl:
        block_v = choose_block_v(batch, heads, head_dim_v, compute_units)
        if block_v == head_dim_v and head_dim_v >= 2 * MIN_BLOCK_V:
            block_v, tiles_per_program = head_dim_v // WHOLE_ROW_TILES, WHOLE_ROW_TILES
    if block_v is None:
        block_v = choose_block_v(batch, heads, head_dim_v, compute_units)
    if not (_is_power_of_two(block_v) and block_v <= head_dim_v):
        raise ValueError(f"block_v must be a power of two dividing DV={head_dim_v}, got {block_v}")
    if tiles_per_program is None:
        tiles_per_program = choose_tiles_per_program(batch, heads, head_dim_v, block_v, compute_units)
    if not (_is_power_of_two(tiles_per_program) and block_v * tiles_per_program <= head_dim_v):
        raise ValueError(f"tiles_per_program must be a power of two with block_v * tiles_per_program <= "
                         f"DV={head_dim_v}, got {tiles_per_program} x {block_v}")
    if num_warps is None:
        num_warps = num_warps_for(head_dim, block_v)
    if not (_is_power_of_two(num_warps) and num_warps <= 16):
        raise ValueError(f"num_warps must be a power of two up to 16, got {num_warps}")
    if num_stages is not None and not 1 <= num_stages <= 3:
        raise ValueError(f"num_stages must be 1 to 3, got {num_stages}")
    if num_stages is None:
        num_stages = 2
    num_stages = min(num_stages, tiles_per_program)
    if max_registers is not None and not 24 <= max_registers <= 255:
        raise ValueError(f"max_registers must be 24 to 255, got {max_registers}")
    if evict_state is None:  # on for whole-row tiles of small batches, see the module docstring
        whole_rows = block_v * tiles_per_program == head_dim_v and block_v >= 64
        evict_state = whole_rows and batch * heads < 2 * compute_units
    return LaunchConfig(block_v, tiles_per_program, num_warps, num_stages, bool(evict_state), max_registers,
                        bool(pdl))


def bytes_moved(
    batch: int, heads: int, head_dim: int, head_dim_v: int, conv_kernel: int, act_bytes: int
) -> int:
    """Bytes one step must move at least: state read + write, activations, conv states, weights."""
    hd, hdv = heads * head_dim, heads * head_dim_v
    state = 2 * batch * heads * head_dim * head_dim_v * 4
    activations = batch * (3 * hd + 2 * hdv + heads + hdv) * act_bytes  # q, k, a; v, gate; beta; out
    conv_states = 2 * batch * (2 * hd + hdv) * (conv_kernel - 1) * act_bytes
    weights = (2 * hd + hdv) * conv_kernel * 4 + hd * 4 + heads * 4 + head_dim_v * 4 + batch * 8
    return state + activations + conv_states + weights


def _constexprs(
    heads: int, head_dim: int, head_dim_v: int, conv_kernel: int, config: LaunchConfig
) -> dict[str, int | str]:
    return {"H": heads, "D": head_dim, "DV": head_dim_v, "K": conv_kernel,
            "KP": triton.next_power_of_2(conv_kernel), "BV": config.block_v, "NT": config.tiles_per_program,
            "NS": config.num_stages, "STATE_EVICT": "evict_first" if config.evict_state else "",
            "PDL": config.pdl}


_FP32_POINTERS = ("q_conv_w_ptr", "k_conv_w_ptr", "v_conv_w_ptr", "a_log_ptr", "dt_bias_ptr", "state_ptr",
                  "norm_weight_ptr")


def aot_signature(
    dtype: torch.dtype, heads: int = 12, head_dim: int = 128, head_dim_v: int = 128, block_v: int = 16,
    conv_kernel: int = 4, *, tiles_per_program: int = 1, num_warps: int | None = None, num_stages: int = 2,
    evict_state: bool = False, pdl: bool = False,
) -> tuple[dict[str, str], dict[str, int | str], int]:
    """(signature, constexprs, num_warps) of the kernel as ``kda_decode_fused`` launches it with
    activations and conv states in ``dtype`` and these launch choices (``launch_config``; the
    compiler's own num_stages is 1), for ``aot.compile_for_target``; K3 per-rank defaults.
    ``pdl`` only for CUDA targets (the wait is a CUDA instruction)."""
    config = launch_config(1, heads, head_dim, head_dim_v, 1, block_v=block_v, tiles_per_program=tiles_per_program,
                           num_warps=num_warps, num_stages=num_stages, evict_state=evict_state, pdl=pdl)
    t = TRITON_DTYPES[dtype]
    pointer = {"slots_ptr": "i64", "counter_ptr": "i32", **{name: "fp32" for name in _FP32_POINTERS}}
    signature = {
        arg: f"*{pointer.get(arg, t)}" if arg.endswith("_ptr") else "fp32" if arg in ("lower_bound", "scale", "eps")
        else "i32" if arg.endswith("_stride") else "constexpr"
        for arg in kda_decode_kernel.arg_names
    }
    return signature, _constexprs(heads, head_dim, head_dim_v, conv_kernel, config), config.num_warps


@functools.cache
def supports_pdl(device: torch.device) -> bool:
    """Programmatic dependent launch: CUDA (not ROCm) from compute capability 9.0."""
    return on_nvidia(device) and torch.cuda.get_device_capability(device)[0] >= 9


def _is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0
