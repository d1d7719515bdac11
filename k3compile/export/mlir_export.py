"""One rank's optimized decode or prefill program as an MLIR module (torch-mlir).

The program is re-traced as ``k3compile.export.trace`` describes, then imported by
torch-mlir's fx importer into the torch dialect (``torch-mlir``'s backend contract:
value-semantics tensors, ``torch.aten.*`` ops), and with ``dialect="linalg"`` lowered to
linalg-on-tensors as torch-mlir defines it (linalg, tensor, arith, math, and its own
``tm_tensor`` for scatter and sort). Either way the module holds one function named
after the phase:

    func.func @decode(input_ids, cu_seqlens, seq_lens, state_slots, block_table,
                      slot_mapping, logit_indices, cache ...) -> (logits, cache.next ...)

(``@prefill`` the same, with ``input_ids`` and ``slot_mapping`` of the packed tokens.)
The batch, the block table's width and a prefill's token count are dynamic (``?``); the
caches have the fixed shapes of ``ExportOptions``. The weights are embedded as dense resources. The module's
attributes name the arguments and results (``k3compile.inputs``, ``k3compile.outputs``:
arrays of strings) and map each cache output to its input (``k3compile.cache_outputs``:
a dictionary), next to ``k3compile.phase``, ``k3compile.rank`` and
``k3compile.cache_capacity``.

With ``ExportOptions(k3_ops="keep")`` (torch dialect only) every k3 op call stays one op,
``torch.operator "torch.k3.<name>"`` (``"torch.k3_functional.<name>"`` for the ops that
update a cache: ``k3compile.export.custom_ops``), and the module is the fx importer's
torch dialect as imported: torch-mlir's backend pipeline cannot take ops it has no shape
functions for, so it does not run, and nothing lowers the module to linalg. The attribute
``k3compile.k3_op_references`` names each kept op's torch reference.

A TP > 1 rank's collectives stay ``torch.operator "torch._c10d_functional.<name>"`` (and
their waits), in the torch dialect as imported, like kept k3 ops; the attribute
``k3compile.collectives`` describes their groups. Linalg has no collectives: refused.

Three things torch-mlir cannot take are handled before the import:

- a ``cond``: the GEMM dispatch branches on the token count at 16, so a decode exports
  at most 15 sequences, and a prefill is traced for 16 tokens or more (each ``cond``
  then runs the branch the range decides: ``k3compile.export.trace``);
- ``x[i, j]`` with two index tensors of dynamic shape, which its linalg lowering does
  not legalise: :func:`index_as_one_gather` makes it one gather on a flattened ``x``;
- ``a % b`` of sizes (the tiled GEMM's padding to 16 rows, taken by a prefill), which its
  importer makes ``aten.fmod.int``: no lowering, and C's sign rule instead of Python's.
  :func:`size_mod_as_floordiv` rewrites it ``a - b * (a // b)``.
"""

from __future__ import annotations

import operator
import tempfile
import time
import warnings
from pathlib import Path

import torch
from torch import Tensor

from k3compile.export.custom_ops import kept_calls, reference
from k3compile.export.trace import (
    ExportOptions,
    ExportResult,
    ModelStructure,
    TracedStep,
    check_output_path,
    load_exportable,
    move_into_place,
    trace_step,
)
from k3compile.model.gemm import FAST_MIN_TOKENS

#: the dialects ``export_mlir`` writes: torch-mlir's torch dialect, or its lowering to linalg-on-tensors
DIALECTS = ("torch", "linalg")


def export_mlir(artifact_dir: str | Path, out: str | Path, options: ExportOptions = ExportOptions(),
                dialect: str = "torch") -> ExportResult:
    """Write ``options.phase``'s program of ``options.rank`` as an MLIR module in
    ``dialect`` at ``out`` (module docstring), as text. The module is verified before it
    is moved into place, so a failed export leaves nothing behind."""
    if isinstance(artifact_dir, ModelStructure):
        raise ValueError("a structure-only export writes ONNX: an MLIR module embeds its weights, which a model "
                         "structure has none of")
    if dialect not in DIALECTS:
        raise ValueError(f"dialect: one of {', '.join(DIALECTS)}, got {dialect!r}")
    if options.external_data:
        raise ValueError("external_data is for ONNX: an MLIR module embeds its weights as dense resources")
    if options.k3_ops == "keep" and dialect != "torch":
        raise ValueError(f"kept k3 ops export to the torch dialect only: torch-mlir has no lowering of them to "
                         f"{dialect} (export with dialect torch, or decompose the k3 ops)")
    out = Path(out)
    check_output_path(out, ".mlir")
    _require_torch_mlir()
    start = time.perf_counter()
    artifact = load_exportable(artifact_dir, options, "MLIR" if dialect == "torch" else f"MLIR's {dialect} dialect",
                               with_collectives=dialect == "torch")
    _check_branches(artifact.programs[options.phase].graph_module, options)
    traced = trace_step(artifact, options, conds=False)
    module = _import(traced, options, dialect)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.") as tmp:
        (Path(tmp) / out.name).write_text(str(module))
        size = move_into_place(Path(tmp), out.parent)
    return ExportResult(out, time.perf_counter() - start, size, traced.inputs, traced.outputs, traced.cache_outputs,
                        traced.collectives)


def _require_torch_mlir() -> None:
    try:
        import torch_mlir  # noqa: F401
    except ImportError as e:
        raise ValueError("MLIR export needs torch-mlir: pip install 'k3compile[mlir]'") from e


