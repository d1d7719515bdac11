"""Exports of an artifact's optimized programs to other toolchains (issue #25).

``export_onnx``: one rank's decode program as an ONNX model whose k3 ops are decomposed
into standard operators and whose caches are inputs and outputs (docs/export.md).
"""

from k3compile.export.onnx_export import ExportOptions, ExportResult, export_onnx

__all__ = ["ExportOptions", "ExportResult", "export_onnx"]
