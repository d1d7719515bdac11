"""One rank's optimized decode or prefill program as an ONNX model.

The program is re-traced as ``k3compile.export.trace`` describes (its k3 ops pointed at
their standard-operator forms, its caches functional), then translated by
``torch.onnx``. The model's metadata (``k3compile.cache_outputs``) maps every cache
output ``<input>.next`` to its input, so a caller feeds the outputs back in the next
step.

    inputs   input_ids [B], cu_seqlens [B + 1], seq_lens [B], state_slots [B],
             block_table [B, blocks], slot_mapping [B], logit_indices [B],
             cache.<layer>.<part> ... (fixed shapes: ExportOptions' sequences and context)
    outputs  logits [B, vocab], cache.<layer>.<part>.next ...

B and the block table's width are dynamic. A prefill's inputs are the same, its tokens
packed: ``input_ids`` and ``slot_mapping`` [T], T dynamic too; its GEMM dispatch's
``cond`` is an ``If`` (``k3compile.export.trace``). FP8 MLA caches are refused (their rows are
bytes reinterpreted in place, which the ONNX translator cannot express yet).

With ``ExportOptions(k3_ops="keep")`` every k3 op call is one node of the ONNX domain
``k3`` instead of its decomposition (``k3compile.export.custom_ops``); the metadata says
so (``k3compile.k3_ops``) and names each kept op's torch reference
(``k3compile.k3_op_references``). No ONNX runtime has kernels for that domain.

A TP > 1 rank's collectives are nodes of the domain ``k3.collectives``, described by the
metadata ``k3compile.collectives`` (``k3compile.export.collectives``). A structure-only
export (a ``ModelStructure``) has its weights as graph inputs without values
(``k3compile.export.structure``).
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import torch

from k3compile.export import collectives
from k3compile.export.custom_ops import (
    K3_DOMAIN,
    K3_DOMAIN_VERSION,
    kept_calls,
    onnx_translation_table,
    reference,
    restore_output_types,
)
from k3compile.export.structure import lift_weights, trace_source
from k3compile.export.trace import (
    STEP_INPUTS,
    ExportOptions,
    ExportResult,
    ModelStructure,
    check_output_path,
    move_into_place,
)

__all__ = ["STEP_INPUTS", "export_onnx"]


def export_onnx(source: str | Path | ModelStructure, out: str | Path,
                options: ExportOptions = ExportOptions()) -> ExportResult:
    """Write ``options.phase``'s program of ``options.rank`` as an ONNX model at ``out``
    (module docstring); checked with ``onnx.checker`` (full check) before it is moved into
    place, so a failed export leaves nothing behind. ``source``: an artifact directory, or
    a :class:`ModelStructure` for a structure-only export (its weights graph inputs without
    values: ``k3compile.export.structure``)."""
    import onnx

    out = Path(out)
    check_output_path(out, ".onnx")
    if isinstance(source, ModelStructure) and options.external_data:
        raise ValueError("external_data: a structure-only export has no weight data to write")
    start = time.perf_counter()
    traced = trace_source(source, options, "ONNX")
    kept = sorted(set(kept_calls(traced.program)))
    table = {**(onnx_translation_table(set(kept)) if kept else {}),
             **(collectives.onnx_translation_table(traced.collectives) if traced.collectives else {})}
    onnx_program = torch.onnx.export(traced.program, dynamo=True, input_names=list(traced.inputs),
                                     output_names=list(traced.outputs), verbose=False,
                                     custom_translation_table=table or None, optimize=not traced.structure)
    weights = ()
    if traced.structure:  # the optimizer's constant folding would read the weights' values, which meta lacks
        weights = tuple(lift_weights(onnx_program.model))
        onnx_program.optimize()
        onnx_program.model.metadata_props.update({"k3compile.structure_only": "true",
                                                  "k3compile.structure": json.dumps(traced.structure)})
    onnx_program.model.metadata_props.update({
        "k3compile.phase": options.phase, "k3compile.rank": str(options.rank),
        "k3compile.cache_outputs": json.dumps(traced.cache_outputs),
        "k3compile.cache_capacity": json.dumps({"max_sequences": options.max_sequences,
                                                "max_context": options.max_context}),
        "k3compile.k3_ops": options.k3_ops,
    })
    restore_output_types(onnx_program.model, (K3_DOMAIN, collectives.COLLECTIVES_DOMAIN))
    if kept:
        onnx_program.model.opset_imports[K3_DOMAIN] = K3_DOMAIN_VERSION
        onnx_program.model.metadata_props["k3compile.k3_op_references"] = json.dumps({n: reference(n) for n in kept})
    if traced.collectives:
        onnx_program.model.opset_imports[collectives.COLLECTIVES_DOMAIN] = collectives.COLLECTIVES_DOMAIN_VERSION
        onnx_program.model.metadata_props["k3compile.collectives"] = json.dumps(traced.collectives)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.") as tmp:
        staged = Path(tmp) / out.name
        onnx_program.save(staged, external_data=options.external_data)
        onnx.checker.check_model(str(staged), full_check=True)
        size = move_into_place(Path(tmp), out.parent)
    return ExportResult(out, time.perf_counter() - start, size, traced.inputs, traced.outputs, traced.cache_outputs,
                        traced.collectives, weights)
