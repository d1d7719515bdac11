"""Fused single-token KDA decode: the launcher of ``kda_decode_kernel`` (everything
between the projections and ``o_proj`` in one launch) and ``k3::kda_decode_fused``'s
kernel registration.

The kernel and its algorithm are in ``kda_decode_kernel.py``, its launch plans (value
tile, tiles per program, warps, stages, the evict-first hint, programmatic dependent
launch) and the bytes a step moves in ``kda_decode_plans.py``. The launcher checks its
arguments, takes the plan for the batch and the device (``kda_decode_plans.launch_config``)
and launches the kernel once.

Slots are the caller's contract, as for the unfused ops: distinct within a launch and in
range (checking would cost a device sync). The arrival counters are a per-device workspace
shared by launches: do not run two of these kernels concurrently on different streams of one
device. The first launch on a device allocates the counters (4096, grown for B*H beyond), so run
once at the largest batch before capturing CUDA graphs (warm-up does); buffers are never freed,
as captured graphs keep their addresses.

On CPU the launcher runs only under the Triton interpreter: ``TRITON_INTERPRET=1`` set before
triton is first imported in the process (triton.language's own jit functions, ``tl.sum`` and
``tl.sigmoid``, are built then). The runtime uses the torch reference on CPU
(``k3compile.ops.kda_fused.kda_decode_chain_reference``, the op's default implementation)
unless asked for the Triton kernels there (``RuntimeOptions.kernels="triton"``).

:func:`register_kernels` makes :func:`kda_decode_fused_op` (argument preparation, then this
launcher) the implementation of ``k3::kda_decode_fused`` on a device type.
"""

from __future__ import annotations

import torch
import triton
from torch import Tensor

from k3compile.ops import kda_fused as fused_op
from k3compile.runtime.kernels.counters import ArrivalCounters
from k3compile.runtime.kernels.kda_decode_kernel import kda_decode_kernel
from k3compile.runtime.kernels.targets import compute_units, device_target, register_cap
from k3compile.runtime.kernels.kda_decode_plans import (
    _constexprs,
    _is_power_of_two,
    launch_config,
    launch_grid,
    supports_pdl,
)
from k3compile.runtime.weight_layout import column_blocks, consecutive_rows

__all__ = ["kda_decode_fused", "kda_decode_fused_op", "kda_decode_fused_proj_op", "register_kernels"]

MODEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_counters = ArrivalCounters("kda_decode_fused")


# --------------------------------------------------------------------------- checks


def _dtype_names(dtypes: tuple[torch.dtype, ...]) -> str:
    return " or ".join(str(d).removeprefix("torch.") for d in dtypes)


#: the activations the kernel reads with a row stride (each row's elements contiguous)
ROW_STRIDED = ("q", "k", "v", "a", "beta", "gate")


def _expect(
    name: str, t: object, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...], device: torch.device
) -> None:
    """Raise ValueError naming ``name`` unless t is a tensor of this shape, dtype, device,
    contiguous (for :data:`ROW_STRIDED` activations: each row contiguous, rows at any stride)."""
    if not isinstance(t, Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must be {_dtype_names(dtypes)}, got {str(t.dtype).removeprefix('torch.')}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but the state is on {device}")
    if name in ROW_STRIDED and t.dim() == 2 and t.stride(1) == 1:
        return
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous{' row by row' if name in ROW_STRIDED else ''}, "
                         f"got strides {t.stride()}")


# --------------------------------------------------------------------------- launcher


