"""Split the MLA KV cache by context for decode context parallelism (DCP).

Under TP every rank computes its own heads but caches the latent of every token, so the
MLA history is stored ``tp`` times (1.96 GB per GPU of FP8 latent at 142K tokens in K3 at
TP8). With ``--dcp D`` each group of D consecutive TP ranks splits the history by
position instead (k3compile/context_parallel.py: position p is stored by member
``(p // interleave) % D``). Decode attention then needs every query against every
member's positions; the pass rewrites each decode MLA attention node into:

1. an all-gather of the absorbed queries over the DCP group (each member now holds the
   D*h heads of its group),
2. attention of those heads over the member's own positions (``k3.dcp_local_lengths``
   turns the global context lengths into its share), giving a partial output and LSE,
3. the merge, by one of two exchanges (``Config.merge``):

   - ``"reduce-scatter"``: an all-gather of the LSEs, each member scaling its
     partial by ``exp(lse_k - logsumexp_j lse_j)`` (``k3.dcp_rescale``, heads first), and
     a reduce-scatter that sums the terms and hands every member its own h heads back;
   - ``"all-to-all"`` (default): one collective instead of two. Each member packs its partial
     output with its LSE per (sequence, head), member k's heads in chunk k
     (``k3.dcp_pack``); an all-to-all sends chunk k to member k; each member merges the D
     partials of its own heads (``k3.dcp_merge``). The same bytes cross the links (the
     partials, fp32), plus one LSE column; the LSE all-gather and the output cast go.
     On two H200s (NVLink, NCCL) its collectives took 20.5-27.3 us against 27.8-33.0 us
     and every measured DCP2 attention was faster (BENCHMARKS.md).

A member that owns no position of a sequence yet (length <= its first position) has an
empty attention: LSE -inf, weight 0. The merge is exact up to rounding (softmax over a
union of disjoint position sets).

Before (layer 4 of ``tiny-h24`` at TP2, decode, h = 12 heads per rank)::

    %cat_3        = aten.cat([%einsum_2, %slice_12], -1)                       (s, 12, 40) S(1)
    %mla_decode_1 = k3.mla_decode(%cat_3, %caches_13, %block_table, %seq_lens, 0.25, 32)
    %getitem_8    = getitem(%mla_decode_1, 0)                                  (s, 12, 32) S(1)
    %einsum_3     = aten.einsum('thl,hdl->thd', [%getitem_8, %slice_10])

After (``--dcp 2 --dcp-merge reduce-scatter``)::

    %all_gather_into_tensor = _c10d_functional.all_gather_into_tensor(%cat_3, 2, 'k3_dcp')
    %wait_tensor  = _c10d_functional.wait_tensor(%all_gather_into_tensor)     (2s, 12, 40) L
    %view / %permute / %reshape                                                (s, 24, 40) L
    %dcp_local_lengths = k3.dcp_local_lengths(%seq_lens, %b_context_parallel_position_offset, 2, 1)
    %mla_decode   = k3.mla_decode(%reshape, %caches_13, %block_table, %dcp_local_lengths, 0.25, 32)
    %getitem / %getitem_1                          (o, lse): (s, 24, 32), (s, 24)  L
    %all_gather_into_tensor_1 = ...(%getitem_1, 2, 'k3_dcp'); %wait_tensor_1   (2s, 24) L
    %dcp_rescale  = k3.dcp_rescale(%getitem, %getitem_1, %wait_tensor_1, 2)    (24, s, 32) L
    %reduce_scatter_tensor = _c10d_functional.reduce_scatter_tensor(%dcp_rescale, 'sum', 2, 'k3_dcp')
    %wait_tensor_2                                                             (12, s, 32) S(0)
    %permute_1 / %_to_copy                                                     (s, 12, 32) S(1)
    %einsum_3     = aten.einsum('thl,hdl->thd', [%_to_copy, %slice_10])

After with the default ``merge="all-to-all"``, the merge part::

    %getitem / %getitem_1                          (o, lse): (s, 24, 32), (s, 24)  L
    %dcp_pack     = k3.dcp_pack(%getitem, %getitem_1, 2)                      (2, s, 12, 33) L
    %all_to_all_single = _c10d_functional.all_to_all_single(%dcp_pack, [1, 1], [1, 1], 'k3_dcp')
    %wait_tensor_1                                                            (2, s, 12, 33) S(2)
    %dcp_merge    = k3.dcp_merge(%wait_tensor_1, torch.float32)                 (s, 12, 32) S(1)
    %einsum_3     = aten.einsum('thl,hdl->thd', [%dcp_merge, %slice_10])

(L: RankLocal, a value of this rank alone.) The cache write is not rewritten: its slot
mapping input now holds this rank's local slot for the tokens it owns and the scratch
slot for the others, and ``block_table`` this rank's blocks (the layout's contract with
the runtime, which fills them). ``seq_lens`` stays global. KDA state stays split by heads.

Prefill: each ``k3.mla_prefill`` (the naive form, reading the whole context back from the
cache after the step's write) reads the history the DCP group holds, so that a sequence
with history (a continuation, a prefill chunk after the first) continues under DCP. By
default (``prefill="gathered"``) the group's history of the step's sequences is
all-gathered in position order and the DCP1 op runs on this rank's own heads (it picks
the expanded or the absorbed form itself, as without DCP)::

    %dcp_local_blocks = k3.dcp_local_blocks(%caches_13, %block_table)   [N, B, bs, bytes] u8 L
    %all_gather_into_tensor = _c10d_functional.all_gather_into_tensor(%dcp_local_blocks, 2, 'k3_dcp')
    %wait_tensor                                                    [2N, B, bs, bytes] u8 L
    %dcp_history_order = k3.dcp_history_order(%wait_tensor, 2, 1, torch.bfloat16)
    %getitem / %getitem_1         the history as a cache [N*2B, bs, W] and its table   R
    %mla_prefill = k3.mla_prefill(%q, %getitem, %kv_b_proj_weight, %cu_seqlens, %getitem_1, %seq_lens, s)

It moves each sequence's history (1,152 bytes a position and layer in bf16; 150 MB for
128K positions) once a layer and step, where the absorbed form below moves the step's
queries of every head (T x dcp*h x W) and its merge; and the DCP1 op may take the
expanded form, whose kernel runs at 56-61% of the bf16 matmul rate at 32K-128K tokens
where the absorbed kernel reaches 8% (an H200, BENCHMARKS.md). The gathered history is
transient: the cache stays split. With ``prefill="partial"`` the prefill becomes the absorbed form
over this rank's positions::

    %view = aten.view(%kv_b_proj_weight, [h, Dn+Dv, L]); %w_uk / %w_uv: its two slices
    %q_latent = aten.einsum('thd,hdl->thl', [q_nope, %w_uk]); %q_abs = cat([%q_latent, q_pe])
    (the heads all-gathered to [T, dcp*h, W] as above)
    %mla_prefill_partial = k3.mla_prefill_partial(%q_all, %caches_13, %block_table, %cu_seqlens,
                               %seq_lens, %context_parallel_position_offset, dcp, interleave, scale, L)
    (the same merge as decode: [T, h, L])
    %einsum_1 = aten.einsum('thl,hdl->thd', [%merged, %w_uv])                   [T, h, Dv]

Each new token attends to the cached positions up to its own (the op maps a rank's local
rows to global positions); the all-gather moves T x dcp*h x W queries per layer, which a
prefill chunk size bounds.

The pass runs only when the plan has ``dcp > 1`` and is then required (the runtime lays
out the caches by position); it must run before ``pad_attention_heads``, which then
sees the gathered head count (D*h: 24 at TP8/DCP2 is padded to 32; 96 at DCP8 is taken
as is). A graph that uses the attention's LSE downstream is rejected (the merged LSE
is not built). Sets ``gm.meta["context_parallel"] = (dcp, interleave)``.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Literal

import torch
from torch.fx import GraphModule, Node

from k3compile.context_parallel import DCP_GROUP_NAME, LAYOUT_META_KEY, program_layout
from k3compile.mla_cache_fp8 import cache_value_width
from k3compile.pipeline.graph_edits import add_rank_constant
from k3compile.pipeline.interface import GraphPass, PassContext, PassError, PassResult, Rewrite, Skipped, register_pass
from k3compile.sharding import ParallelPlan, ShardOffset

aten, k3, c10d = torch.ops.aten, torch.ops.k3, torch.ops._c10d_functional

#: The per-rank constant: this member's first position in each cycle of positions.
POSITION_OFFSET = "context_parallel.position_offset"

_DECODE_OPS = (k3.mla_decode.default, k3.mla_decode_split_kv.default)


def _stack(node: Node) -> dict:
    return node.meta.get("nn_module_stack", {})


@register_pass
class SplitMLAContext(GraphPass):
    """Rewrite MLA attention for a KV cache split by position across the DCP group (see
    the module docstring)."""

    name = "split_mla_context"

    @dataclass(frozen=True)
    class Config:
        #: how the members' partial attentions are merged (see the module docstring); the
        #: choices are checked by the registry and offered by ``optimize --dcp-merge``
        merge: Literal["reduce-scatter", "all-to-all"] = "all-to-all"
        #: prefill attention: "gathered" (the group's history all-gathered, then the DCP1
        #: prefill on this rank's heads) or "partial" (the absorbed form over this rank's
        #: positions, merged); see the module docstring
        prefill: Literal["gathered", "partial"] = "gathered"

    @classmethod
    def required_by(cls, plan: ParallelPlan) -> str | None:
        """Under DCP the runtime lays the MLA cache out by position, which only the
        rewritten attention reads correctly."""
        return f"dcp={plan.dcp}" if plan.dcp > 1 else None

    def run(self, gm: GraphModule, ctx: PassContext) -> PassResult:
        result = PassResult(changed=False)
        attention = [n for n in gm.graph.nodes if n.target in (*_DECODE_OPS, k3.mla_prefill.default)]
        if ctx.plan.dcp == 1:
            for node in attention:
                result.skipped.append(Skipped(node.name, "dcp=1: every rank keeps the whole MLA history"))
            return result
        if not attention:
            return result
        if program_layout(gm) is not None:
            result.skipped.append(Skipped(attention[0].name, "the program is already in the context-parallel layout"))
            return result
        dcp, interleave = ctx.plan.dcp, ctx.plan.dcp_interleave
        offset: list[Node] = []  # the rank constant, made once
        local_lengths: dict[Node, Node] = {}  # per seq_lens input: one k3.dcp_local_lengths for all layers
        for node in attention:
            gathered = node.target is k3.mla_prefill.default and self.config.prefill == "gathered"
            if not offset and not gathered:  # the gathered prefill reads whole histories: no offset
                offset.append(add_rank_constant(ctx, POSITION_OFFSET, ShardOffset(dcp * interleave, period=dcp)))
            if gathered:
                result.add_rewrite(self._rewrite_prefill_gathered(gm, node, dcp, interleave))
                continue
            if node.target is k3.mla_prefill.default:
                result.add_rewrite(self._rewrite_prefill(gm, node, offset[0], dcp, interleave))
                continue
            seq_lens = node.args[3]
            if seq_lens not in local_lengths:
                with gm.graph.inserting_before(node):  # the first decode attention of the graph
                    local_lengths[seq_lens] = gm.graph.call_function(
                        k3.dcp_local_lengths.default, (seq_lens, offset[0], dcp, interleave))
            result.add_rewrite(self._rewrite_decode(gm, node, local_lengths[seq_lens], dcp))
        gm.meta[LAYOUT_META_KEY] = (dcp, interleave)
        result.changed = True
        return result

    def _rewrite_decode(self, gm: GraphModule, node: Node, local_lengths: Node, dcp: int) -> Rewrite:
        graph = gm.graph
        q, kv_cache, block_table, _seq_lens, scale, value_dim = node.args
        q_val = q.meta["val"]
        _, heads, width = q_val.shape
        users = {user.args[1]: user for user in node.users}
        if any(user.target is not operator.getitem for user in node.users):
            raise PassError(f"{node.name}: a user takes the (o, lse) tuple whole; split_mla_context needs getitems")
        if 1 in users and users[1].users:
            raise PassError(f"{node.name}: its LSE is used downstream; split_mla_context does not build the merged LSE")

        existing = set(graph.nodes)
        with graph.inserting_before(node):
            q_all = _gather_heads(graph, q, dcp, heads, width)
            local = graph.call_function(node.target, (q_all, kv_cache, block_table, local_lengths, scale, value_dim))
            out = self._merge(graph, local, dcp, q_val.dtype)
        _adopt(graph, existing, node)
        if 0 in users:
            users[0].replace_all_uses_with(out)
        for user in users.values():
            graph.erase_node(user)
        graph.erase_node(node)

        cache_val = kv_cache.meta["val"]
        stats = {
            "collectives_added": 2 if self.config.merge == "all-to-all" else 3,
            # per token of history per MLA layer: this rank no longer stores (dcp-1)/dcp of it
            "kv_bytes_per_token_removed": cache_val.shape[-1] * cache_val.dtype.itemsize * (dcp - 1) / dcp,
        }
        detail = (
            f"{_module(node)}: {heads} heads gathered to {dcp * heads} over the DCP group, attention over this "
            f"rank's 1/{dcp} of the positions, LSE merge by {self.config.merge}"
        )
        return Rewrite(node.name, detail, stats)

    def _merge(self, graph, local: Node, dcp: int, dtype: torch.dtype) -> Node:
        """The members' partial (o, lse) of ``local`` merged into this rank's heads."""
        o_part = graph.call_function(operator.getitem, (local, 0))
        lse_part = graph.call_function(operator.getitem, (local, 1))
        if self.config.merge == "all-to-all":
            packed = graph.call_function(k3.dcp_pack.default, (o_part, lse_part, dcp))
            chunks = [1] * dcp  # one member per chunk of dim 0
            received = _collective(graph, c10d.all_to_all_single.default, packed, chunks, chunks, DCP_GROUP_NAME)
            return graph.call_function(k3.dcp_merge.default, (received, dtype))
        lse_all = _collective(graph, c10d.all_gather_into_tensor.default, lse_part, dcp, DCP_GROUP_NAME)
        term = graph.call_function(k3.dcp_rescale.default, (o_part, lse_part, lse_all, dcp))
        mine = _collective(graph, c10d.reduce_scatter_tensor.default, term, "sum", dcp, DCP_GROUP_NAME)
        mine = graph.call_function(aten.permute.default, (mine, [1, 0, 2]))
        return graph.call_function(aten._to_copy.default, (mine,), {"dtype": dtype})

    def _rewrite_prefill_gathered(self, gm: GraphModule, node: Node, dcp: int, interleave: int) -> Rewrite:
        """The prefill over the whole history, all-gathered from the group in position
        order (``k3.dcp_local_blocks``, the all-gather, ``k3.dcp_history_order``): the
        DCP1 op on this rank's heads, which picks its form (expanded or absorbed) itself."""
        graph = gm.graph
        q, kv_cache, kv_b_weight, cu_seqlens, block_table, seq_lens, scale = node.args
        existing = set(graph.nodes)
        with graph.inserting_before(node):
            blocks = graph.call_function(k3.dcp_local_blocks.default, (kv_cache, block_table))
            gathered = _collective(graph, c10d.all_gather_into_tensor.default, blocks, dcp, DCP_GROUP_NAME)
            ordered = graph.call_function(k3.dcp_history_order.default,
                                          (gathered, dcp, interleave, kv_cache.meta["val"].dtype))
            cache = graph.call_function(operator.getitem, (ordered, 0))
            table = graph.call_function(operator.getitem, (ordered, 1))
            out = graph.call_function(k3.mla_prefill.default, (q, cache, kv_b_weight, cu_seqlens, table, seq_lens,
                                                               scale))
        _replace(graph, node, out, existing)
        detail = (f"{_module(node)}: prefill over the history all-gathered from the {dcp} DCP members in position "
                  f"order, this rank's heads (the DCP1 op)")
        return Rewrite(node.name, detail, {"collectives_added": 1})

    def _rewrite_prefill(self, gm: GraphModule, node: Node, offset: Node, dcp: int, interleave: int) -> Rewrite:
        """The naive-form prefill becomes the absorbed form over this rank's positions:
        q_nope W_UK ++ q_pe, heads gathered, ``k3.mla_prefill_partial`` over the rank's
        cache (this step's tokens are written to it first), the merge, then W_UV."""
        graph = gm.graph
        q, kv_cache, kv_b_weight, cu_seqlens, block_table, seq_lens, scale = node.args
        _, heads, dqk = q.meta["val"].shape
        L = kv_b_weight.meta["val"].shape[1]
        rope = cache_value_width(kv_cache.meta["val"]) - L
        nope = dqk - rope
        dv = kv_b_weight.meta["val"].shape[0] // heads - nope
        existing = set(graph.nodes)
        with graph.inserting_before(node):
            w = graph.call_function(aten.view.default, (kv_b_weight, [heads, nope + dv, L]))
            w_uk = graph.call_function(aten.slice.Tensor, (w, 1, 0, nope))
            w_uv = graph.call_function(aten.slice.Tensor, (w, 1, nope, nope + dv))
            q_nope = graph.call_function(aten.slice.Tensor, (q, 2, 0, nope))
            q_pe = graph.call_function(aten.slice.Tensor, (q, 2, nope, dqk))
            q_latent = graph.call_function(aten.einsum.default, ("thd,hdl->thl", [q_nope, w_uk]))
            q_abs = graph.call_function(aten.cat.default, ([q_latent, q_pe], 2))
            q_all = _gather_heads(graph, q_abs, dcp, heads, L + rope)
            local = graph.call_function(k3.mla_prefill_partial.default, (
                q_all, kv_cache, block_table, cu_seqlens, seq_lens, offset, dcp, interleave, scale, L))
            merged = self._merge(graph, local, dcp, q.meta["val"].dtype)
            out = graph.call_function(aten.einsum.default, ("thl,hdl->thd", [merged, w_uv]))
        _replace(graph, node, out, existing)
        detail = (f"{_module(node)}: prefill in the absorbed form, {heads} heads gathered to {dcp * heads}, causal "
                  f"attention over this rank's positions (history included), LSE merge by {self.config.merge}")
        return Rewrite(node.name, detail, {"collectives_added": 2 if self.config.merge == "all-to-all" else 3})


