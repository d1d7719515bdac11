"""Which part of the model a graph node belongs to: its layer type and layer index.

Read from the node's ``nn_module_stack`` (export keeps it, the passes carry it to the
nodes they make): kda / mla / moe / dense_mlp / attn_res / embedding / head / other. The
pre-norms count with the sub-layer they feed, the residual adds of a decoder layer with
attn_res, the final norm and the ``logit_indices`` gather with head. The placement
analysis groups redundant work this way, and ``k3compile bench`` device time.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from torch.fx import Node

__all__ = ["GROUPS", "node_groups"]

GROUPS = ("kda", "mla", "moe", "dense_mlp", "attn_res", "embedding", "head", "other")

#: Module classes (by class name) whose nodes form a group.
_MODULE_GROUPS = {
    "KDAAttention": "kda",
    "MLAAttention": "mla",
    "LatentMoE": "moe",
    "DenseMLP": "dense_mlp",
    "AttnResMix": "attn_res",
    "VocabParallelEmbedding": "embedding",
    "ParallelLMHead": "head",
}
_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


def _stack(node: Node) -> list[tuple[str, str]]:
    stack = node.meta.get("nn_module_stack") or {}
    out = []
    for v in stack.values():
        path, cls = v[0], v[1]
        cls = cls if isinstance(cls, str) else getattr(cls, "__qualname__", str(cls))
        out.append((path, cls.rsplit(".", 1)[-1]))
    return out


def _layer_of(path: str) -> int | None:
    m = _LAYER_RE.search(path)
    return int(m.group(1)) if m else None


def _classify(node: Node, sublayer: Mapping[tuple[int, str], str]) -> tuple[str, int | None, str]:
    """(group, layer, module path) of a node."""
    stack = _stack(node)
    if not stack:
        return "other", None, ""
    inner = stack[-1][0]
    layer = _layer_of(inner)
    for path, cls in reversed(stack):
        if cls in _MODULE_GROUPS:
            return _MODULE_GROUPS[cls], layer, inner
    if layer is not None:
        if inner.endswith(".input_layernorm"):
            return sublayer.get((layer, "attn"), "other"), layer, inner
        if inner.endswith(".post_attention_layernorm"):
            return sublayer.get((layer, "mlp"), "other"), layer, inner
        if stack[-1][1] == "K3DecoderLayer":
            return "attn_res", layer, inner  # the residual (partial-sum) adds
    if inner.endswith("model.norm") or stack[-1][1] == "K3ForCausalLM":
        return "head", None, inner
    return "other", layer, inner


def node_groups(nodes: Iterable[Node]) -> dict[Node, tuple[str, int | None, str]]:
    """(group, layer index or None, innermost module path) of each node."""
    nodes = list(nodes)
    # Which attention / MLP kind each layer has, for its pre-norms.
    sublayer: dict[tuple[int, str], str] = {}
    for n in nodes:
        g, layer, _ = _classify(n, {})
        if layer is not None and g in ("kda", "mla"):
            sublayer[(layer, "attn")] = g
        elif layer is not None and g in ("moe", "dense_mlp"):
            sublayer[(layer, "mlp")] = g
    return {n: _classify(n, sublayer) for n in nodes}
