"""What the runtime would launch for one rank's decode and prefill step on a target, and
how each launch fills the device: the grid (workgroups / CTAs) against the target's
compute units and the programs its compiled resources let reside on one.

The plans come from the launchers' own plan functions (``kda_decode_plans.launch_config``,
``mla_split_kv.choose_num_splits``, ``moe_plans.choose_plan``, the KDA prefill's chunk
and group counts, ...), the resources from compiling the same specialisations ahead of
time (``aot``; on AMD with ROCm's buffer loads). No GPU is needed.

    fill = programs / (compute units x programs resident per unit)

below 1: part of one wave's slots stay empty; a launch with fewer programs than compute
units leaves units idle (a warning). Every Triton kernel of the runtime that the default
GPU pipeline launches is listed: the attention / recurrent layers' and the routed
experts' (grids by batch and context) and the per-token ones (a program per token and
column block: AttnRes mixes, input-projection consumers, routing, short convolution, DCP
merges, FP8 cache writes). Vendor GEMMs and Inductor's kernels are not. Where the
runtime would run an op's torch reference instead of its kernel at these shapes, the
launch is left out and :func:`reference_fallbacks` says why.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton

from k3compile.config import K3Config
from k3compile.mla_cache_fp8 import fp8_row_width, is_fp8_dtype
from k3compile.runtime.kernels import (activations, aot, attn_res, dcp_merge, kda_decode_plans, kda_prefill,
                                       mla_cache_write, mla_input_proj, moe, moe_dequant, moe_input, packed_chunks,
                                       routing, rows, short_conv)
from k3compile.runtime.kernels import mla_attention as attention
from k3compile.runtime.kernels import kda_prefill_scan as scan
from k3compile.runtime.kernels import mla_prefill_expanded as expanded
from k3compile.runtime.kernels import mla_split_kv as split_kv
from k3compile.runtime.kernels.aot import KernelLaunch, KernelResources
from k3compile.runtime.kernels.kda_decode_kernel import kda_decode_kernel
from k3compile.runtime.kernels.targets import NVIDIA_TARGETS
from k3compile.runtime.weight_layout import padded_rows


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
    dcp_merge: str = "all-to-all"  # split_mla_context's decode merge option
    block_size: int = 16  # tokens per MLA cache block (the artifact's; targets.Target.mla_block_size)
    q_lora: int = 1536
    dense_intermediate: int = 4224  # a rank's columns of the dense MLP (layer 0)
    shared_intermediate: int = 768  # a rank's columns of the shared expert
    conv_kernel: int = 4  # the KDA short convolution's taps
    attn_res_candidates: int = 9  # the most candidates of a mix: the finished blocks and the partial sum

    def __post_init__(self) -> None:
        if self.dcp_prefill not in ("gathered", "partial"):
            raise ValueError(f"dcp_prefill: 'gathered' or 'partial', got {self.dcp_prefill!r}")
        if self.dcp_merge not in ("all-to-all", "reduce-scatter"):
            raise ValueError(f"dcp_merge: 'all-to-all' or 'reduce-scatter', got {self.dcp_merge!r}")
        if self.batch < 1 or self.context < 1:
            raise ValueError(f"a step needs batch >= 1 and context >= 1, got {self.batch} and {self.context}")

    @classmethod
    def of_model(cls, config: K3Config, tp: int, dcp: int, batch: int, context: int, dtype: torch.dtype,
                 kv_dtype: torch.dtype | None = None, dcp_prefill: str = "gathered",
                 dcp_merge: str = "all-to-all", block_size: int = 16) -> StepShapes:
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
                   dcp_prefill=dcp_prefill, hidden=config.hidden_size, tp=tp, dcp_merge=dcp_merge,
                   q_lora=config.q_lora_rank, dense_intermediate=config.intermediate_size // tp,
                   shared_intermediate=config.shared_intermediate_size // tp, block_size=block_size,
                   conv_kernel=config.linear_attn.short_conv_kernel_size,
                   attn_res_candidates=2 + (config.num_hidden_layers - 1) // config.attn_res_block_size)


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


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


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


def _kda_decode(target: str, s: StepShapes, units: int) -> list[PlannedLaunch]:
    pdl = target in NVIDIA_TARGETS  # the runtime launches it dependent where the target allows
    H, D = s.kda_heads, s.kda_head_dim
    if not _power_of_two(D):
        return []  # fuse_kda_decode leaves the unfused ops: reference_fallbacks
    config = kda_decode_plans.launch_config(s.batch, H, D, D, units, pdl=pdl)
    signature, constexprs, warps = kda_decode_plans.aot_signature(
        s.dtype, H, D, D, config.block_v, tiles_per_program=config.tiles_per_program, num_warps=config.num_warps,
        num_stages=config.num_stages, evict_state=config.evict_state, pdl=pdl)
    grid = kda_decode_plans.launch_grid(s.batch, H, D, config.block_v, config.tiles_per_program)
    plan = (f"value tile {config.block_v} x {config.tiles_per_program}, {warps} warps"
            + (", evict-first" if config.evict_state else "") + (", PDL" if pdl else ""))
    launch = KernelLaunch(f"kda_decode_fused_v{config.block_v}x{config.tiles_per_program}_w{warps}", kda_decode_kernel,
                          signature, constexprs, warps)
    # q, k, v, g, f_a and b are column blocks of one GEMM's product (kda_decode_fused_proj); a is f_b's output
    row = padded_rows(4 * H * D + D + H)
    launch = aot.specialised(launch, q_stride=row, k_stride=row, v_stride=row, a_stride=H * D, beta_stride=row,
                             gate_stride=row)
    return [PlannedLaunch("decode", "kda decode (fused)", launch, grid[0] * grid[1] * grid[2], plan)]


def _mla_decode(target: str, s: StepShapes, units: int) -> list[PlannedLaunch]:
    H, qk, latent = s.mla_heads, s.mla_latent + s.mla_rope, s.mla_latent
    if not split_kv.SPLIT_KV.accepts(H, s.dtype, qk, latent):
        return []  # the generic kernel or the reference: reference_fallbacks says which
    config = split_kv.split_kv_config(target, H, s.dtype, s.kv_dtype)
    splits = split_kv.choose_num_splits(s.batch, H, triton.cdiv(s.context, s.dcp), units, config)
    kernel = next(launch for launch in split_kv.split_kv_aot_launches(target, qk, latent, s.dtype, s.kv_dtype)
                  if launch.constexprs["BLOCK_H"] == config.block_h)
    row = fp8_row_width(qk) if is_fp8_dtype(s.kv_dtype or s.dtype) else qk  # a cache row's elements
    # the strides mla_decode_split_kv passes: q [B, H, qk]; the cache [blocks, 64, row]; the
    # fp32 partials o [B, H, S, latent] and lse [B, H, S], or (one split) o and lse themselves
    o_strides = (H * splits * latent, splits * latent, latent) if splits > 1 else (H * latent, latent, 0)
    lse_strides = (H * splits, splits, 1) if splits > 1 else (H, 1, 0)
    ints = dict(num_heads=H, num_splits=splits, stride_qb=H * qk, stride_qh=qk, stride_kvb=s.block_size * row,
                stride_kvt=row, stride_btb=triton.cdiv(s.context, s.block_size), block_size=s.block_size,
                **dict(zip(("stride_ob", "stride_oh", "stride_os"), o_strides)),
                **dict(zip(("stride_lb", "stride_lh", "stride_ls"), lse_strides)))
    if splits == 1:  # the programs write the final output in the model dtype, not fp32 partials
        out_type = "*" + aot.TRITON_DTYPES[s.dtype]
        kernel = replace(kernel, name=kernel.name + "_unsplit", signature={**kernel.signature, "o_ptr": out_type})
    plan = f"head tile {config.block_h}, KV tile {config.block_n}, {splits} splits" + (", TMA" if config.tma else "")
    out = [PlannedLaunch("decode", "mla decode split-KV", aot.specialised(kernel, **ints),
                         triton.cdiv(H, config.block_h) * splits * s.batch, plan)]
    if splits > 1:
        combine = split_kv.combine_aot_launch(latent, s.dtype, splits)
        combine = aot.specialised(combine, stride_pb=o_strides[0], stride_ph=o_strides[1], stride_ps=o_strides[2],
                                  stride_lpb=lse_strides[0], stride_lph=lse_strides[1], stride_ob=H * latent,
                                  stride_oh=latent, stride_lb=H, stride_lh=1, num_splits=splits)
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
    def launch(glu: bool) -> KernelLaunch:
        n, kd = (I, D) if glu else (D, I)
        return aot.specialised(_sized(moe.expert_gemm_launch(plan, glu, label, s.top_k, D, I, s.dtype), sizes[glu]),
                               P=pairs, N=n, KD=kd)

    return [PlannedLaunch(phase, f"experts {'w13' if glu else 'w2'}", launch(glu), grid[0] * grid[1] * grid[2],
                          str(plan))
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
    launch = aot.specialised(KernelLaunch(f"rows_splitk_{'dot' if config.dot else 'fma'}_s{plan.splits}",
                                          rows._rows_gemv_add_kernel, signature, constexprs, warps),
                             T=s.batch, N=N, n=n, K=K)
    return [PlannedLaunch("decode", "expert up-projection rows (split-K)", launch, plan.programs, str(config))]


def _kda_prefill(target: str, s: StepShapes, units: int) -> list[PlannedLaunch]:
    H, D = s.kda_heads, s.kda_head_dim
    chunks = triton.cdiv(s.context, kda_prefill.CHUNK)
    worst = packed_chunks.worst_chunks(s.batch * s.context, s.batch, kda_prefill.CHUNK)
    T, BT, act = s.batch * s.context, kda_prefill.CHUNK, s.dtype.itemsize
    work = kda_prefill.work_dtype(s.dtype).itemsize
    tile, square = worst * H * BT * D, worst * H * BT * BT
    sizes = {"q_ptr": T * H * D * act, "k_ptr": T * H * D * act, "v_ptr": T * H * D * act, "o_ptr": T * H * D * act,
             "g_ptr": T * H * D * 4, **{n: tile * work for n in ("w_ptr", "u_ptr", "qg_ptr", "ke_ptr")},
             "aq_ptr": square * work, "qk_ptr": 2 * tile * work, "gc_ptr": tile * 4, "a_ptr": square * 4}
    if not kda_prefill.kernel_takes_dims(D, D):
        return []  # the reference: reference_fallbacks
    tiles = D // min(scan.BLOCK_X[target], D)
    group = scan.group_size(s.batch, H, tiles, worst, units)
    segments = packed_chunks.worst_groups(worst, s.batch, group) if group else 0  # the launcher's grid
    ints = {"kda_prefill chunk table": {"N": s.batch, "worst": worst}, "kda_prefill prep": {"N": s.batch, "H": H},
            "kda_prefill chunk groups": {"N": s.batch, "worst": segments, "size": group or 1}}
    launches = {launch.name: aot.specialised(_sized(launch, sizes), **ints.get(launch.name, {"H": H}))
                for launch in kda_prefill.aot_requests(target, H, D, s.dtype)}
    out = [PlannedLaunch("prefill", "kda prefill preparation", launches["kda_prefill prep"], worst * H,
                         f"chunks of {kda_prefill.CHUNK}"),
           PlannedLaunch("prefill", "kda prefill chunk table", launches["kda_prefill chunk table"],
                         triton.cdiv(worst, packed_chunks.TABLE_BLOCK), f"{packed_chunks.TABLE_BLOCK} chunks a program")]
    if group:
        out += [PlannedLaunch("prefill", "kda prefill chunk groups", launches["kda_prefill chunk groups"],
                              triton.cdiv(segments, packed_chunks.TABLE_BLOCK),
                              f"{packed_chunks.TABLE_BLOCK} groups a program"),
                PlannedLaunch("prefill", "kda prefill group summaries", launches["kda_prefill group summaries"],
                              segments * H * 2 * tiles, f"groups of {group} chunks"),
                PlannedLaunch("prefill", "kda prefill group scan", launches["kda_prefill group scan"],
                              s.batch * H * tiles, f"{triton.cdiv(chunks, group)} groups a sequence"),
                PlannedLaunch("prefill", "kda prefill state pass", launches["kda_prefill state pass"],
                              segments * H * tiles, f"groups of {group} chunks")]
    else:
        out.append(PlannedLaunch("prefill", "kda prefill state pass", launches["kda_prefill state pass"],
                                 s.batch * H * tiles, "one segment a sequence"))
    return out


def _absorbed_prefill(target: str, s: StepShapes, heads: int, positions: int, split: bool) -> KernelLaunch:
    """The absorbed-form prefill kernel (``mla_attention._launch``) on ``heads`` heads over
    ``positions`` cached positions of each sequence; ``split``: a DCP member's share."""
    qk, latent = s.mla_latent + s.mla_rope, s.mla_latent
    name = attention.PREFILL.name + ("_context_split" if split else "")
    launch = next(launch for launch in attention.attention_aot_launches(target, qk, latent, s.dtype, s.kv_dtype)
                  if launch.name.removesuffix("_fp8") == name)
    row = fp8_row_width(qk) if is_fp8_dtype(s.kv_dtype or s.dtype) else qk
    return aot.specialised(launch, num_heads=heads, cycle=s.dcp if split else 1, interleave=1,
                           stride_qt=heads * qk, stride_qh=qk, stride_kvb=s.block_size * row, stride_kvt=row,
                           stride_btb=triton.cdiv(positions, s.block_size),  # the batch's widest block table
                           stride_ot=heads * latent, stride_oh=latent, stride_lt=heads, stride_lh=1,
                           block_size=s.block_size)


