"""Hand edits of captured graphs for the pass tests: a value given one more reader."""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node


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
