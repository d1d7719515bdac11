"""Pad MLA decode queries to a head count the target's fast attention kernel accepts.

Fast MLA decode kernels put 16 heads on the matrix units of one program and split the
context across programs (flash-decoding), so they take head counts that are multiples of
16. K3 at TP8 leaves 12 of its 96 heads on each rank; an engine then falls back to a
kernel that runs one program per head (each re-reading the context), whose time grows
with the context. Padding the query with zero heads up to the next accepted count costs
a few query bytes and a pad and a narrow copy; the KV cache, the traffic that matters, is
then read once per 16-head tile, for 12 real and 4 zero heads alike. Production measured
decode at 32K context almost twice as fast (issue #6).

For every ``k3.mla_decode`` node, with H the local head count from q's fake shape and
the target's fastest decode kernel from :mod:`k3compile.kernel_tables` (derived from the
kernels' own declarations):

- the kernel accepts H: nothing to do (skipped: "already accepted by ..."). This is how
  the pass composes with decode context parallelism: run after it, it finds the heads
  its all-gather assembled (all 96 in K3), which the kernel takes as they are;
- it rejects H but accepts a padded count H': q is padded with H' - H zero heads, the
  kernel's own op (``k3.mla_decode_split_kv``) runs, and the output and the LSE are
  narrowed back to the H real heads.

Exact: heads are independent in attention, so the real heads' outputs do not depend on
the padded ones (which are discarded). The KV cache and every other input are unchanged.

Before (layer 4 of ``tiny-h24`` at TP2, decode: 12 heads per rank, target h200)::

    %cat_3        = aten.cat([%einsum_2, %slice_12], -1)                       (s, 12, 40) S(1)
    %mla_decode_1 = k3.mla_decode(%cat_3, %caches_13, %block_table, %seq_lens, 0.25, 32)
                                                          ((s, 12, 32), (s, 12)) (S(1), S(1))
    %getitem_8    = getitem(%mla_decode_1, 0)                                  (s, 12, 32) S(1)
    %getitem_9    = getitem(%mla_decode_1, 1)          (the LSE, unused)       (s, 12)     S(1)
    %einsum_3     = aten.einsum('thl,hdl->thd', [%getitem_8, %slice_10])       (s, 12, 8)  S(1)

After::

    %cat_3        = aten.cat([%einsum_2, %slice_12], -1)                       (s, 12, 40) S(1)
    %pad_heads_1  = k3.pad_heads(%cat_3, 16)                                   (s, 16, 40) S(1)
    %mla_decode_split_kv_1 = k3.mla_decode_split_kv(%pad_heads_1, %caches_13, %block_table,
                                 %seq_lens, 0.25, 32)     ((s, 16, 32), (s, 16)) (S(1), S(1))
    %getitem_13   = getitem(%mla_decode_split_kv_1, 0)                         (s, 16, 32) S(1)
    %narrow_heads_1 = k3.narrow_heads(%getitem_13, 12)                         (s, 12, 32) S(1)
    %einsum_3     = aten.einsum('thl,hdl->thd', [%narrow_heads_1, %slice_10])  (s, 12, 8)  S(1)

``k3.pad_heads`` / ``k3.narrow_heads`` act on each rank's block of the head-sharded
tensors (S(1) -> S(1)); an ``aten.constant_pad_nd`` or ``aten.slice`` of the sharded dim
would mean padding or slicing the logical tensor, which the placement analysis rightly
rejects. The LSE is narrowed the same way when the graph uses it; an unused getitem (K3's
model discards the LSE) is dropped.

Skipped, with the reason in the record: the head count is already accepted (above); the
target has no decode kernel, or its fastest kernel rejects the dtype or the widths
whatever the head count, or no graph op runs that kernel. On ``cpu`` the fastest kernel
is the torch reference, which takes every head count: the pass does nothing there.
Prefill attention (``k3.mla_prefill``) is only reported: the prefill kernels tile
(token, head) rows and take any head count; a prefill kernel that rejected one would be
reported as not padded.
"""

from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule, Node

from k3compile.mla_cache_fp8 import cache_value_width
from k3compile.kernel_tables import AttentionKernel, fast_attention_kernel
from k3compile.pipeline.interface import GraphPass, PassContext, PassResult, Rewrite, Skipped, register_pass
from k3compile.targets import GPU_DEVICES

k3 = torch.ops.k3


def _module_path(node: Node) -> str:
    """The innermost module the node was traced in (``model.layers.4.self_attn``)."""
    stack = node.meta.get("nn_module_stack") or {}
    return list(stack.values())[-1][0] if stack else "<no module>"


