"""``optimize``: model directory -> captured programs -> pass pipeline -> artifact.

    model_dir --config--> rank-local model (meta) --torch.export--> one program per phase
      --placements--> pass pipeline (records, diffs, validation) --> OUT/ (artifact)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from k3compile.artifact_writer import save_artifact
from k3compile.batch import resolve_kv_cache_dtype
from k3compile.capture import PHASES, CaptureCache, CapturedModel, capture
from k3compile.checkpoint.loader import CheckpointReader, LoadReport, fill_parameter, load_checkpoint_config
from k3compile.distributed import RankPools
from k3compile.pipeline import PipelineOptions, PipelineResult, pass_configs, resolve_passes, run_pipeline
from k3compile.placement import propagate_placements
from k3compile.sharding import ParallelPlan
from k3compile.targets import LOWERINGS, get_target
from k3compile.validation import TranslationValidator

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass(frozen=True)
class CompileOptions:
    tp: int = 1
    dcp: int = 1  # decode context parallelism (a divisor of tp), see k3compile/context_parallel.py
    dcp_interleave: int = 1
    target: str = "cpu"
    dtype: str = "bfloat16"
    #: the MLA latent cache: "auto" (the model dtype), "bf16" or "fp8" (the target's FP8
    #: format, values with per-token scales: k3compile/mla_cache_fp8.py)
    kv_cache_dtype: str = "auto"
    block_size: int | None = None  # tokens per MLA cache block; None: the target's (Target.mla_block_size)
    #: how the runtime runs the programs: "auto" (the target's, Target.lowering), or one of
    #: targets.LOWERINGS; recorded in the artifact
    lowering: str = "auto"
    enable: tuple[str, ...] = ()
    disable: tuple[str, ...] = ()
    validate: bool = False
    rtol: float = 1e-4
    #: record each checkpoint shard's full sha256 (reads the whole checkpoint once), so that
    #: loads with RuntimeOptions.verify_weights can check every byte
    hash_weights: bool = False
    #: pass name -> its options (a ``Config`` instance or a mapping of its fields), e.g.
    #: ``{"split_mla_context": {"merge": "reduce-scatter"}}``: how DCP members merge
    pass_configs: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        self.mla_cache_dtype  # an unknown choice, or bf16 with a float32 model, fails here
        pass_configs(self.pass_configs)  # unknown passes, options or choices fail here
        if self.block_size is None:
            object.__setattr__(self, "block_size", get_target(self.target).mla_block_size)
        if self.lowering == "auto":
            object.__setattr__(self, "lowering", get_target(self.target).lowering)
        if self.lowering not in LOWERINGS:
            raise ValueError(f"lowering must be auto or one of {', '.join(LOWERINGS)}, got {self.lowering!r}")

    @property
    def mla_cache_dtype(self) -> torch.dtype:
        """The MLA caches' torch dtype for ``kv_cache_dtype`` on this target and model dtype."""
        return resolve_kv_cache_dtype(self.kv_cache_dtype, DTYPES[self.dtype], get_target(self.target))


@dataclass
class CompileResult:
    out_dir: Path
    captured: CapturedModel
    pipeline: PipelineResult
    phases_seconds: dict[str, float] = field(default_factory=dict)

    def __repr__(self) -> str:
        return f"CompileResult({self.out_dir}, {self.pipeline!r})"

    def _repr_html_(self) -> str:
        return self.pipeline._repr_html_()


def check_checkpoint_headers(model_dir: Path, captured: CapturedModel) -> LoadReport:
    """Every parameter's checkpoint tensors exist with the expected shapes and dtypes
    (headers only, on meta): a bad checkpoint fails at optimize, not at load."""
    report = LoadReport()
    program = captured.programs[next(iter(captured.programs))]
    with CheckpointReader(model_dir, captured.config.checkpoint_prefix) as reader:
        for plan_rank in range(captured.plan.tp):
            plan = captured.plan.for_rank(plan_rank)
            for name, spec in captured.specs.items():
                fill_parameter(reader, name, spec, plan, program.state_dict[name], report)
    return report


def optimize(
    model_dir: str | Path,
    out_dir: str | Path,
    options: CompileOptions = CompileOptions(),
    overwrite: bool = False,
    on_step: Callable[[str], None] | None = None,
    ranks: RankPools | None = None,
    captures: CaptureCache | None = None,
) -> CompileResult:
    """Compile ``model_dir`` for ``options`` into the artifact directory ``out_dir``.
    Validation at TP > 1 runs on ``ranks`` when given (pools kept across compiles), else
    on ranks started for this compile; with ``captures``, a model captured by an earlier
    compile of the same config, plan, dtype and block size is copied, not exported again."""
    model_dir = Path(model_dir)
    say = on_step or (lambda _msg: None)
    cfg = load_checkpoint_config(model_dir)
    plan = ParallelPlan(options.tp, 0, options.dcp, options.dcp_interleave)
    pipeline_options = PipelineOptions(
        target=options.target, enable=options.enable, disable=options.disable, validate=options.validate,
        rtol=options.rtol, pass_configs=pass_configs(options.pass_configs),
    )
    resolve_passes(get_target(options.target), pipeline_options, plan)  # unknown or required passes fail here
    dtype, kv_dtype, on_phase = DTYPES[options.dtype], options.mla_cache_dtype, lambda p: say(f"capture {p}")
    if captures is not None:
        captured = captures.get(cfg, plan, dtype, options.block_size, on_phase, kv_dtype)
    else:
        captured = capture(cfg, plan, dtype, options.block_size, PHASES, on_phase, kv_dtype)
    say("check checkpoint")
    check_checkpoint_headers(model_dir, captured)
    for program in captured.programs.values():
        propagate_placements(program.graph_module, program, captured.specs, plan)
    validator = (
        TranslationValidator(options.rtol, block_size=options.block_size, constants=captured.constants, ranks=ranks,
                             kv_cache_dtype=kv_dtype)
        if options.validate
        else None
    )
    try:
        result = run_pipeline(
            captured.programs, cfg, plan, captured.specs, pipeline_options, validator,
            on_pass=lambda name, phase: say(f"pass {name} ({phase})"), constants=captured.constants,
        )
    finally:
        if validator is not None:
            validator.close()
    say("write artifact")
    out = save_artifact(
        out_dir, captured, model_dir, options.target, [r.summary() for r in result.records], overwrite=overwrite,
        lowering=options.lowering, hash_weights=options.hash_weights,
    )
    return CompileResult(out, captured, result)
