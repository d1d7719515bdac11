"""What every exporter shares: the options, the refusals, and the traced step.

An exporter does not translate the artifact's stored program. It re-traces one rank's
decode or prefill program on the CPU with ``torch.export``, with the rank's weights and a
batch the runtime's own sequence table made, while ``DecomposedK3Ops`` sends every k3 op
call to its standard-operator form (or, with ``ExportOptions.k3_ops == "keep"``,
``KeptK3Ops`` keeps each call one op: ``k3compile.export.custom_ops``). The traced step
is functional:

- The caches, which the runtime updates in place, are copied first, so the program
  mutates no input. Each cache is an input, and its updated value an output named
  ``<input>.next``. :attr:`TracedStep.cache_outputs` maps every such output to its input.
- A ``cond`` whose predicate the exported sizes decide runs its branch directly
  (:class:`DecidedBranches`). The GEMM dispatch of ``k3compile.model.gemm`` branches on
  ``tokens >= 16``: a decode batch of at most 15 sequences always takes the GEMV. A
  prefill's token count is dynamic from 1, so its ``cond`` stays (ONNX: an ``If``), unless
  the format has no ``cond`` (MLIR): then the prefill is traced for 16 tokens or more,
  which takes the tiled GEMM.

The inputs are the step's tensors (:data:`STEP_INPUTS`), then every cache. The batch and
the block table's width are dynamic, and for a prefill the packed token count (of
``input_ids`` and ``slot_mapping``) too, up to ``max_sequences * max_context``. The caches
have the fixed shapes of :class:`ExportOptions`' sequences and context.

A TP > 1 rank's program keeps its functional collectives (``k3compile.export.collectives``).
The trace runs no step, so it needs no peers: the example batch comes from the runtime's
sequence table alone, and the runtime is built inside torch's in-process ``fake`` process
group (a DCP rank's runtime makes its DCP group). A :class:`ModelStructure` instead of an
artifact is compiled on the meta device and traced there, without weights
(``k3compile.export.structure``).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.overrides import TorchFunctionMode

from k3compile.batch import KDALayerCache, MLALayerCache, flatten_caches
from k3compile.capture import tracing_process_group
from k3compile.config import K3Config
from k3compile.export.collectives import COLLECTIVES, collectives_metadata, program_collectives
from k3compile.export.custom_ops import K3_OPS_MODES, KeptK3Ops
from k3compile.export.decompositions import DecomposedK3Ops, missing_decompositions
from k3compile.mla_cache_fp8 import is_fp8_dtype
from k3compile.model.gemm import FAST_MIN_TOKENS

#: a step program's non-cache inputs (decode and prefill alike), in the order the runtime passes them
STEP_INPUTS = ("input_ids", "cu_seqlens", "seq_lens", "state_slots", "block_table", "slot_mapping", "logit_indices")
PHASES = ("decode", "prefill")


@dataclass(frozen=True)
class ExportOptions:
    """What to export and the cache capacity the model's cache inputs are sized for."""

    phase: str = "decode"
    rank: int = 0
    max_sequences: int = 4  # KDA state slots (one more is the runtime's reserved slot)
    max_context: int = 256  # tokens per sequence: MLA cache blocks
    external_data: bool = False  # ONNX only: weights in a ``<file>.data`` beside the model
    k3_ops: str = "decompose"  # or "keep": one custom node a k3 op call (k3compile.export.custom_ops)

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise ValueError(f"phase: one of {', '.join(PHASES)}, got {self.phase!r}")
        if self.k3_ops not in K3_OPS_MODES:
            raise ValueError(f"k3_ops: one of {', '.join(K3_OPS_MODES)}, got {self.k3_ops!r}")
        for name in ("max_sequences", "max_context"):
            if getattr(self, name) < 2:
                raise ValueError(f"{name}: at least 2, got {getattr(self, name)}")


@dataclass(frozen=True)
class ExportResult:
    path: Path
    seconds: float
    file_bytes: int  # the written file and, for ONNX, its external data
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    cache_outputs: dict[str, str]  # output name -> the cache input it updates
    collectives: dict = field(default_factory=dict)  # k3compile.export.collectives.collectives_metadata
    weights: tuple[str, ...] = ()  # structure-only ONNX: the weight inputs after the caches, without values