def _mla_prefill(target: str, s: StepShapes) -> list[PlannedLaunch]:
    H, qk, latent = s.mla_prefill_heads, s.mla_latent + s.mla_rope, s.mla_latent
    if s.dcp > 1 and s.dcp_prefill == "partial":  # the absorbed kernel over the member's share, the group's heads
        heads = H * s.dcp
        if not attention.PREFILL.accepts(heads, s.dtype, qk, latent):
            return []
        launch = _absorbed_prefill(target, s, heads, triton.cdiv(s.context, s.dcp), split=True)
        grid = attention.attention_grid(s.batch, s.context, heads, launch.constexprs["BLOCK_M"])
        return [PlannedLaunch("prefill", "mla prefill (absorbed, DCP share)", launch, grid[0] * grid[1],
                              f"{heads} gathered heads, 1/{s.dcp} of the history")]
    if not attention.PREFILL.accepts(H, s.dtype, qk, latent):
        return []
    prompts = expanded.PrefillCounts((s.context,) * s.batch, (s.context,) * s.batch)
    if expanded.prefill_form(prompts, H, latent, s.mla_rope, s.mla_nope, s.mla_value) == "absorbed":
        launch = _absorbed_prefill(target, s, H, s.context, split=False)
        grid = attention.attention_grid(s.batch, s.context, H, launch.constexprs["BLOCK_M"])
        return [PlannedLaunch("prefill", "mla prefill (absorbed)", launch, grid[0] * grid[1],
                              "the form with fewer FLOPs for these prompts")]
    config = expanded.expanded_config(target, s.dtype)
    programs = triton.cdiv(s.context, config.block_m) * H * s.batch
    T, act = s.batch * s.context, s.dtype.itemsize
    nope_rope, nope_value = s.mla_nope + s.mla_rope, s.mla_nope + s.mla_value
    launch = _sized(expanded.aot_launch(target, s.dtype, s.mla_nope, s.mla_rope, s.mla_value),
                    {"q_ptr": T * H * nope_rope * act, "o_ptr": T * H * s.mla_value * act,
                     "kv_ptr": T * H * nope_value * act, "pe_ptr": T * s.mla_rope * act})
    # q [T, H, nope + rope]; the decompressed keys / values [P, H, nope + value]; k_pe rows of the gathered cache
    launch = aot.specialised(launch, stride_qt=H * nope_rope, stride_qh=nope_rope, stride_kvp=H * nope_value,
                             stride_kvh=nope_value, stride_pep=s.mla_rope, stride_ot=H * s.mla_value,
                             stride_oh=s.mla_value, w_start=0, w_end=s.context)
    return [PlannedLaunch("prefill", "mla prefill (expanded)", launch, programs,
                          f"{config.block_m} tokens x {config.block_n} positions a step")]


