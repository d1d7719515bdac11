"""Fused single-token KDA decode: everything between the projections and ``o_proj`` in one launch.

The unfused chain (``k3compile/model/kda.py``, decode branch; one token per sequence)::

    q, k, v = short_conv_decode(q_proj x), ... (k, v)      conv + SiLU, shifts 3 conv states
    g       = kda_gate(f_b_proj(f_a_proj x), A_log, dt_bias, lower_bound)
    beta    = sigmoid(b_proj x)
    o       = kda_decode(q, k, v, g, beta, state, slots, scale)
    y       = gated_rms_norm(o, g_proj x, o_norm.weight, eps)

is about 30 small kernels in eager torch and 4-5 in a serving engine (conv, gate + recurrence,
norm). At decode the recurrent state dominates the bytes and everything else is tiny, so the
chain is one memory-bound pass over the state, launched once.

Algorithm, per (sequence b, head h, value tile j) program; D is the key width, DV the value
width, BV the value tile, K the conv kernel size (4):

1. Short conv + SiLU of this head's D query and D key channels and of the tile's BV value
   channels, from the conv states (the K-1 previous inputs, oldest first) and this token's
   projections. Outputs are rounded to the model dtype, as the unfused chain stores them.
2. fp32 L2 norm of q and k (fla's convention: ``x / sqrt(sum x^2 + 1e-6)``), q times ``scale``;
   decay gate ``g = lower_bound * sigmoid(exp(A_log[h]) * (a + dt_bias))`` [D];
   ``beta = sigmoid(beta logits)``.
3. Delta rule on the [D, BV] slice of the fp32 state ``S[slot, h]`` (layout [D_k, D_v]):
   ``S <- diag(exp g) S;  u = v - S^T k;  S <- S + beta k u^T;  o = S^T q``. The state slice
   is read once and written once; o [BV] is rounded to the model dtype (the chain does).
4. ``y = RMSNorm_DV(o) * o_norm * sigmoid(gate)`` over the head's whole DV row.

Grid ``(DV // BV, H, B)``: value tiles fastest, so the tiles of one head run side by side.
Why value tiles: a sequence's state is H [D, DV] matrices (12 x 64 KiB at K3 per rank), and
at batch 1 one program per head would leave 120 of the H200's 132 SMs idle while 12 stream
the state. Every column of the state is independent given q, k, g, beta, so splitting DV
into BV-wide tiles multiplies the programs by DV / BV (96 at batch 1, BV = 16). The price
is that each program recomputes the per-head q/k parts (conv of 2 x D channels, norms, gate:
about 7 KB of reads per program at K3, served from L2 after the first tile) and that two
things need the whole head:

- The RMSNorm needs sum(o^2) over all DV. Each program stores its o tile (model dtype) to
  the output, then increments a per-(b, h) arrival counter (``atomic_add``, acq_rel). The
  program that arrives last, and only it, reads the whole o row back, normalises and gates it
  in place, and resets the counter to 0 for the next launch (so the counters stay zero
  between launches and CUDA-graph replays need no memset). Cost per (b, h): one int32
  atomic per tile plus one extra read and write of the DV outputs (~0.5 KB at K3, about 0.4%
  of the 128 KiB of state traffic). With BV == DV there is one program per head and no
  counter at all; ``choose_block_v`` picks that once the batch alone fills the machine.
- The q/k conv states must be updated exactly once, yet every tile reads the old ones. The
  last-arriving program writes them: when it has seen the counter reach DV/BV - 1, every
  other tile has already passed its atomic, and its reads of the old conv states precede its
  atomic (a barrier orders all its threads' accesses before the release), so no program can
  read a state another program already overwrote. Each tile writes its own v conv channels,
  which no other program touches.

Bytes per step (``bytes_moved``), the floor a memory-bound kernel cannot beat:
fp32 state read + written once, ``2 * B * H * D * DV * 4`` (1.5 MiB per sequence at K3 per
rank: H=12, D=DV=128), plus q, k, v, a, gate and beta in the model dtype, the three conv
states read + written (``2 * B * 3 * H * D * (K-1)`` elements), the output, and the weights
once (conv weights 3 x H*D*K fp32, dt_bias, o_norm; 80 KB at K3). At batch 1 that is 1.7 MB;
the state is 91% of it and grows with the batch while the weights do not.

Slots are the caller's contract, as for the unfused ops: distinct within a launch and in
range (checking would cost a device sync). The arrival counters are a per-device workspace
shared by launches: do not run two of these kernels concurrently on different streams of one
device. The first launch on a device allocates the counters (4096, grown for B*H beyond), so run
once at the largest batch before capturing CUDA graphs (warm-up does); buffers are never freed,
as captured graphs keep their addresses.

On CPU the launcher runs only under the Triton interpreter: ``TRITON_INTERPRET=1`` set before
triton is first imported in the process (triton.language's own jit functions, ``tl.sum`` and
``tl.sigmoid``, are built then). The runtime uses the torch reference on CPU.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

import k3compile.ops  # noqa: F401  (registers torch.ops.k3.* for the reference chain)
from k3compile.ops.kda import L2NORM_EPS

__all__ = [
    "MIN_BLOCK_V",
    "aot_signature",
    "bytes_moved",
    "choose_block_v",
    "kda_decode_chain_reference",
    "kda_decode_fused",
    "kda_decode_kernel",
    "launch_grid",
    "num_warps_for",
]

#: widest value tile (see choose_block_v)
MAX_BLOCK_V = 32
MIN_BLOCK_V = 16
"""Narrowest value tile the launcher picks by itself (a smaller one may be passed)."""

MODEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_L2_EPS = tl.constexpr(L2NORM_EPS)


# --------------------------------------------------------------------------- kernel


@triton.jit
def _short_conv(x_ptr, weight_ptr, conv_state_ptr, channels, cols, K: tl.constexpr):
    """Depthwise causal conv + SiLU of ``channels`` for one token.

    Returns (y [C] fp32 rounded to x's dtype, window [C, KP] fp32). The window holds the K
    inputs the conv sees, oldest first: the K-1 stored ones, then x (columns >= K are 0).
    """
    stored = tl.load(
        conv_state_ptr + channels[:, None] * (K - 1) + cols[None, :], mask=cols[None, :] < K - 1, other=0.0
    )
    x = tl.load(x_ptr + channels)
    window = tl.where(cols[None, :] == K - 1, x[:, None].to(tl.float32), stored.to(tl.float32))
    w = tl.load(weight_ptr + channels[:, None] * K + cols[None, :], mask=cols[None, :] < K, other=0.0)
    acc = tl.sum(window * w.to(tl.float32), axis=1)
    y = acc * tl.sigmoid(acc)
    return y.to(x_ptr.dtype.element_ty).to(tl.float32), window


@triton.jit
def _store_conv_state(conv_state_ptr, channels, cols, window, K: tl.constexpr):
    """New conv state = the window without its oldest input: column c goes to slot c - 1."""
    tl.store(
        conv_state_ptr + channels[:, None] * (K - 1) + cols[None, :] - 1,
        window.to(conv_state_ptr.dtype.element_ty),
        mask=(cols[None, :] >= 1) & (cols[None, :] < K),
    )


@triton.jit
def _gated_rms_norm_store(o, cols, gate_ptr, weight_ptr, out_ptr, eps, DV: tl.constexpr):
    """out[cols] = o * rsqrt(mean(o^2) + eps) * weight * sigmoid(gate); o is a whole head row."""
    rstd = tl.rsqrt(tl.sum(o * o, axis=0) / DV + eps)
    y = o * rstd * tl.load(weight_ptr + cols).to(tl.float32)
    y = y * tl.sigmoid(tl.load(gate_ptr + cols).to(tl.float32))
    tl.store(out_ptr + cols, y.to(out_ptr.dtype.element_ty))


@triton.jit
def kda_decode_kernel(
    q_ptr, k_ptr, v_ptr,  # [B, H*D], [B, H*D], [B, H*DV] projections (pre-conv), model dtype
    q_conv_w_ptr, k_conv_w_ptr, v_conv_w_ptr,  # [H*D, K], [H*D, K], [H*DV, K]
    q_conv_state_ptr, k_conv_state_ptr, v_conv_state_ptr,  # [S, H*D, K-1], ..., [S, H*DV, K-1]
    a_ptr, a_log_ptr, dt_bias_ptr,  # [B, H*D] gate input, [H], [H*D]
    beta_ptr,  # [B, H] logits
    state_ptr,  # [S, H, D, DV] fp32
    slots_ptr,  # [B] int64
    gate_ptr, norm_weight_ptr,  # [B, H*DV] output gate logits, [DV]
    out_ptr,  # [B, H, DV]
    counter_ptr,  # [>= B*H] int32, zero between launches
    lower_bound, scale, eps,
    H: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
    BV: tl.constexpr,
):
    NV: tl.constexpr = DV // BV
    i_v = tl.program_id(0)
    i_h = tl.program_id(1)
    i_b = tl.program_id(2).to(tl.int64)
    slot = tl.load(slots_ptr + i_b).to(tl.int64)

    cols = tl.arange(0, KP)
    dk = tl.arange(0, D)
    dv = i_v * BV + tl.arange(0, BV)  # this tile's value columns within the head
    qk_channels = i_h * D + dk
    v_channels = i_h * DV + dv
    q_conv_state = q_conv_state_ptr + slot * (H * D * (K - 1))
    k_conv_state = k_conv_state_ptr + slot * (H * D * (K - 1))
    v_conv_state = v_conv_state_ptr + slot * (H * DV * (K - 1))

    # 1. short conv + SiLU (reads the old conv states; q/k states are written at the end).
    q, q_window = _short_conv(q_ptr + i_b * (H * D), q_conv_w_ptr, q_conv_state, qk_channels, cols, K)
    k, k_window = _short_conv(k_ptr + i_b * (H * D), k_conv_w_ptr, k_conv_state, qk_channels, cols, K)
    v, v_window = _short_conv(v_ptr + i_b * (H * DV), v_conv_w_ptr, v_conv_state, v_channels, cols, K)
    _store_conv_state(v_conv_state, v_channels, cols, v_window, K)  # this tile's channels only

    # 2. L2 norms, decay gate, beta.
    q = q * tl.rsqrt(tl.sum(q * q, axis=0) + _L2_EPS) * scale
    k = k * tl.rsqrt(tl.sum(k * k, axis=0) + _L2_EPS)
    a = tl.load(a_ptr + i_b * (H * D) + qk_channels).to(tl.float32) + tl.load(dt_bias_ptr + qk_channels)
    g = lower_bound * tl.sigmoid(tl.exp(tl.load(a_log_ptr + i_h).to(tl.float32)) * a)
    beta = tl.sigmoid(tl.load(beta_ptr + i_b * H + i_h).to(tl.float32))

    # 3. Delta rule on the [D, BV] state slice.
    s_ptrs = state_ptr + (slot * H + i_h) * (D * DV) + dk[:, None] * DV + dv[None, :]
    s = tl.load(s_ptrs) * tl.exp(g)[:, None]
    u = v - tl.sum(s * k[:, None], axis=0)
    s = s + (beta * k)[:, None] * u[None, :]
    tl.store(s_ptrs, s)
    o = tl.sum(s * q[:, None], axis=0).to(out_ptr.dtype.element_ty)

    # 4. Gated RMSNorm over the whole head row, by the only or the last-arriving tile.
    row = (i_b * H + i_h) * DV
    gate_row = gate_ptr + i_b * (H * DV) + i_h * DV
    if NV == 1:
        _gated_rms_norm_store(o.to(tl.float32), dv, gate_row, norm_weight_ptr, out_ptr + row, eps, DV)
        _store_conv_state(q_conv_state, qk_channels, cols, q_window, K)
        _store_conv_state(k_conv_state, qk_channels, cols, k_window, K)
    else:
        tl.store(out_ptr + row + dv, o)
        tl.debug_barrier()  # all threads' loads and stores precede the release below
        counter = counter_ptr + i_b * H + i_h
        arrived = tl.atomic_add(counter, 1, sem="acq_rel")
        if arrived == NV - 1:
            tl.debug_barrier()
            all_v = tl.arange(0, DV)
            o_row = tl.load(out_ptr + row + all_v).to(tl.float32)
            _gated_rms_norm_store(o_row, all_v, gate_row, norm_weight_ptr, out_ptr + row, eps, DV)
            _store_conv_state(q_conv_state, qk_channels, cols, q_window, K)
            _store_conv_state(k_conv_state, qk_channels, cols, k_window, K)
            tl.store(counter, 0)


# --------------------------------------------------------------------------- launch plan


def launch_grid(batch: int, heads: int, head_dim_v: int, block_v: int) -> tuple[int, int, int]:
    """The kernel's grid: (value tiles, heads, batch)."""
    return (head_dim_v // block_v, heads, batch)


def choose_block_v(batch: int, heads: int, head_dim_v: int, compute_units: int, waves: int = 2) -> int:
    """Widest power-of-two value tile up to ``MAX_BLOCK_V`` that still gives ``waves``
    programs per compute unit.

    Narrower tiles keep small batches from leaving CUs idle. Wider ones recompute the
    per-head q/k work fewer times, but a [D, BV] fp32 state tile beyond 32 columns costs
    registers and occupancy: on an H200 (benchmarks/kda_decode.py, BV sweep) BV = 32 was
    the fastest at batch 1, 8, 64 and 256 (64 and 128 were 1.3-1.6x slower at batch 64
    and 256). Floor ``MIN_BLOCK_V``. H=12, DV=128 on 132 SMs: batch 1 -> 16, 8+ -> 32.
    """
    bv = min(head_dim_v, MAX_BLOCK_V)
    while bv > MIN_BLOCK_V and batch * heads * (head_dim_v // bv) < waves * compute_units:
        bv //= 2
    return bv


def num_warps_for(head_dim: int, block_v: int) -> int:
    """Warps for a [D, BV] fp32 state tile: about 32 state values per thread, 2 to 8 warps."""
    return max(2, min(8, head_dim * block_v // (32 * 32)))


def bytes_moved(
    batch: int, heads: int, head_dim: int, head_dim_v: int, conv_kernel: int, act_bytes: int
) -> int:
    """Bytes one step must move at least: state read + write, activations, conv states, weights."""
    hd, hdv = heads * head_dim, heads * head_dim_v
    state = 2 * batch * heads * head_dim * head_dim_v * 4
    activations = batch * (3 * hd + 2 * hdv + heads + hdv) * act_bytes  # q, k, a; v, gate; beta; out
    conv_states = 2 * batch * (2 * hd + hdv) * (conv_kernel - 1) * act_bytes
    weights = (2 * hd + hdv) * conv_kernel * 4 + hd * 4 + heads * 4 + head_dim_v * 4 + batch * 8
    return state + activations + conv_states + weights


def _constexprs(heads: int, head_dim: int, head_dim_v: int, conv_kernel: int, block_v: int) -> dict[str, int]:
    return {"H": heads, "D": head_dim, "DV": head_dim_v, "K": conv_kernel,
            "KP": triton.next_power_of_2(conv_kernel), "BV": block_v}


_TRITON_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
_FP32_POINTERS = ("q_conv_w_ptr", "k_conv_w_ptr", "v_conv_w_ptr", "a_log_ptr", "dt_bias_ptr", "state_ptr",
                  "norm_weight_ptr")


def aot_signature(
    dtype: torch.dtype, heads: int = 12, head_dim: int = 128, head_dim_v: int = 128, block_v: int = 16,
    conv_kernel: int = 4,
) -> tuple[dict[str, str], dict[str, int], int]:
    """(signature, constexprs, num_warps) of the kernel as ``kda_decode_fused`` launches it with
    activations and conv states in ``dtype`` (for ``aot.compile_for_target``); K3 per-rank defaults."""
    t = _TRITON_DTYPES[dtype]
    pointer = {"slots_ptr": "i64", "counter_ptr": "i32", **{name: "fp32" for name in _FP32_POINTERS}}
    signature = {
        arg: f"*{pointer.get(arg, t)}" if arg.endswith("_ptr") else "fp32" if arg in ("lower_bound", "scale", "eps")
        else "constexpr"
        for arg in kda_decode_kernel.arg_names
    }
    constexprs = _constexprs(heads, head_dim, head_dim_v, conv_kernel, block_v)
    return signature, constexprs, num_warps_for(head_dim, block_v)


@functools.cache
def _compute_units(device: torch.device) -> int:
    """SMs / CUs (ROCm reports CUs here too); 1 for the CPU interpreter (one tile per head)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


# Per device, every counter buffer handed out so far: a grown buffer replaces the last one for
# new launches, but the old ones stay alive because captured CUDA graphs hold their addresses.
_counters: dict[torch.device, list[Tensor]] = {}


def _arrival_counters(device: torch.device, n: int) -> Tensor:
    """At least n int32 counters on device, zero between launches (the kernel resets those it uses)."""
    buffers = _counters.setdefault(device, [])
    if not buffers or buffers[-1].numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise ValueError(
                f"kda_decode_fused needs {n} arrival counters on {device} but only "
                f"{buffers[-1].numel() if buffers else 0} exist: run it once at this batch size "
                "before capturing a CUDA graph"
            )
        buffers.append(torch.zeros(max(n, 4096), dtype=torch.int32, device=device))
    return buffers[-1]


# --------------------------------------------------------------------------- checks


def _dtype_names(dtypes: tuple[torch.dtype, ...]) -> str:
    return " or ".join(str(d).removeprefix("torch.") for d in dtypes)


def _expect(
    name: str, t: object, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...], device: torch.device
) -> None:
    """Raise ValueError naming ``name`` unless t is a contiguous tensor of this shape, dtype, device."""
    if not isinstance(t, Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must be {_dtype_names(dtypes)}, got {str(t.dtype).removeprefix('torch.')}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but the state is on {device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {t.stride()}")


def _is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


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
) -> Tensor:
    """One KDA decode step for B sequences, one launch; updates conv states and state in place.

    q, k [B, H*D] and v [B, H*DV]: q/k/v projections before the conv (model dtype: fp32,
    bf16 or fp16; a, gate share it). conv_weight_* [C, K] fp32 and conv_state_* [S, C, K-1]
    (C = H*D, or H*DV for v). a [B, H*D]: f_b_proj output (gate input); A_log [H] fp32;
    dt_bias [H*D] fp32; beta [B, H]: b_proj logits (sigmoid applied here). state
    [S, H, D, DV] fp32, slots [B] int64 (distinct rows of the states). gate [B, H*DV]:
    g_proj output; norm_weight [DV] fp32 (o_norm). Returns [B, H, DV] in the model dtype
    (written into ``out`` if given). ``block_v``: value tile, a power of two dividing DV;
    default ``choose_block_v`` for the device.
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
    if block_v is None:
        block_v = choose_block_v(B, H, DV, _compute_units(device))
    if not (_is_power_of_two(block_v) and block_v <= DV):
        raise ValueError(f"block_v must be a power of two dividing DV={DV}, got {block_v}")
    if device.type == "cpu" and isinstance(kda_decode_kernel, triton.runtime.jit.JITFunction):
        raise ValueError(
            "kda_decode_fused on CPU tensors needs the Triton interpreter: set TRITON_INTERPRET=1 "
            "before triton is first imported (on CPU the runtime uses kda_decode_chain_reference)"
        )
    if B == 0:
        return out

    counters = _arrival_counters(device, B * H)
    kda_decode_kernel[launch_grid(B, H, DV, block_v)](
        q, k, v,
        conv_weight_q, conv_weight_k, conv_weight_v,
        conv_state_q, conv_state_k, conv_state_v,
        a, A_log, dt_bias, beta, state, slots, gate, norm_weight, out, counters,
        float(lower_bound), float(scale), float(eps),
        **_constexprs(H, D, DV, K, block_v),
        num_warps=num_warps_for(D, block_v), num_stages=1,
    )
    return out


def kda_decode_chain_reference(
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
) -> Tensor:
    """The unfused chain with the repo's k3 ops, in the model's order (``kda_decode_fused``'s
    contract; ``block_v`` is accepted and ignored so the two are interchangeable)."""
    B = q.shape[0]
    _, H, D, DV = state.shape
    ops = torch.ops.k3
    qc = ops.short_conv_decode(q, conv_weight_q, conv_state_q, slots).view(B, H, D)
    kc = ops.short_conv_decode(k, conv_weight_k, conv_state_k, slots).view(B, H, D)
    vc = ops.short_conv_decode(v, conv_weight_v, conv_state_v, slots).view(B, H, DV)
    g = ops.kda_gate(a.view(B, H, D), A_log, dt_bias, lower_bound)
    o = ops.kda_decode(qc, kc, vc, g, torch.sigmoid(beta.float()), state, slots, scale)
    y = ops.gated_rms_norm(o, gate.view(B, H, DV), norm_weight, eps)
    if out is None:
        return y
    return out.copy_(y)
