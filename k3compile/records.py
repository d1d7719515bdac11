"""What each pass did, in a form people can read: graph snapshots, diffs, summaries.

The pipeline snapshots the graph before and after every pass (:func:`snapshot`) and
keeps a :class:`PassRecord` per pass and phase. A snapshot is one readable line per
node::

    %linear_3 = aten.linear.default(%rms_norm, %p_k3_model_layers_0_self_attn_q_proj_weight) : (s37, 64) f32 [S(1)]

with the node's innermost module path (``k3.model.layers.0.self_attn.q_proj``) and
layer index (``0``, parsed from ``layers.N``) on the side, so a record can be narrowed
to one layer or module (:meth:`PassRecord.filter`). Nodes of branch subgraphs
(``torch.cond``) follow their ``get_attr`` node, named ``<subgraph>.<node>`` and
indented.

A record renders as

* text for the CLI (:meth:`PassRecord.to_text`: header and unified diff),
* a JSON-serialisable dict for the artifact manifest (:meth:`PassRecord.summary`),
* self-contained HTML in Jupyter (:meth:`PassRecord._repr_html_`): a side-by-side
  diff aligned by node, removed lines red, added green, changed yellow, long unchanged
  stretches collapsed, under a header with the pass's matches, stats, op-count deltas,
  skipped candidates and validation error.

:func:`pipeline_summary_html` / :func:`pipeline_summary_text` tabulate a whole run, and
:func:`draw_subgraph` draws part of a graph (a layer, a module) as SVG or DOT without
graphviz or matplotlib.
"""

from __future__ import annotations

import dataclasses
import difflib
import html
import math
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import networkx as nx
import torch
from torch.fx import GraphModule, Node

__all__ = [
    "GraphSnapshot",
    "NodeLine",
    "PassRecord",
    "Subgraph",
    "draw_subgraph",
    "pipeline_summary_html",
    "pipeline_summary_text",
    "snapshot",
]

#: Node kinds that are not operations (left out of op counts).
_NON_OPS = frozenset({"placeholder", "output", "get_attr"})
_LAYER_IN_PATH = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")
#: Export names parameters/buffers ``p_<fqn with _>`` / ``b_<...>``: the layer survives.
_LAYER_IN_NAME = re.compile(r"(?:^|_)layers_(\d+)(?:_|$)")
_EMPTY_STACK = "_empty_nn_module_stack"
#: Unchanged stretches longer than this are collapsed in the HTML diff ...
_FOLD_MIN = 6
#: ... keeping this many lines of context next to each change.
_FOLD_CONTEXT = 2

_DTYPE_SHORT = {
    torch.float32: "f32",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.float64: "f64",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "b8",
    torch.complex64: "c64",
}


# ---------------------------------------------------------------------------
# Snapshots
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeLine:
    """One node as a line of text, with where it sits in the model."""

    name: str  # node name; ``<subgraph>.<node>`` inside a branch subgraph
    op: str  # 'aten.linear.default', 'k3.rms_norm.default', 'placeholder', ...
    text: str  # '%name = op(args...) : shape dtype [placement]'
    module: str = ""  # innermost module path, '' if none
    layer: int | None = None  # from 'layers.N' in the module path

    def matches(self, layer: int | None = None, module: str | None = None) -> bool:
        if layer is not None and self.layer != layer:
            return False
        return module is None or module in self.module


@dataclass(frozen=True)
class GraphSnapshot:
    """A graph as text lines (in graph order) plus its op counts."""

    lines: tuple[NodeLine, ...]
    op_counts: dict[str, int] = field(default_factory=dict, compare=False)

    @classmethod
    def from_lines(cls, lines: Iterable[NodeLine]) -> GraphSnapshot:
        lines = tuple(lines)
        counts = Counter(line.op for line in lines if line.op not in _NON_OPS)
        return cls(lines, dict(sorted(counts.items())))

    def __len__(self) -> int:
        return len(self.lines)

    def __iter__(self):
        return iter(self.lines)

    @property
    def texts(self) -> list[str]:
        return [line.text for line in self.lines]

    def by_name(self) -> dict[str, NodeLine]:
        return {line.name: line for line in self.lines}

    def filter(self, layer: int | None = None, module: str | None = None) -> GraphSnapshot:
        """The nodes of layer ``layer`` whose module path contains ``module``."""
        if layer is None and module is None:
            return self
        return GraphSnapshot.from_lines(line for line in self.lines if line.matches(layer, module))

    def to_text(self) -> str:
        return "\n".join(self.texts)


