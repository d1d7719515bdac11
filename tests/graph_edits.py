"""Hand edits of captured graphs for the pass tests: a value given one more reader, and a
pass run on an edited copy of a compiled program."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch.fx import GraphModule, Node

from k3compile.pipeline import PassContext, PassResult, lint_graph
from k3compile.targets import get_target


def run_on_edited_copy(compiled, graph_pass, edit: Callable[[GraphModule], Any]) -> tuple[PassResult, Any]:
    """``graph_pass`` (a GraphPass) on a copy of ``compiled``'s decode program (a
    CompileResult for the cpu target) after ``edit(gm)``, the graph linted after it:
    (the pass's result, what ``edit`` returned)."""
    captured = compiled.captured
    program = copy.deepcopy(captured.programs["decode"])
    gm = program.graph_module
    edited = edit(gm)
    ctx = PassContext(captured.config, captured.plan, get_target("cpu"), "decode", program, captured.specs)
    result = graph_pass.run(gm, ctx)
    lint_graph(gm)
    return result, edited


def read_also(gm: GraphModule, value: Node, output: Node) -> Node:
    """Make ``output``'s users read ``output + mean(value)``: ``value`` gets a reader outside
    whatever chain a pass would fuse (it "is computed anyway"). Returns the mean node."""
    graph = gm.graph
    with graph.inserting_after(output):
        mean = graph.call_function(torch.ops.aten.mean.default, (value,))
    with graph.inserting_after(mean):
        bumped = graph.call_function(torch.ops.aten.add.Tensor, (output, mean))
    output.replace_all_uses_with(bumped, delete_user_cb=lambda user: user is not bumped)
    return mean
