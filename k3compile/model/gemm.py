"""A GEMM dispatch written the way serving code writes it: stage, then branch.

    staged = zeros(rows rounded up to 16, K); staged[:T] = x    # a copy, made for the fast path
    y = cond(tokens >= 16, tiled_gemm(staged), gemv(x))         # the fallback never reads it

Why the copy exists: a tiled GEMM kernel reads whole 16-row tiles of its input, so the
fast path needs the activations in a staging buffer padded to a multiple of 16 rows (a
packed, contiguous layout it can load without row masks). Serving code prepares that
buffer before it decides which kernel to run, because the preparation is written next
to the kernel's requirements and not next to the decision. At decode (a few tokens) the
dispatch takes the GEMV fallback, which reads the original input: the staging copy is
one wasted kernel launch per call. Production found 69 of them per decode step (one per
KDA layer); the ``sink_copies`` pass moves the copy into the branch that reads it.

Both branches are real and compute the same product (the padded rows are zeros and
are sliced away): on a GPU backend they map to different kernels (a tiled GEMM and a
GEMV); in the torch reference both are ``F.linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

#: Rows per tile of the fast GEMM, and the fewest tokens for which it beats the GEMV.
TILE_ROWS = 16
FAST_MIN_TOKENS = 16


def _tiled_gemm(x: Tensor, weight: Tensor, staged: Tensor):  # no return annotation: FX would print it
    """The fast path: whole 16-row tiles of the padded staging buffer, padding sliced off."""
    return (F.linear(staged, weight)[: x.shape[0]],)


def _gemv(x: Tensor, weight: Tensor, staged: Tensor):
    """The fallback for a few tokens: reads the original input, not the staging copy."""
    return (F.linear(x, weight),)


def dispatch_linear(x: Tensor, weight: Tensor) -> Tensor:
    """``F.linear(x, weight)`` for a 2-D ``x`` through the staged fast path / fallback.

    On concrete sizes the branch runs directly (as ``torch.cond`` does with a Python bool).
    On a symbolic size (capture) the ``cond`` operator is called itself: ``torch.cond``
    would first compile its branches with Dynamo, about 0.3 s a call, 69 calls in the
    full model; the operator traces the two branch functions directly into the same
    graph (operands, one-tuple outputs and their ``getitem`` as Dynamo lifts them)."""
    tokens = x.shape[0]
    staged = x.new_zeros(tokens + (-tokens) % TILE_ROWS, x.shape[1])  # the staging buffer
    staged = torch.slice_scatter(staged, x, 0, 0, tokens)
    fast = tokens >= FAST_MIN_TOKENS
    if isinstance(fast, bool):
        return (_tiled_gemm if fast else _gemv)(x, weight, staged)[0]
    return torch.ops.higher_order.cond(fast, _tiled_gemm, _gemv, (x, weight, staged))[0]
