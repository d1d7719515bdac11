"""Pass records: snapshots, diffs, summaries, HTML/text rendering, subgraph drawing.

Real graphs only: ``torch.fx.symbolic_trace`` of toy modules and ``torch.export``
programs (with ``layers.N.proj`` module paths), rewritten by hand the way a pass would.
"""

from __future__ import annotations

import copy
import json
import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass

import pytest
import torch
from torch import nn
from torch.export import Dim
from torch.fx.passes.shape_prop import ShapeProp

from k3compile.pipeline import PassResult, Skipped
from k3compile.records import (
    GraphSnapshot,
    NodeLine,
    PassRecord,
    Subgraph,
    draw_subgraph,
    pipeline_summary_html,
    pipeline_summary_text,
    snapshot,
)

aten = torch.ops.aten
SVG = "{http://www.w3.org/2000/svg}"


@dataclass
class Report:
    max_error: float
    tolerance: float
    ok: bool


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.proj(x)).clone()


class Stack(nn.Module):
    def __init__(self, n: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class CondModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.layers[0].proj(x)
        return torch.cond(x.shape[0] < 4, lambda t: t.sin(), lambda t: t.cos(), (y,))[0]


@pytest.fixture(scope="module")
def program():
    torch.manual_seed(0)
    return torch.export.export(Stack(), (torch.randn(3, 4),), dynamic_shapes={"x": {0: Dim("b", min=2)}})


def _node(gm, name):
    return next(n for n in gm.graph.nodes if n.name == name)


def remove_clone(gm, name: str) -> None:
    """The rewrite of a 'drop redundant clone' pass."""
    node = _node(gm, name)
    node.replace_all_uses_with(node.args[0])
    gm.graph.erase_node(node)
    gm.recompile()


def relu_to_gelu(gm, name: str) -> None:
    node = _node(gm, name)
    with gm.graph.inserting_after(node):
        new = gm.graph.call_function(aten.gelu.default, (node.args[0],))
    new.meta.update(node.meta)
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)
    gm.recompile()


@pytest.fixture(scope="module")
def clone_record(program):
    gm = program.graph_module
    after = copy.deepcopy(gm)
    remove_clone(after, "clone")  # layer 0; its user linear_1 is in layer 1
    result = PassResult(
        changed=True,
        matches=1,
        stats={"nodes_removed": 1, "bytes_removed": 48.0, "launches_removed": 1},
        skipped=[Skipped("clone_1", "output <aliased> by a view"), Skipped("clone_2", "feeds the graph output")],
    )
    return PassRecord("drop_clone", "decode", snapshot(gm), snapshot(after), result, Report(1.5e-7, 1e-4, True), 0.0123)


def _diff_body(diff: str) -> tuple[list[str], list[str]]:
    lines = diff.splitlines()
    minus = [ln[1:] for ln in lines if ln.startswith("-") and not ln.startswith("---")]
    plus = [ln[1:] for ln in lines if ln.startswith("+") and not ln.startswith("+++")]
    return minus, plus


# ---------------------------------------------------------------------------
# Snapshots
# ---------------------------------------------------------------------------


def test_snapshot_of_exported_program(program):
    snap = snapshot(program.graph_module)
    by = snap.by_name()
    assert [ln.name for ln in snap.lines][:7] == [
        "p_layers_0_proj_weight", "p_layers_0_proj_bias", "p_layers_1_proj_weight", "p_layers_1_proj_bias",
        "p_layers_2_proj_weight", "p_layers_2_proj_bias", "x",
    ]  # fmt: skip
    assert len(snap) == 7 + 9 + 1
    lin = by["linear_1"]
    assert lin.op == "aten.linear.default"
    assert lin.module == "layers.1.proj" and lin.layer == 1
    assert re.fullmatch(
        r"%linear_1 = aten\.linear\.default\(%clone, %p_layers_1_proj_weight, %p_layers_1_proj_bias\) : \(s\d+, 4\) f32",
        lin.text,
    ), lin.text
    assert by["relu_2"].module == "layers.2" and by["relu_2"].layer == 2
    assert by["x"].op == "placeholder" and by["x"].layer is None and by["x"].module == ""
    assert re.fullmatch(r"%x = placeholder : \(s\d+, 4\) f32", by["x"].text)
    # Parameters: layer from export's names; module path when the signature is given.
    assert by["p_layers_2_proj_bias"].layer == 2 and by["p_layers_2_proj_bias"].module == ""
    assert by["p_layers_2_proj_bias"].text == "%p_layers_2_proj_bias = placeholder : (4,) f32"
    with_sig = snapshot(program.graph_module, program).by_name()
    assert with_sig["p_layers_2_proj_bias"].module == "layers.2.proj"
    assert by["output"].text == "%output = output(%clone_2)"
    assert snap.op_counts == {"aten.clone.default": 3, "aten.linear.default": 3, "aten.relu.default": 3}
    assert isinstance(snap.lines[0], NodeLine)


