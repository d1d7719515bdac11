"""Draw part of a graph (a layer, a module, named nodes) as SVG or DOT, without
graphviz or matplotlib.

:func:`draw_subgraph` selects nodes by the same layer / module criteria as
:meth:`~k3compile.records.record.PassRecord.filter` and returns a :class:`Subgraph`
(a networkx DiGraph) that renders in Jupyter. The layout is layered: rows are
topological generations, each ordered by the barycenter of its predecessors.
"""

from __future__ import annotations

import html
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch.fx import GraphModule, Node

from k3compile.records.snapshot import NodeLine, node_line

if TYPE_CHECKING:  # networkx is imported where a drawing is made: every compile imports this module
    import networkx as nx

_BOX_H = 34
_ROW_GAP = 46
_COL_GAP = 18
_CHAR_W = 7.0
_MARGIN = 12


@dataclass
class Subgraph:
    """Selected nodes of a graph with the edges among them (``graph``: networkx
    DiGraph whose nodes carry ``label``, ``op``, ``text``, ``module``, ``layer``,
    ``order``)."""

    graph: nx.DiGraph
    title: str = ""

    def to_dot(self) -> str:
        def q(s: str) -> str:
            return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'

        lines = [f"digraph {q(self.title or 'subgraph')} {{", "  rankdir=TB;", '  node [shape=box, fontname="monospace", fontsize=10];']
        for n, d in self.graph.nodes(data=True):
            lines.append(f"  {q(n)} [label={q(d['label'])}, tooltip={q(d['text'])}];")
        for u, v in self.graph.edges:
            lines.append(f"  {q(u)} -> {q(v)};")
        lines.append("}")
        return "\n".join(lines)

    def layout(self) -> dict[str, tuple[float, float, float]]:
        """Node -> (x center, y top, box width): rows are topological generations,
        ordered within a row by the barycenter of their predecessors."""
        import networkx as nx

        g = self.graph
        order = nx.get_node_attributes(g, "order")
        rank = {n: r for r, gen in enumerate(nx.topological_generations(g)) for n in gen}
        # Sources (weights, inputs) sit just above their first consumer, not all on top.
        for n in g.nodes:
            if g.in_degree(n) == 0 and g.out_degree(n) > 0:
                rank[n] = min(rank[s] for s in g.successors(n)) - 1
        depth = max(rank.values(), default=-1) + 1
        rows = [sorted((n for n in g.nodes if rank[n] == r), key=lambda n: order.get(n, 0)) for r in range(depth)]
        pos_idx: dict[str, float] = {}
        for row in rows:
            for i, n in enumerate(row):
                pos_idx[n] = i
        for _ in range(2):  # barycenter sweeps
            for r, row in enumerate(rows):
                if r == 0:
                    continue

                def key(n: str) -> tuple[float, int]:
                    preds = [pos_idx[p] for p in g.predecessors(n)]
                    return (sum(preds) / len(preds) if preds else pos_idx[n], order.get(n, 0))

                row.sort(key=key)
                for i, n in enumerate(row):
                    pos_idx[n] = i
        widths = {n: max(len(d["name_short"]), len(d["op_short"])) * _CHAR_W + 16 for n, d in g.nodes(data=True)}
        row_w = [sum(widths[n] for n in row) + _COL_GAP * max(len(row) - 1, 0) for row in rows]
        full = max(row_w, default=0)
        out: dict[str, tuple[float, float, float]] = {}
        for r, row in enumerate(rows):
            x = _MARGIN + (full - row_w[r]) / 2
            y = _MARGIN + r * (_BOX_H + _ROW_GAP)
            for n in row:
                out[n] = (x + widths[n] / 2, y, widths[n])
                x += widths[n] + _COL_GAP
        return out

    def to_svg(self) -> str:
        e = html.escape
        pos = self.layout()
        width = max((x + w / 2 for x, _, w in pos.values()), default=0) + _MARGIN
        height = max((y + _BOX_H for _, y, _ in pos.values()), default=0) + _MARGIN
        parts = [
            (
                f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
                f'viewBox="0 0 {width:.0f} {height:.0f}" font-family="ui-monospace,monospace" font-size="11">'
            ),
            (
                '<defs><marker id="k3arrow" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="7" '
                'markerHeight="7" orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="#666"/></marker></defs>'
            ),
        ]
        if self.title:
            parts.append(f"<title>{e(self.title)}</title>")
        for u, v in self.graph.edges:
            x1, y1, _ = pos[u]
            x2, y2, _ = pos[v]
            y1 += _BOX_H
            dy = (y2 - y1) / 2
            parts.append(
                f'<path d="M{x1:.1f},{y1:.1f} C{x1:.1f},{y1 + dy:.1f} {x2:.1f},{y2 - dy:.1f} {x2:.1f},{y2:.1f}" '
                'fill="none" stroke="#888" stroke-width="1.2" marker-end="url(#k3arrow)"/>'
            )
        for n, d in self.graph.nodes(data=True):
            x, y, w = pos[n]
            fill = _box_fill(d["op"])
            parts.append(
                f'<g><title>{e(d["text"])}{(chr(10) + e(d["module"])) if d["module"] else ""}</title>'
                f'<rect x="{x - w / 2:.1f}" y="{y:.1f}" width="{w:.1f}" height="{_BOX_H}" rx="4" '
                f'fill="{fill}" stroke="#555" stroke-width="1"/>'
                f'<text x="{x:.1f}" y="{y + 14:.1f}" text-anchor="middle" font-weight="bold">{e(d["name_short"])}</text>'
                f'<text x="{x:.1f}" y="{y + 27:.1f}" text-anchor="middle" fill="#333">{e(d["op_short"])}</text></g>'
            )
        parts.append("</svg>")
        return "".join(parts)

    def _repr_svg_(self) -> str:
        return self.to_svg()


