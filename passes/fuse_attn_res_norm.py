"""Fuse each Attention Residuals mix with the RMSNorm that reads it: ``k3::attn_res_mix_norm``.

Every mix of K3 feeds exactly one RMSNorm (``h = Mix(p, B)`` is only ever normalised:
``input_layernorm(h)``, ``post_attention_layernorm(h)``, the final ``norm``), and nothing
else reads ``h``. On GPUs the fused op is one Triton kernel
(``k3compile/runtime/kernels/attn_res.py``): the row is read, mixed and normalised in
registers, so the mix is never written and read back and one launch is saved per pair (the
mix's torch reference, about fifteen launches, is gone with the kernel either way). On the
CPU the fused op runs the same two ops, so the rewrite is exact there.

Before (layer 1 of ``tiny``, decode; weights' names shortened)::

    %add_1 = aten.add.Tensor(%getitem, %linear_9)
    %attn_res_mix_1 = k3.attn_res_mix(%add_1, [%embedding], %layers_1_self_attention_res_proj_weight,
                                      %layers_1_self_attention_res_norm_weight, 1e-05)
    %rms_norm_2 = k3.rms_norm(%attn_res_mix_1, %layers_1_input_layernorm_weight, 1e-05)
    ... (the attention's projections read %rms_norm_2)

After::

    %add_1 = aten.add.Tensor(%getitem, %linear_9)
    %attn_res_mix_norm_1 = k3.attn_res_mix_norm(%add_1, [%embedding], %layers_1_self_attention_res_proj_weight,
                                                %layers_1_self_attention_res_norm_weight, 1e-05,
                                                %layers_1_input_layernorm_weight, 1e-05)
    ... (the attention's projections read %attn_res_mix_norm_1)

The final mix is read through a row selection (``hidden[logit_indices]``: the last token
of each sequence) before the final norm. A row-wise op commutes with selecting rows, so
``rms_norm(mix[idx])`` becomes ``attn_res_mix_norm(...)[idx]``: exact, and at decode every
row is selected anyway (at prefill the norm runs on every token, inside the same kernel).

Not rewritten (reported in ``skipped``): a mix with another user besides the norm (or the
row selection), or whose only user is not an RMSNorm of it (the mix would have to be stored
anyway).

Stats per step (per rank): ``matches`` (pairs fused), ``launches_removed`` (one per pair:
two ops become one), ``nodes_removed`` / ``nodes_added``, and ``bytes_removed``: the mix
no longer written and read back, at one token.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

import k3compile.ops.attn_res  # noqa: F401  (registers torch.ops.k3.attn_res_mix_norm)
from k3compile.pipeline.interface import GraphPass, PassContext, PassResult, Rewrite, Skipped, register_pass
from k3compile.pipeline.node_queries import carry_meta, is_call, layer_of, numel_at_one, op_arg, tensor_val
from k3compile.targets import GPU_DEVICES

k3 = torch.ops.k3
aten = torch.ops.aten


@register_pass
class FuseAttnResNorm(GraphPass):
    """Replace ``rms_norm(attn_res_mix(...))`` by one ``attn_res_mix_norm``."""

    name = "fuse_attn_res_norm"
    #: GPU targets: the fused op is one Triton kernel there; on the CPU it runs the same ops.
    default_on = GPU_DEVICES

    def run(self, gm: GraphModule, ctx: PassContext) -> PassResult:
        result = PassResult(changed=False)
        for mix in [n for n in gm.graph.nodes if n.target is k3.attn_res_mix.default]:
            norm, rows, reason = self._norm_of(mix)
            if norm is None:
                result.skipped.append(Skipped(mix.name, reason))
                continue
            result.add_rewrite(self._rewrite(gm, mix, rows, norm))
        result.changed = result.matches > 0
        return result

    @staticmethod
    def _norm_of(mix: Node) -> tuple[Node | None, Node | None, str]:
        """(the norm, the row selection between mix and norm or None, '') or (None, None, why not)."""
        users = list(mix.users)
        if len(users) != 1:
            return None, None, f"{mix.name} has {len(users)} users ({', '.join(u.name for u in users) or 'none'}), not one norm"
        (user,) = users
        rows = None
        if _selects_rows(user, mix) and len(user.users) == 1:
            rows, user = user, next(iter(user.users))
        source = rows if rows is not None else mix
        if not (is_call(user, {k3.rms_norm.default}) and op_arg(user, "x") is source):
            return None, None, f"{source.name} feeds {user.name} ({user.target}), not an RMSNorm of it"
        return user, rows, ""

    @staticmethod
    def _rewrite(gm: GraphModule, mix: Node, rows: Node | None, norm: Node) -> Rewrite:
        graph = gm.graph
        args = (*(op_arg(mix, a) for a in ("partial", "blocks", "proj", "norm", "eps")),
                op_arg(norm, "weight"), op_arg(norm, "eps"))
        with graph.inserting_before(norm):
            fused = graph.call_function(k3.attn_res_mix_norm.default, args)
            out = fused if rows is None else graph.call_function(aten.index.Tensor, (fused, rows.args[1]))
        carry_meta(fused, mix)
        carry_meta(out, norm)
        norm.replace_all_uses_with(out)
        for node in (norm, rows, mix):
            if node is not None:
                graph.erase_node(node)
        val = tensor_val(mix)
        stats = {"launches_removed": 1, "nodes_removed": 2 if rows is None else 3, "nodes_added": 1 if rows is None else 2,
                 "bytes_removed": 2 * numel_at_one(val) * val.element_size() if val is not None else 0}
        blocks = len(op_arg(fused, "blocks"))
        what = "k3.rms_norm" if rows is None else "(row selection) k3.rms_norm"
        detail = (f"layer {layer_of(fused)}: k3.attn_res_mix ({blocks + 1} candidates) + {what} -> "
                  f"k3.attn_res_mix_norm{'' if rows is None else ', then the row selection'}")
        return Rewrite(fused.name, detail, stats)


def _selects_rows(node: Node, source: Node) -> bool:
    """``node`` is ``source[idx]``: aten.index with one index tensor, on the first dim. A
    row-wise op then commutes with it: norm(x)[idx] == norm(x[idx])."""
    if not is_call(node, {aten.index.Tensor}) or node.args[0] is not source:
        return False
    indices = node.args[1]
    return len(indices) == 1 and isinstance(indices[0], Node)


__all__ = ["FuseAttnResNorm"]