@dataclass(frozen=True)
class TracedStep:
    """One rank's program as a functional ``torch.export`` program (module docstring)."""

    program: torch.export.ExportedProgram
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    cache_outputs: dict[str, str]
    collectives: dict  # k3compile.export.collectives.collectives_metadata: empty without collectives
    structure: dict = field(default_factory=dict)  # structure-only (a ModelStructure, on meta): what it compiled


@dataclass(frozen=True)
class ModelStructure:
    """What to export instead of an artifact for a structure-only export: ``config``
    compiled now on the meta device for ``tp`` x ``dcp`` and the hardware ``target``, as
    ``k3compile plan`` compiles it; no checkpoint, no weights (``k3compile.export.structure``)."""

    config: K3Config
    tp: int = 1
    dcp: int = 1
    dcp_interleave: int = 1
    target: str = "mi355x"
    dtype: torch.dtype = torch.float32  # ONNX has no bfloat16 Einsum
    kv_cache_dtype: torch.dtype | None = None  # of the MLA caches; None: ``dtype``
    block_size: int | None = None  # tokens a MLA cache block; None: the target's


def cache_names(caches: list) -> list[str]:
    """``cache.<layer>.<part>`` for the runtime's per-layer caches, in the programs' order."""
    names = []
    for layer, cache in enumerate(caches):
        if isinstance(cache, KDALayerCache):
            names += [f"cache.{layer}.{part}" for part in ("conv_q", "conv_k", "conv_v", "state")]
        elif isinstance(cache, MLALayerCache):
            names.append(f"cache.{layer}.kv")
        else:
            raise TypeError(f"layer {layer}: unknown cache {type(cache).__name__}")
    return names


def check_output_path(out: Path, suffix: str) -> None:
    if out.suffix != suffix:
        raise ValueError(f"{out}: the output file must end in {suffix}")
    if not out.parent.is_dir():
        raise ValueError(f"{out.parent}: no such directory")


def check_exportable(artifact, options: ExportOptions, target: str, with_collectives: bool = True) -> None:
    """Refuse what cannot be exported to ``target`` (a format's name), before any weight is
    read; ``with_collectives``: whether ``target`` keeps the collectives of a TP > 1
    program (k3compile.export.collectives)."""
    info = artifact.info
    check_plan(options, info.tp, info.dcp, info.block_size, info.dtype, info.kv_cache_dtype, target, "the artifact")
    if options.phase not in artifact.programs:
        raise ValueError(f"the artifact has no {options.phase} program")
    check_program(artifact.programs[options.phase].graph_module, options, target, with_collectives, info.tp, info.dcp)


def check_plan(options: ExportOptions, tp: int, dcp: int, block_size: int, dtype: torch.dtype,
               kv_cache_dtype: torch.dtype, target: str, what: str) -> None:
    """Refuse a rank outside ``tp``, bfloat16 in ONNX, FP8 MLA caches and a cache capacity of
    one MLA block: what an export of ``what`` (the artifact, the model structure) to
    ``target`` cannot take, known before its program is read."""
    if not 0 <= options.rank < tp:
        raise ValueError(f"rank {options.rank}: {what} has ranks 0..{tp - 1}")
    if dtype == torch.bfloat16 and target == "ONNX":
        raise ValueError(f"{what} is bfloat16, and its program's einsums (the k3 ops' references, the model's "
                         "projections) become ONNX Einsum nodes, which have no bfloat16: export a float32 one "
                         "(compiled with --dtype float32)")
    if is_fp8_dtype(kv_cache_dtype):
        raise ValueError(f"{what}'s MLA caches are {str(kv_cache_dtype).removeprefix('torch.')}, whose "
                         f"byte-level rows (codes and scales) do not translate to {target} yet: compile with "
                         "--kv-cache-dtype auto to export")
    if options.max_context <= block_size * dcp:
        raise ValueError(f"max_context {options.max_context}: the caches must hold more than one MLA block of "
                         f"{block_size} tokens a sequence{f' on each of the {dcp} DCP ranks' if dcp > 1 else ''} "
                         "(the block table's width is a dynamic dimension)")


