"""Sink copies into the ``torch.cond`` branches that read them; delete the unread ones.

Serving code often prepares an input for a fast kernel (a padded, packed or cast copy)
and only then branches between the fast kernel and a fallback that reads the original
(``k3compile/model/gemm.py``). Whenever the fallback runs, the copy is wasted: a kernel
launch and its bytes, per call. This pass moves such a copy into the branch that reads
it, so the other branch no longer pays for it, and deletes a copy no branch reads.

Matches any cond operand that is a pure copy-like node (data movement only: ``clone``,
``_to_copy``, ``pad``/``constant_pad_nd``, functional ``copy`` into a fresh buffer, view
copies) whose only user is that cond. Inside the branch the copy is rebuilt from the
branch's own inputs: its tensor arguments become cond operands if they are not already,
and the size arithmetic its arguments use (``sym_size``, ``-``, ``%`` ...) is recomputed
there. Nested conds are handled by running the same rewrite inside every branch.

Before (the KDA output projection of ``tiny``, decode)::

    %mod  = operator.mod(-%sym_size_int, 16)
    %pad  = aten.pad(%reshape, [0, 0, 0, %mod])                     # staging copy
    %cond = cond(%ge, %true_graph_0, %false_graph_0, (%reshape, %p_o_proj_weight, %pad))
        true_graph_0(reshape, w, pad):   linear(pad, w)[:T]          # reads the copy
        false_graph_0(reshape, w, pad):  linear(reshape, w)          # does not

After::

    %cond = cond(%ge, %true_graph_0, %false_graph_0, (%reshape, %p_o_proj_weight))
        true_graph_0(reshape, w):  pad = aten.pad(reshape, [0, 0, 0, -sym_size(reshape, 0) % 16])
                                   linear(pad, w)[:T]
        false_graph_0(reshape, w): linear(reshape, w)

Never moved: a node with side effects (a mutable schema) or that is not copy-like, a
copy with any user outside the cond (it must exist there anyway), a copy both branches
read (moving it would duplicate it, not remove it). Each is reported with the reason.

Stats (per decode step, summed over conds): ``copies_moved``, ``copies_deleted``, and
for each predicate outcome the kernel launches and bytes no longer spent
(``launches_removed_if_false`` ...; bytes are counted at one token per sequence and one
sequence, read + write, with the staging buffer's padded size).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import Graph, GraphModule, Node

from k3compile.pipeline.interface import GraphPass, PassContext, PassResult, Rewrite, Skipped, register_pass
from k3compile.pipeline.node_queries import numel_at_one
from k3compile.targets import DEVICE_KINDS

aten = torch.ops.aten
COND = torch.ops.higher_order.cond

#: Ops that only move or convert data: no arithmetic that a branch could depend on
#: being shared, no side effects.
COPY_LIKE = frozenset(
    p.overloadpacket if hasattr(p, "overloadpacket") else p
    for p in (
        aten.clone, aten._to_copy, aten.pad, aten.constant_pad_nd, aten.copy, aten.contiguous,
        aten.view_copy, aten.permute_copy, aten.expand_copy, aten.slice_copy, aten.transpose_copy,
        aten.slice_scatter, aten.select_scatter,
        aten.empty_like, aten.zeros_like, aten.new_empty, aten.new_zeros, aten.zeros, aten.empty,
    )
)

def _is_copy(node: Node) -> bool:
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    return target.overloadpacket in COPY_LIKE and not target._schema.is_mutable


def _is_scalar(node: Node) -> bool:
    """Size arithmetic (a SymInt/int/bool value computed by a pure call)."""
    return node.op == "call_function" and not isinstance(node.meta.get("val"), torch.Tensor) and not (
        isinstance(node.target, torch._ops.OpOverload) and node.target._schema.is_mutable
    )


def _placeholders(gm: GraphModule) -> list[Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]




def _copy_bytes(node: Node) -> int:
    """Bytes read + written by one copy at one token: the output plus its tensor inputs."""
    out = node.meta["val"]
    total = numel_at_one(out) * out.element_size()
    for arg in node.args:
        if isinstance(arg, Node) and isinstance(arg.meta.get("val"), torch.Tensor):
            total += numel_at_one(arg.meta["val"]) * arg.meta["val"].element_size()
    return total


@dataclass
class _Cond:
    """One cond node with its two branch modules and its operand list (edited in place)."""

    node: Node
    branches: tuple[GraphModule, GraphModule]
    operands: list

    def add_operand(self, value: Node) -> None:
        """Pass one more tensor into both branches (a new last placeholder in each)."""
        self.operands.append(value)
        for branch in self.branches:
            last = _placeholders(branch)[-1]
            with branch.graph.inserting_after(last):
                ph = branch.graph.placeholder(value.name)
            ph.meta = {k: v for k, v in value.meta.items() if k in ("val", "tensor_meta", "placement")}

        self._sync()

    def remove_operand(self, index: int) -> None:
        for branch in self.branches:
            branch.graph.erase_node(_placeholders(branch)[index])
        self.operands.pop(index)
        self._sync()

    def _sync(self) -> None:
        self.node.args = (*self.node.args[:3], tuple(self.operands))


@register_pass
class SinkCopies(GraphPass):
    """Move cond operands that are copies into the one branch that reads them."""

    name = "sink_copies"
    default_on = frozenset(DEVICE_KINDS)

    def run(self, gm: GraphModule, ctx: PassContext) -> PassResult:
        result = PassResult(changed=False)
        self._sink_in(gm, "", result)
        result.changed = result.matches > 0
        return result

    def _sink_in(self, gm: GraphModule, scope: str, result: PassResult) -> None:
        for node in [n for n in gm.graph.nodes if n.target is COND]:
            cond = _Cond(node, (getattr(gm, node.args[1].target), getattr(gm, node.args[2].target)), list(node.args[3]))
            for index in reversed(range(len(cond.operands))):
                self._consider(gm, cond, index, scope, result)
            for branch_index, branch in enumerate(cond.branches):
                branch.graph.lint()
                branch.recompile()
                self._sink_in(branch, f"{scope}{node.args[1 + branch_index].target}.", result)
        _erase_dead_scalars(gm.graph)

    def _consider(self, gm: GraphModule, cond: _Cond, index: int, scope: str, result: PassResult) -> None:
        copy = cond.operands[index]
        if not (isinstance(copy, Node) and _is_copy(copy)):
            return  # only copies are candidates
        name = f"{scope}{copy.name}"
        outside = [u.name for u in copy.users if u is not cond.node]
        if outside or cond.operands.count(copy) > 1:
            result.skipped.append(Skipped(name, f"also used outside the cond ({', '.join(outside) or 'twice'})"))
            return
        readers = [i for i, b in enumerate(cond.branches) if _placeholders(b)[index].users]
        if len(readers) == 2:
            result.skipped.append(Skipped(name, "read by both branches: moving it would duplicate it"))
            return
        chain = _copy_chain(copy)
        nbytes = sum(_copy_bytes(n) for n in chain)
        if readers:
            self._rebuild_in_branch(cond, index, readers[0], chain)
        cond.remove_operand(index)
        for node in reversed(chain):
            gm.graph.erase_node(node)
        outcome = ("true", "false")
        for side in (outcome[i] for i in range(2) if i not in readers):
            result.add_stats({f"launches_removed_if_{side}": len(chain), f"bytes_removed_if_{side}": nbytes})
        result.add_stats({"copies_moved" if readers else "copies_deleted": 1})
        ops = " + ".join(str(n.target) for n in chain)
        where = f"moved into the {outcome[readers[0]]} branch" if readers else "deleted (no branch reads it)"
        result.rewrites.append(Rewrite(name, f"{ops}: {where}", {"launches": len(chain), "bytes": nbytes}))
        result.matches += 1

    def _rebuild_in_branch(self, cond: _Cond, index: int, branch_index: int, chain: list[Node]) -> None:
        """Recreate ``chain`` (ending in operand ``index``) at the top of one branch from
        the branch's inputs, and point the branch's readers at the rebuilt copy. Values
        the chain reads that the branch does not see yet (tensors, sizes) become operands."""
        branch = cond.branches[branch_index]
        built: dict[Node, Node] = {}

        def inside(arg: Node) -> Node:
            if arg in built:
                return built[arg]
            if arg not in cond.operands or arg is chain[-1]:
                cond.add_operand(arg)
            return _placeholders(branch)[cond.operands.index(arg)]

        first = next(n for n in branch.graph.nodes if n.op != "placeholder")
        for node in chain:
            args = torch.fx.node.map_arg(node.args, inside)
            kwargs = torch.fx.node.map_arg(node.kwargs, inside)
            with branch.graph.inserting_before(first):
                built[node] = branch.graph.call_function(node.target, args, kwargs)
            built[node].meta = dict(node.meta)
        _placeholders(branch)[index].replace_all_uses_with(built[chain[-1]])


def copies_confined_to_one_branch(gm: GraphModule) -> list[str]:
    """Copies (at any nesting level) made outside a cond and read by only one of its
    branches and nowhere else: what this pass leaves none of."""
    found = []
    for node in [n for n in gm.graph.nodes if n.target is COND]:
        branches = [getattr(gm, node.args[i].target) for i in (1, 2)]
        for index, operand in enumerate(node.args[3]):
            if isinstance(operand, Node) and _is_copy(operand) and set(operand.users) == {node}:
                if sum(bool(_placeholders(b)[index].users) for b in branches) < 2:
                    found.append(operand.name)
        for branch in branches:
            found += copies_confined_to_one_branch(branch)
    return found


def _copy_chain(copy: Node) -> list[Node]:
    """``copy`` and the copy-like nodes before it that only it (transitively) uses, in
    graph order: e.g. a staging buffer's allocation and the copy into it."""
    chain = [copy]
    frontier = [copy]
    while frontier:
        node = frontier.pop()
        for arg in node.all_input_nodes:
            if arg not in chain and _is_copy(arg) and all(u in chain for u in arg.users):
                chain.append(arg)
                frontier.append(arg)
    order = {n: i for i, n in enumerate(copy.graph.nodes)}
    return sorted(chain, key=order.__getitem__)


def _erase_dead_scalars(graph: Graph) -> None:
    """Size arithmetic left without users once its copies moved."""
    for node in reversed(list(graph.nodes)):
        if _is_scalar(node) and not node.users:
            graph.erase_node(node)
