"""What the runtime would launch for one rank's decode and prefill step on a target, and
how each launch fills the device: the grid (workgroups / CTAs) against the target's
compute units and the programs its compiled resources let reside on one.

The plans come from the launchers' own plan functions (``kda_decode_plans.launch_config``,
``mla_split_kv.choose_num_splits``, ``moe_plans.choose_plan``, the KDA prefill's chunk
and group counts, ...), the resources from compiling the same specialisations ahead of
time (``aot``; on AMD with ROCm's buffer loads). No GPU is needed.

    fill = programs / (compute units x programs resident per unit)

below 1: part of one wave's slots stay empty; a launch with fewer programs than compute
units leaves units idle (a warning). The kernels covered are the attention / recurrent
layers' and the routed experts' (the ones whose grids depend on batch and context);
the small per-token kernels (norms, AttnRes mixes, routing, short conv) are not listed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton

from k3compile.config import K3Config
from k3compile.runtime.kernels import aot, kda_decode_plans, kda_prefill, moe, moe_dequant
from k3compile.runtime.kernels import mla_attention as attention
from k3compile.runtime.kernels import rows
from k3compile.runtime.kernels import kda_prefill_scan as scan
from k3compile.runtime.kernels import mla_prefill_expanded as expanded
from k3compile.runtime.kernels import mla_split_kv as split_kv
from k3compile.runtime.kernels.aot import KernelLaunch, KernelResources
from k3compile.runtime.kernels.kda_decode_kernel import kda_decode_kernel
from k3compile.runtime.kernels.targets import NVIDIA_TARGETS


@dataclass(frozen=True)
class StepShapes:
    """One rank's shapes of a step (K3 TP8 by default) and the step's size."""

    batch: int  # sequences
    context: int  # decode: cached positions a sequence attends to; prefill: prompt tokens a sequence
    kda_heads: int = 12
    kda_head_dim: int = 128
    mla_heads: int = 16  # the heads the decode kernel takes (padded; gathered over a DCP group)
    mla_prefill_heads: int = 12  # the rank's own heads (prefill takes them unpadded)
    mla_latent: int = 512  # kv_lora_rank: the cached latent, the absorbed kernels' value width
    mla_rope: int = 64
    mla_nope: int = 128
    mla_value: int = 128
    experts: int = 896
    top_k: int = 16
    expert_hidden: int = 3584  # D of the routed experts (the latent width)
    expert_intermediate: int = 384  # I a rank holds
    dtype: torch.dtype = torch.bfloat16
    kv_dtype: torch.dtype | None = None  # the MLA cache's (None: dtype)
    dcp: int = 1  # members of a DCP group: each holds 1 / dcp of the MLA history
    dcp_prefill: str = "gathered"  # split_mla_context's prefill option (decision 66)
    hidden: int = 7168
    tp: int = 8  # the deduplicated expert up-projection's rows a rank adds: hidden / tp

    def __post_init__(self) -> None:
        if self.dcp_prefill not in ("gathered", "partial"):
            raise ValueError(f"dcp_prefill: 'gathered' or 'partial', got {self.dcp_prefill!r}")
        if self.batch < 1 or self.context < 1:
            raise ValueError(f"a step needs batch >= 1 and context >= 1, got {self.batch} and {self.context}")

    @classmethod
    def of_model(cls, config: K3Config, tp: int, dcp: int, batch: int, context: int, dtype: torch.dtype,
                 kv_dtype: torch.dtype | None = None, dcp_prefill: str = "gathered") -> StepShapes:
        """One rank's shapes of ``config`` at TP ``tp`` (heads and expert intermediates
        split ``tp`` ways) and DCP ``dcp`` (the decode kernel takes the group's gathered
        heads, padded to its head tile)."""
        heads = config.num_attention_heads // tp
        return cls(batch, context, kda_heads=config.linear_attn.num_heads // tp,
                   kda_head_dim=config.linear_attn.head_dim,
                   mla_heads=-(-heads * dcp // split_kv.HEAD_TILE) * split_kv.HEAD_TILE, mla_prefill_heads=heads,
                   mla_latent=config.kv_lora_rank, mla_rope=config.qk_rope_head_dim,
                   mla_nope=config.qk_nope_head_dim, mla_value=config.v_head_dim, experts=config.num_experts,
                   top_k=config.num_experts_per_token, expert_hidden=config.routed_expert_hidden_size,
                   expert_intermediate=config.moe_intermediate_size // tp, dtype=dtype, kv_dtype=kv_dtype, dcp=dcp,
                   dcp_prefill=dcp_prefill, hidden=config.hidden_size, tp=tp)


@dataclass(frozen=True)
class PlannedLaunch:
    """One kernel launch of a step: what compiles and how many programs it runs."""

    phase: str  # "decode" or "prefill"
    name: str
    launch: KernelLaunch
    programs: int
    plan: str  # the plan's choices, in words


@dataclass(frozen=True)
class LaunchRow:
    """A planned launch with its compiled resources on the target."""

    planned: PlannedLaunch
    resources: KernelResources
    compute_units: int

    @property
    def resident(self) -> int | None:
        """Programs resident per compute unit (None: registers unknown)."""
        return self.resources.programs_per_unit

    @property
    def fill(self) -> float | None:
        """Programs over the device's resident slots (1: one full wave)."""
        return None if not self.resident else self.planned.programs / (self.compute_units * self.resident)

    @property
    def warnings(self) -> list[str]:
        out = []
        if self.planned.programs < self.compute_units:
            out.append(f"{self.compute_units - self.planned.programs} of {self.compute_units} compute units idle")
        if self.resources.spills:
            out.append(f"{self.resources.spills} spilled registers")
        if not self.resources.fits:
            out.append("does not fit")
        return out