def check_program(gm: torch.fx.GraphModule, options: ExportOptions, target: str, with_collectives: bool, tp: int,
                  dcp: int) -> None:
    """Refuse collectives that ``target`` cannot express and k3 ops without a decomposition
    (unless kept; a context-parallel prefill's, kept or not: untested) in the program
    ``gm`` of ``options.phase``."""
    collectives = program_collectives(gm)
    unknown = sorted(set(collectives) - set(COLLECTIVES))
    if collectives and (not with_collectives or unknown):
        raise ValueError(f"the {options.phase} program holds collectives ({', '.join(unknown or collectives)}), which "
                         f"{target} cannot express: export a TP1 artifact (this one is TP{tp}, DCP{dcp})"
                         + ("" if unknown else ", or to a format that keeps collectives (ONNX, MLIR's torch dialect)"))
    missing = missing_decompositions(gm)
    if missing and options.phase == "prefill":
        raise ValueError(f"the prefill program's k3 ops {', '.join(missing)} (context parallelism, DCP{dcp}) do not "
                         "export yet, decomposed or kept: export the decode phase, or the prefill of a DCP1 artifact")
    if missing and options.k3_ops == "decompose":
        raise ValueError(f"the {options.phase} program's k3 ops {', '.join(missing)} have no decomposition into "
                         "standard operators yet: export them kept (--keep-k3-ops)")


def load_exportable(artifact_dir: str | Path, options: ExportOptions, target: str, with_collectives: bool = True):
    """The artifact at ``artifact_dir`` (its manifest and programs; no weights yet), checked
    by :func:`check_exportable`."""
    from k3compile.artifact import load_artifact

    artifact = load_artifact(artifact_dir)
    check_exportable(artifact, options, target, with_collectives)
    return artifact