def kda_decode_fused(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    conv_weight_q: Tensor,
    conv_weight_k: Tensor,
    conv_weight_v: Tensor,
    conv_state_q: Tensor,
    conv_state_k: Tensor,
    conv_state_v: Tensor,
    a: Tensor,
    A_log: Tensor,
    dt_bias: Tensor,
    lower_bound: float,
    beta: Tensor,
    state: Tensor,
    slots: Tensor,
    scale: float,
    gate: Tensor,
    norm_weight: Tensor,
    eps: float,
    *,
    out: Tensor | None = None,
    block_v: int | None = None,
    tiles_per_program: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    evict_state: bool | None = None,
    max_registers: int | None = None,
    pdl: bool = False,
) -> Tensor:
    """One KDA decode step for B sequences, one launch; updates conv states and state in place.

    q, k [B, H*D] and v [B, H*DV]: q/k/v projections before the conv (model dtype: fp32,
    bf16 or fp16; a, gate share it). The activations (q, k, v, a, beta, gate) may be
    row-strided views (columns of one projection's output). conv_weight_* [C, K] fp32 and conv_state_* [S, C, K-1]
    (C = H*D, or H*DV for v). a [B, H*D]: f_b_proj output (gate input); A_log [H] fp32;
    dt_bias [H*D] fp32; beta [B, H]: b_proj logits (sigmoid applied here). state
    [S, H, D, DV] fp32, slots [B] int64 (distinct rows of the states). gate [B, H*DV]:
    g_proj output; norm_weight [DV] fp32 (o_norm). Returns [B, H, DV] in the model dtype
    (written into ``out`` if given).

    Launch choices (``launch_config``; each defaults to the heuristic for this batch and
    device): ``block_v``, the value tile, a power of two dividing DV; ``tiles_per_program``,
    value tiles one program updates in turn; ``num_warps``; ``num_stages``, value tiles in
    flight per program (with several tiles per program); ``evict_state``, the evict-first
    cache hint on the state stream; ``max_registers``, a register cap per thread (CUDA's
    maxnreg; not passed on AMD GPUs: ``targets.register_cap``; every cap tried on an H200 was slower, BENCHMARKS.md);
    ``pdl``, launch as a programmatic dependent launch (CUDA sm_90+; ValueError elsewhere):
    the caller promises that the kernel launched just before this one on the stream writes
    neither the states nor the slots (it may write the projections, which are read after
    the wait).
    """
    if not isinstance(state, Tensor) or state.dim() != 4:
        raise ValueError(f"state must be a [S, H, D, DV] tensor, got {getattr(state, 'shape', type(state).__name__)}")
    S, H, D, DV = state.shape
    device = state.device
    _expect("state", state, (S, H, D, DV), (torch.float32,), device)
    if not (_is_power_of_two(D) and _is_power_of_two(DV)):
        raise ValueError(f"head dims must be powers of two, got D={D}, DV={DV}")
    if not isinstance(q, Tensor) or q.dim() != 2:
        raise ValueError(f"q must be a [B, H*D] tensor, got {getattr(q, 'shape', type(q).__name__)}")
    B = q.shape[0]
    if not isinstance(conv_weight_q, Tensor) or conv_weight_q.dim() != 2:
        raise ValueError("conv_weight_q must be a [H*D, K] tensor")
    K = conv_weight_q.shape[1]
    if K < 2:
        raise ValueError(f"conv kernel size must be >= 2, got {K}")
    act = q.dtype
    if act not in MODEL_DTYPES:
        raise ValueError(f"q must be {_dtype_names(MODEL_DTYPES)}, got {act}")
    f32 = (torch.float32,)
    floats = MODEL_DTYPES
    for name, t, shape, dtypes in (
        ("q", q, (B, H * D), (act,)),
        ("k", k, (B, H * D), (act,)),
        ("v", v, (B, H * DV), (act,)),
        ("conv_weight_q", conv_weight_q, (H * D, K), f32),
        ("conv_weight_k", conv_weight_k, (H * D, K), f32),
        ("conv_weight_v", conv_weight_v, (H * DV, K), f32),
        ("conv_state_q", conv_state_q, (S, H * D, K - 1), floats),
        ("conv_state_k", conv_state_k, (S, H * D, K - 1), floats),
        ("conv_state_v", conv_state_v, (S, H * DV, K - 1), floats),
        ("a", a, (B, H * D), (act,)),
        ("A_log", A_log, (H,), f32),
        ("dt_bias", dt_bias, (H * D,), f32),
        ("beta", beta, (B, H), floats),
        ("slots", slots, (B,), (torch.int64,)),
        ("gate", gate, (B, H * DV), (act,)),
        ("norm_weight", norm_weight, (DV,), f32),
    ):
        _expect(name, t, shape, dtypes, device)
    if out is None:
        out = torch.empty(B, H, DV, dtype=act, device=device)
    else:
        _expect("out", out, (B, H, DV), (act,), device)
    if pdl and not supports_pdl(device):
        raise ValueError(f"pdl (programmatic dependent launch) needs a CUDA GPU of compute capability 9.0 or "
                         f"newer, got {device}")
    config = launch_config(B, H, D, DV, compute_units(device), block_v=block_v, tiles_per_program=tiles_per_program,
                           num_warps=num_warps, num_stages=num_stages, evict_state=evict_state,
                           max_registers=max_registers, pdl=pdl)
    if device.type == "cpu" and isinstance(kda_decode_kernel, triton.runtime.jit.JITFunction):
        raise ValueError(
            "kda_decode_fused on CPU tensors needs the Triton interpreter: set TRITON_INTERPRET=1 "
            "before triton is first imported (on CPU the runtime uses the op's torch reference)"
        )
    if B == 0:
        return out

    counters = _counters.get(device, B * H)
    kda_decode_kernel[launch_grid(B, H, DV, config.block_v, config.tiles_per_program)](
        q, k, v,
        conv_weight_q, conv_weight_k, conv_weight_v,
        conv_state_q, conv_state_k, conv_state_v,
        a, A_log, dt_bias, beta, state, slots, gate, norm_weight, out, counters,
        float(lower_bound), float(scale), float(eps),
        q.stride(0), k.stride(0), v.stride(0), a.stride(0), beta.stride(0), gate.stride(0),
        **_constexprs(H, D, DV, K, config),
        num_warps=config.num_warps, num_stages=1,  # the kernel has no loop for Triton to pipeline
        **register_cap(device_target(device), config.max_registers),
        **({"launch_pdl": True} if config.pdl else {}),
    )
    return out