def snapshot(gm: GraphModule, signature: Any = None) -> GraphSnapshot:
    """The readable lines of every node of ``gm`` (and of its branch subgraphs).

    ``signature`` (an ``ExportedProgram`` or its ``graph_signature``, optional) gives
    parameter and buffer placeholders the module path they belong to; without it
    their layer index is still read from export's ``p_..._layers_N_...`` names."""
    owners = _placeholder_owners(signature)
    lines: list[NodeLine] = []
    _snapshot_graph(gm, "", 0, owners, lines, set(), ("", None))
    return GraphSnapshot.from_lines(lines)


def _placeholder_owners(signature: Any) -> dict[str, str]:
    if signature is None:
        return {}
    sig = getattr(signature, "graph_signature", signature)
    owners: dict[str, str] = {}
    for attr in ("inputs_to_parameters", "inputs_to_buffers", "inputs_to_lifted_tensor_constants"):
        for name, fqn in (getattr(sig, attr, None) or {}).items():
            owners[name] = fqn.rpartition(".")[0]
    return owners


def _snapshot_graph(
    gm: torch.nn.Module,
    prefix: str,
    depth: int,
    owners: dict[str, str],
    out: list[NodeLine],
    seen: set[int],
    parent: tuple[str, int | None],
) -> None:
    for node in gm.graph.nodes:
        line = _node_line(node, prefix, depth, owners if depth == 0 else {})
        if depth and not line.module and line.layer is None:
            # Branch-subgraph nodes carry no module stack: they sit where the branch does.
            line = dataclasses.replace(line, module=parent[0], layer=parent[1])
        out.append(line)
        if node.op == "get_attr":
            sub = _get_attr(gm, node.target)
            if isinstance(sub, torch.nn.Module) and hasattr(sub, "graph") and id(sub) not in seen:
                seen.add(id(sub))
                _snapshot_graph(sub, f"{prefix}{node.target}.", depth + 1, owners, out, seen, (line.module, line.layer))


def _get_attr(mod: torch.nn.Module, target: str) -> Any:
    obj: Any = mod
    for part in str(target).split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _node_line(node: Node, prefix: str = "", depth: int = 0, owners: dict[str, str] | None = None) -> NodeLine:
    name = prefix + node.name
    op = op_name(node)
    module, layer = node_location(node, owners)
    if node.op == "placeholder":
        body = "placeholder"
    elif node.op == "get_attr":
        body = f"get_attr[{node.target}]"
    elif node.op == "output":
        outs = node.args[0] if len(node.args) == 1 and isinstance(node.args[0], (tuple, list)) else node.args
        body = f"output({', '.join(_fmt_arg(a, prefix) for a in outs)})"
    else:
        parts = [_fmt_arg(a, prefix) for a in node.args]
        parts += [f"{k}={_fmt_arg(v, prefix)}" for k, v in node.kwargs.items()]
        body = f"{op}({', '.join(parts)})"
    text = f"{'  ' * depth}%{name} = {body}"
    value = _fmt_value(node)
    if value:
        text += f" : {value}"
    placement = node.meta.get("placement")
    if placement is not None:
        text += f" [{_fmt_placement(placement)}]"
    return NodeLine(name, op, text, module, layer)


def op_name(node: Node) -> str:
    """A short, stable name of what ``node`` does: 'aten.linear.default', 'operator.getitem'."""
    if node.op in ("placeholder", "output", "get_attr"):
        return node.op
    if node.op == "call_method":
        return f"method.{node.target}"
    if node.op == "call_module":
        return f"module.{node.target}"
    target = node.target
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(target)
    if isinstance(target, torch._ops.HigherOrderOperator):
        return f"higher_order.{target.name()}"
    try:
        name = torch.fx.node._get_qualified_name(target)
        return "operator." + name[len("_operator.") :] if name.startswith("_operator.") else name
    except (AttributeError, RuntimeError, TypeError):
        return getattr(target, "__name__", None) or str(target)


