"""Launch plans of the routed-expert kernels (``moe.py``): tiles per product, the path
(pair-major or grouped) per batch, per target, and the choice between them.

The sm_90 plans come from H200 measurements (``benchmarks/moe_probe.py``,
``benchmarks/moe_layer.py``; BENCHMARKS.md, docs/kernels.md); the AMD ones from compiled
resources only.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import triton


@dataclass(frozen=True)
class GemmPlan:
    """Tiles of one expert product: weight rows per program (the MMA's M: 16/32 use
    mma.sync on sm_90, 64+ wgmma), input columns per step (a multiple of 32: one scale
    column per 32), warps, software-pipeline stages."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 2
    #: programs per weight tile, each over its share of the inputs (w13 only): a batch-1
    #: step has 16 experts x 24 row tiles, too few programs to keep every SM issuing
    split_k: int = 1

    def __str__(self) -> str:
        split = f"x{self.split_k}" if self.split_k > 1 else ""
        return f"n{self.block_n}k{self.block_k}w{self.num_warps}s{self.num_stages}{split}"


@dataclass(frozen=True)
class MoePlan:
    """One launch plan of the experts: pair-major (``grouped`` False: one pair per
    program; block_m 16: the matrix unit with one real column of 16, block_m 1: products
    on the vector units) or grouped (block_m pairs of one expert per program, matrix unit),
    and the tiles of the w13 and w2 products."""

    grouped: bool
    block_m: int
    w13: GemmPlan
    w2: GemmPlan

    def __str__(self) -> str:
        return f"{'grouped' if self.grouped else 'pair'} m{self.block_m} w13 {self.w13} w2 {self.w2}"


@dataclass(frozen=True)
class TargetPlans:
    """A target's defaults: pair-major below ``grouped_min_pairs`` pairs (T * top_k),
    grouped from there, and grouped with prefill-sized tiles from ``prefill_min_pairs``."""

    pair: MoePlan
    grouped: MoePlan
    grouped_min_pairs: int
    prefill: MoePlan
    prefill_min_pairs: int
    #: from this many pairs (eager calls with bf16 activations) the experts run dequantised
    #: to bf16 by groups with grouped GEMMs (``moe_dequant.py``); None: never
    dequant_min_pairs: int | None = None