def test_snapshot_of_symbolic_trace_with_shapes_and_placements():
    torch.manual_seed(0)
    gm = torch.fx.symbolic_trace(Stack(2))
    ShapeProp(gm).propagate(torch.randn(3, 4))

    class Placement:
        def __init__(self, s: str) -> None:
            self.s = s

        def __str__(self) -> str:
            return self.s

    for node in gm.graph.nodes:
        node.meta["placement"] = Placement("S(1)" if node.op == "call_module" else "R")
    snap = snapshot(gm)
    by = snap.by_name()
    assert by["layers_0_proj"].op == "module.layers.0.proj"
    assert by["layers_0_proj"].module == "layers.0.proj" and by["layers_0_proj"].layer == 0
    assert by["layers_0_proj"].text == "%layers_0_proj = module.layers.0.proj(%x) : (3, 4) f32 [S(1)]"
    assert by["clone_1"].op == "method.clone" and by["clone_1"].layer == 1
    assert by["clone_1"].text == "%clone_1 = method.clone(%relu_1) : (3, 4) f32 [R]"
    assert by["relu"].op == "torch.relu"
    assert snap.op_counts == {"method.clone": 2, "module.layers.0.proj": 1, "module.layers.1.proj": 1, "torch.relu": 2}

    # A hand-written rewrite on the traced graph, recorded.
    after = copy.deepcopy(gm)
    remove_clone(after, "clone")
    rec = PassRecord("drop_clone", "prefill", snap, snapshot(after), PassResult(True, 1), None, 0.001)
    assert rec.changed_nodes() == {"clone", "layers_1_proj"}
    assert rec.op_count_delta() == {"method.clone": -1}
    minus, plus = _diff_body(rec.unified_diff())
    assert minus == [
        "%clone = method.clone(%relu) : (3, 4) f32 [R]",
        "%layers_1_proj = module.layers.1.proj(%clone) : (3, 4) f32 [S(1)]",
    ]
    assert plus == ["%layers_1_proj = module.layers.1.proj(%relu) : (3, 4) f32 [S(1)]"]


def test_snapshot_includes_branch_subgraphs():
    ep = torch.export.export(CondModel(), (torch.randn(5, 4),), dynamic_shapes={"x": {0: Dim("b", min=2)}})
    gm = ep.graph_module
    snap = snapshot(gm)
    names = [ln.name for ln in snap.lines]
    i = names.index("true_graph_0")
    assert names[i + 1 : i + 4] == ["true_graph_0.linear", "true_graph_0.sin", "true_graph_0.output"]
    sin = snap.by_name()["true_graph_0.sin"]
    assert sin.op == "aten.sin.default"
    assert re.fullmatch(r"  %true_graph_0\.sin = aten\.sin\.default\(%true_graph_0\.linear\) : \(s\d+, 4\) f32", sin.text)
    assert snap.op_counts["aten.sin.default"] == 1 and snap.op_counts["higher_order.cond"] == 1
    assert re.search(r"%lt = operator\.lt\(%sym_size_int_\d+, 4\) : s\d+ < 4", snap.to_text())

    # Rewrite inside a branch: the diff and the op counts see it.
    after = copy.deepcopy(gm)
    branch = after.true_graph_0
    sin_node = _node(branch, "sin")
    with branch.graph.inserting_after(sin_node):
        neg = branch.graph.call_function(aten.neg.default, (sin_node.args[0],))
    neg.meta.update(sin_node.meta)
    sin_node.replace_all_uses_with(neg)
    branch.graph.erase_node(sin_node)
    branch.recompile()
    rec = PassRecord("sin_to_neg", "decode", snap, snapshot(after), PassResult(True, 1), None, 0.0)
    assert rec.op_count_delta() == {"aten.neg.default": 1, "aten.sin.default": -1}
    assert rec.changed_nodes() == {"true_graph_0.sin", "true_graph_0.neg_default", "true_graph_0.output"}
    minus, plus = _diff_body(rec.unified_diff())
    assert [m.strip().split(" =")[0] for m in minus] == ["%true_graph_0.sin", "%true_graph_0.output"]
    assert [p.strip().split(" =")[0] for p in plus] == ["%true_graph_0.neg_default", "%true_graph_0.output"]
    # HTML escapes the '<' of the branch predicate.
    page = rec._repr_html_()
    assert "k3rec-rrep" in page and "k3rec-rchg" in page  # sin -> neg; the branch output
    assert "… 6 unchanged nodes …" in page  # the predicate's stretch is folded ...
    full = rec.to_html(fold=False)  # ... and shown when asked, escaped
    assert "unchanged nodes" not in full
    assert re.search(r"%lt = operator\.lt\(%sym_size_int_\d+, 4\) : s\d+ &lt; 4</td>", full)
    assert "< 4" not in full