def node_location(node: Node, owners: dict[str, str] | None = None) -> tuple[str, int | None]:
    """(innermost module path, layer index) of ``node``; ('', None) when unknown."""
    module = ""
    stack = node.meta.get("nn_module_stack") or {}
    for key, value in reversed(list(stack.items())):
        path = value[0] if isinstance(value, (tuple, list)) and value else (value if isinstance(value, str) else key)
        if not isinstance(path, str) or path.startswith(_EMPTY_STACK) or str(key).startswith(_EMPTY_STACK):
            continue
        module = path
        break
    if not module and owners and node.op == "placeholder":
        module = owners.get(node.name, "")
    m = _LAYER_IN_PATH.search(module)
    if m:
        return module, int(m.group(1))
    if node.op == "placeholder":
        m = _LAYER_IN_NAME.search(node.name)
        if m:
            return module, int(m.group(1))
    return module, None


def _fmt_arg(a: Any, prefix: str = "") -> str:
    if isinstance(a, Node):
        return f"%{prefix}{a.name}"
    if isinstance(a, tuple):
        inner = ", ".join(_fmt_arg(x, prefix) for x in a)
        return f"({inner},)" if len(a) == 1 else f"({inner})"
    if isinstance(a, list):
        return "[" + ", ".join(_fmt_arg(x, prefix) for x in a) + "]"
    if isinstance(a, dict):
        return "{" + ", ".join(f"{_fmt_arg(k, prefix)}: {_fmt_arg(v, prefix)}" for k, v in a.items()) + "}"
    if isinstance(a, torch.dtype):
        return _DTYPE_SHORT.get(a, str(a).removeprefix("torch."))
    if isinstance(a, (torch.device, torch.memory_format, torch.layout)):
        return str(a)
    if isinstance(a, (str, int, float, bool)) or a is None:
        return repr(a)
    return str(a)