def _sized(launch: KernelLaunch, sizes: dict[str, int]) -> KernelLaunch:
    """``launch`` with the pointers whose tensors hold 2^31 bytes or more at these sizes
    (bytes by argument name) declared so: ROCm's JIT compiles those without buffer loads,
    a variant of its own (decision 62), named here by its 64-bit pointers."""
    over = tuple(n for n, size in sizes.items()
                 if size >= 2**31 and n in launch.signature and n not in launch.pointers_over_2gib)
    if not over:
        return launch
    return replace(launch, name=f"{launch.name} [64-bit {', '.join(over)}]",
                   pointers_over_2gib=launch.pointers_over_2gib + over)


def _kda_decode(target: str, s: StepShapes, units: int) -> PlannedLaunch:
    pdl = target in NVIDIA_TARGETS  # the runtime launches it dependent where the target allows
    H, D = s.kda_heads, s.kda_head_dim
    config = kda_decode_plans.launch_config(s.batch, H, D, D, units, pdl=pdl)
    signature, constexprs, warps = kda_decode_plans.aot_signature(
        s.dtype, H, D, D, config.block_v, tiles_per_program=config.tiles_per_program, num_warps=config.num_warps,
        num_stages=config.num_stages, evict_state=config.evict_state, pdl=pdl)
    grid = kda_decode_plans.launch_grid(s.batch, H, D, config.block_v, config.tiles_per_program)
    plan = (f"value tile {config.block_v} x {config.tiles_per_program}, {warps} warps"
            + (", evict-first" if config.evict_state else "") + (", PDL" if pdl else ""))
    launch = KernelLaunch(f"kda_decode_fused_v{config.block_v}x{config.tiles_per_program}_w{warps}", kda_decode_kernel,
                          signature, constexprs, warps)
    return PlannedLaunch("decode", "kda decode (fused)", launch, grid[0] * grid[1] * grid[2], plan)


def _mla_decode(target: str, s: StepShapes, units: int) -> list[PlannedLaunch]:
    H = s.mla_heads
    config = split_kv.split_kv_config(target, H, s.dtype, s.kv_dtype)
    splits = split_kv.choose_num_splits(s.batch, H, triton.cdiv(s.context, s.dcp), units, config)
    qk, latent = s.mla_latent + s.mla_rope, s.mla_latent
    kernel = next(launch for launch in split_kv.split_kv_aot_launches(target, qk, latent, s.dtype, s.kv_dtype)
                  if launch.constexprs["BLOCK_H"] == config.block_h)
    if splits == 1:  # the programs write the final output in the model dtype, not fp32 partials
        out_type = "*" + aot.TRITON_DTYPES[s.dtype]
        kernel = replace(kernel, name=kernel.name + "_unsplit", signature={**kernel.signature, "o_ptr": out_type})
    plan = f"head tile {config.block_h}, KV tile {config.block_n}, {splits} splits" + (", TMA" if config.tma else "")
    out = [PlannedLaunch("decode", "mla decode split-KV", kernel,
                         triton.cdiv(H, config.block_h) * splits * s.batch, plan)]
    if splits > 1:
        combine = split_kv.combine_aot_launch(latent, s.dtype, splits)
        tiles = triton.cdiv(latent, combine.constexprs["BLOCK_L"])
        out.append(PlannedLaunch("decode", "mla split combine", combine, s.batch * H * tiles, f"{splits} splits"))
    return out