# ---------------------------------------------------------------------------
# Records
# ---------------------------------------------------------------------------


def test_diff_changed_nodes_and_op_deltas(clone_record):
    rec = clone_record
    by = rec.before.by_name()
    minus, plus = _diff_body(rec.unified_diff())
    assert minus == [by["clone"].text, by["linear_1"].text]
    assert plus == [by["linear_1"].text.replace("(%clone,", "(%relu,")]
    assert rec.changed_nodes() == {"clone", "linear_1"}
    assert rec.op_count_delta() == {"aten.clone.default": -1}
    assert len(rec.before) == 17 and len(rec.after) == 16


def test_filter_restricts_diff(clone_record):
    rec = clone_record
    by = rec.before.by_name()
    minus, plus = _diff_body(rec.unified_diff(layer=0))
    assert minus == [by["clone"].text] and plus == []
    minus, plus = _diff_body(rec.unified_diff(layer=1))
    assert minus == [by["linear_1"].text] and len(plus) == 1 and "%relu," in plus[0]
    assert rec.unified_diff(layer=2) == ""
    minus, plus = _diff_body(rec.unified_diff(module="layers.1.proj"))
    assert minus == [by["linear_1"].text] and len(plus) == 1

    view = rec.filter(layer=0)
    assert isinstance(view, PassRecord) and view.scope == "layer=0"
    assert {ln.layer for ln in view.before.lines} == {0}
    # Layer 0: two parameters and linear, relu, clone.
    assert [ln.name for ln in view.before.lines] == [
        "p_layers_0_proj_weight", "p_layers_0_proj_bias", "linear", "relu", "clone",
    ]  # fmt: skip
    assert view.changed_nodes() == {"clone"}
    assert view.op_count_delta() == {"aten.clone.default": -1}
    assert rec.filter(layer=1).op_count_delta() == {}
    assert rec.filter(layer=1).changed_nodes() == {"linear_1"}
    assert rec.filter(layer=1, module="proj").changed_nodes() == {"linear_1"}
    assert [ln.name for ln in rec.filter(layer=1, module="proj").after.lines] == ["linear_1"]
    assert "(layer=0)" in view.unified_diff().splitlines()[0]
    assert rec.filter() is rec


def test_summary_is_json(clone_record):
    s = json.loads(json.dumps(clone_record.summary()))
    assert s == {
        "pass": "drop_clone",
        "phase": "decode",
        "changed": True,
        "matches": 1,
        "stats": {"nodes_removed": 1, "bytes_removed": 48, "launches_removed": 1},
        "skipped": 2,
        "skipped_reasons": [
            {"node": "clone_1", "reason": "output <aliased> by a view"},
            {"node": "clone_2", "reason": "feeds the graph output"},
        ],
        "rewrites": [],
        "nodes_before": 17,
        "nodes_after": 16,
        "op_count_delta": {"aten.clone.default": -1},
        "validation": {"max_error": 1.5e-7, "tolerance": 1e-4, "ok": True},
        "seconds": 0.0123,
    }
    unvalidated = PassRecord("p", "prefill", clone_record.before, clone_record.before, PassResult(False), None, 0.5)
    s = json.loads(json.dumps(unvalidated.summary()))
    assert s["validation"] is None and s["changed"] is False and s["op_count_delta"] == {}
    assert s["skipped"] == 0 and s["skipped_reasons"] == [] and s["stats"] == {}
    # Non-finite errors and tensor-valued stats stay JSON-safe.
    odd = PassRecord(
        "p", "decode", clone_record.before, clone_record.after,
        PassResult(True, 2, {"flops_removed": torch.tensor(3.0), "ratio": 0.25}), Report(float("nan"), 1e-4, False), 0.1,
    )  # fmt: skip
    s = json.loads(json.dumps(odd.summary(), allow_nan=False))
    assert s["stats"] == {"flops_removed": 3, "ratio": 0.25}
    assert s["validation"] == {"max_error": "nan", "tolerance": 1e-4, "ok": False}


