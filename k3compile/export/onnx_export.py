"""One rank's optimized decode program as an ONNX model.

The program is re-traced on the CPU with the rank's weights and a real decode batch
(runtime inputs of the runtime's own making), its k3 ops pointed at their
standard-operator forms (``decompositions``), then translated by ``torch.onnx``. The
caches, which the runtime updates in place, are functional here: each cache tensor is an
input and its updated value an output, named ``<input>.next``; the model's metadata
(``k3compile.cache_outputs``) maps every such output to its input, so a caller feeds
the outputs back in the next step.

    inputs   input_ids [B], cu_seqlens [B + 1], seq_lens [B], state_slots [B],
             block_table [B, blocks], slot_mapping [B], logit_indices [B],
             cache.<layer>.<part> ... (fixed shapes: ExportOptions' sequences and context)
    outputs  logits [B, vocab / tp], cache.<layer>.<part>.next ...

B and the block table's width are dynamic. FP8 MLA caches are refused (their rows are
bytes reinterpreted in place, which the ONNX translator cannot express yet).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from k3compile.batch import KDALayerCache, MLALayerCache
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
    external_data: bool = False  # weights in a ``<file>.data`` beside the model

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise ValueError(f"phase: one of {', '.join(PHASES)}, got {self.phase!r}")
        for name in ("max_sequences", "max_context"):
            if getattr(self, name) < 2:
                raise ValueError(f"{name}: at least 2, got {getattr(self, name)}")


@dataclass(frozen=True)
class ExportResult:
    path: Path
    seconds: float
    file_bytes: int  # the model file and its external data
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    cache_outputs: dict[str, str]  # output name -> the cache input it updates


class _StepWithCaches(torch.nn.Module):
    """The decode program returning its caches after the step's in-place updates."""

    def __init__(self, step: torch.fx.GraphModule):
        super().__init__()
        self.step = step

    def forward(self, input_ids: Tensor, cu_seqlens: Tensor, seq_lens: Tensor, state_slots: Tensor,
                block_table: Tensor, slot_mapping: Tensor, logit_indices: Tensor,
                caches: list[Tensor]) -> tuple[Tensor, ...]:
        logits = self.step(input_ids, cu_seqlens, seq_lens, state_slots, block_table, slot_mapping, logit_indices,
                           caches)
        return (logits, *(c.clone() for c in caches))


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


def _check_exportable(artifact, options: ExportOptions) -> None:
    """Refuse what cannot be exported, before any weight is read."""
    info = artifact.info
    if not 0 <= options.rank < info.tp:
        raise ValueError(f"rank {options.rank}: the artifact has ranks 0..{info.tp - 1}")
    if is_fp8_dtype(info.kv_cache_dtype):
        raise ValueError(f"the artifact's MLA caches are {str(info.kv_cache_dtype).removeprefix('torch.')}, whose "
                         "byte-level rows (codes and scales) do not translate to ONNX yet: compile with "
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
        raise ValueError(f"the {options.phase} program holds collectives ({', '.join(collectives)}), which ONNX "
                         f"cannot express: export a TP1 artifact (this one is TP{info.tp}, DCP{info.dcp})")
    missing = missing_decompositions(gm)
    if missing:
        raise ValueError(f"the {options.phase} program's k3 ops {', '.join(missing)} have no decomposition into "
                         "standard operators yet: only the decode phase exports")


def _decode_example(runtime) -> tuple[Tensor, ...]:
    """A decode step's inputs as the runtime makes them: two sequences whose contexts
    span two cache blocks (a width of 1 would be specialised by the trace)."""
    length = runtime.artifact.info.block_size + 1
    ids, _ = runtime.prefill([[1] * length, [2] * (length - 1)])
    runtime.table.reserve(ids, [1, 1])
    batch = runtime.table.make_batch(ids, [1, 1], True, device=runtime.device)
    return (torch.tensor([3, 4]), batch.cu_seqlens, batch.seq_lens, batch.state_slots, batch.block_table,
            batch.slot_mapping, batch.logit_indices)


def export_onnx(artifact_dir: str | Path, out: str | Path, options: ExportOptions = ExportOptions()) -> ExportResult:
    """Write ``options.phase``'s program of ``options.rank`` as an ONNX model at ``out``
    (module docstring); checked with ``onnx.checker`` (full check) before it is moved into
    place, so a failed export leaves nothing behind."""
    import onnx

    from k3compile.artifact import load_artifact
    from k3compile.runtime.engine import Runtime, RuntimeOptions

    out = Path(out)
    if out.suffix != ".onnx":
        raise ValueError(f"{out}: the output file must end in .onnx")
    if not out.parent.is_dir():
        raise ValueError(f"{out.parent}: no such directory")
    start = time.perf_counter()
    artifact = load_artifact(artifact_dir)
    _check_exportable(artifact, options)
    runtime = Runtime(artifact, options.rank, torch.device("cpu"),
                      RuntimeOptions(max_sequences=options.max_sequences, max_context=options.max_context,
                                     cuda_graphs=False, lowering="eager"))
    step = _decode_example(runtime)
    caches = [c.clone() for c in runtime.cache_tensors]
    gm = runtime.graph_modules[options.phase]
    batch, blocks = torch.export.Dim("batch", min=1, max=options.max_sequences), torch.export.Dim("blocks")
    dynamic = ({0: batch}, {0: batch + 1}, {0: batch}, {0: batch}, {0: batch, 1: blocks}, {0: batch}, {0: batch},
               [None] * len(caches))
    with DecomposedK3Ops():
        program = torch.export.export(_StepWithCaches(gm), (*step, caches), dynamic_shapes=dynamic)
    names = cache_names(runtime.caches)
    outputs = ("logits", *(f"{n}.next" for n in names))
    onnx_program = torch.onnx.export(program, dynamo=True, input_names=[*STEP_INPUTS, *names],
                                     output_names=list(outputs), verbose=False)
    cache_outputs = {f"{n}.next": n for n in names}
    onnx_program.model.metadata_props.update({
        "k3compile.phase": options.phase, "k3compile.rank": str(options.rank),
        "k3compile.cache_outputs": json.dumps(cache_outputs),
        "k3compile.cache_capacity": json.dumps({"max_sequences": options.max_sequences,
                                                "max_context": options.max_context}),
    })
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.") as tmp:
        staged = Path(tmp) / out.name
        onnx_program.save(staged, external_data=options.external_data)
        onnx.checker.check_model(str(staged), full_check=True)
        files = sorted(Path(tmp).iterdir())
        size = sum(f.stat().st_size for f in files)
        for f in files:
            target = out.parent / f.name
            if target.is_dir():
                shutil.rmtree(target)
            os.replace(f, target)
    return ExportResult(out, time.perf_counter() - start, size, (*STEP_INPUTS, *names), outputs, cache_outputs)
