"""Per-GPU memory of a compiled model: weights by kind, MLA latent KV cache, KDA state.

Everything is derived from what the compiler actually produces, not from formulas kept
beside it: the weights are the decode program's parameters with their shard specs after
the passes (a pass that reshards a weight changes them), the caches are what
:func:`k3compile.batch.allocate_caches` allocates for the plan (on ``meta``: no memory is
touched). The full K3 config works without weights: capture runs on ``meta``.

:func:`plan_memory` runs the target's passes one at a time and keeps an estimate after
each pass that changed memory, so a report shows the model with and without each
memory-changing pass.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

from k3compile.batch import CacheShape, KDALayerCache, MLALayerCache, allocate_caches
from k3compile.config import K3Config
from k3compile.context_parallel import ContextLayout, program_layout
from k3compile.sharding import ParallelPlan, ShardSpec
from k3compile.targets import get_target

#: Weight kinds in report order, each with the checkpoint-name pattern that selects it
#: (the first match wins; names are the checkpoint's, without the kimi_k3 prefix).
WEIGHT_KINDS: tuple[tuple[str, str], ...] = (
    ("routed experts", r"\.block_sparse_moe\.experts\."),
    ("shared experts", r"\.block_sparse_moe\.shared_experts\."),
    ("MoE latent projections", r"\.block_sparse_moe\.(routed_expert_down_proj|routed_expert_up_proj|routed_expert_norm)\."),
    ("MoE router", r"\.block_sparse_moe\.gate\."),
    ("dense MLP", r"\.mlp\."),
    ("attention", r"\.self_attn\."),
    ("embedding", r"embed_tokens\."),
    ("LM head", r"lm_head\."),
    ("norms and AttnRes", r"."),
)


@functools.lru_cache(maxsize=None)
def weight_kind(checkpoint_name: str) -> str:
    """The kind (``WEIGHT_KINDS``) a checkpoint tensor's bytes are reported under."""
    for kind, pattern in WEIGHT_KINDS:
        if re.search(pattern, checkpoint_name):
            return kind
    raise AssertionError("the last pattern matches every name")


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one GPU holds (the rank-0 slice; ranks hold equal slices)."""

    weights: dict[str, int]  # by kind, in WEIGHT_KINDS order
    mla_kv: int  # latent KV cache of every MLA layer
    kda_state: int  # conv states + fp32 recurrent state of every KDA layer

    @property
    def weight_total(self) -> int:
        return sum(self.weights.values())

    @property
    def total(self) -> int:
        return self.weight_total + self.mla_kv + self.kda_state


def weight_bytes_by_kind(program: ExportedProgram, specs: dict[str, ShardSpec]) -> dict[str, int]:
    """This rank's parameter bytes as the runtime holds them (the program's parameter
    dtypes: dense experts in the model dtype, or MXFP4 codes and scales after the
    ``mxfp4_experts`` pass), by kind."""
    out = {kind: 0 for kind, _ in WEIGHT_KINDS}
    for spec_in in program.graph_signature.input_specs:
        if spec_in.kind != InputKind.PARAMETER:
            continue
        param = program.state_dict[spec_in.target]
        out[weight_kind(specs[spec_in.target].names[0])] += param.numel() * param.element_size()
    return out


def cache_bytes(
    cfg: K3Config,
    plan: ParallelPlan,
    dtype: torch.dtype,
    context: int,
    sequences: int,
    block_size: int,
    context_split: bool = False,
    kv_cache_dtype: torch.dtype | None = None,
) -> tuple[int, int]:
    """(MLA latent KV, KDA state) bytes on one rank for ``sequences`` of ``context`` tokens,
    the MLA cache in ``kv_cache_dtype`` (default ``dtype``; FP8 rows count their scales);
    with ``context_split`` the MLA cache holds only the rank's DCP share of the positions
    (the largest share: member 0's, rounded up to whole blocks)."""
    stored = ContextLayout.of(plan).max_local_length(context) if context_split else context
    blocks = sequences * math.ceil(stored / block_size)
    caches = allocate_caches(cfg, plan, CacheShape(sequences, blocks, block_size), dtype, "meta", kv_cache_dtype)
    nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
    mla = sum(nbytes(c.kv) for c in caches if isinstance(c, MLALayerCache))
    kda = sum(
        nbytes(c.conv_q) + nbytes(c.conv_k) + nbytes(c.conv_v) + nbytes(c.state)
        for c in caches
        if isinstance(c, KDALayerCache)
    )
    return mla, kda


@dataclass(frozen=True)
class MemoryOptions:
    """The deployment the estimate is for."""

    tp: int = 8
    dcp: int = 1
    dcp_interleave: int = 1
    target: str = "mi355x"
    dtype: torch.dtype = torch.bfloat16
    context: int = 131072  # tokens per sequence
    sequences: int = 1  # sequences resident at once
    block_size: int | None = None  # tokens per MLA cache block; None: the target's (Target.mla_block_size)
    enable: tuple[str, ...] = ()
    disable: tuple[str, ...] = ()
    kv_cache_dtype: torch.dtype | None = None  # of the MLA cache; None: ``dtype``

    def __post_init__(self) -> None:
        if self.block_size is None:
            object.__setattr__(self, "block_size", get_target(self.target).mla_block_size)

    @property
    def mla_cache_dtype(self) -> torch.dtype:
        return self.dtype if self.kv_cache_dtype is None else self.kv_cache_dtype


@dataclass
class MemoryPlan:
    """Estimates before any pass, then after each pass that changed memory."""

    config: K3Config
    options: MemoryOptions
    stages: list[tuple[str, MemoryEstimate]] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)  # passes that ran without changing memory
    hbm_bytes: int = 0  # the target's memory per GPU (0: unknown)
    program: ExportedProgram | None = None  # the decode program after the passes
    specs: dict[str, ShardSpec] = field(default_factory=dict)  # its parameters' specs

    @property
    def final(self) -> MemoryEstimate:
        return self.stages[-1][1]

    def routed_expert_format(self) -> str | None:
        """How the final program holds the routed experts ("MXFP4 codes + scales" or the
        dense dtype), or None without MoE layers."""
        if self.program is None:
            return None
        for spec_in in self.program.graph_signature.input_specs:
            if spec_in.kind != InputKind.PARAMETER:
                continue
            if weight_kind(self.specs[spec_in.target].names[0]) == "routed experts":
                dtype = self.program.state_dict[spec_in.target].dtype
                return "MXFP4 codes + scales (uint8)" if dtype == torch.uint8 else f"dense {str(dtype).removeprefix('torch.')}"
        return None

    def after(self, pass_name: str) -> MemoryEstimate:
        """The estimate right after ``pass_name``, a pass that changed memory."""
        names = [name for name, _ in self.stages]
        if pass_name not in names:
            raise KeyError(f"pass {pass_name} changed no memory (or did not run)")
        return self.stages[names.index(pass_name)][1]

    def saved_by(self, pass_name: str) -> int:
        """Bytes per GPU the pass saved (0 if it changed nothing)."""
        names = [name for name, _ in self.stages]
        if pass_name not in names:
            return 0
        i = names.index(pass_name)
        return self.stages[i - 1][1].total - self.stages[i][1].total