def test_to_text(clone_record):
    text = clone_record.to_text()
    lines = text.splitlines()
    assert lines[0] == "== drop_clone [decode]: changed, 1 match(es), nodes 17 -> 16, 12.3 ms"
    assert "   stats: nodes_removed=1, bytes_removed=48, launches_removed=1" in lines
    assert "   ops:   aten.clone.default -1" in lines
    assert "   validation: max error 1.50e-07 (tolerance 1.0e-04) ok" in lines
    assert "     clone_1: output <aliased> by a view" in lines
    assert "-" + clone_record.before.by_name()["clone"].text in lines
    assert "\x1b[" not in text  # no terminal escapes
    short = clone_record.to_text(diff=False)
    assert text.startswith(short + "\n--- drop_clone/decode before") and "@@" not in short


def test_html(clone_record):
    page = clone_record._repr_html_()
    assert page.startswith('<div class="k3rec"><style>') and page.endswith("</div>")
    assert "<script" not in page and "http" not in page and "<link" not in page
    assert "<b>drop_clone</b>" in page and "decode" in page
    # Header: stats, op deltas, validation, skipped reasons (escaped).
    assert "bytes_removed=<b>48</b>" in page
    assert "aten.clone.default <b>-1</b>" in page
    assert "max error 1.50e-07 (tolerance 1.0e-04) ok" in page
    assert "skipped 2 candidate(s)" in page
    assert "<td>output &lt;aliased&gt; by a view</td>" in page and "<aliased>" not in page
    # Diff rows: the removed clone in red, linear_1 changed in yellow, the token that changed marked.
    assert re.search(r'<td class="k3rec-del"[^>]*>%clone = aten\.clone\.default\(%relu\)', page)
    assert '<tr class="k3rec-rdel">' in page and '<td class="k3rec-nil"></td>' in page
    assert page.count('<tr class="k3rec-rchg">') == 1
    assert '<span class="k3rec-hl">clone</span>' in page and '<span class="k3rec-hl">relu</span>' in page
    assert "k3rec-add" not in page.split("</style>")[1]  # nothing only added
    # 7 placeholders + linear + relu unchanged at the top: 7 collapsed, 2 shown as context.
    assert "… 7 unchanged nodes …" in page
    assert page.count('<tr class="k3rec-rsame">') == 2 + 6  # context + the short stretch after the change
    assert 'title="layers.1.proj (layer 1)"' in page
    # A filtered record renders only its nodes.
    sub = clone_record.filter(layer=0)._repr_html_()
    assert "layer=0" in sub and "linear_1" not in sub.split("</style>")[1]


def test_html_styles_are_scoped_and_keep_graph_lines_whole(clone_record):
    """Notebook front ends style every output table (JupyterLab and nbconvert: cells
    right-aligned with ``white-space: normal``, up to ``:not(.jp-RenderedMarkdown)
    .jp-RenderedHTMLCommon td``): the diff's cells are left-aligned and never wrap, with
    rules that win over those, and no rule reaches outside our own classes."""
    from k3compile.records.html_diff import STYLE

    css = STYLE.removeprefix("<style>").removesuffix("</style>").replace("\n", "")
    rules = re.findall(r"([^{}]+)\{([^{}]*)\}", css)
    assert rules and re.sub(r"[^{}]+\{[^{}]*\}", "", css) == ""  # every rule parsed
    declared: dict[str, str] = {}
    for selectors, body in rules:
        for sel in selectors.split(","):
            assert re.match(r"\.k3(rec|sum)", sel.strip()), f"unscoped selector {sel!r}"
            declared[sel.strip()] = declared.get(sel.strip(), "") + body + ";"
    assert "text-align:left!important" in declared[".k3rec table td"]
    assert "text-align:left!important" in declared[".k3rec table th"]
    cell = declared[".k3rec table.k3rec-diff td"]
    for prop in ("white-space:pre!important", "word-break:normal!important", "overflow-wrap:normal!important"):
        assert prop in cell
    assert "monospace" in declared[".k3rec table.k3rec-diff"]
    assert "overflow-x:auto" in declared[".k3rec .k3rec-scroll"]
    assert "break-all" not in css and "pre-wrap" not in css
    assert "margin:0" in declared[".k3rec table.k3rec-diff"]  # not centred by the front end's table rule
    # Line numbers and the summary's numbers are the only right-aligned cells.
    assert "text-align:right!important" in declared[".k3rec table.k3rec-diff td.k3rec-no"]
    page = clone_record._repr_html_()
    assert '<div class="k3rec-scroll"><table class="k3rec-diff">' in page
    assert '<th class="k3rec-no"></th><th>before</th>' in page
    summary = pipeline_summary_html([clone_record])
    assert '<div class="k3rec-scroll"><table class="k3sum">' in summary and '<th class="k3sum-num">matches</th>' in summary


