"""A graph invariant of FP8 MLA caches: quantised once per written token, read only by kernels.

An FP8 cache (k3compile/mla_cache_fp8.py) holds values and their scales in one tensor;
only the k3 cache ops know that layout. So in a program whose MLA caches are FP8:

- each cache is written by exactly one ``k3::mla_cache_write`` (it quantises the step's
  new tokens: once per written token), and read only by the attention ops that
  dequantise in their kernels (``READERS``);
- no other node takes a cache, and no node makes an FP8 value: nothing quantises or
  dequantises the history in the graph, where it would cost a pass over the whole cache.
  The DCP prefill's gathered history (passes/split_mla_context.py) is the exception: its
  rows travel as bytes and ``k3::dcp_history_order`` puts them back as FP8 cache rows,
  codes and scales as written, which only the attention ops read (``HISTORY``).

Caches handed to a ``torch.cond`` branch are followed into it. :func:`check_mla_cache_use`
runs after capture and after every pass (``lint_graph``).
"""

from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule, Node

import k3compile.ops  # noqa: F401  (registers torch.ops.k3.*)
from k3compile.mla_cache_fp8 import is_fp8_dtype
from k3compile.pipeline.interface import PassError

k3 = torch.ops.k3
COND = torch.ops.higher_order.cond
WRITER = k3.mla_cache_write.default
READERS = frozenset({k3.mla_decode.default, k3.mla_decode_split_kv.default, k3.mla_prefill.default,
                     k3.mla_prefill_partial.default, k3.dcp_local_blocks.default})
#: the op that puts all-gathered cache bytes back as cache rows (no quantisation): its
#: history output is FP8 like the caches and, like them, read only by READERS
HISTORY = k3.dcp_history_order.default


def _is_fp8(node: Node) -> bool:
    val = node.meta.get("val")
    return getattr(val, "dtype", None) is not None and is_fp8_dtype(val.dtype)


def _uses(gm: GraphModule, cache: Node) -> list[Node]:
    """The nodes that take ``cache``, through ``torch.cond`` branches into their subgraphs."""
    uses = []
    for user in cache.users:
        if user.target is not COND:
            uses.append(user)
            continue
        index = list(user.args[3]).index(cache)
        for branch in (getattr(gm, user.args[i].target) for i in (1, 2)):
            placeholder = [n for n in branch.graph.nodes if n.op == "placeholder"][index]
            uses.extend(_uses(branch, placeholder))
    return uses


def _is_history(node: Node) -> bool:
    """A gathered history, or the ``dcp_history_order`` that makes it (``HISTORY``)."""
    return node.target is HISTORY or (node.target is operator.getitem and node.args[0].target is HISTORY)


def check_mla_cache_use(gm: GraphModule) -> None:
    """Raise PassError if an FP8 MLA cache of ``gm`` is used other than as described above."""
    caches = [n for n in gm.graph.nodes if n.op == "placeholder" and _is_fp8(n)]
    for node in gm.graph.nodes:
        if node.op != "placeholder" and not _is_history(node) and _is_fp8(node):
            raise PassError(f"{node.name} ({node.target}) makes an FP8 value outside the cache ops: "
                            "the FP8 MLA cache is quantised only by k3::mla_cache_write")
        if node.target is operator.getitem and _is_history(node) and _is_fp8(node):
            readers = [u for u in node.users if u.target not in READERS]
            if readers:
                raise PassError(f"the gathered FP8 MLA history {node.name} is read by {readers[0].name} "
                                f"({readers[0].target}): only the attention ops dequantise it, in their kernels")
    for cache in caches:
        uses = _uses(gm, cache)
        writes = [u for u in uses if u.target is WRITER]
        others = [u for u in uses if u.target is not WRITER and u.target not in READERS]
        if len(writes) != 1:
            raise PassError(f"FP8 MLA cache {cache.name} is written by {len(writes)} k3::mla_cache_write nodes, "
                            "not one: each new token must be quantised once")
        if others:
            raise PassError(f"FP8 MLA cache {cache.name} is read by {others[0].name} ({others[0].target}): only "
                            f"the attention ops dequantise it, in their kernels")