def _experts(phase: str, target: str, s: StepShapes, tokens: int) -> list[PlannedLaunch]:
    pairs = tokens * s.top_k
    E, D, I = s.experts, s.expert_hidden, s.expert_intermediate
    dequant_from = moe.PLANS[target].dequant_min_pairs
    if phase == "prefill" and dequant_from is not None and pairs >= dequant_from and s.dtype == torch.bfloat16:
        launch = moe_dequant.aot_requests(s.dtype)[0]
        group = min(moe_dequant.EXPERT_GROUP, E)
        out = []
        for what, rows, k in (("w1 / w3", group * I, D), ("w2", group * D, I)):
            programs = triton.cdiv(rows, moe_dequant.BLOCK_R) * triton.cdiv(k // 2, moe_dequant.BLOCK_B)
            out.append(PlannedLaunch(phase, f"experts: dequantise {what}", launch, programs,
                                     f"{group} experts a launch, then grouped bf16 GEMMs"))
        return out
    plan = moe.choose_plan(pairs, target)
    plans = moe.PLANS[target]
    label = "pair" if not plan.grouped else "grouped" if plan == plans.grouped else "grouped_prefill"
    grids = moe.expert_gemm_grids(plan, moe.pair_blocks(plan, pairs, E), D, I)
    act = s.dtype.itemsize
    sizes = {True: {"x_ptr": tokens * D * act, "out_ptr": pairs * I * act, "wa_ptr": E * I * D // 2,
                    "wb_ptr": E * I * D // 2},  # z in, h out, packed W1 / W3
             False: {"x_ptr": pairs * I * act, "out_ptr": pairs * D * 4, "wa_ptr": E * D * I // 2}}  # h, fp32 y
    return [PlannedLaunch(phase, f"experts {'w13' if glu else 'w2'}",
                          _sized(moe.expert_gemm_launch(plan, glu, label, s.top_k, D, I, s.dtype), sizes[glu]),
                          grid[0] * grid[1] * grid[2], str(plan))
            for glu, grid in ((True, grids[0]), (False, grids[1]))]


def _dedup_rows(target: str, s: StepShapes) -> list[PlannedLaunch]:
    """The routed experts' up-projection, deduplicated (each rank its hidden / tp rows,
    added into the replicated partial): the split-K kernel up to SPLITK_MAX_T tokens."""
    if s.tp == 1 or s.batch > rows.SPLITK_MAX_T:
        return []
    N, n, K = s.hidden, s.hidden // s.tp, s.expert_hidden
    config = rows.choose_splitk_config(s.batch, target)
    plan = rows.splitk_plan(s.batch, N, n, K, config, s.dtype, interpreted=False)
    signature, constexprs, warps = rows.splitk_aot_signature(s.dtype, config, s.batch, N, n, K, target)
    divisible = tuple(a for a, v in (("N", N), ("n", n), ("K", K)) if v % 16 == 0)  # as the JIT marks them
    launch = KernelLaunch(f"rows_splitk_{'dot' if config.dot else 'fma'}_s{plan.splits}", rows._rows_gemv_add_kernel,
                          signature, constexprs, warps, 1, divisible)
    return [PlannedLaunch("decode", "expert up-projection rows (split-K)", launch, plan.programs, str(config))]


def _kda_prefill(target: str, s: StepShapes, units: int) -> list[PlannedLaunch]:
    H, D = s.kda_heads, s.kda_head_dim
    chunks = triton.cdiv(s.context, kda_prefill.CHUNK)
    worst = triton.cdiv(s.batch * s.context, kda_prefill.CHUNK) + s.batch
    T, BT, act = s.batch * s.context, kda_prefill.CHUNK, s.dtype.itemsize
    work = kda_prefill.work_dtype(s.dtype).itemsize
    tile, square = worst * H * BT * D, worst * H * BT * BT
    sizes = {"q_ptr": T * H * D * act, "k_ptr": T * H * D * act, "v_ptr": T * H * D * act, "o_ptr": T * H * D * act,
             "g_ptr": T * H * D * 4, **{n: tile * work for n in ("w_ptr", "u_ptr", "qg_ptr", "ke_ptr")},
             "aq_ptr": square * work, "scratch_ptr": 3 * tile * 4, "a_ptr": square * 4, "t_ptr": square * 4,
             "chunk_states_ptr": worst * H * D * D * work}
    launches = {launch.name: _sized(launch, sizes) for launch in kda_prefill.aot_requests(target, H, D, s.dtype)}
    tiles = D // min(scan.BLOCK_X[target], D)
    group = scan.group_size(s.batch, H, tiles, worst, units)
    out = [PlannedLaunch("prefill", "kda prefill preparation", launches["kda_prefill prep"], worst * H,
                         f"chunks of {kda_prefill.CHUNK}")]
    if group:
        segments = triton.cdiv(worst, group) + s.batch  # the launcher's worst-case grid (kda_prefill_scan.chunk_groups)
        out += [PlannedLaunch("prefill", "kda prefill group summaries", launches["kda_prefill group summaries"],
                              segments * H * 2 * tiles, f"groups of {group} chunks"),
                PlannedLaunch("prefill", "kda prefill group scan", launches["kda_prefill group scan"],
                              s.batch * H * tiles, f"{triton.cdiv(chunks, group)} groups a sequence"),
                PlannedLaunch("prefill", "kda prefill state pass", launches["kda_prefill state pass"],
                              segments * H * tiles, f"groups of {group} chunks")]
    else:
        out.append(PlannedLaunch("prefill", "kda prefill state pass", launches["kda_prefill state pass"],
                                 s.batch * H * tiles, "one segment a sequence"))
    out.append(PlannedLaunch("prefill", "kda prefill outputs", launches["kda_prefill outputs"], worst * H * tiles,
                             f"{tiles} state tiles a chunk"))
    return out


def _mla_prefill(target: str, s: StepShapes) -> PlannedLaunch:
    if s.dcp > 1 and s.dcp_prefill == "partial":  # the absorbed kernel over the member's share, the group's heads
        launches = attention.attention_aot_launches(target, s.mla_latent + s.mla_rope, s.mla_latent, s.dtype,
                                                    s.kv_dtype)
        split_name = attention.PREFILL.name + "_context_split"
        launch = next(launch for launch in launches if launch.name.startswith(split_name))
        heads = s.mla_prefill_heads * s.dcp
        grid = attention.attention_grid(s.batch, s.context, heads, launch.constexprs["BLOCK_M"])
        return PlannedLaunch("prefill", "mla prefill (absorbed, DCP share)", launch, grid[0] * grid[1],
                             f"{heads} gathered heads, 1/{s.dcp} of the history")
    config = expanded.expanded_config(target, s.dtype)
    programs = triton.cdiv(s.context, config.block_m) * s.mla_prefill_heads * s.batch
    T, H, act = s.batch * s.context, s.mla_prefill_heads, s.dtype.itemsize
    launch = _sized(expanded.aot_launch(target, s.dtype, s.mla_nope, s.mla_rope, s.mla_value),
                    {"q_ptr": T * H * (s.mla_nope + s.mla_rope) * act, "o_ptr": T * H * s.mla_value * act,
                     "kv_ptr": T * H * (s.mla_nope + s.mla_value) * act, "pe_ptr": T * s.mla_rope * act})
    return PlannedLaunch("prefill", "mla prefill (expanded)", launch, programs,
                         f"{config.block_m} tokens x {config.block_n} positions a step")


def planned_launches(target: str, shapes: StepShapes) -> list[PlannedLaunch]:
    """The covered launches (module docstring) of one decode step of ``shapes.batch``
    sequences at ``shapes.context`` positions and one prefill of ``shapes.batch`` prompts
    of ``shapes.context`` tokens, on ``target`` (a key of ``aot.TARGETS``)."""
    units = aot.TARGETS[target].compute_units
    return [_kda_decode(target, shapes, units), *_mla_decode(target, shapes, units),
            *_experts("decode", target, shapes, shapes.batch), *_dedup_rows(target, shapes),
            *_kda_prefill(target, shapes, units), _mla_prefill(target, shapes),
            *_experts("prefill", target, shapes, shapes.batch * shapes.context)]


def launch_reports(cases: list[tuple[str, StepShapes]]) -> list[list[LaunchRow]]:
    """:func:`planned_launches` of each (target, shapes) with each launch's compiled
    resources, all compiled in one AOT batch."""
    planned = [planned_launches(target, shapes) for target, shapes in cases]
    resources = iter(aot.compile_many([p.launch.request(target) for (target, _), step in zip(cases, planned)
                                       for p in step]))
    return [[LaunchRow(p, next(resources), aot.TARGETS[target].compute_units) for p in step]
            for (target, _), step in zip(cases, planned, strict=True)]


def launch_report(target: str, shapes: StepShapes) -> list[LaunchRow]:
    """:func:`launch_reports` of one step."""
    return launch_reports([(target, shapes)])[0]