def plan_memory(
    cfg: K3Config, options: MemoryOptions, on_step: Callable[[str], None] | None = None
) -> MemoryPlan:
    """Capture the decode program (on ``meta``), then run the target's passes one by one,
    estimating per-GPU memory before the first and after each that changed it."""
    from k3compile.capture import capture
    from k3compile.pipeline import GraphPass, PipelineOptions, resolve_passes, run_pipeline
    from k3compile.placement import propagate_placements

    say = on_step or (lambda _msg: None)
    target = get_target(options.target)
    pipeline = PipelineOptions(target=options.target, enable=options.enable, disable=options.disable)
    plan = ParallelPlan(options.tp, 0, options.dcp, options.dcp_interleave)
    passes = resolve_passes(target, pipeline, plan)
    say("capture decode")
    captured = capture(cfg, plan, options.dtype, options.block_size, phases=("decode",),
                       kv_cache_dtype=options.kv_cache_dtype)
    program = captured.programs["decode"]
    propagate_placements(program.graph_module, program, captured.specs, plan)

    caches: dict[bool, tuple[int, int]] = {}  # by whether the MLA cache is split by context

    def estimate() -> MemoryEstimate:
        split = program_layout(program.graph_module) is not None
        if split not in caches:
            caches[split] = cache_bytes(cfg, plan, options.dtype, options.context, options.sequences,
                                        options.block_size, split, options.kv_cache_dtype)
        return MemoryEstimate(weight_bytes_by_kind(program, captured.specs), *caches[split])

    result = MemoryPlan(cfg, options, [("no passes", estimate())], hbm_bytes=target.hbm_bytes, program=program,
                        specs=captured.specs)

    def estimate_after(graph_pass: GraphPass) -> None:
        after = estimate()
        if after != result.stages[-1][1]:
            result.stages.append((graph_pass.name, after))
        else:
            result.unchanged.append(graph_pass.name)

    run_pipeline(captured.programs, cfg, plan, captured.specs, pipeline, constants=captured.constants, passes=passes,
                 record=False, after_pass=estimate_after, on_pass=lambda name, _phase: say(f"pass {name}"))
    return result
