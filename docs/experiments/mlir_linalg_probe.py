"""A probe, not a feature: torch-mlir's fx importer to linalg-on-tensors, lowered by an
upstream pipeline and run by torch-mlir's execution engine (the wheel has no reference
backend). docs/export.md, "MLIR: the route, checked by a probe".

    pip install torch-mlir            # 20261001 for CPython 3.11 was used
    python docs/experiments/mlir_linalg_probe.py    # prints the max error against torch
"""

import ctypes

import numpy as np
import torch
from torch_mlir import fx, ir
from torch_mlir.execution_engine import ExecutionEngine
from torch_mlir.passmanager import PassManager
from torch_mlir.runtime import np_to_memref as nm

PIPELINE = ("builtin.module(one-shot-bufferize{bufferize-function-boundaries "
            "function-boundary-type-conversion=identity-layout-map},buffer-deallocation-pipeline,"
            "convert-linalg-to-loops,expand-strided-metadata,lower-affine,convert-scf-to-cf,convert-math-to-llvm,"
            "convert-math-to-libm,finalize-memref-to-llvm,convert-arith-to-llvm,convert-func-to-llvm,"
            "convert-cf-to-llvm,reconcile-unrealized-casts)")


class Probe(torch.nn.Module):
    def forward(self, x, y):
        return torch.tanh(x @ y) + 1


x, y = torch.randn(3, 4), torch.randn(4, 5)
module = fx.export_and_import(Probe(), x, y, output_type="linalg-on-tensors", func_name="main")
with module.context:
    for op in module.body.operations:
        op.attributes["llvm.emit_c_interface"] = ir.UnitAttr.get()
    PassManager.parse(PIPELINE).run(module.operation)
engine = ExecutionEngine(module, opt_level=2, shared_libs=[])
result = ctypes.pointer(ctypes.pointer(nm.make_nd_memref_descriptor(2, nm.as_ctype(np.float32))()))
args = [ctypes.pointer(ctypes.pointer(nm.get_ranked_memref_descriptor(t.numpy()))) for t in (x, y)]
engine.invoke("main", result, *args)
print("max error", float(np.abs(nm.ranked_memref_to_numpy(result[0]) - Probe()(x, y).numpy()).max()))