@register_pass
class PadAttentionHeads(GraphPass):
    """Pad MLA decode queries to the head count the target's fast kernel accepts (see the
    module docstring)."""

    name = "pad_attention_heads"
    #: GPU targets (on the CPU the reference kernel takes every head count).
    default_on = GPU_DEVICES
    #: It must see the head count decode attention finally runs with (DCP gathers heads).
    after = ("split_mla_context",)

    def run(self, gm: GraphModule, ctx: PassContext) -> PassResult:
        result = PassResult(changed=False)
        for node in list(gm.graph.nodes):
            if node.target is k3.mla_prefill.default:
                result.skipped.append(Skipped(node.name, self._prefill_reason(ctx, node)))
            if node.target is not k3.mla_decode.default:
                continue
            kernel, padded, reason = self._match(ctx, node)
            if kernel is None:
                result.skipped.append(Skipped(node.name, reason))
                continue
            result.add_rewrite(self._rewrite(gm, node, kernel, padded))
        result.changed = result.matches > 0
        return result

    def _match(self, ctx: PassContext, node: Node) -> tuple[AttentionKernel | None, int, str]:
        """(the fast kernel, the head count to pad to, "") or (None, 0, why not)."""
        q, value_dim = node.args[0], node.args[5]
        q_val = q.meta["val"]
        _, heads, width = q_val.shape
        kernel = fast_attention_kernel(ctx.target.name, "decode")
        if kernel is None:
            return None, 0, f"target {ctx.target.name} has no MLA decode kernel"
        if kernel.accepts(heads, q_val.dtype, width, value_dim):
            return None, 0, f"{heads} heads: already accepted by {kernel.name}"
        padded = kernel.padded_heads(heads)
        rejected = kernel.reason_rejected(padded, q_val.dtype, width, value_dim)
        if rejected is not None:  # the dtype or a width: no head count helps
            return None, 0, f"not padded to {padded} heads: {rejected}"
        if kernel.op is None:
            return None, 0, f"{kernel.name} would take {padded} heads, but no k3 op runs it in a graph"
        if any(user.target is not operator.getitem for user in node.users):
            return None, 0, "a user takes the (o, lse) tuple whole, not through getitem"
        return kernel, padded, ""

    def _rewrite(self, gm: GraphModule, node: Node, kernel: AttentionKernel, padded: int) -> Rewrite:
        graph = gm.graph
        q = node.args[0]
        _, heads, width = q.meta["val"].shape
        op_name = kernel.op.removeprefix("k3::")
        stack = node.meta.get("nn_module_stack", {})
        with graph.inserting_before(node):
            padded_q = graph.create_node("call_function", k3.pad_heads.default, (q, padded), name="pad_heads")
            fast = graph.create_node("call_function", getattr(k3, op_name).default,
                                     (padded_q, *node.args[1:]), node.kwargs, name=op_name)
        padded_q.meta["nn_module_stack"] = fast.meta["nn_module_stack"] = stack
        narrowed_outputs = 0
        for old in list(node.users):  # getitem 0 (o) and 1 (lse); export keeps unused ones: drop those
            if old.users:
                with graph.inserting_before(old):
                    item = graph.call_function(operator.getitem, (fast, old.args[1]))
                    narrowed = graph.create_node("call_function", k3.narrow_heads.default, (item, heads),
                                                 name="narrow_heads")
                item.meta["nn_module_stack"] = narrowed.meta["nn_module_stack"] = stack
                old.replace_all_uses_with(narrowed)
                narrowed_outputs += 1
            graph.erase_node(old)
        graph.erase_node(node)

        stats = {
            "heads_added": padded - heads,
            # per sequence of the decode batch (B is dynamic): the zero heads the kernel reads
            "query_bytes_added_per_sequence": (padded - heads) * width * q.meta["val"].dtype.itemsize,
            # one attention op replaced by another; the pad and each narrow are small copies
            "launches_added": 1 + narrowed_outputs,
        }
        detail = f"{_module_path(node)}: heads {heads} -> {padded} for {kernel.name} ({fast.name})"
        return Rewrite(node.name, detail, stats)

    def _prefill_reason(self, ctx: PassContext, node: Node) -> str:
        """Why a prefill attention node is left alone: the target's prefill kernel, judged
        at the absorbed widths it runs at (W = cache width, values = the latent)."""
        q, kv_cache, kv_b_weight = node.args[0], node.args[1], node.args[2]
        heads, dtype = q.meta["val"].shape[1], q.meta["val"].dtype
        width, latent = cache_value_width(kv_cache.meta["val"]), kv_b_weight.meta["val"].shape[1]
        kernel = fast_attention_kernel(ctx.target.name, "prefill")
        if kernel is None:
            return f"prefill attention: target {ctx.target.name} has no MLA prefill kernel"
        reason = kernel.reason_rejected(heads, dtype, width, latent)
        if reason is None:
            return f"prefill attention, {heads} heads: already accepted by {kernel.name}"
        return f"prefill attention is not padded ({reason})"
