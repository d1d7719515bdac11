"""Fuse a KDA layer's single-token decode chain into one ``k3::kda_decode_fused`` op.

A decode step of a KDA layer runs, between its projections and its output projection,
three short convs, the decay gate, the beta sigmoid (and its fp32 cast), the recurrent
step and the gated RMSNorm: eight launches per layer (seven in fp32, where the cast is
gone) around one memory-bound pass over the recurrent state. ``k3::kda_decode_fused``
(``k3compile/ops/kda_fused.py``) does all of it in one launch on GPUs (the Triton kernel of
``k3compile/runtime/kernels/kda_decode_kernel.py``, launched by ``kda_decode.py``) and runs
the very same ops on the CPU.

Matched by op semantics, walking from each ``k3.kda_decode`` to its producers and its
consumer; views are recognised by what they do (split the flat channel dim into
``[T, H, D]`` as given by the recurrent state's shape), not by names::

    q/k/v:  view(short_conv_decode(X, W, conv_state, slots), [T, H, D])  (same slots as the step)
    g:      kda_gate(view(A, [T, H, D]), A_log, dt_bias, lower_bound)
    beta:   sigmoid(to_fp32(L))  or  sigmoid(L) with L fp32           (fp32 result)
    o:      kda_decode(q, k, v, g, beta, state, slots, scale)
    y:      gated_rms_norm(o, view(G, [T, H, DV]), weight, eps)

Before (layer 0 of ``tiny``, decode, fp32 before remove_noops)::

    %linear   = aten.linear(%rms_norm, %q_proj_weight)                   [s, 64]
    %view     = aten.view(%q_conv1d_weight, [64, 4])
    %short_conv_decode = k3.short_conv_decode(%linear, %view, %caches_0, %state_slots)
    %view_1   = aten.view(%short_conv_decode, [s, 4, 16])
    ... (k: %view_3 from %caches_1, v: %view_5 from %caches_2)
    %linear_4 = aten.linear(%linear_3, %f_b_proj_weight)
    %view_6   = aten.view(%linear_4, [s, 4, 16])
    %kda_gate = k3.kda_gate(%view_6, %a_log, %dt_bias, -5.0)
    %linear_5 = aten.linear(%rms_norm, %b_proj_weight)                   [s, 4]
    %to       = aten.to.dtype(%linear_5, torch.float32)
    %sigmoid  = aten.sigmoid(%to)
    %kda_decode = k3.kda_decode(%view_1, %view_3, %view_5, %kda_gate, %sigmoid,
                                %caches_3, %state_slots, 0.25)
    %linear_6 = aten.linear(%rms_norm, %g_proj_weight)
    %view_7   = aten.view(%linear_6, [s, 4, 16])
    %gated_rms_norm = k3.gated_rms_norm(%kda_decode, %view_7, %o_norm_weight, 1e-05)

After (the projections and the conv weights' views stay; the caches are updated by the
fused op, in place, where the norm was)::

    %kda_decode_fused = k3.kda_decode_fused(%linear, %linear_1, %linear_2,
        %view, %view_2, %view_4, %caches_0, %caches_1, %caches_2,
        %linear_4, %a_log, %dt_bias, -5.0, %linear_5, %caches_3, %state_slots, 0.25,
        %linear_6, %o_norm_weight, 1e-05)                                 [s, 4, 16]

When the projections the fused op reads (``%linear``, ``%linear_1``, ``%linear_2``,
``%linear_5``, ``%linear_6``: q, k, v, beta's logits and the output gate; and the forget
gate's low-rank pair ``%linear_4 = linear(%linear_3 = linear(%rms_norm, %f_a_proj_weight),
%f_b_proj_weight)``) are linears of one input by parameters, read by nothing else, they go
into the op too: the node becomes ``k3.kda_decode_fused_proj(%rms_norm, %q_proj_weight,
%k_proj_weight, %v_proj_weight, %g_proj_weight, %b_proj_weight, %f_a_proj_weight,
%f_b_proj_weight, %view, ...)``, and on GPUs the six GEMMs that read x become one (the
runtime lays q, k, v, g, f_a and b out as consecutive rows:
``k3compile/runtime/weight_layout.py``), then f_b reads the f_a columns of its product.

The fused op takes beta's logits (``%linear_5``), so the sigmoid and the cast are fused
too; it computes ``sigmoid(logits.float())``, what the graph did, so the rewrite is exact
(bit-identical on the CPU: the op's reference is the same chain of k3 ops).

Moving the cache updates. The unfused chain updates the conv states at the convs and the
recurrent state at ``kda_decode``; the fused op updates all four at the norm's place. That
is only the same program if nothing else touches those caches, so each cache must be used
by its op of the chain and by nothing else (true of every layer's caches in the captured
programs); otherwise the candidate is skipped.

Not rewritten (each reported in ``skipped`` with the reason): the prefill phase (there is
no fused chunked kernel; the pass is for one token per sequence); a ``kda_decode`` whose
inputs are not produced as above (no short conv, gate or sigmoid; a view that is not a
split of the flat channel dim; different slots); any intermediate (conv outputs, views,
gate, beta, the step's output, the norm's gate view) with another user, since it would have
to be computed anyway; a cache used elsewhere; on GPU targets, head dims the Triton kernel
does not take (D and DV must be powers of two).

Stats per decode step (per rank): ``matches`` (layers fused), ``launches_removed``:
the number of k3/aten compute nodes fused minus the one added, as a launch estimate for
eager execution (views are metadata, not launches, and are not counted; a CUDA graph
replays the same kernels, so the estimate holds there too), ``nodes_removed`` /
``nodes_added`` (graph nodes, views included), and ``bytes_removed``: the intermediates
(conv outputs, gate, beta, the step's output) no longer written and read back, counted at
one sequence (symbolic sizes set to 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node

import k3compile.ops.kda_fused  # noqa: F401  (registers torch.ops.k3.kda_decode_fused*)
from k3compile.pipeline.interface import GraphPass, PassContext, PassResult, Rewrite, Skipped, register_pass
from k3compile.pipeline.node_queries import (is_call, is_linear_of_parameter, layer_of, numel_at_one, op_arg, op_name,
                                             other_users, parameter_placeholders, tensor_val)
from k3compile.targets import GPU_DEVICES

aten = torch.ops.aten
k3 = torch.ops.k3

_VIEWS = frozenset({aten.view.default, aten.reshape.default, aten._unsafe_view.default})
_CASTS = frozenset({aten.to.dtype, aten._to_copy.default})
#: kda_decode_fused_proj's weights of the projections kda_decode_fused reads (q, k, v, b, gate)
_X_WEIGHTS = ("q_weight", "k_weight", "v_weight", "g_weight", "b_weight")


@dataclass
class _Chain:
    """One KDA layer's decode chain: the nodes to replace and the fused op's inputs."""

    decode: Node
    norm: Node
    convs: list[Node]  # short_conv_decode for q, k, v
    conv_views: list[Node]  # their [T, H, D] views (kda_decode's q, k, v)
    gate: Node  # kda_gate
    gate_view: Node  # its input view
    sigmoid: Node
    cast: Node | None  # fp32 cast of the logits (absent when they are fp32 already)
    logits: Node
    norm_gate_view: Node  # gated_rms_norm's gate view

    def compute_nodes(self) -> list[Node]:
        """The replaced nodes that launch work (views excluded)."""
        cast = [self.cast] if self.cast is not None else []
        return [*self.convs, self.gate, *cast, self.sigmoid, self.decode, self.norm]

    def replaced(self) -> list[Node]:
        """Every node to erase, in an order in which each has no users left when erased."""
        cast = [self.cast] if self.cast is not None else []
        return [self.norm, self.norm_gate_view, self.decode, *self.conv_views, *self.convs,
                self.gate, self.gate_view, self.sigmoid, *cast]

    def projections(self) -> list[Node]:
        """The fused op's projection inputs, in ``_X_WEIGHTS`` order: q, k, v, g, b."""
        return [*(c.args[0] for c in self.convs), self.norm_gate_view.args[0], self.logits]

    def fused_args(self) -> tuple:
        q, k, v = (c.args[0] for c in self.convs)
        wq, wk, wv = (op_arg(c, "weight") for c in self.convs)
        cq, ck, cv = (op_arg(c, "conv_state") for c in self.convs)
        return (
            q, k, v, wq, wk, wv, cq, ck, cv,
            self.gate_view.args[0], op_arg(self.gate, "A_log"), op_arg(self.gate, "dt_bias"),
            op_arg(self.gate, "lower_bound"), self.logits,
            op_arg(self.decode, "state"), op_arg(self.decode, "slots"), op_arg(self.decode, "scale"),
            self.norm_gate_view.args[0], op_arg(self.norm, "weight"), op_arg(self.norm, "eps"),
        )


