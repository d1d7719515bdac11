"""Triton 3.9's interpreter, made fast enough to run kernels at K3's per-rank shapes on CPU.

The interpreter runs a grid's programs one after the other, each ``tl`` operation as numpy
work plus Python-side type checks. Three of its costs do not change what a kernel computes
and are removed here (a context manager, undone on exit):

- ``tl.reduce`` with a combine function of the kernel's own (KDA's paired sums): the
  interpreter calls the combine function once per ELEMENT (a [128, 16] state tile: 2,048
  calls of ~0.5 ms each). Here it is called once per halving of the reduced axis on whole
  arrays (log2(n) calls), a tree as a GPU reduces: the same fp32 additions in another
  order. (tl.sum, tl.max and the like already take numpy's reductions.)
- Every call of a ``@triton.jit`` helper (``tl.sum`` and ``tl.sigmoid`` included) patches
  ``triton.language`` again for the helper (~200 attribute sets); the launch already did.
  Here a launch patches each set of language modules once.
- Integer overflow checks (``sanitize_overflow``): every int32 add / mul is redone in int64
  and compared with the int32 range, half the interpreter's time on index arithmetic.
  At the shapes the K3-shape tests run (one layer, small batch and context) no offset comes
  near 2^31; the toy-shape tests keep the checks (``overflow_checks=True``).

On the 2-core CI machine under load, a K3-shape KDA launch at batch 1 (96 programs) took
13 s with these instead of 120 s, the split-K rows GEMV at K3's TP8 shape (840 programs)
23 s instead of 42 s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import triton.language as tl
from triton.runtime import interpreter as ti


def _tree_reduce(self: ti.ReduceOps, inputs: tuple[tl.tensor, ...]) -> list[tl.tensor]:
    """``ReduceOps.generic_reduce`` by halves of the axis: the combine function on whole arrays."""
    original_axis = self.axis
    inputs, axis = self.unravel(inputs, self.axis)
    input_shape = inputs[0].handle.data.shape
    data = [t.handle.data for t in inputs]
    dtypes = [t.dtype for t in inputs]
    while data[0].shape[axis] > 1:
        n = data[0].shape[axis]
        half = n // 2
        low = [self.to_tensor(np.take(d, np.arange(half), axis=axis), t) for d, t in zip(data, dtypes)]
        high = [self.to_tensor(np.take(d, np.arange(half, 2 * half), axis=axis), t) for d, t in zip(data, dtypes)]
        out = self.combine_fn.fn(*low, *high)
        out = out if isinstance(out, tuple) else (out,)
        merged = [o.handle.data.astype(d.dtype) for o, d in zip(out, data)]
        if n % 2:  # the odd element joins the next round
            merged = [np.concatenate([m, np.take(d, [n - 1], axis=axis)], axis=axis) for m, d in zip(merged, data)]
        data = merged
    results = []
    for d, t in zip(data, dtypes):  # packed as generic_reduce packs them
        d = np.squeeze(d, axis=axis)
        if self.keep_dims:
            d = np.expand_dims(d, axis) if original_axis is not None else d.reshape((1,) * len(input_shape))
        elif original_axis is None:
            d = d.item()
        results.append(self.to_tensor(d, t))
    return results


def _patchable() -> bool:
    """Whether this Triton's interpreter has what :func:`fast_interpreter` replaces."""
    builder = getattr(ti, "interpreter_builder", None)
    return (hasattr(ti, "_patch_lang") and hasattr(ti.ReduceOps, "generic_reduce")
            and hasattr(ti.GridExecutor, "__call__") and dataclasses.is_dataclass(getattr(builder, "options", None))
            and hasattr(builder.options, "sanitize_overflow"))


class _Patched:
    """A no-op patch scope: the languages were patched for this launch already."""

    def restore(self) -> None:
        pass


@contextlib.contextmanager
def fast_interpreter(overflow_checks: bool = False) -> Iterator[None]:
    """The interpreter with the patches of the module docstring (the integer overflow
    checks only without ``overflow_checks``), restored on exit. On a Triton whose
    interpreter lacks the internals patched here (written against 3.9), the plain, slower
    interpreter runs instead."""
    if not _patchable():
        yield
        return
    patch_lang = ti._patch_lang
    grid_call = ti.GridExecutor.__call__
    patched: set[frozenset[int]] = set()  # language module sets patched during the current launch

    def patch_once(fn: Any) -> Any:
        langs = frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and (v is tl or v is tl.core))
        if langs in patched:
            return _Patched()
        scope = patch_lang(fn)
        patched.add(langs)
        return scope

    def launch(self: ti.GridExecutor, *args: Any, **kwargs: Any) -> Any:
        patched.clear()  # the launch's own patch scope is restored when it ends
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            patched.clear()

    builder = ti.interpreter_builder
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ti.ReduceOps, "generic_reduce", _tree_reduce)
        mp.setattr(ti, "_patch_lang", patch_once)
        mp.setattr(ti.GridExecutor, "__call__", launch)
        mp.setattr(builder, "options", dataclasses.replace(builder.options, sanitize_overflow=overflow_checks))
        yield