# H200 (132 SMs), from benchmarks/moe_probe.py and moe_layer.py (BENCHMARKS.md). Pair-major
# on the vector units (block_m 1): 64-row tiles of 4 warps, K steps of 128, w13 in four K
# splits (batch 1: 16 experts x 6 row tiles x 4 = 384 programs): 28 us against 76 for the
# best matrix-unit plan at batch 1, 286 against 842 at 16, 2.1 against 3.0 ms at 128; the
# grouped matrix-unit plan wins from T = 256 (3.5 against 4.1 ms), so grouped from 3,072
# pairs (T = 192). Tile variants of the vector plan were within 5% of each other at every
# batch. On the grouped path a warp's MMA tile is 16 weight rows (with more warps every
# warp decoded the same tile), one warp per 16-row tile; 64-row (wgmma) tiles were slower,
# prefill of 1,024 tokens included (16-pair blocks: 6.5 against 12.7 ms). Long prefills
# (benchmarks/moe_probe.py at T = 4,096 and 32,768): blocks of 128 pairs against 128-row
# wgmma tiles of 8 warps were the fastest of seven plans, 14.9 against 15.6 ms and 73
# against 112 ms (w13 spills 118 words a thread there; BENCHMARKS.md).
_SM90 = TargetPlans(
    pair=MoePlan(False, 1, GemmPlan(64, 128, 4, 1, split_k=4), GemmPlan(64, 128, 4, 1)),
    grouped=MoePlan(True, 16, GemmPlan(16, 128, 1, 4), GemmPlan(16, 128, 1, 3)),
    grouped_min_pairs=3072,  # T = 192 at top_k 16
    prefill=MoePlan(True, 128, GemmPlan(128, 128, 8, 3), GemmPlan(128, 128, 8, 3)),
    prefill_min_pairs=65536,  # T = 4,096
    # dequantised from 2,048 tokens (32,768 pairs, every expert picked ~37 times): one layer
    # 7.35 against 8.44 ms for the grouped plan there, 7.09 against 6.62 at 1,536 tokens
    # (benchmarks/moe_probe.py time, BENCHMARKS.md)
    dequant_min_pairs=32768,
)
# MI355X / MI300X (256 / 304 CUs, 64-wide waves): the matrix unit on both paths (gfx950
# decodes E2M1 in hardware there, where the H200 decodes it in software), one warp per
# 16-row tile, two stages (the AMD stream pipeliner's default). From the AOT resources (no
# spills), not measured on hardware; the vector-unit plan compiles for both (CI).
# Long prefills: blocks of 64 pairs against 64 weight rows, 4 warps, 2 stages, the largest
# block that compiles without spills and keeps two workgroups per CU on both targets
# (gfx950 w13 183 / w2 147 VGPRs, gfx942 203 / 172; the H200's 128-row, 8-warp tiles spill
# w13 on both and hold one workgroup): each decoded weight serves 64 pairs instead of 16.
# From 65,536 pairs (4,096 tokens) an expert has ~73 pairs on average, so its blocks are
# mostly full. From the resources, not measured on hardware (decision 65).
_CDNA = TargetPlans(
    pair=MoePlan(False, 16, GemmPlan(16, 128, 1, 2), GemmPlan(16, 128, 1, 2)),
    grouped=MoePlan(True, 16, GemmPlan(16, 128, 1, 2), GemmPlan(16, 128, 1, 2)),
    grouped_min_pairs=512,
    prefill=MoePlan(True, 64, GemmPlan(64, 128, 4, 2), GemmPlan(64, 128, 4, 2)),
    prefill_min_pairs=65536,
)
PLANS: dict[str, TargetPlans] = {"sm_90": _SM90, "gfx950": _CDNA, "gfx942": _CDNA}


def choose_plan(pairs: int, target: str = "sm_90") -> MoePlan:
    """The default plan for ``pairs`` (T * top_k) routed pairs."""
    plans = PLANS[target]
    if pairs < plans.grouped_min_pairs:
        return plans.pair
    return plans.grouped if pairs < plans.prefill_min_pairs else plans.prefill


def _fit(g: GemmPlan, rows: int, kd: int) -> GemmPlan:
    """Tiles for a product of ``rows`` weight rows over ``kd`` inputs: block_k must divide
    kd (no K masks), block_n need not exceed the rows (small test shapes)."""
    block_k = min(g.block_k, kd & -kd)  # the largest power of two dividing kd (>= 32)
    return replace(g, block_k=block_k, block_n=min(g.block_n, max(16, triton.next_power_of_2(rows))),
                   split_k=min(g.split_k, kd // block_k))


def _check_plan(plan: MoePlan) -> None:
    if plan.w2.split_k != 1 or plan.w13.split_k < 1:
        raise ValueError(f"moe plan {plan}: only the w13 product splits K (split_k >= 1)")
    for g in (plan.w13, plan.w2):
        if not all(v > 0 and v & (v - 1) == 0 for v in (g.block_n, g.block_k, g.num_warps)):
            raise ValueError(f"moe plan {plan}: block_n, block_k and num_warps must be powers of two")
        if g.block_n < 16 or g.block_k < 32 or g.num_stages < 1:
            raise ValueError(f"moe plan {plan}: needs block_n >= 16, block_k >= 32, num_stages >= 1")
    if plan.grouped and (plan.block_m < 16 or plan.block_m & (plan.block_m - 1)):
        raise ValueError(f"moe plan {plan}: a grouped block_m must be a power of two >= 16")
    if not plan.grouped and plan.block_m not in (1, 16):
        raise ValueError(f"moe plan {plan}: a pair-major block_m must be 1 (vector units) or 16 (matrix unit)")


def grouped_blocks(pairs: int, experts: int, block_m: int) -> int:
    """Worst-case blocks of the grouped grid: every expert's segment padded to block_m."""
    return triton.cdiv(pairs, block_m) + min(experts, pairs)