def _same(a, b) -> bool:
    """Sizes equal (ints, or the same symbolic expression)."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return str(a) == str(b)


def _split_view(view: object, heads: int, width: int) -> str:
    """'' if ``view`` is a view of a flat [T, heads*width] tensor as [T, heads, width]."""
    if not is_call(view, _VIEWS):
        return f"{getattr(view, 'name', view)} is not a view of a flat [T, H*D] tensor"
    src, out = tensor_val(view.args[0]), tensor_val(view)
    if src is None or out is None or src.dim() != 2 or out.dim() != 3:
        return f"{view.name} is not a [T, C] -> [T, H, D] view"
    if not (_same(src.shape[0], out.shape[0]) and _same(src.shape[1], heads * width)
            and _same(out.shape[1], heads) and _same(out.shape[2], width)):
        return (f"{view.name} views {list(src.shape)} as {list(out.shape)}, not as "
                f"[T, {heads}, {width}] (heads of the recurrent state)")
    return ""


def _arg_names(op: torch._ops.OpOverload) -> list[str]:
    return [a.name for a in op._schema.arguments]


def _power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


@register_pass
class FuseKDADecode(GraphPass):
    """Replace each KDA decode chain (conv x3, gate, beta, step, norm) by one fused op."""

    name = "fuse_kda_decode"
    #: GPU targets: the fused op is one Triton kernel there; on the CPU it runs the same ops.
    default_on = GPU_DEVICES

    def run(self, gm: GraphModule, ctx: PassContext) -> PassResult:
        result = PassResult(changed=False)
        decodes = [n for n in gm.graph.nodes if n.target is k3.kda_decode.default]
        if ctx.phase != "decode":
            result.skipped.append(Skipped("*", f"{ctx.phase}: the fused op is a single-token decode step; "
                                               "prefill runs the chunked kda_prefill"))
            return result
        gpu = ctx.target is not None and ctx.target.device != "cpu"
        params = parameter_placeholders(ctx.program)
        for node in decodes:
            chain, reason = self._match(node)
            if chain is None:
                result.skipped.append(Skipped(node.name, reason))
                continue
            if gpu:
                _, _, D, DV = tensor_val(op_arg(node, "state")).shape
                if not (_power_of_two(int(D)) and _power_of_two(int(DV))):
                    result.skipped.append(Skipped(node.name, f"the {ctx.target.name} kernel needs power-of-two "
                                                             f"head dims, got D={D}, DV={DV}"))
                    continue
            result.add_rewrite(self._rewrite(gm, chain, params))
        result.changed = result.matches > 0
        return result

    def _match(self, decode: Node) -> tuple[_Chain | None, str]:
        state = tensor_val(op_arg(decode, "state"))
        if state is None or state.dim() != 4:
            return None, "the recurrent state is not a [S, H, D, DV] tensor"
        H, D, DV = (int(s) for s in state.shape[1:])  # never int() the slot count: it would specialise it
        slots = op_arg(decode, "slots")

        if len(decode.users) != 1:
            users = ", ".join(u.name for u in decode.users) or "none"
            return None, f"{decode.name} must have one user, gated_rms_norm (users: {users})"
        (norm,) = decode.users
        if not (is_call(norm, {k3.gated_rms_norm.default}) and op_arg(norm, "x") is decode):
            return None, f"its output feeds {norm.target}, not gated_rms_norm's input"
        norm_gate_view = op_arg(norm, "gate")
        if reason := _split_view(norm_gate_view, H, DV) or other_users(norm_gate_view, norm):
            return None, reason

        convs, conv_views = [], []
        for name, width in (("q", D), ("k", D), ("v", DV)):
            view = op_arg(decode, name)
            if reason := _split_view(view, H, width) or other_users(view, decode):
                return None, f"{name}: {reason}"
            conv = view.args[0]
            if not is_call(conv, {k3.short_conv_decode.default}):
                return None, f"{name} is not produced by short_conv_decode (found {conv.target})"
            if reason := other_users(conv, view):
                return None, f"{name}: {reason}"
            if op_arg(conv, "slots") is not slots:
                return None, f"{conv.name} reads other slots than {decode.name}"
            convs.append(conv)
            conv_views.append(view)

        gate = op_arg(decode, "g")
        if not is_call(gate, {k3.kda_gate.default}):
            return None, f"g is not produced by kda_gate (found {getattr(gate, 'target', gate)})"
        gate_view = op_arg(gate, "a")
        if reason := (other_users(gate, decode) or _split_view(gate_view, H, D) or other_users(gate_view, gate)):
            return None, f"g: {reason}"

        sigmoid = op_arg(decode, "beta")
        if not is_call(sigmoid, {aten.sigmoid.default}):
            return None, f"beta is not a sigmoid (found {getattr(sigmoid, 'target', sigmoid)})"
        if reason := other_users(sigmoid, decode):
            return None, f"beta: {reason}"
        if tensor_val(sigmoid) is None or tensor_val(sigmoid).dtype != torch.float32:
            return None, "beta's sigmoid is not computed in fp32 (the fused op computes sigmoid(logits.float()))"
        cast, logits = None, sigmoid.args[0]
        if is_call(logits, _CASTS) and self._is_fp32_cast(logits):
            if reason := other_users(logits, sigmoid):
                return None, f"beta: {reason}"
            cast, logits = logits, logits.args[0]
        lv = tensor_val(logits)
        if lv is None or lv.dim() != 2 or not lv.is_floating_point() or not _same(lv.shape[1], H):
            return None, f"beta's logits {getattr(logits, 'name', logits)} are not a floating [T, {H}] tensor"

        caches = [op_arg(c, "conv_state") for c in convs] + [op_arg(decode, "state")]
        if len(set(caches)) != 4:
            return None, "the three conv states and the recurrent state are not four distinct tensors"
        for cache, op in zip(caches, [*convs, decode]):
            if reason := other_users(cache, op):
                return None, (f"cache {cache.name} is also used by {[u.name for u in cache.users if u is not op]}: "
                              "moving its in-place update to the fused op would reorder it")
        return _Chain(decode, norm, convs, conv_views, gate, gate_view, sigmoid, cast, logits, norm_gate_view), ""

    @staticmethod
    def _is_fp32_cast(node: Node) -> bool:
        """A pure dtype conversion to fp32 (no device, layout or memory-format change)."""
        src, out = tensor_val(node.args[0]), tensor_val(node)
        if src is None or out is None or out.dtype != torch.float32 or not src.is_floating_point():
            return False
        if node.target is aten.to.dtype:
            return not node.kwargs or set(node.kwargs) <= {"non_blocking", "copy"}
        return len(node.args) == 1 and set(node.kwargs) <= {"dtype"}

    @staticmethod
    def _shared_input(chain: _Chain, params: dict[str, str]) -> tuple[Node, Node, Node] | None:
        """(x, f_a's linear, f_b's linear) when every projection the fused op reads is
        ``linear(x, W)`` with W a parameter (no bias), the same x, and the forget gate's
        input is ``linear(linear(x, W_fa), W_fb)``, none of them with another reader; else None."""
        f_b = chain.gate_view.args[0]
        f_a = f_b.args[0] if is_call(f_b, {aten.linear.default}) else None
        linears = [*chain.projections(), f_a, f_b]
        if not all(is_linear_of_parameter(n, params) and len(n.users) == 1 for n in linears):
            return None
        x = linears[0].args[0]
        return (x, f_a, f_b) if all(n.args[0] is x for n in linears[:-1]) else None

    def _rewrite(self, gm: GraphModule, chain: _Chain, params: dict[str, str]) -> Rewrite:
        graph = gm.graph
        fused_nodes = chain.compute_nodes()
        intermediates = [*chain.convs, chain.gate, *([chain.cast] if chain.cast else []), chain.sigmoid, chain.decode]
        # Each intermediate is written once and read once by the next op of the chain.
        nbytes = sum(2 * numel_at_one(tensor_val(n)) * tensor_val(n).element_size() for n in intermediates)
        removed, name = chain.replaced(), chain.decode.name
        shared = self._shared_input(chain, params)
        with graph.inserting_before(chain.norm):
            if shared is None:
                fused = graph.call_function(k3.kda_decode_fused.default, chain.fused_args())
            else:  # the projections replaced by their input and weights, the other arguments as they were
                x, f_a, f_b = shared
                projections = [*chain.projections(), f_b, f_a]  # (erased in this order: users first)
                by_name = dict(zip(_arg_names(k3.kda_decode_fused.default), chain.fused_args(), strict=True))
                by_name.update(x=x, f_a_weight=f_a.args[1], f_b_weight=f_b.args[1],
                               **{w: p.args[1] for w, p in zip(_X_WEIGHTS, chain.projections(), strict=True)})
                fused = graph.call_function(k3.kda_decode_fused_proj.default,
                                            tuple(by_name[n] for n in _arg_names(k3.kda_decode_fused_proj.default)))
        fused.meta["nn_module_stack"] = chain.norm.meta.get("nn_module_stack", {})
        chain.norm.replace_all_uses_with(fused)
        for node in removed:
            graph.erase_node(node)
        if shared is not None:
            for node in projections:
                graph.erase_node(node)
            fused_nodes = [*projections, *fused_nodes]
        launches = 1 if shared is None else 3  # GPU: the GEMM over x, f_b's, the kernel
        names = [op_name(n) for n in fused_nodes]
        ops = ", ".join(f"{op} x{names.count(op)}" if names.count(op) > 1 else op for op in dict.fromkeys(names))
        stats = {
            "launches_removed": len(fused_nodes) - launches,
            "nodes_removed": len(removed),
            "nodes_added": 1,
            "bytes_removed": nbytes,
        }
        detail = (f"layer {layer_of(fused)}: {ops} -> {op_name(fused)} ({len(fused_nodes)} launches -> {launches}"
                  f"{'' if shared is None else ': one GEMM over the six weights that read x, f_b, the kernel'})")
        return Rewrite(name, detail, stats)


__all__ = ["FuseKDADecode"]