def test_html_added_and_replaced_rows(program):
    gm = program.graph_module
    after = copy.deepcopy(gm)
    relu_to_gelu(after, "relu_1")
    rec = PassRecord("relu_to_gelu", "prefill", snapshot(gm), snapshot(after), PassResult(True, 1), None, 0.0)
    assert rec.op_count_delta() == {"aten.gelu.default": 1, "aten.relu.default": -1}
    assert rec.changed_nodes() == {"relu_1", "gelu_default", "clone_1"}
    page = rec._repr_html_()
    # relu_1 and gelu sit in one row: red left, green right.
    assert re.search(
        r'<tr class="k3rec-rrep">.*?<td class="k3rec-del"[^>]*>%relu_1 = .*?<td class="k3rec-add"[^>]*>%gelu_default = aten\.gelu',
        page,
    )
    minus, plus = _diff_body(rec.unified_diff(layer=1))
    assert [m.split(" =")[0] for m in minus] == ["%relu_1", "%clone_1"]
    assert [p.split(" =")[0] for p in plus] == ["%gelu_default", "%clone_1"]


def test_unchanged_record_collapses_everything(program):
    snap = snapshot(program.graph_module)
    rec = PassRecord("noop", "decode", snap, snap, PassResult(False), None, 0.0)
    assert rec.unified_diff() == "" and rec.changed_nodes() == set() and rec.op_count_delta() == {}
    page = rec._repr_html_()
    assert f"… {len(snap)} unchanged nodes …" in page
    assert "k3rec-rsame" not in page


def test_pipeline_summary(program, clone_record):
    snap = snapshot(program.graph_module)
    noop = PassRecord("sink_copies", "decode", snap, snap, PassResult(False, 0, {}, [Skipped("clone", "no branch")]), None, 0.002)
    prefill = PassRecord("drop_clone", "prefill", snap, clone_record.after, clone_record.result, Report(2e-6, 1e-4, True), 0.5)
    records = [clone_record, noop, prefill]

    page = pipeline_summary_html(records)
    assert page.count('<tr class="k3sum-row') == 3
    assert page.count('<tr class="k3sum-row k3sum-changed">') == 2
    rows = re.findall(r'<tr class="k3sum-row[^"]*">(.*?)</tr>', page)
    cells = [re.findall(r"<td[^>]*>(.*?)</td>", r) for r in rows]
    assert cells[0] == ["drop_clone", "decode", "yes", "1", "17 -&gt; 16",
                        "nodes_removed=1, launches_removed=1, bytes_removed=48", "1.50e-07", "0.012"]  # fmt: skip
    assert cells[1] == ["sink_copies", "decode", "no", "0", "17 -&gt; 17", "-", "-", "0.002"]
    assert cells[2][:2] == ["drop_clone", "prefill"] and cells[2][6] == "2.00e-06"
    assert page.count("<details><summary>") == 2  # one diff per changed record
    assert "<script" not in page

    text = pipeline_summary_text(records)
    lines = text.splitlines()
    assert lines[0].split() == ["pass", "phase", "changed", "matches", "nodes", "stats", "max", "error", "seconds"]
    body = lines[2:-1]
    assert len(body) == 3
    assert body[0].split()[:6] == ["drop_clone", "decode", "yes", "1", "17", "->"]
    assert body[1].split() == ["sink_copies", "decode", "no", "0", "17", "->", "17", "-", "-", "0.002"]
    assert lines[-1] == "3 record(s), 2 changed, 0.514 s"


# ---------------------------------------------------------------------------
# Subgraph drawing
# ---------------------------------------------------------------------------