def _per_token(phase: str, s: StepShapes, tokens: int) -> list[PlannedLaunch]:
    """The small kernels of a step of ``tokens`` tokens in the default GPU pipeline: a
    program per token (and column block), reading the fused projections' products in
    place (their rows padded to ``weight_layout.ROW_ALIGN``)."""
    T = tokens
    E, Z, I, Q, L, R = s.experts, s.expert_hidden, s.shared_intermediate, s.q_lora, s.mla_latent, s.mla_rope
    G = s.mla_prefill_heads * s.mla_value  # the output gate's columns
    out = []

    def add(name: str, launch: KernelLaunch, programs: int, plan: str, **ints: int) -> None:
        out.append(PlannedLaunch(phase, name, aot.specialised(launch, **ints), programs, plan))

    n = s.attn_res_candidates
    if n <= attn_res.MAX_CANDIDATES and s.hidden <= attn_res.MAX_WIDTH:
        add("attn_res mix + norm", attn_res.aot_launch(n, True, s.hidden, s.dtype), T, f"up to {n} candidates",
            width=s.hidden)
    product = padded_rows(E + Z + 2 * I)  # moe_input_proj: router, latent down, shared gate / up
    add("moe input: routing", routing.aot_requests(E, s.top_k)[0], T, f"top {s.top_k} of {E}", E=E,
        logits_stride=product)
    add("moe input: latent and shared SiTU", moe_input.aot_launch(), T * (triton.cdiv(Z, moe_input.BLOCK)
        + triton.cdiv(I, moe_input.BLOCK)), "", stride=product, z_col=E, Z=Z, g_col=E + Z, u_col=E + Z + I, I=I)
    width = padded_rows(2 * s.dense_intermediate)  # situ_and_mul_proj: gate and up of the dense MLP
    add("dense MLP SiTU", activations.aot_launch(s.dtype), T * triton.cdiv(s.dense_intermediate, activations.BLOCK),
        "layer 0", width=s.dense_intermediate, gate_stride=width, up_stride=width)
    row = padded_rows(Q + L + R + G)  # mla_input_proj: q_a, kv_a, g_proj
    add("mla input norms and gate", mla_input_proj.aot_launch(s.dtype, Q, L, R),
        T * (mla_input_proj.NORM_SEGMENTS + triton.cdiv(G, mla_input_proj.BLOCK_G)), "", q_stride=row, c_stride=row,
        g_stride=row, Q=Q, L=L, R=R, G=G)
    if s.kv_dtype is not None and is_fp8_dtype(s.kv_dtype):
        add("mla FP8 cache write", mla_cache_write.aot_launch(s.kv_dtype, L + R, L, s.dtype), T, "",
            stride_kv=L + R, stride_slot=1)
    if phase == "prefill":
        C, blocks = s.kda_heads * s.kda_head_dim, triton.cdiv(s.kda_heads * s.kda_head_dim, short_conv.BLOCK_C)
        chunks = triton.cdiv(s.context, short_conv.BLOCK_T) * s.batch
        conv, state = short_conv.aot_requests(C, s.dtype)
        worst = packed_chunks.worst_chunks(s.context * s.batch, s.batch, short_conv.BLOCK_T)
        add("kda short conv chunk table", packed_chunks.chunk_table_launch(short_conv.BLOCK_T),
            triton.cdiv(worst, packed_chunks.TABLE_BLOCK), "", N=s.batch, worst=worst)
        add("kda short conv", conv, chunks * blocks, f"{short_conv.BLOCK_T} tokens x {short_conv.BLOCK_C} channels",
            C=C)
        add("kda short conv state", state, s.batch * blocks, "", C=C)
    elif s.dcp > 1:  # the decode merge of the members' partial attention (split_mla_context)
        heads, h, V = s.mla_prefill_heads * s.dcp, s.mla_prefill_heads, s.mla_latent
        kernels = dcp_merge.aot_launches(s.dcp, V, s.dtype)
        if s.dcp_merge == "all-to-all":
            add("dcp pack", kernels["pack"], s.batch * heads, f"{s.dcp} members", B=s.batch, H=heads, D=V)
            add("dcp merge", kernels["merge"], s.batch * h, "", B=s.batch, h=h, D=V)
        else:
            add("dcp rescale", kernels["rescale"], s.batch * heads, f"{s.dcp} members", B=s.batch, H=heads, D=V)
    return out