def _fmt_val(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return _fmt_shape(v.shape) + " " + _DTYPE_SHORT.get(v.dtype, str(v.dtype).removeprefix("torch."))
    if hasattr(v, "shape") and hasattr(v, "dtype"):  # TensorMetadata (fx ShapeProp), a NamedTuple
        return _fmt_shape(v.shape) + " " + _DTYPE_SHORT.get(v.dtype, str(v.dtype).removeprefix("torch."))
    if isinstance(v, (tuple, list)):
        return "(" + ", ".join(_fmt_val(x) for x in v) + ("," if len(v) == 1 else "") + ")"
    if v is None:
        return "None"
    return str(v)


def _fmt_shape(shape: Sequence[Any]) -> str:
    dims = [str(d) for d in shape]
    return f"({dims[0]},)" if len(dims) == 1 else "(" + ", ".join(dims) + ")"


def _fmt_value(node: Node) -> str:
    if "val" in node.meta:
        v = node.meta["val"]
        return "" if v is None and node.op in ("output", "get_attr") else _fmt_val(v)
    tm = node.meta.get("tensor_meta")
    return _fmt_val(tm) if tm is not None else ""


def _fmt_placement(p: Any) -> str:
    if isinstance(p, (tuple, list)):
        return "(" + ", ".join(_fmt_placement(x) for x in p) + ")"
    return str(p)


# ---------------------------------------------------------------------------
# Pass records
# ---------------------------------------------------------------------------


@dataclass(repr=False)
class PassRecord:
    """One pass on one phase: the graph before and after, what the pass said it did,
    translation validation (``report``: ``max_error``, ``tolerance``, ``ok``; or None)
    and the time it took (the pass plus its after-pass checks)."""

    pass_name: str
    phase: str
    before: GraphSnapshot
    after: GraphSnapshot
    result: Any  # k3compile.pipeline.PassResult
    report: Any = None
    seconds: float = 0.0
    #: Set by :meth:`filter`: which part of the graph this record shows.
    scope: str = ""

    def __repr__(self) -> str:
        err = "-" if self.report is None else f"{self.report.max_error:.1e}"
        scope = f", {self.scope}" if self.scope else ""
        return (
            f"PassRecord({self.pass_name}, {self.phase}{scope}: changed={self.result.changed}, "
            f"matches={self.result.matches}, nodes {len(self.before.lines)} -> {len(self.after.lines)}, "
            f"max_error={err})"
        )

    # -- views -----------------------------------------------------------------

    def filter(self, layer: int | None = None, module: str | None = None) -> PassRecord:
        """The same record restricted to the nodes of layer ``layer`` and/or whose
        module path contains ``module``."""
        if layer is None and module is None:
            return self
        parts = [self.scope] if self.scope else []
        if layer is not None:
            parts.append(f"layer={layer}")
        if module is not None:
            parts.append(f"module~{module!r}")
        return dataclasses.replace(
            self,
            before=self.before.filter(layer, module),
            after=self.after.filter(layer, module),
            scope=" ".join(parts),
        )

    def unified_diff(self, layer: int | None = None, module: str | None = None, context: int = 3) -> str:
        """``diff -u`` of the graph text (optionally of one layer / module)."""
        rec = self.filter(layer, module)
        where = f" ({rec.scope})" if rec.scope else ""
        lines = difflib.unified_diff(
            rec.before.texts,
            rec.after.texts,
            fromfile=f"{self.pass_name}/{self.phase} before{where}",
            tofile=f"{self.pass_name}/{self.phase} after{where}",
            n=context,
            lineterm="",
        )
        return "\n".join(lines)

    def op_count_delta(self) -> dict[str, int]:
        """Op -> (count after - count before), nonzero changes only."""
        ops = sorted(set(self.before.op_counts) | set(self.after.op_counts))
        delta = {op: self.after.op_counts.get(op, 0) - self.before.op_counts.get(op, 0) for op in ops}
        return {op: d for op, d in delta.items() if d}

    def changed_nodes(self) -> set[str]:
        """Names of nodes removed, added, or whose line changed."""
        before, after = self.before.by_name(), self.after.by_name()
        changed = set(before) ^ set(after)
        changed |= {n for n in set(before) & set(after) if before[n].text != after[n].text}
        return changed

    # -- renderings ------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        """JSON-serialisable facts of this record (for the artifact manifest)."""
        result = self.result
        skipped = list(getattr(result, "skipped", None) or [])
        return {
            "pass": self.pass_name,
            "phase": self.phase,
            "changed": bool(getattr(result, "changed", False)),
            "matches": int(getattr(result, "matches", 0) or 0),
            "stats": {str(k): _json_number(v) for k, v in (getattr(result, "stats", None) or {}).items()},
            "skipped": len(skipped),
            "skipped_reasons": [{"node": str(s.node), "reason": str(s.reason)} for s in skipped[:5]],
            "rewrites": [
                {"node": str(r.node), "detail": str(r.detail), "stats": {k: _json_number(v) for k, v in r.stats.items()}}
                for r in getattr(result, "rewrites", None) or []
            ],
            "nodes_before": len(self.before),
            "nodes_after": len(self.after),
            "op_count_delta": self.op_count_delta(),
            "validation": _validation(self.report),
            "seconds": round(float(self.seconds), 6),
        }

    def to_text(self, diff: bool = True, context: int = 3, max_skipped: int = 10) -> str:
        """Plain text for the CLI: header, stats, deltas, skipped candidates, diff."""
        s = self.summary()
        out = [
            (
                f"== {self.pass_name} [{self.phase}]{' (' + self.scope + ')' if self.scope else ''}: "
                f"{'changed' if s['changed'] else 'unchanged'}, {s['matches']} match(es), "
                f"nodes {s['nodes_before']} -> {s['nodes_after']}, {_fmt_seconds(self.seconds)}"
            )
        ]
        if s["stats"]:
            out.append("   stats: " + ", ".join(f"{k}={_fmt_num(v)}" for k, v in s["stats"].items()))
        if s["op_count_delta"]:
            out.append("   ops:   " + ", ".join(f"{k} {d:+d}" for k, d in s["op_count_delta"].items()))
        if s["validation"] is not None:
            out.append("   validation: " + _fmt_validation(self.report))
        rewrites = [(r.node, r.detail) for r in getattr(self.result, "rewrites", None) or []]
        skipped = [(sk.node, sk.reason) for sk in getattr(self.result, "skipped", None) or []]
        for label, items in (("rewrote", rewrites), ("skipped", skipped)):
            if items:
                out.append(f"   {label} {len(items)} candidate(s):")
                out += [f"     {node}: {why}" for node, why in items[:max_skipped]]
                if len(items) > max_skipped:
                    out.append(f"     ... {len(items) - max_skipped} more")
        if diff:
            d = self.unified_diff(context=context)
            if d:
                out.append(d)
        return "\n".join(out)

    def __str__(self) -> str:
        return self.to_text(diff=False)

    def _repr_html_(self) -> str:
        return self.to_html()

    def to_html(self, max_rows: int = 2000, fold: bool = True) -> str:
        """Self-contained HTML: header plus side-by-side diff (no external JS/CSS).
        ``fold=False`` shows unchanged stretches in full."""
        return f'<div class="k3rec">{_STYLE}{self._html_header()}{self._html_diff(max_rows, fold)}</div>'

    def _html_header(self) -> str:
        e = html.escape
        s = self.summary()
        status = "changed" if s["changed"] else "unchanged"
        title = (
            f'<div class="k3rec-title"><b>{e(self.pass_name)}</b> <span class="k3rec-tag">{e(self.phase)}</span> '
            f'<span class="k3rec-tag k3rec-{status}">{status}</span> '
            f"{s['matches']} match(es) &middot; nodes {s['nodes_before']} &rarr; {s['nodes_after']} &middot; "
            f"{e(_fmt_seconds(self.seconds))}"
            + (f' &middot; <span class="k3rec-scope">{e(self.scope)}</span>' if self.scope else "")
            + "</div>"
        )
        rows = []
        if s["stats"]:
            cells = " ".join(
                f'<span class="k3rec-kv">{e(k)}=<b>{e(_fmt_num(v))}</b></span>' for k, v in s["stats"].items()
            )
            rows.append(f"<tr><th>stats</th><td>{cells}</td></tr>")
        if s["op_count_delta"]:
            cells = " ".join(
                f'<span class="k3rec-kv {"k3rec-neg" if d < 0 else "k3rec-pos"}">{e(k)} <b>{d:+d}</b></span>'
                for k, d in s["op_count_delta"].items()
            )
            rows.append(f"<tr><th>ops</th><td>{cells}</td></tr>")
        if self.report is not None:
            ok = bool(getattr(self.report, "ok", True))
            cls = "k3rec-ok" if ok else "k3rec-fail"
            rows.append(f'<tr><th>validation</th><td class="{cls}">{e(_fmt_validation(self.report))}</td></tr>')
        head = title + (f'<table class="k3rec-meta">{"".join(rows)}</table>' if rows else "")
        rewrites = [(r.node, r.detail) for r in getattr(self.result, "rewrites", None) or []]
        skipped = [(sk.node, sk.reason) for sk in getattr(self.result, "skipped", None) or []]
        for label, column, items in (("rewrote", "what", rewrites), ("skipped", "reason", skipped)):
            if items:
                body = "".join(f"<tr><td>{e(str(node))}</td><td>{e(str(why))}</td></tr>" for node, why in items)
                head += (
                    f'<details class="k3rec-skipped"><summary>{label} {len(items)} candidate(s)</summary>'
                    f'<table class="k3rec-reasons"><tr><th>node</th><th>{column}</th></tr>{body}</table></details>'
                )
        return head

    def _html_diff(self, max_rows: int, fold: bool = True) -> str:
        rows = _diff_rows(self.before.lines, self.after.lines, fold)
        out = []
        for shown, row in enumerate(rows):
            if shown >= max_rows:
                rest = len(rows) - shown
                out.append(
                    f'<tr class="k3rec-fold"><td colspan="4">… {rest} more rows not shown: narrow with '
                    f".filter(layer=…, module=…) …</td></tr>"
                )
                break
            out.append(_html_row(row))
        if not rows:
            out.append('<tr class="k3rec-fold"><td colspan="4">(empty)</td></tr>')
        return (
            '<table class="k3rec-diff"><thead><tr><th></th><th>before</th><th></th><th>after</th></tr></thead>'
            f"<tbody>{''.join(out)}</tbody></table>"
        )


def _json_number(v: Any) -> Any:
    if isinstance(v, bool):
        return v
    if hasattr(v, "item") and not isinstance(v, (int, float)):  # tensors, numpy scalars
        v = v.item()
    if isinstance(v, int):
        return int(v)
    if isinstance(v, float):
        if v.is_integer() and abs(v) < 2**53:
            return int(v)
        return v if math.isfinite(v) else str(v)
    try:
        return float(v)
    except (TypeError, ValueError):
        return str(v)


def _validation(report: Any) -> dict[str, Any] | None:
    if report is None:
        return None

    def num(x: Any) -> Any:
        x = float(x)
        return x if math.isfinite(x) else str(x)

    return {
        "max_error": num(report.max_error),
        "tolerance": num(getattr(report, "tolerance", float("nan"))),
        "ok": bool(getattr(report, "ok", True)),
    }


def _fmt_validation(report: Any) -> str:
    if report is None:
        return "-"
    v = _validation(report)
    tol = v["tolerance"]
    tol_s = f"{tol:.1e}" if isinstance(tol, float) else str(tol)
    err = v["max_error"]
    err_s = f"{err:.2e}" if isinstance(err, float) else str(err)
    return f"max error {err_s} (tolerance {tol_s}) {'ok' if v['ok'] else 'FAILED'}"


def _fmt_seconds(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


def _fmt_num(v: Any) -> str:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return str(v)
    if isinstance(v, float) and not v.is_integer():
        return f"{v:.3g}"
    n = int(v)
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= 10 * scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)


# -- side-by-side diff rows -------------------------------------------------------


@dataclass(frozen=True)
class _Row:
    kind: str  # same | chg | del | add | rep | fold
    left: tuple[int, NodeLine] | None = None
    right: tuple[int, NodeLine] | None = None
    folded: int = 0


def _diff_rows(before: Sequence[NodeLine], after: Sequence[NodeLine], fold: bool = True) -> list[_Row]:
    """Align ``before`` and ``after`` by node name (SequenceMatcher opcodes); an equal
    name whose line differs is 'chg'; unchanged stretches longer than ``_FOLD_MIN``
    collapse to a 'fold' row with ``_FOLD_CONTEXT`` lines of context either side."""
    a = [line.name for line in before]
    b = [line.name for line in after]
    raw: list[_Row] = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if tag == "equal":
            for k in range(i2 - i1):
                left, right = before[i1 + k], after[j1 + k]
                kind = "same" if left.text == right.text else "chg"
                raw.append(_Row(kind, (i1 + k, left), (j1 + k, right)))
        else:
            n = max(i2 - i1, j2 - j1)
            for k in range(n):
                left = (i1 + k, before[i1 + k]) if i1 + k < i2 else None
                right = (j1 + k, after[j1 + k]) if j1 + k < j2 else None
                kind = "rep" if left and right else ("del" if left else "add")
                raw.append(_Row(kind, left, right))
    if not fold:
        return raw
    # Collapse long unchanged stretches.
    rows: list[_Row] = []
    i = 0
    while i < len(raw):
        if raw[i].kind != "same":
            rows.append(raw[i])
            i += 1
            continue
        j = i
        while j < len(raw) and raw[j].kind == "same":
            j += 1
        run = raw[i:j]
        if len(run) <= _FOLD_MIN:
            rows.extend(run)
        else:
            head = 0 if i == 0 else _FOLD_CONTEXT
            tail = 0 if j == len(raw) else _FOLD_CONTEXT
            hidden = len(run) - head - tail
            rows.extend(run[:head])
            rows.append(_Row("fold", folded=hidden))
            rows.extend(run[len(run) - tail :])
        i = j
    return rows


_CELL_CLASS = {"same": ("", ""), "chg": ("chg", "chg"), "del": ("del", "nil"), "add": ("nil", "add"), "rep": ("del", "add")}


def _html_row(row: _Row) -> str:
    if row.kind == "fold":
        return f'<tr class="k3rec-fold"><td colspan="4">… {row.folded} unchanged nodes …</td></tr>'
    lcls, rcls = _CELL_CLASS[row.kind]
    if row.kind == "chg":
        ltext, rtext = _intraline(row.left[1].text, row.right[1].text)
    else:
        ltext = html.escape(row.left[1].text) if row.left else ""
        rtext = html.escape(row.right[1].text) if row.right else ""

    def cells(side: tuple[int, NodeLine] | None, cls: str, text: str) -> str:
        c = f' class="k3rec-{cls}"' if cls else ""
        if side is None:
            return f'<td class="k3rec-no"></td><td{c}></td>'
        idx, line = side
        tip = line.module + (f" (layer {line.layer})" if line.layer is not None else "")
        t = f' title="{html.escape(tip)}"' if tip else ""
        return f'<td class="k3rec-no">{idx + 1}</td><td{c}{t}>{text}</td>'

    return f'<tr class="k3rec-r{row.kind}">{cells(row.left, lcls, ltext)}{cells(row.right, rcls, rtext)}</tr>'


_TOKEN = re.compile(r"\w+|\W")


def _intraline(a: str, b: str) -> tuple[str, str]:
    """Both lines escaped, with the tokens that differ wrapped in ``k3rec-hl`` spans."""
    ta, tb = _TOKEN.findall(a), _TOKEN.findall(b)
    outa, outb = [], []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, ta, tb, autojunk=False).get_opcodes():
        sa, sb = html.escape("".join(ta[i1:i2])), html.escape("".join(tb[j1:j2]))
        if tag == "equal":
            outa.append(sa)
            outb.append(sb)
        else:
            if sa:
                outa.append(f'<span class="k3rec-hl">{sa}</span>')
            if sb:
                outb.append(f'<span class="k3rec-hl">{sb}</span>')
    return "".join(outa), "".join(outb)