def test_draw_subgraph_layer(program):
    sub = draw_subgraph(program.graph_module, layer=0)
    assert isinstance(sub, Subgraph)
    g = sub.graph
    assert set(g.nodes) == {"p_layers_0_proj_weight", "p_layers_0_proj_bias", "linear", "relu", "clone"}
    assert set(g.edges) == {
        ("p_layers_0_proj_weight", "linear"), ("p_layers_0_proj_bias", "linear"), ("linear", "relu"), ("relu", "clone"),
    }  # fmt: skip
    assert g.nodes["linear"]["label"] == "linear\naten.linear.default"
    assert g.nodes["linear"]["module"] == "layers.0.proj" and g.nodes["relu"]["layer"] == 0

    root = ET.fromstring(sub._repr_svg_())
    assert root.tag == f"{SVG}svg"
    assert len(root.findall(f".//{SVG}rect")) == 5
    edges = [p for p in root.findall(f"{SVG}path") if p.get("marker-end")]
    assert len(edges) == 4
    texts = [t.text for t in root.iter(f"{SVG}text")]
    assert "linear" in texts and "aten.linear" in texts and "aten.clone" in texts
    # Rows follow data flow: parameters above linear above relu above clone.
    ys = {}
    for grp in root.findall(f"{SVG}g"):
        ys[grp.find(f"{SVG}text").text] = float(grp.find(f"{SVG}rect").get("y"))
    assert ys["p_layers_0_proj_weight"] < ys["linear"] < ys["relu"] < ys["clone"]

    dot = sub.to_dot()
    assert dot.startswith('digraph "layer=0" {') and dot.rstrip().endswith("}")
    assert '"linear" -> "relu";' in dot and '"p_layers_0_proj_bias" -> "linear";' in dot
    assert '"clone" [label="clone\\naten.clone.default"' in dot
    assert dot.count("->") == 4


def test_draw_subgraph_selection(program):
    gm = program.graph_module
    sub = draw_subgraph(gm, module="proj")
    assert set(sub.graph.nodes) == {"linear", "linear_1", "linear_2"} and sub.graph.number_of_edges() == 0
    sub = draw_subgraph(gm, nodes=["x", "linear", "relu", "linear_1"])
    assert set(sub.graph.edges) == {("x", "linear"), ("linear", "relu")}
    sub = draw_subgraph(gm, layer=1, nodes=["x", "linear_1", "relu_1"])
    assert set(sub.graph.nodes) == {"linear_1", "relu_1"}
    ET.fromstring(sub.to_svg())
    # Escaping in SVG/DOT: a '<' in what a node prints.
    ep = torch.export.export(CondModel(), (torch.randn(5, 4),), dynamic_shapes={"x": {0: Dim("b", min=2)}})
    sub = draw_subgraph(ep.graph_module)
    root = ET.fromstring(sub.to_svg())
    tips = [t.text for t in root.iter(f"{SVG}title") if t.text and t.text.startswith("%lt")]
    assert len(tips) == 1 and tips[0].endswith("< 4")
    (pred,) = sub.graph.predecessors("lt")
    assert pred.startswith("sym_size_int") and list(sub.graph.predecessors(pred)) == ["x"]
    assert set(sub.graph.predecessors("cond")) == {"lt", "true_graph_0", "false_graph_0", "linear"}


def test_draw_subgraph_rejects_empty_and_large(program):
    gm = program.graph_module
    with pytest.raises(ValueError, match="empty"):
        draw_subgraph(gm, layer=99)
    with pytest.raises(ValueError, match="empty"):
        draw_subgraph(gm, module="no_such_module")
    with pytest.raises(ValueError, match="max_nodes=4"):
        draw_subgraph(gm, layer=0, max_nodes=4)
    with pytest.raises(ValueError, match="no such node"):
        draw_subgraph(gm, nodes=["nope"])
    assert draw_subgraph(gm, layer=0, max_nodes=5).graph.number_of_nodes() == 5


def test_graph_snapshot_filter_recounts_ops(program):
    snap = snapshot(program.graph_module)
    layer2 = snap.filter(layer=2)
    assert isinstance(layer2, GraphSnapshot)
    assert layer2.op_counts == {"aten.clone.default": 1, "aten.linear.default": 1, "aten.relu.default": 1}
    assert snap.filter(module="layers.0").op_counts == {
        "aten.clone.default": 1, "aten.linear.default": 1, "aten.relu.default": 1,
    }  # fmt: skip
