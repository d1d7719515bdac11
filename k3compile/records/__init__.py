"""What each pass did, in a form people can read: graph snapshots, diffs, summaries.

The pipeline snapshots the graph before and after every pass and keeps a
:class:`PassRecord` per pass and phase. One module per concept:

* :mod:`~k3compile.records.result`: what a pass reports (:class:`PassResult`, its
  rewrites and skipped candidates, the standard stats);
* :mod:`~k3compile.records.snapshot`: a graph as one readable line per node, with its
  module path and layer (:func:`snapshot`);
* :mod:`~k3compile.records.record`: :class:`PassRecord`: filters, unified diff, op-count
  deltas, the manifest's summary, text for the CLI;
* :mod:`~k3compile.records.text` / :mod:`~k3compile.records.html_diff`: the shared
  number formatting, the summary tables (:func:`pipeline_summary_text`,
  :func:`pipeline_summary_html`) and the side-by-side HTML diff for Jupyter;
* :mod:`~k3compile.records.graph_svg`: :func:`draw_subgraph`, part of a graph as SVG
  or DOT.
"""

from k3compile.records.graph_svg import Subgraph, draw_subgraph
from k3compile.records.html_diff import pipeline_summary_html
from k3compile.records.record import PassRecord
from k3compile.records.result import STANDARD_STATS, PassResult, Rewrite, Skipped
from k3compile.records.snapshot import GraphSnapshot, NodeLine, node_location, op_name, snapshot
from k3compile.records.text import pipeline_summary_text

__all__ = [
    "STANDARD_STATS",
    "GraphSnapshot",
    "NodeLine",
    "PassRecord",
    "PassResult",
    "Rewrite",
    "Skipped",
    "Subgraph",
    "draw_subgraph",
    "node_location",
    "op_name",
    "pipeline_summary_html",
    "pipeline_summary_text",
    "snapshot",
]
