"""Exports of an artifact's optimized programs to other toolchains (issue #25).

``export_onnx``: one rank's decode or prefill program as an ONNX model whose k3 ops are
decomposed into standard operators (``decompositions``, ``prefill_decompositions``) and
whose caches are inputs and outputs. ``export_mlir``: the
same program as an MLIR module, in torch-mlir's torch dialect or lowered to
linalg-on-tensors, which ``LinalgModule`` runs on the CPU (docs/export.md). With
``ExportOptions(k3_ops="keep")`` the k3 ops stay custom ops instead
(``k3compile.export.custom_ops``). A TP > 1 rank's program keeps its collectives
(``k3compile.export.collectives``). ``export_onnx`` of a ``ModelStructure`` compiles a
config on meta and writes its graph without weights (``k3compile.export.structure``).
"""

from k3compile.export.mlir_export import export_mlir
from k3compile.export.mlir_run import LinalgModule
from k3compile.export.onnx_export import export_onnx
from k3compile.export.trace import ExportOptions, ExportResult, ModelStructure

__all__ = ["ExportOptions", "ExportResult", "LinalgModule", "ModelStructure", "export_mlir", "export_onnx"]