def _adopt(graph, existing: set[Node], node: Node) -> None:
    """The nodes added since ``existing`` take ``node``'s module stack (the layer they replace)."""
    for new in graph.nodes:
        if new not in existing:
            new.meta["nn_module_stack"] = _stack(node)


def _replace(graph, node: Node, out: Node, existing: set[Node]) -> None:
    """``node`` replaced by ``out``, the nodes added since ``existing`` adopted into its layer."""
    _adopt(graph, existing, node)
    node.replace_all_uses_with(out)
    graph.erase_node(node)


def _collective(graph, op, *args) -> Node:
    issued = graph.call_function(op, args)
    return graph.call_function(c10d.wait_tensor.default, (issued,))


def _gather_heads(graph, q: Node, dcp: int, heads: int, width: int) -> Node:
    """q [T, heads, width] of every DCP member -> [T, dcp*heads, width], member k's heads at k*heads."""
    gathered = _collective(graph, c10d.all_gather_into_tensor.default, q, dcp, DCP_GROUP_NAME)
    by_member = graph.call_function(aten.view.default, (gathered, [dcp, -1, heads, width]))
    q_all = graph.call_function(aten.permute.default, (by_member, [1, 0, 2, 3]))
    return graph.call_function(aten.reshape.default, (q_all, [-1, dcp * heads, width]))


def _module(node: Node) -> str:
    stack = _stack(node)
    return list(stack.values())[-1][0] if stack else "<no module>"

