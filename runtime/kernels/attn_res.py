"""The Attention Residuals mix in one launch, alone or with the RMSNorm that follows it.

Semantics are those of ``torch.ops.k3.attn_res_mix`` and ``torch.ops.k3.attn_res_mix_norm``
(k3compile/ops/attn_res.py, whose torch references are the numerical truth). The
reference is about fifteen launches on a GPU (stack, casts, square, mean, rsqrt, products,
sums, softmax, weighted sum, cast back), each over a few KB at decode; K3 runs two mixes
per layer and one before the head.

``_attn_res_mix_kernel``: one program per token row, the row (K3: 7168 wide) held in
registers across up to 16 warps. The candidates ``[*blocks, partial]`` arrive as a tuple of
pointers (one specialisation per candidate count; K3 has at most 9) and are read once
each, by an online softmax over candidates: for each v_i, the logit
``<v_i, norm_w * proj_w> * rsqrt(mean(v_i^2) + eps)`` (the reference's score, its
normalisation factored out of the sum; both sums in one paired reduction), then the
running maximum, the rescaled sum of weights and the rescaled weighted sum of the raw
v_i. With ``NORM`` the mix is rounded to the activation dtype (what the reference stores
between its two ops) and normalised by RMSNorm with its own weight and eps before one
store.

At decode a mix is a few rows: its time is memory latency, not bandwidth. Reading each
candidate's whole row in one unrolled load (all candidates in flight together) takes one
round trip to memory; walking the row in chunks took one per chunk and candidate (a first
version with 1,024-column chunks: 10.8 us per mix at batch 1 in the slice's graph replay).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from k3compile.ops import attn_res as attn_res_ops
from k3compile.runtime.kernels import counted
from k3compile.runtime.kernels.aot import TRITON_DTYPES, KernelLaunch, launch_signature

#: candidates one launch takes (K3: 8 finished blocks + the partial sum); beyond, the reference
MAX_CANDIDATES = 16
#: rows wider than this are left to the reference: a row is held in registers, at most
#: VALUES_PER_THREAD values of each candidate per thread (16 warps at 8,192)
MAX_WIDTH = 8192
VALUES_PER_THREAD = 16


@triton.jit
def _add_pairs(a_dot, a_sq, b_dot, b_sq):
    return a_dot + b_dot, a_sq + b_sq


@counted
@triton.jit
def _attn_res_mix_kernel(cands, proj_ptr, score_norm_ptr, norm_ptr, out_ptr, width, eps, norm_eps,
                         N: tl.constexpr, BLOCK: tl.constexpr, NORM: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    score_w = (tl.load(proj_ptr + cols, mask=mask, other=0.0).to(tl.float32)
               * tl.load(score_norm_ptr + cols, mask=mask, other=0.0).to(tl.float32))
    best = float("-inf")
    total = 0.0
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in tl.static_range(N):  # unrolled: the candidates' loads are independent, all in flight at once
        v = tl.load(cands[i] + row * width + cols, mask=mask, other=0.0).to(tl.float32)
        dot, sq = tl.reduce((v * score_w, v * v), 0, _add_pairs)  # one reduction (one barrier) for both
        logit = dot / tl.sqrt(sq / width + eps)
        new_best = tl.maximum(best, logit)
        rescale = tl.exp(best - new_best)
        p = tl.exp(logit - new_best)
        acc = acc * rescale + p * v
        total = total * rescale + p
        best = new_best
    mixed = (acc / total).to(out_ptr.dtype.element_ty)
    if NORM:
        y = mixed.to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(y * y, axis=0) / width + norm_eps)
        w = tl.load(norm_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        mixed = (y * inv * w).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * width + cols, mixed, mask=mask)


def _reference_takes_it(partial: Tensor, blocks: list[Tensor]) -> bool:
    """Inputs the kernel does not take (the reference computes them)."""
    return len(blocks) + 1 > MAX_CANDIDATES or partial.shape[-1] > MAX_WIDTH or partial.dtype not in TRITON_DTYPES


def _constexprs(n: int, width: int, norm: bool) -> dict[str, object]:
    return {"N": n, "BLOCK": triton.next_power_of_2(width), "NORM": norm}


def _num_warps(width: int) -> int:
    """Warps for one row: VALUES_PER_THREAD values of it per thread (K3's 7168: 16 warps)."""
    return max(1, min(16, triton.next_power_of_2(width) // (32 * VALUES_PER_THREAD)))


def _launch(partial: Tensor, blocks: list[Tensor], proj: Tensor, norm: Tensor, eps: float,
            weight: Tensor | None, norm_eps: float) -> Tensor:
    width = partial.shape[-1]
    for i, b in enumerate(blocks):
        if b.shape != partial.shape or b.dtype != partial.dtype:
            raise ValueError(f"attn_res_mix: block {i} is {b.dtype} {tuple(b.shape)}, the partial sum "
                             f"{partial.dtype} {tuple(partial.shape)}: candidates must match")
    for name, w in (("proj", proj), ("norm", norm), ("weight", weight)):
        if w is not None and w.numel() != width:
            raise ValueError(f"attn_res_mix: {name} has {w.numel()} elements for rows of width {width}")
    cands = tuple(t.reshape(-1, width).contiguous() for t in (*blocks, partial))
    out = torch.empty_like(cands[-1])
    if out.shape[0]:
        _attn_res_mix_kernel[(out.shape[0],)](
            cands, proj.contiguous(), norm.contiguous(), (weight if weight is not None else norm).contiguous(),
            out, width, float(eps), float(norm_eps), **_constexprs(len(cands), width, weight is not None),
            num_warps=_num_warps(width))
    return out.view(partial.shape)


def attn_res_mix(partial: Tensor, blocks: list[Tensor], proj: Tensor, norm: Tensor, eps: float) -> Tensor:
    """``k3::attn_res_mix`` in one launch (the reference beyond ``MAX_CANDIDATES`` / ``MAX_WIDTH``)."""
    if _reference_takes_it(partial, blocks):
        return attn_res_ops.attn_res_mix_reference(partial, blocks, proj, norm, eps)
    return _launch(partial, blocks, proj, norm, eps, None, 0.0)


def attn_res_mix_norm(partial: Tensor, blocks: list[Tensor], proj: Tensor, norm: Tensor, eps: float,
                      weight: Tensor, norm_eps: float) -> Tensor:
    """``k3::attn_res_mix_norm`` in one launch (the reference beyond ``MAX_CANDIDATES`` / ``MAX_WIDTH``)."""
    if _reference_takes_it(partial, blocks):
        mixed = attn_res_ops.attn_res_mix_reference(partial, blocks, proj, norm, eps)
        return torch.ops.k3.rms_norm(mixed, weight, norm_eps)
    return _launch(partial, blocks, proj, norm, eps, weight, norm_eps)


def register_kernels(device_type: str) -> None:
    """Use these kernels for ``k3::attn_res_mix`` and ``k3::attn_res_mix_norm`` on
    ``device_type`` tensors (registering again replaces the same functions)."""
    attn_res_ops.attn_res_mix.register_kernel(device_type)(attn_res_mix)
    attn_res_ops.attn_res_mix_norm.register_kernel(device_type)(attn_res_mix_norm)


def aot_launch(n: int, norm: bool, width: int = 7168, dtype: torch.dtype = torch.bfloat16) -> KernelLaunch:
    """The mix of ``n`` candidates (with the norm after it: ``norm``) as the launcher
    specialises it for rows of ``width``, for AOT checks."""
    t = TRITON_DTYPES[dtype]
    c = _constexprs(n, width, norm)
    types = {"cands": (f"*{t}",) * n, "proj_ptr": f"*{t}", "score_norm_ptr": f"*{t}", "norm_ptr": f"*{t}",
             "out_ptr": f"*{t}", "eps": "fp32", "norm_eps": "fp32"}
    return KernelLaunch(f"attn_res_mix N={n} norm={norm}", _attn_res_mix_kernel,
                        launch_signature(_attn_res_mix_kernel, types, c), c, _num_warps(width))


def aot_requests(width: int = 7168, dtype: torch.dtype = torch.bfloat16) -> list[KernelLaunch]:
    """The mix with the norm at K3's extremes of candidates (2: the first mix after the
    embedding's block; 9: the last layers), at K3's hidden size; and the plain mix at 5
    candidates (K3's default pipeline fuses every mix with its norm; on sm_90 ptxas hoists
    every candidate's load of the plain mix and spills from 7 candidates)."""
    return [aot_launch(n, norm, width, dtype) for n, norm in ((2, True), (9, True), (5, False))]
