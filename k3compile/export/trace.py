"""What every exporter shares: the options, the refusals, and the traced decode step.

An exporter does not translate the artifact's stored program. It re-traces one rank's
program on the CPU with ``torch.export``, with the rank's weights and a decode batch the
runtime itself made, while ``DecomposedK3Ops`` sends every k3 op call to its
standard-operator form (or, with ``ExportOptions.k3_ops == "keep"``, ``KeptK3Ops`` keeps
each call one op: ``k3compile.export.custom_ops``). The traced step is functional:

- The caches, which the runtime updates in place, are copied first, so the program
  mutates no input. Each cache is an input, and its updated value an output named
  ``<input>.next``. :attr:`TracedStep.cache_outputs` maps every such output to its input.
- A ``cond`` whose predicate the exported sizes decide runs its branch directly
  (:class:`DecidedBranches`). The GEMM dispatch of ``k3compile.model.gemm`` branches on
  ``tokens >= 16``, and a decode batch of at most 15 sequences always takes the GEMV.

The inputs are the decode step's tensors (:data:`STEP_INPUTS`), then every cache. The
batch and the block table's width are dynamic. The caches have the fixed shapes of
:class:`ExportOptions`' sequences and context.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.overrides import TorchFunctionMode

from k3compile.batch import KDALayerCache, MLALayerCache
from k3compile.export.custom_ops import K3_OPS_MODES, KeptK3Ops
from k3compile.export.decompositions import DecomposedK3Ops, missing_decompositions
from k3compile.mla_cache_fp8 import is_fp8_dtype

#: the decode program's non-cache inputs, in the order the runtime passes them
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


@dataclass(frozen=True)
class TracedStep:
    """One rank's program as a functional ``torch.export`` program (module docstring)."""

    program: torch.export.ExportedProgram
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    cache_outputs: dict[str, str]


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


def check_exportable(artifact, options: ExportOptions, target: str) -> None:
    """Refuse what cannot be exported to ``target`` (a format's name), before any weight is read."""
    info = artifact.info
    if not 0 <= options.rank < info.tp:
        raise ValueError(f"rank {options.rank}: the artifact has ranks 0..{info.tp - 1}")
    if is_fp8_dtype(info.kv_cache_dtype):
        raise ValueError(f"the artifact's MLA caches are {str(info.kv_cache_dtype).removeprefix('torch.')}, whose "
                         f"byte-level rows (codes and scales) do not translate to {target} yet: compile with "
                         "--kv-cache-dtype auto to export")
    if options.max_context <= info.block_size:
        raise ValueError(f"max_context {options.max_context}: the caches must hold more than one MLA block of "
                         f"{info.block_size} tokens a sequence (the block table's width is a dynamic dimension)")
    if options.phase not in artifact.programs:
        raise ValueError(f"the artifact has no {options.phase} program")
    gm = artifact.programs[options.phase].graph_module
    collectives = sorted({str(n.target).split(".")[1] for n in gm.graph.nodes
                          if n.op == "call_function" and str(n.target).startswith("_c10d_functional.")}
                         - {"wait_tensor"})
    if collectives:
        raise ValueError(f"the {options.phase} program holds collectives ({', '.join(collectives)}), which {target} "
                         f"cannot express: export a TP1 artifact (this one is TP{info.tp}, DCP{info.dcp})")
    missing = missing_decompositions(gm)
    if missing:
        raise ValueError(f"the {options.phase} program's k3 ops {', '.join(missing)} have no decomposition into "
                         "standard operators yet: only the decode phase exports")


def load_exportable(artifact_dir: str | Path, options: ExportOptions, target: str):
    """The artifact at ``artifact_dir`` (its manifest and programs; no weights yet), checked
    by :func:`check_exportable`."""
    from k3compile.artifact import load_artifact

    artifact = load_artifact(artifact_dir)
    check_exportable(artifact, options, target)
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
    """The decode program on copies of the caches, returning them after its updates."""

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


def _decode_example(runtime) -> tuple[Tensor, ...]:
    """A decode step's inputs as the runtime makes them: two sequences whose contexts
    span two cache blocks (a width of 1 would be specialised by the trace)."""
    length = runtime.artifact.info.block_size + 1
    ids, _ = runtime.prefill([[1] * length, [2] * (length - 1)])
    runtime.table.reserve(ids, [1, 1])
    batch = runtime.table.make_batch(ids, [1, 1], True, device=runtime.device)
    return (torch.tensor([3, 4]), batch.cu_seqlens, batch.seq_lens, batch.state_slots, batch.block_table,
            batch.slot_mapping, batch.logit_indices)


def trace_step(artifact, options: ExportOptions) -> TracedStep:
    """``options.phase``'s program of ``options.rank`` traced as :class:`TracedStep` (module
    docstring): the runtime is built on the CPU with the rank's weights for the trace. With
    ``options.k3_ops == "keep"`` the k3 op calls stay (``KeptK3Ops``) instead of being
    decomposed."""
    from k3compile.runtime.engine import Runtime, RuntimeOptions

    runtime = Runtime(artifact, options.rank, torch.device("cpu"),
                      RuntimeOptions(max_sequences=options.max_sequences, max_context=options.max_context,
                                     cuda_graphs=False, lowering="eager"))
    step = _decode_example(runtime)
    caches = [c.clone() for c in runtime.cache_tensors]
    batch, blocks = torch.export.Dim("batch", min=1, max=options.max_sequences), torch.export.Dim("blocks")
    dynamic = ({0: batch}, {0: batch + 1}, {0: batch}, {0: batch}, {0: batch, 1: blocks}, {0: batch}, {0: batch},
               [None] * len(caches))
    with DecomposedK3Ops() if options.k3_ops == "decompose" else KeptK3Ops(), DecidedBranches():
        program = torch.export.export(_StepWithCaches(runtime.graph_modules[options.phase]), (*step, caches),
                                      dynamic_shapes=dynamic)
    names = cache_names(runtime.caches)
    cache_outputs = {f"{n}.next": n for n in names}
    return TracedStep(program, (*STEP_INPUTS, *names), ("logits", *cache_outputs), cache_outputs)


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