# --------------------------------------------------------------------------- k3 op


def kda_decode_fused_op(
    q: Tensor, k: Tensor, v: Tensor, conv_weight_q: Tensor, conv_weight_k: Tensor, conv_weight_v: Tensor,
    conv_state_q: Tensor, conv_state_k: Tensor, conv_state_v: Tensor, a: Tensor, A_log: Tensor,
    dt_bias: Tensor, lower_bound: float, beta: Tensor, state: Tensor, slots: Tensor, scale: float,
    gate: Tensor, norm_weight: Tensor, eps: float,
) -> Tensor:
    """``k3::kda_decode_fused`` as one launch: the launcher needs activations whose rows are
    contiguous and fp32 conv weights / A_log / dt_bias / norm_weight, so those in another
    layout or dtype are copied here. On CUDA GPUs of compute capability 9.0 or newer it launches with programmatic
    dependent launch (H200: 33.0 -> 30.9 us at batch 64, BENCHMARKS.md) unless it had to
    cast a weight, whose copy the launch just before wrote."""

    def act(t: Tensor) -> Tensor:
        return t if t.dim() == 2 and t.stride(1) == 1 else t.contiguous()

    def f32(t: Tensor) -> Tensor:
        return t.float().contiguous()

    weights = (conv_weight_q, conv_weight_k, conv_weight_v, A_log, dt_bias, norm_weight)
    cast = tuple(f32(w) for w in weights)
    # Programmatic dependent launch lets the kernel read the states, slots and weights
    # before the previous kernel has finished, so none of them may come from that kernel.
    # States are only written by this op, slots are step inputs, weights are parameters;
    # but a weight cast here was written by the launch just before: then no PDL.
    pdl = supports_pdl(state.device) and all(c is w for c, w in zip(cast, weights, strict=True))
    conv_wq, conv_wk, conv_wv, a_log, dt_b, norm_w = cast
    # Caches are passed as they are: they are updated in place (the launcher checks them).
    return kda_decode_fused(
        act(q), act(k), act(v), conv_wq, conv_wk, conv_wv,
        conv_state_q, conv_state_k, conv_state_v, act(a), a_log, dt_b, lower_bound,
        act(beta), state, slots, scale, act(gate), norm_w, eps, pdl=pdl,
    )


def kda_decode_fused_proj_op(
    x: Tensor, q_weight: Tensor, k_weight: Tensor, v_weight: Tensor, g_weight: Tensor, b_weight: Tensor,
    f_a_weight: Tensor, f_b_weight: Tensor, conv_weight_q: Tensor, conv_weight_k: Tensor, conv_weight_v: Tensor,
    conv_state_q: Tensor, conv_state_k: Tensor, conv_state_v: Tensor, A_log: Tensor, dt_bias: Tensor,
    lower_bound: float, state: Tensor, slots: Tensor, scale: float, norm_weight: Tensor, eps: float,
) -> Tensor:
    """``k3::kda_decode_fused_proj``: the six projections of x as ONE GEMM when the runtime
    laid their weights out as consecutive rows of one buffer (``weight_layout``), else one
    GEMM each; f_b on the f_a columns; the kernel then reads the projections' columns in
    place (row-strided views)."""
    weights = (q_weight, k_weight, v_weight, g_weight, f_a_weight, b_weight)  # fused_op.PROJECTION_WEIGHTS
    rows = consecutive_rows(weights)
    if rows is not None:
        q, k, v, g, f_a, b = column_blocks(torch.nn.functional.linear(x, rows), weights)
    else:
        q, k, v, g, f_a, b = (torch.nn.functional.linear(x, w) for w in weights)
    a = torch.nn.functional.linear(f_a, f_b_weight)
    return kda_decode_fused_op(q, k, v, conv_weight_q, conv_weight_k, conv_weight_v, conv_state_q, conv_state_k,
                               conv_state_v, a, A_log, dt_bias, lower_bound, b, state, slots, scale, g, norm_weight,
                               eps)


def register_kernels(device_type: str) -> None:
    """Make :func:`kda_decode_fused_op` and :func:`kda_decode_fused_proj_op` the
    ``device_type`` implementations of ``k3::kda_decode_fused`` and
    ``k3::kda_decode_fused_proj`` (registering again replaces the same functions)."""
    fused_op.kda_decode_fused.register_kernel(device_type)(kda_decode_fused_op)
    fused_op.kda_decode_fused_proj.register_kernel(device_type)(kda_decode_fused_proj_op)