def planned_launches(target: str, shapes: StepShapes) -> list[PlannedLaunch]:
    """The covered launches (module docstring) of one decode step of ``shapes.batch``
    sequences at ``shapes.context`` positions and one prefill of ``shapes.batch`` prompts
    of ``shapes.context`` tokens, on ``target`` (a key of ``aot.TARGETS``)."""
    units = aot.TARGETS[target].compute_units
    return [*_kda_decode(target, shapes, units), *_mla_decode(target, shapes, units),
            *_experts("decode", target, shapes, shapes.batch), *_dedup_rows(target, shapes),
            *_per_token("decode", shapes, shapes.batch),
            *_kda_prefill(target, shapes, units), *_mla_prefill(target, shapes),
            *_experts("prefill", target, shapes, shapes.batch * shapes.context),
            *_per_token("prefill", shapes, shapes.batch * shapes.context)]


def reference_fallbacks(shapes: StepShapes) -> list[str]:
    """The ops that would run their torch reference instead of a kernel at ``shapes``
    (their launches are left out of :func:`planned_launches`), each with the reason."""
    s = shapes
    qk, latent = s.mla_latent + s.mla_rope, s.mla_latent
    out = []
    if not split_kv.SPLIT_KV.accepts(s.mla_heads, s.dtype, qk, latent):
        generic = attention.GENERIC.accepts(s.mla_heads, s.dtype, qk, latent)
        kernel = "the generic kernel" if generic else "the reference"
        out.append(f"mla decode: {kernel} ({s.mla_heads} heads, {qk} / {latent} wide, {s.dtype} are not the "
                   f"split-KV kernel's)")
    heads = s.mla_prefill_heads * (s.dcp if s.dcp > 1 and s.dcp_prefill == "partial" else 1)
    if not attention.PREFILL.accepts(heads, s.dtype, qk, latent):
        out.append(f"mla prefill: the reference ({heads} heads, {qk} / {latent} wide, {s.dtype})")
    if not _power_of_two(s.kda_head_dim):
        out.append(f"kda decode: the unfused ops (fuse_kda_decode needs a power-of-two head dim, not "
                   f"{s.kda_head_dim})")
    if not kda_prefill.kernel_takes_dims(s.kda_head_dim, s.kda_head_dim):
        out.append(f"kda prefill: the reference (head dim {s.kda_head_dim}: powers of two >= 16 only)")
    if s.attn_res_candidates > attn_res.MAX_CANDIDATES or s.hidden > attn_res.MAX_WIDTH:
        out.append(f"attn_res mix: the reference beyond {attn_res.MAX_CANDIDATES} candidates or "
                   f"{attn_res.MAX_WIDTH} wide ({s.attn_res_candidates}, {s.hidden})")
    return out


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