_STYLE = """<style>
.k3rec{font-family:ui-sans-serif,system-ui,sans-serif;font-size:13px;margin:4px 0}
.k3rec-title{margin:2px 0 4px}
.k3rec-tag{display:inline-block;padding:0 6px;border-radius:8px;background:rgba(127,127,127,.18);font-size:12px}
.k3rec-changed{background:rgba(250,200,40,.35)}
.k3rec-scope{font-family:ui-monospace,monospace}
.k3rec-meta th{text-align:left;padding:1px 8px 1px 0;vertical-align:top;font-weight:600}
.k3rec-meta td{text-align:left;padding:1px 0}
.k3rec-kv{display:inline-block;margin-right:10px;font-family:ui-monospace,monospace;font-size:12px}
.k3rec-neg b{color:#c0392b}.k3rec-pos b{color:#1e8449}
.k3rec-ok{color:#1e8449}.k3rec-fail{color:#c0392b;font-weight:700}
.k3rec-skipped{margin:4px 0}
.k3rec-reasons td,.k3rec-reasons th{text-align:left;padding:1px 8px;font-size:12px}
.k3rec-diff{border-collapse:collapse;font-family:ui-monospace,monospace;font-size:12px;width:100%;table-layout:fixed}
.k3rec-diff th{text-align:left;border-bottom:1px solid rgba(127,127,127,.4)}
.k3rec-diff th:nth-child(odd),.k3rec-diff td.k3rec-no{width:3.5em;text-align:right;color:rgba(127,127,127,.9);padding-right:6px}
.k3rec-diff td{text-align:left;white-space:pre-wrap;word-break:break-all;vertical-align:top;padding:0 4px}
.k3rec-del{background:rgba(231,76,60,.22)}
.k3rec-add{background:rgba(46,204,113,.22)}
.k3rec-chg{background:rgba(241,196,15,.25)}
.k3rec-nil{background:rgba(127,127,127,.08)}
.k3rec-hl{background:rgba(241,150,15,.45);border-radius:2px}
.k3rec-fold td{text-align:center;color:rgba(127,127,127,.95);font-style:italic;background:rgba(127,127,127,.07)}
.k3sum{border-collapse:collapse;font-size:13px;margin:6px 0}
.k3sum th,.k3sum td{text-align:left;padding:2px 10px;border-bottom:1px solid rgba(127,127,127,.25)}
.k3sum td.k3sum-num{text-align:right;font-family:ui-monospace,monospace}
.k3sum tr.k3sum-changed td:first-child{border-left:3px solid rgba(241,196,15,.9)}
</style>"""


