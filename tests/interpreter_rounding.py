"""Triton's interpreter rounding like a GPU: fp32 -> bf16 and fp32 -> fp8 to nearest even.

Triton 3.9's interpreter converts fp32 -> bf16 by truncation (``_convert_float`` without a
rounding mode) and fp32 -> fp8 with a carry bug (a value that rounds up into the next
binade, 125 -> 128 in E4M3, lands on the binade's first value, 64). GPUs (and torch) round
both to nearest even: inside :func:`rounds_like_gpus` the interpreter does so, through
torch's conversions, so kernels that round to the model dtype or write FP8 codes compare
exactly with their references. Used by conftest's ``interpreter_rounds_like_gpus`` fixture
and by spawned ranks that run kernels interpreted (tests/test_triton_cpu.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import torch
import triton.language as tl
from triton.runtime import interpreter

_TORCH_DTYPES = {tl.bfloat16: torch.bfloat16, tl.float8e4nv: torch.float8_e4m3fn, tl.float8e4b8: torch.float8_e4m3fnuz}


def _rounded(src, dst_type):
    """``src`` (fp32) converted by torch to ``dst_type``, or None for other conversions."""
    if src.dtype.scalar != tl.float32 or dst_type.scalar not in _TORCH_DTYPES:
        return None
    data = torch.from_numpy(np.ascontiguousarray(src.data)).to(_TORCH_DTYPES[dst_type.scalar])
    bits = torch.int16 if dst_type.scalar == tl.bfloat16 else torch.uint8
    return interpreter.TensorHandle(data.view(bits).numpy().view(interpreter._get_np_dtype(dst_type)),
                                    dst_type.scalar)


@contextmanager
def rounds_like_gpus() -> Iterator[None]:
    cast_impl, fp_to_fp = interpreter.InterpreterBuilder.cast_impl, interpreter.InterpreterBuilder.create_fp_to_fp

    def cast(self, src, dst_type):
        out = _rounded(src, dst_type)
        return cast_impl(self, src, dst_type) if out is None else out

    def convert(self, src, dst_type, rounding_mode):
        out = _rounded(src, dst_type)
        return fp_to_fp(self, src, dst_type, rounding_mode) if out is None else out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(interpreter.InterpreterBuilder, "cast_impl", cast)
        mp.setattr(interpreter.InterpreterBuilder, "create_fp_to_fp", convert)
        yield
