"""Every k3 op of a decode or prefill program as standard torch operators, for exporters.

A k3 op is one node in the optimized graph; ONNX and MLIR know nothing of it. Most ops'
torch references already are straight-line torch code (no host values read from
tensors, no loops over data), so the reference is the decomposition. The exceptions get
one here, written from the op's documented semantics:

- ``sigmoid_topk_route``: its reference sorts (a stable descending sort, which ONNX
  lacks); ``topk`` selects the same ids in the same order, equal scores going to the lower
  expert id (ONNX TopK's tie rule as well).
- ``moe_experts`` / ``moe_experts_mxfp4``: the references visit the picked experts one by
  one (a host loop over ``unique(ids)``). Here every expert runs on every token, weighted
  by a dense [T, E] routing matrix that is zero where the token did not pick it: exact,
  and E times the FLOPs, which is what an export of a tiny model can afford.
- MXFP4 weights are decoded with arithmetic on the codes (no lookup-table constants, no
  bitwise operators on uint8: exporters mistype those): a code's magnitude is
  ``0.5 m`` for exponent bits 0, else ``2^(e-1) (1 + 0.5 m)``; the E8M0 scale is
  ``2^(byte - 127)``.

- The prefill ops over packed sequences of different lengths (``short_conv_prefill``,
  ``kda_prefill``, ``mla_prefill``): their references loop over the sequences on the host;
  ``k3compile.export.prefill_decompositions`` has their forms with masks and gathers.

The decode context-parallel ops (``dcp_local_lengths``, ...) and the DCP forms of the
prefill (``mla_prefill_new_tokens``, ``mla_prefill_partial``) have no decomposition yet,
and :func:`missing_decompositions` names them.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from collections.abc import Callable

import torch
from torch import Tensor
from torch._library.custom_ops import CustomOpDef
from torch.overrides import TorchFunctionMode

import k3compile.ops as k3_ops
from k3compile.checkpoint.mxfp4 import GROUP_SIZE
from k3compile.export import prefill_decompositions
from k3compile.ops.activations import situ_glu

#: the k3 ops whose references are not straight-line torch code, without a decomposition
NOT_DECOMPOSED = frozenset({
    "mla_prefill_new_tokens", "mla_prefill_partial", "dcp_local_lengths", "dcp_local_blocks", "dcp_history_order",
})


def sigmoid_topk_route(logits: Tensor, correction_bias: Tensor, top_k: int, renormalize: bool,
                       scaling: float) -> tuple[Tensor, Tensor]:
    scores = torch.sigmoid(logits.float())
    ids = torch.topk(scores + correction_bias.float(), top_k, dim=-1).indices
    weights = scores.gather(-1, ids)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


def moe_experts(z: Tensor, weights: Tensor, ids: Tensor, w1: Tensor, w3: Tensor, w2: Tensor, situ_beta: float,
                situ_linear_beta: float) -> Tensor:
    experts = torch.arange(w1.shape[0], device=z.device)
    routing = (weights.float()[..., None] * (ids[..., None] == experts)).sum(1)  # [T, E]
    gate, up = torch.einsum("td,eid->tei", z, w1), torch.einsum("td,eid->tei", z, w3)
    h = situ_glu(gate, up, situ_beta, situ_linear_beta).to(z.dtype)
    y = torch.einsum("tei,edi->ted", h, w2).float()
    return (routing[..., None] * y).sum(1).to(z.dtype)


def decode_mxfp4(packed: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """MXFP4 codes (two a byte, low nibble first) and E8M0 scales -> values in ``dtype``."""
    byte = packed.to(torch.float32)
    high = torch.floor(byte / 16)
    codes = torch.stack((byte - 16 * high, high), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
    negative = codes >= 8
    magnitude_code = torch.where(negative, codes - 8, codes)
    exponent = torch.floor(magnitude_code / 2)
    mantissa = magnitude_code - 2 * exponent
    magnitude = torch.where(exponent == 0, 0.5 * mantissa, torch.exp2(exponent - 1) * (1 + 0.5 * mantissa))
    values = torch.where(negative, -magnitude, magnitude)
    group_scale = torch.exp2(scale.to(torch.float32) - 127)
    return (values.view(*scale.shape, GROUP_SIZE) * group_scale.unsqueeze(-1)).reshape(codes.shape).to(dtype)


def moe_experts_mxfp4(z: Tensor, weights: Tensor, ids: Tensor, w1_packed: Tensor, w1_scale: Tensor,
                      w3_packed: Tensor, w3_scale: Tensor, w2_packed: Tensor, w2_scale: Tensor, situ_beta: float,
                      situ_linear_beta: float) -> Tensor:
    w1, w3, w2 = (decode_mxfp4(p, s, z.dtype) for p, s in ((w1_packed, w1_scale), (w3_packed, w3_scale),
                                                            (w2_packed, w2_scale)))
    return moe_experts(z, weights, ids, w1, w3, w2, situ_beta, situ_linear_beta)


_OWN: dict[str, Callable[..., object]] = {
    "sigmoid_topk_route": sigmoid_topk_route, "moe_experts": moe_experts, "moe_experts_mxfp4": moe_experts_mxfp4,
    "short_conv_prefill": prefill_decompositions.short_conv_prefill,
    "kda_prefill": prefill_decompositions.kda_prefill, "mla_prefill": prefill_decompositions.mla_prefill,
}


@functools.cache
def k3_op_definitions() -> dict[str, CustomOpDef]:
    """Every k3 custom op by name (the op library's modules, imported)."""
    ops: dict[str, CustomOpDef] = {}
    for info in pkgutil.iter_modules(k3_ops.__path__):
        module = importlib.import_module(f"{k3_ops.__name__}.{info.name}")
        ops.update({v._name: v for v in vars(module).values()
                    if isinstance(v, CustomOpDef) and v._namespace == "k3"})
    return ops


def decomposition(name: str) -> Callable[..., object]:
    """The standard-operator form of k3 op ``name`` (module docstring)."""
    if name in NOT_DECOMPOSED:
        raise ValueError(f"k3.{name} has no decomposition into standard operators yet (a context-parallel op)")
    return _OWN.get(name) or k3_op_definitions()[name]._init_fn


def missing_decompositions(gm: torch.fx.GraphModule) -> list[str]:
    """The k3 ops of ``gm`` (its top-level graph) that :func:`decomposition` cannot give, sorted."""
    return sorted({k3_name(n.target) for n in gm.graph.nodes if _is_k3(n)} & NOT_DECOMPOSED)


class DecomposedK3Ops(TorchFunctionMode):
    """While active, every call of a k3 op runs its decomposition instead (module
    docstring), including the k3 ops a decomposition itself calls (the fused ops'
    references call the unfused ones): a ``torch.export`` trace inside records standard
    operators only, and the in-place cache updates as input mutations."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = k3_name(func)
        if name is None:
            return func(*args, **(kwargs or {}))
        with self:
            return decomposition(name)(*args, **(kwargs or {}))


def k3_name(func: object) -> str | None:
    """The op name of a k3 op overload or packet, else None."""
    if isinstance(func, torch._ops.OpOverload) and func.namespace == "k3":
        return func._schema.name.split("::")[1]
    if isinstance(func, torch._ops.OpOverloadPacket) and func._qualified_op_name.startswith("k3::"):
        return func._qualified_op_name.split("::")[1]
    return None


def _is_k3(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and k3_name(node.target) is not None
