"""Structure-only exports: a model's optimized decode program without its weights.

An export normally re-traces a compiled artifact's program with the rank's weights
(``k3compile.export.trace``). The full K3 has no weights here, and needs none to be read:
:func:`trace_structure` compiles a :class:`~k3compile.export.trace.ModelStructure` (a
config, a parallel plan, a target) on the meta device, as ``k3compile plan`` does (capture,
then the target's passes), and traces that program on meta tensors in the same functional
form: the same inputs, outputs, collectives and cache mapping as an artifact's export.

In ONNX the weights (and the per-rank constants that passes add) are graph inputs after
the caches, named by their parameter, with their shapes and types and no values. Not
initializers without data: ``onnx.checker`` needs an initializer's bytes, and ONNX
external data would have to point at a file that does not exist. The model's metadata
says so (``k3compile.structure_only``, ``k3compile.structure``). It passes the full check;
no runtime can run it without the weights. :func:`trace_source` traces either kind of
source: an artifact (``k3compile.export.trace``) or a structure.
"""

from __future__ import annotations

from pathlib import Path

import torch

from k3compile.export.trace import (
    ExportOptions,
    ModelStructure,
    TracedStep,
    check_plan,
    check_program,
    decode_example,
    export_step,
    load_exportable,
    trace_step,
)


def structure_metadata(structure: ModelStructure) -> dict:
    """What a structure-only export says of what it compiled (``k3compile.structure``)."""
    cfg = structure.config
    return {"num_hidden_layers": cfg.num_hidden_layers, "hidden_size": cfg.hidden_size, "num_experts": cfg.num_experts,
            "tp": structure.tp, "dcp": structure.dcp, "dcp_interleave": structure.dcp_interleave,
            "target": structure.target, "dtype": str(structure.dtype).removeprefix("torch.")}


def trace_structure(structure: ModelStructure, options: ExportOptions, target: str,
                    with_collectives: bool = True) -> TracedStep:
    """``structure`` compiled on meta (as ``k3compile plan``) and its decode program of
    ``options.rank`` traced as an export's :class:`TracedStep`, on meta tensors; refused for
    ``target`` (a format's name) as an artifact would be, before the compile where the plan
    alone decides."""
    from k3compile.batch import CacheShape, allocate_caches
    from k3compile.context_parallel import ContextLayout
    from k3compile.memory import MemoryOptions, plan_memory
    from k3compile.sequences import SequenceTable
    from k3compile.sharding import ParallelPlan

    if options.phase != "decode":
        raise ValueError(f"a structure-only export compiles the decode program only, not {options.phase}")
    memory = MemoryOptions(tp=structure.tp, dcp=structure.dcp, dcp_interleave=structure.dcp_interleave,
                           target=structure.target, dtype=structure.dtype, context=options.max_context,
                           sequences=options.max_sequences, block_size=structure.block_size,
                           kv_cache_dtype=structure.kv_cache_dtype)
    check_plan(options, structure.tp, structure.dcp, memory.block_size, structure.dtype, memory.mla_cache_dtype,
               target, "the model structure")
    program = plan_memory(structure.config, memory).program
    check_program(program.graph_module, options, target, with_collectives, structure.tp, structure.dcp)
    plan = ParallelPlan(structure.tp, options.rank, structure.dcp, structure.dcp_interleave)
    layout = ContextLayout.of(plan)
    shape = CacheShape.serving(options.max_sequences, layout.max_local_length(options.max_context),
                               memory.block_size)
    caches = allocate_caches(structure.config, plan, shape, structure.dtype, torch.device("meta"),
                             structure.kv_cache_dtype)
    example = decode_example(SequenceTable(structure.config.vocab_size, shape, reserved_slots=1, reserved_blocks=1,
                                            layout=layout))
    return export_step(program.module(), tuple(t.to("meta") for t in example), caches, options, structure.tp,
                       structure.dcp, structure_metadata(structure))


def lift_weights(model) -> list[str]:
    """Make every initializer of ``model`` (an ``onnx_ir`` model from ``torch.onnx.export``,
    not yet optimized) a graph input without a value; their names. Run before the
    exporter's optimizer, whose constant folding would read the values."""
    graph = model.graph
    names = list(graph.initializers)
    for name in names:
        value = graph.initializers.pop(name)
        value.const_value = None
        graph.inputs.append(value)
    return names


def trace_source(source: str | Path | ModelStructure, options: ExportOptions, target: str,
                 with_collectives: bool = True) -> TracedStep:
    """The traced step of ``source``, an artifact directory or a :class:`ModelStructure`
    (``k3compile.export.structure``), checked for ``target`` (a format's name) first."""
    if isinstance(source, ModelStructure):
        return trace_structure(source, options, target, with_collectives)
    return trace_step(load_exportable(source, options, target, with_collectives), options)