def _box_fill(op: str) -> str:
    if op in ("placeholder", "get_attr"):
        return "#e8e8e8"
    if op == "output":
        return "#d9d9f3"
    if op.startswith("k3."):
        return "#d6e9fb"
    if "c10d" in op or "collective" in op:
        return "#fde2c4"
    if op.startswith("higher_order."):
        return "#efd9f7"
    return "#ffffff"


def _short(s: str, n: int = 40) -> str:
    return s if len(s) <= n else s[: n - 1] + "…"


def draw_subgraph(
    gm: GraphModule,
    module: str | None = None,
    layer: int | None = None,
    nodes: Iterable[str | Node] | None = None,
    max_nodes: int = 200,
) -> Subgraph:
    """The induced subgraph of the top-level nodes of ``gm`` that are in layer
    ``layer``, whose module path contains ``module`` and (if given) are named in
    ``nodes`` (all criteria must hold; none given selects every node).

    Raises ValueError when the selection is empty or has more than ``max_nodes`` nodes."""
    wanted: set[str] | None = None
    all_nodes = list(gm.graph.nodes)
    if nodes is not None:
        wanted = {n.name if isinstance(n, Node) else str(n) for n in nodes}
        unknown = wanted - {n.name for n in all_nodes}
        if unknown:
            raise ValueError(f"no such node(s) in the graph: {', '.join(sorted(unknown))}")
    selected: list[tuple[Node, NodeLine]] = []
    for node in all_nodes:
        if wanted is not None and node.name not in wanted:
            continue
        line = node_line(node)
        if line.matches(layer, module):
            selected.append((node, line))
    what = ", ".join(
        p for p in (f"layer={layer}" if layer is not None else "", f"module~{module!r}" if module is not None else "",
                    f"{len(wanted)} named node(s)" if wanted is not None else "") if p
    ) or "all nodes"
    if not selected:
        raise ValueError(f"draw_subgraph: the selection ({what}) is empty")
    if len(selected) > max_nodes:
        raise ValueError(
            f"draw_subgraph: the selection ({what}) has {len(selected)} nodes, more than max_nodes={max_nodes}; "
            "narrow it with layer=, module= or nodes=, or raise max_nodes"
        )
    import networkx as nx

    g = nx.DiGraph()
    names = {node.name for node, _ in selected}
    for i, (node, line) in enumerate(selected):
        op_short = line.op.removesuffix(".default")
        g.add_node(
            node.name,
            label=f"{node.name}\n{line.op}",
            op=line.op,
            text=line.text,
            module=line.module,
            layer=line.layer,
            order=i,
            name_short=_short(node.name),
            op_short=_short(op_short),
        )
    for node, _ in selected:
        for inp in node.all_input_nodes:
            if inp.name in names:
                g.add_edge(inp.name, node.name)
    return Subgraph(g, title=what)