# ---------------------------------------------------------------------------
# Pipeline summary
# ---------------------------------------------------------------------------


def _key_stats(stats: dict[str, Any], limit: int = 4) -> list[tuple[str, Any]]:
    from k3compile.pipeline import STANDARD_STATS

    items = [(k, v) for k, v in stats.items() if v not in (0, 0.0, None, False)]
    items.sort(key=lambda kv: (STANDARD_STATS.index(kv[0]) if kv[0] in STANDARD_STATS else len(STANDARD_STATS)))
    return items[:limit]


def _summary_cells(rec: PassRecord) -> list[str]:
    s = rec.summary()
    stats = ", ".join(f"{k}={_fmt_num(v)}" for k, v in _key_stats(s["stats"]))
    err = s["validation"]
    if err is None:
        err_s = "-"
    else:
        e = err["max_error"]
        err_s = (f"{e:.2e}" if isinstance(e, float) else str(e)) + ("" if err["ok"] else " FAIL")
    return [
        rec.pass_name,
        rec.phase,
        "yes" if s["changed"] else "no",
        str(s["matches"]),
        f"{s['nodes_before']} -> {s['nodes_after']}",
        stats or "-",
        err_s,
        f"{rec.seconds:.3f}",
    ]


_SUMMARY_HEAD = ["pass", "phase", "changed", "matches", "nodes", "stats", "max error", "seconds"]