class DecidedBranches(TorchFunctionMode):
    """While active, a ``cond`` whose predicate is a size comparison that the traced sizes'
    ranges decide runs the branch it picks; any other ``cond`` stays (module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.higher_order.cond and not kwargs and isinstance(args[0], torch.SymBool):
            pred, true_fn, false_fn, operands = args
            for value, branch in ((pred, true_fn), (torch.sym_not(pred), false_fn)):
                if statically_known_true(value):
                    with self:
                        return branch(*operands)
        return func(*args, **(kwargs or {}))


class _StepWithCaches(torch.nn.Module):
    """A step program on copies of the caches, returning them after its updates."""

    def __init__(self, step: torch.fx.GraphModule):
        super().__init__()
        self.step = step

    def forward(self, input_ids: Tensor, cu_seqlens: Tensor, seq_lens: Tensor, state_slots: Tensor,
                block_table: Tensor, slot_mapping: Tensor, logit_indices: Tensor,
                caches: list[Tensor]) -> tuple[Tensor, ...]:
        caches = [c.clone() for c in caches]
        logits = self.step(input_ids, cu_seqlens, seq_lens, state_slots, block_table, slot_mapping, logit_indices,
                           caches)
        return (logits, *caches)


def decode_example(table) -> tuple[Tensor, ...]:
    """A decode step's inputs as the runtime makes them with its sequence table ``table``
    (its blocks then taken): two sequences whose contexts span two cache blocks of the rank
    (a width of 1 would be specialised by the trace)."""
    length = table.shape.block_size * table.layout.dcp + 1
    ids = [table.new_sequence() for _ in range(2)]
    table.reserve(ids, [length, length - 1])
    table.advance(ids, [length, length - 1])
    table.reserve(ids, [1, 1])
    batch = table.make_batch(ids, [1, 1], True)
    return (torch.tensor([3, 4]), batch.cu_seqlens, batch.seq_lens, batch.state_slots, batch.block_table,
            batch.slot_mapping, batch.logit_indices)


def prefill_example(table) -> tuple[Tensor, ...]:
    """A prefill step's inputs as the runtime makes them with its sequence table ``table``
    (its blocks then taken): a sequence that continues after most of one cache block of
    the rank (2 new tokens, its context then spanning two blocks: a width of 1 would be
    specialised by the trace), and a new one with a prompt of ``FAST_MIN_TOKENS + 1``
    tokens (19 packed tokens: in every traced range, and none of the batch's sizes)."""
    cached = table.shape.block_size * table.layout.dcp - 1
    counts = [2, FAST_MIN_TOKENS + 1]
    ids = [table.new_sequence() for _ in counts]
    table.reserve(ids[:1], [cached])
    table.advance(ids[:1], [cached])
    table.reserve(ids, counts)
    batch = table.make_batch(ids, counts, False)
    return (torch.arange(3, 3 + sum(counts)), batch.cu_seqlens, batch.seq_lens, batch.state_slots, batch.block_table,
            batch.slot_mapping, batch.logit_indices)


def min_prefill_tokens(conds: bool) -> int:
    """The fewest packed tokens a prefill export takes: 1 where the format keeps a
    ``cond`` (``conds``), else ``FAST_MIN_TOKENS``, from which the GEMM dispatch's branch
    is decided (module docstring)."""
    return 1 if conds else FAST_MIN_TOKENS


def step_dynamic_shapes(options: ExportOptions, min_tokens: int, caches: int) -> tuple:
    """``torch.export``'s dynamic shapes of the step inputs and ``caches`` cache tensors:
    the batch and the block table's width, and at prefill the packed token count from
    ``min_tokens`` up to ``max_sequences * max_context``."""
    batch, blocks = torch.export.Dim("batch", min=1, max=options.max_sequences), torch.export.Dim("blocks", max=1 << 24)
    tokens = batch
    if options.phase == "prefill":
        tokens = torch.export.Dim("tokens", min=min_tokens, max=options.max_sequences * options.max_context)
    return ({0: tokens}, {0: batch + 1}, {0: batch}, {0: batch}, {0: batch, 1: blocks}, {0: tokens}, {0: batch},
            [None] * caches)


def export_step(step: torch.fx.GraphModule, example: tuple[Tensor, ...], caches: list, options: ExportOptions,
                tp: int, dcp: int, structure: dict | None = None, min_tokens: int = 1) -> TracedStep:
    """``options.phase``'s program ``step`` traced as :class:`TracedStep` (module
    docstring) on the step inputs ``example`` and the runtime's per-layer ``caches``
    (copied), with the k3 ops decomposed or kept as ``options`` says; ``structure``: what a
    structure-only export compiled (``k3compile.export.structure``); ``min_tokens``: a
    prefill's fewest packed tokens (:func:`min_prefill_tokens`)."""
    tensors = [c.clone() for c in flatten_caches(caches)]
    dynamic = step_dynamic_shapes(options, min_tokens, len(tensors))
    with DecomposedK3Ops() if options.k3_ops == "decompose" else KeptK3Ops(), DecidedBranches():
        program = torch.export.export(_StepWithCaches(step), (*example, tensors), dynamic_shapes=dynamic)
    names = cache_names(caches)
    cache_outputs = {f"{n}.next": n for n in names}
    return TracedStep(program, (*STEP_INPUTS, *names), ("logits", *cache_outputs), cache_outputs,
                      collectives_metadata(program.graph_module, tp, dcp, options.rank), structure or {})


def trace_step(artifact, options: ExportOptions, conds: bool = True) -> TracedStep:
    """``options.phase``'s program of ``options.rank`` traced as :class:`TracedStep` (module
    docstring): the runtime is built on the CPU with the rank's weights for the trace. With
    ``options.k3_ops == "keep"`` the k3 op calls stay (``KeptK3Ops``) instead of being
    decomposed. ``conds``: whether the format keeps a ``cond`` the sizes leave open
    (:func:`min_prefill_tokens`)."""
    from k3compile.runtime.engine import Runtime, RuntimeOptions

    info = artifact.info
    with tracing_process_group(info.tp, options.rank):  # the trace runs no collective
        runtime = Runtime(artifact, options.rank, torch.device("cpu"),
                          RuntimeOptions(max_sequences=options.max_sequences, max_context=options.max_context,
                                         cuda_graphs=False, lowering="eager"))
        min_tokens = min_prefill_tokens(conds)
        example = (decode_example(runtime.table) if options.phase == "decode"
                   else prefill_example(runtime.table))
        return export_step(runtime.graph_modules[options.phase], example, runtime.caches, options, info.tp, info.dcp,
                           min_tokens=min_tokens)


def move_into_place(staged: Path, parent: Path) -> int:
    """Move every file of the directory ``staged`` into ``parent`` (``os.replace``, each one
    atomic); their total bytes. Exporters write and check their files in a temporary
    directory beside the output first, so a failed export leaves nothing behind."""
    files = sorted(staged.iterdir())
    size = sum(f.stat().st_size for f in files)
    for f in files:
        target = parent / f.name
        if target.is_dir():
            shutil.rmtree(target)
        os.replace(f, target)
    return size