def _check_branches(gm: torch.fx.GraphModule, options: ExportOptions) -> None:
    """Refuse a decode batch range in which the GEMM dispatch's ``cond`` is taken both ways
    (a prefill's token range starts where it is decided: ``trace.min_prefill_tokens``)."""
    if options.phase == "decode" and options.max_sequences >= FAST_MIN_TOKENS and any(
            n.target is torch.ops.higher_order.cond for n in gm.graph.nodes):
        raise ValueError(f"max_sequences {options.max_sequences}: the {options.phase} program picks its GEMM by the "
                         f"batch (the tiled GEMM from {FAST_MIN_TOKENS} tokens, k3compile/model/gemm.py), a branch "
                         "taken at run time that torch-mlir cannot import: export at most "
                         f"{FAST_MIN_TOKENS - 1} sequences for MLIR")


def index_as_one_gather(x: Tensor, indices: list[Tensor | None]) -> Tensor:
    """``aten.index.Tensor`` with k >= 2 integer index tensors on the leading dims as one
    index tensor into ``x`` flattened over those dims (negative indices wrapped first);
    ``NotImplemented`` (no decomposition) for every other indexing."""
    if len(indices) < 2 or any(i is None or i.dtype in (torch.bool, torch.uint8) for i in indices):
        return NotImplemented
    flat = None
    for dim, index in enumerate(indices):
        index = torch.where(index < 0, index + x.shape[dim], index).long()
        flat = index if flat is None else flat * x.shape[dim] + index
    return x.reshape(-1, *x.shape[len(indices):])[flat]


def size_mod_as_floordiv(gm: torch.fx.GraphModule) -> int:
    """Rewrite every ``a % b`` of sizes (SymInt arithmetic) in ``gm`` and its submodules as
    ``a - b * (a // b)``, which is Python's ``%``; the number rewritten."""
    count = 0
    for module in gm.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        graph = module.graph
        for node in [n for n in graph.nodes if n.op == "call_function" and n.target is operator.mod]:
            a, b = node.args
            values = [x.meta["val"] if isinstance(x, torch.fx.Node) else x for x in (a, b)]
            with graph.inserting_before(node):
                quotient = graph.call_function(operator.floordiv, (a, b))
                product = graph.call_function(operator.mul, (b, quotient))
                remainder = graph.call_function(operator.sub, (a, product))
            quotient.meta["val"] = values[0] // values[1]
            product.meta["val"] = values[1] * quotient.meta["val"]
            remainder.meta["val"] = node.meta["val"]
            node.replace_all_uses_with(remainder)
            graph.erase_node(node)
            count += 1
        module.recompile()
    return count


def _import(traced: TracedStep, options: ExportOptions, dialect: str):
    """The traced program as a verified torch-mlir module in ``dialect``, with the
    ``k3compile.*`` attributes."""
    from torch_mlir import fx
    from torch_mlir.compiler_utils import OutputType, lower_mlir_module
    from torch_mlir.extras.fx_decomp_util import get_decomposition_table

    table = {**get_decomposition_table(), torch.ops.aten.index.Tensor: index_as_one_gather}
    cond = [n for n in traced.program.graph.nodes if n.target is torch.ops.higher_order.cond]
    if cond:  # _check_branches refuses the ranges known to leave one
        raise ValueError(f"the traced program still holds {len(cond)} cond(s), which torch-mlir cannot import")
    with warnings.catch_warnings():  # torch's own, from inside run_decompositions: nothing a user can act on
        warnings.filterwarnings("ignore", r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning)
        raw = options.k3_ops == "keep" or traced.collectives  # ops the backend pipeline has no shape functions for
        program = traced.program.run_decompositions(table)
        size_mod_as_floordiv(program.graph_module)
        module = fx.export_and_import(program, output_type="raw" if raw else "torch", func_name=options.phase,
                                      decomposition_table={})  # decomposed above
    with module.context:
        for key, value in _attributes(traced, options).items():
            module.operation.attributes[f"k3compile.{key}"] = value
    if dialect == "linalg":
        lower_mlir_module(False, OutputType.LINALG_ON_TENSORS, module)
    module.operation.verify()
    return module


def _attributes(traced: TracedStep, options: ExportOptions) -> dict:
    """The module's ``k3compile.*`` attributes (module docstring), as MLIR attributes."""
    from torch_mlir import ir

    def strings(names):
        return ir.ArrayAttr.get([ir.StringAttr.get(n) for n in names])

    def integer(value: int):
        return ir.IntegerAttr.get(ir.IntegerType.get_signless(64), value)

    def value(v):
        if isinstance(v, dict):
            return ir.DictAttr.get({k: value(x) for k, x in v.items()})
        if isinstance(v, list):
            return ir.ArrayAttr.get([value(x) for x in v])
        return integer(v) if isinstance(v, int) else ir.StringAttr.get(v)

    kept = sorted(set(kept_calls(traced.program)))
    references = {"k3_op_references": value({n: reference(n) for n in kept})} if kept else {}
    if traced.collectives:  # the ONNX domain aside
        references["collectives"] = value({k: v for k, v in traced.collectives.items() if k not in ("domain", "version")})
    return {
        **references, "k3_ops": ir.StringAttr.get(options.k3_ops),
        "phase": ir.StringAttr.get(options.phase), "rank": integer(options.rank),
        "inputs": strings(traced.inputs), "outputs": strings(traced.outputs),
        "cache_outputs": ir.DictAttr.get({k: ir.StringAttr.get(v) for k, v in traced.cache_outputs.items()}),
        "cache_capacity": ir.DictAttr.get({"max_sequences": integer(options.max_sequences),
                                           "max_context": integer(options.max_context)}),
    }