def pipeline_summary_text(records: Sequence[PassRecord]) -> str:
    """A plain-text table, one row per (pass, phase)."""
    rows = [_SUMMARY_HEAD] + [_summary_cells(r) for r in records]
    widths = [max(len(r[i]) for r in rows) for i in range(len(_SUMMARY_HEAD))]
    right = {3, 4, 6, 7}

    def fmt(r: list[str]) -> str:
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()

    lines = [fmt(rows[0]), "  ".join("-" * w for w in widths)]
    lines += [fmt(r) for r in rows[1:]]
    total = sum(r.seconds for r in records)
    lines.append(f"{len(records)} record(s), {sum(1 for r in records if r.result.changed)} changed, {total:.3f} s")
    return "\n".join(lines)


def pipeline_summary_html(records: Sequence[PassRecord], details: bool = True, max_rows: int = 300) -> str:
    """An HTML table, one row per (pass, phase); with ``details`` each changed record's
    diff follows in a collapsible section."""
    e = html.escape
    head = "".join(f"<th>{e(h)}</th>" for h in _SUMMARY_HEAD)
    body = []
    for rec in records:
        cells = _summary_cells(rec)
        tds = "".join(
            f'<td class="k3sum-num">{e(c)}</td>' if i in (3, 4, 6, 7) else f"<td>{e(c)}</td>" for i, c in enumerate(cells)
        )
        cls = "k3sum-row k3sum-changed" if rec.result.changed else "k3sum-row"
        body.append(f'<tr class="{cls}">{tds}</tr>')
    total = sum(r.seconds for r in records)
    out = [
        f'<div class="k3rec">{_STYLE}<table class="k3sum"><thead><tr>{head}</tr></thead>',
        f"<tbody>{''.join(body)}</tbody></table>",
        (
            f'<div class="k3rec-title">{len(records)} record(s), '
            f"{sum(1 for r in records if r.result.changed)} changed, {total:.3f} s</div>"
        ),
    ]
    if details:
        for rec in records:
            if rec.result.changed:
                out.append(
                    f"<details><summary>{e(rec.pass_name)} [{e(rec.phase)}]: diff</summary>"
                    f"{rec._html_header()}{rec._html_diff(max_rows)}</details>"
                )
    out.append("</div>")
    return "".join(out)


# ---------------------------------------------------------------------------
# Subgraph drawing
# ---------------------------------------------------------------------------

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
        line = _node_line(node)
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
