"""Runs a linalg-on-tensors module of ``export_mlir`` on the CPU, with torch-mlir's
execution engine.

torch-mlir's wheel has no reference backend, so :data:`PIPELINE` lowers the module to
LLVM itself. It uses upstream passes, and three of torch-mlir's own: ``tm-tensor-*`` for
its ``tm_tensor`` ops, and ``refback-munge-memref-copy``, which turns copies into loops
(the wheel lacks the runtime library that implements ``memref.copy``). Elementwise ops
are fused first: LLVM's compile time grows faster than linearly in the number of loops
of a function.

The function keeps its calling convention: ``llvm.emit_c_interface`` gives it a C
wrapper that takes a pointer to a struct of the results' memref descriptors, then one
pointer per argument's descriptor. Each result is a buffer the function allocated (the
deallocation pipeline hands the caller ownership of returned buffers): it is copied into
a numpy array and freed.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping
from pathlib import Path

import numpy as np

PASSES = (
    "func.func(linalg-generalize-named-ops)", "func.func(linalg-fuse-elementwise-ops)", "canonicalize", "cse",
    "func.func(tm-tensor-bufferize)",
    "one-shot-bufferize{copy-before-write bufferize-function-boundaries "
    "function-boundary-type-conversion=identity-layout-map}",
    "buffer-deallocation-pipeline", "convert-bufferization-to-memref",
    "func.func(tm-tensor-to-loops)", "func.func(refback-munge-memref-copy)", "convert-linalg-to-loops",
    "expand-strided-metadata", "lower-affine", "convert-scf-to-cf", "func.func(arith-expand)",
    "convert-math-to-llvm", "convert-math-to-libm", "finalize-memref-to-llvm", "convert-arith-to-llvm",
    "convert-func-to-llvm", "convert-cf-to-llvm", "reconcile-unrealized-casts",
)
PIPELINE = f"builtin.module({','.join(PASSES)})"

#: MLIR element types and the numpy dtypes of their arrays
DTYPES = {"f64": np.float64, "f32": np.float32, "f16": np.float16, "i64": np.int64, "i32": np.int32,
          "i16": np.int16, "i8": np.int8, "i1": np.bool_}


class LinalgModule:
    """A linalg-on-tensors ``.mlir`` file written by ``export_mlir``, compiled for this CPU.

    ``run`` takes and returns arrays by the names of the module's ``k3compile.inputs`` and
    ``k3compile.outputs``; ``metadata`` holds its ``k3compile.*`` attributes."""

    def __init__(self, path: str | Path):
        from torch_mlir import ir
        from torch_mlir.dialects import torch as torch_d
        from torch_mlir.execution_engine import ExecutionEngine
        from torch_mlir.passmanager import PassManager
        from torch_mlir.runtime import np_to_memref

        context = ir.Context()
        torch_d.register_dialect(context)
        with context:
            # tm_tensor has no registration of its own in the Python bindings: it is loaded
            # as a dependent dialect of the torch-mlir pass that emits it
            PassManager.parse("builtin.module(func.func(convert-torch-to-tmtensor))").run(
                ir.Module.parse("module {}").operation)
            module = ir.Module.parse(Path(path).read_text())
            attributes = module.operation.attributes
            self.metadata = {n: _python(attributes[n]) for n in attributes if n.startswith("k3compile.")}
            (func,) = [op for op in module.body.operations if op.operation.name == "func.func"]
            self.name = ir.StringAttr(func.attributes["sym_name"]).value
            signature = ir.FunctionType(ir.TypeAttr(func.attributes["function_type"]).value)
            if any(str(t).startswith("!torch.") for t in signature.inputs):
                raise ValueError(f"{path}: a torch-dialect module; export it with --dialect linalg to run it")
            self._arguments = [_spec(t) for t in signature.inputs]
            self._results = [_spec(t) for t in signature.results]
            func.attributes["llvm.emit_c_interface"] = ir.UnitAttr.get()
            PassManager.parse(PIPELINE).run(module.operation)
        self.inputs: list[str] = self.metadata["k3compile.inputs"]
        self.outputs: list[str] = self.metadata["k3compile.outputs"]
        if (len(self.inputs), len(self.outputs)) != (len(self._arguments), len(self._results)):
            raise ValueError(f"{path}: k3compile.inputs / outputs do not name every argument and result")
        descriptors = [np_to_memref.make_nd_memref_descriptor(len(shape), np_to_memref.as_ctype(np.dtype(dtype)))
                       for dtype, shape in self._results]
        self._results_struct = type("Results", (ctypes.Structure,),
                                    {"_fields_": [(f"r{i}", d) for i, d in enumerate(descriptors)]})
        self._free = ctypes.CDLL(None).free  # the C library's: the compiled code allocates with its malloc
        self._free.argtypes = [ctypes.c_void_p]
        self._engine = ExecutionEngine(module, opt_level=0, shared_libs=[])
        self._engine.lookup(self.name)  # compiles it now, not at the first run

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One call of the function on ``feeds`` (every input by name): every output by name."""
        from torch_mlir.runtime import np_to_memref

        if set(feeds) != set(self.inputs):
            raise ValueError(f"inputs: expected {self.inputs}, got {list(feeds)}")
        arrays = [np.ascontiguousarray(feeds[n]) for n in self.inputs]
        for name, array, (dtype, shape) in zip(self.inputs, arrays, self._arguments, strict=True):
            if array.dtype != dtype or len(array.shape) != len(shape) or any(
                    want is not None and want != got for want, got in zip(shape, array.shape)):
                raise ValueError(f"{name}: expected {np.dtype(dtype).name} {_shape(shape)}, got "
                                 f"{array.dtype.name} {list(array.shape)}")
        results = self._results_struct()
        arguments = [ctypes.pointer(ctypes.pointer(np_to_memref.get_ranked_memref_descriptor(a))) for a in arrays]
        self._engine.invoke(self.name, ctypes.pointer(ctypes.pointer(results)), *arguments)
        outputs, buffers = {}, set()
        for i, name in enumerate(self.outputs):
            descriptor = getattr(results, f"r{i}")
            outputs[name] = np.array(np_to_memref.ranked_memref_to_numpy(ctypes.pointer(descriptor)))
            buffers.add(descriptor.allocated)
        for buffer in buffers - {a.ctypes.data for a in arrays}:
            self._free(buffer)
        return outputs


def _spec(tensor_type) -> tuple[type, list[int | None]]:
    """A ranked tensor type's numpy dtype and shape (None: dynamic)."""
    from torch_mlir import ir

    t = ir.RankedTensorType(tensor_type)
    if str(t.element_type) not in DTYPES:
        raise ValueError(f"{t}: the runner takes {', '.join(DTYPES)} tensors (numpy has no {t.element_type}): "
                         "export an artifact compiled with --dtype float32")
    return DTYPES[str(t.element_type)], [None if ir.ShapedType.is_dynamic_size(d) else d for d in t.shape]


def _shape(shape: list[int | None]) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"


def _python(attr):
    """A string, integer, array or dictionary attribute as its Python value; else its text."""
    from torch_mlir import ir

    if isinstance(attr, ir.ArrayAttr):
        return [_python(attr[i]) for i in range(len(attr))]
    if isinstance(attr, ir.DictAttr):
        return {attr[i].name: _python(attr[i].attr) for i in range(len(attr))}
    if isinstance(attr, ir.StringAttr | ir.IntegerAttr):
        return attr.value
    return str(attr)
