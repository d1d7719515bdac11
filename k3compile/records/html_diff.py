"""Records as self-contained HTML (no external JS or CSS), for Jupyter.

A record renders as a header (the pass's matches, stats, op-count deltas, rewritten and
skipped candidates, validation error) over a side-by-side diff of its snapshots:
aligned by node name, removed lines red, added green, changed yellow with the differing
tokens highlighted, long unchanged stretches collapsed. :func:`pipeline_summary_html`
tabulates a whole run with each changed record's diff in a collapsible section.

The alignment and the token highlights are :class:`difflib.SequenceMatcher` opcodes,
over node names and over each changed line's tokens. One stylesheet (:data:`STYLE`),
scoped to our classes, keeps graph lines left-aligned and whole under the table rules of
JupyterLab, nbconvert and the classic notebook; wide diffs scroll sideways in their box.
"""

from __future__ import annotations

import difflib
import html
import re
from collections.abc import Sequence
from dataclasses import dataclass

from k3compile.records.snapshot import NodeLine
from k3compile.records.text import (
    NUMERIC_COLUMNS,
    SUMMARY_HEAD,
    RecordLike,
    fmt_num,
    fmt_seconds,
    fmt_validation,
    summary_cells,
    summary_footer,
)

#: Unchanged stretches longer than this are collapsed in the diff ...
_FOLD_MIN = 6
#: ... keeping this many lines of context next to each change.
_FOLD_CONTEXT = 2


def record_html(rec: RecordLike, max_rows: int = 2000, fold: bool = True) -> str:
    """``rec`` as one self-contained block: header plus side-by-side diff."""
    table = diff_table_html(rec.before.lines, rec.after.lines, max_rows, fold)
    return f'<div class="k3rec">{STYLE}{record_header_html(rec)}{table}</div>'


def record_header_html(rec: RecordLike) -> str:
    """The record's facts: pass, phase, matches, stats, op-count deltas, validation, and
    collapsible lists of the candidates it rewrote and skipped."""
    e = html.escape
    s = rec.summary()
    status = "changed" if s["changed"] else "unchanged"
    title = (
        f'<div class="k3rec-title"><b>{e(rec.pass_name)}</b> <span class="k3rec-tag">{e(rec.phase)}</span> '
        f'<span class="k3rec-tag k3rec-{status}">{status}</span> '
        f"{s['matches']} match(es) &middot; nodes {s['nodes_before']} &rarr; {s['nodes_after']} &middot; "
        f"{e(fmt_seconds(rec.seconds))}"
        + (f' &middot; <span class="k3rec-scope">{e(rec.scope)}</span>' if rec.scope else "")
        + "</div>"
    )
    rows = []
    if s["stats"]:
        cells = " ".join(
            f'<span class="k3rec-kv">{e(k)}=<b>{e(fmt_num(v))}</b></span>' for k, v in s["stats"].items()
        )
        rows.append(f"<tr><th>stats</th><td>{cells}</td></tr>")
    if s["op_count_delta"]:
        cells = " ".join(
            f'<span class="k3rec-kv {"k3rec-neg" if d < 0 else "k3rec-pos"}">{e(k)} <b>{d:+d}</b></span>'
            for k, d in s["op_count_delta"].items()
        )
        rows.append(f"<tr><th>ops</th><td>{cells}</td></tr>")
    if rec.report is not None:
        ok = bool(getattr(rec.report, "ok", True))
        cls = "k3rec-ok" if ok else "k3rec-fail"
        rows.append(f'<tr><th>validation</th><td class="{cls}">{e(fmt_validation(rec.report))}</td></tr>')
    head = title + (f'<table class="k3rec-meta">{"".join(rows)}</table>' if rows else "")
    rewrites = [(r.node, r.detail) for r in getattr(rec.result, "rewrites", None) or []]
    skipped = [(sk.node, sk.reason) for sk in getattr(rec.result, "skipped", None) or []]
    for label, column, items in (("rewrote", "what", rewrites), ("skipped", "reason", skipped)):
        if items:
            body = "".join(f"<tr><td>{e(str(node))}</td><td>{e(str(why))}</td></tr>" for node, why in items)
            head += (
                f'<details class="k3rec-skipped"><summary>{label} {len(items)} candidate(s)</summary>'
                f'<table class="k3rec-reasons"><tr><th>node</th><th>{column}</th></tr>{body}</table></details>'
            )
    return head


def diff_table_html(before: Sequence[NodeLine], after: Sequence[NodeLine], max_rows: int, fold: bool = True) -> str:
    """The side-by-side diff of two snapshots' lines as an HTML table of at most ``max_rows``
    rows, in a box that scrolls sideways (lines are never wrapped)."""
    rows = _diff_rows(before, after, fold)
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
        '<div class="k3rec-scroll"><table class="k3rec-diff"><thead><tr><th class="k3rec-no"></th><th>before</th>'
        f'<th class="k3rec-no"></th><th>after</th></tr></thead><tbody>{"".join(out)}</tbody></table></div>'
    )


def pipeline_summary_html(records: Sequence[RecordLike], details: bool = True, max_rows: int = 300) -> str:
    """An HTML table, one row per (pass, phase); with ``details`` each changed record's
    diff follows in a collapsible section."""
    e = html.escape
    head = "".join(
        f'<th class="k3sum-num">{e(h)}</th>' if i in NUMERIC_COLUMNS else f"<th>{e(h)}</th>"
        for i, h in enumerate(SUMMARY_HEAD)
    )
    body = []
    for rec in records:
        tds = "".join(
            f'<td class="k3sum-num">{e(c)}</td>' if i in NUMERIC_COLUMNS else f"<td>{e(c)}</td>"
            for i, c in enumerate(summary_cells(rec))
        )
        cls = "k3sum-row k3sum-changed" if rec.result.changed else "k3sum-row"
        body.append(f'<tr class="{cls}">{tds}</tr>')
    out = [
        f'<div class="k3rec">{STYLE}<div class="k3rec-scroll"><table class="k3sum"><thead><tr>{head}</tr></thead>',
        f"<tbody>{''.join(body)}</tbody></table></div>",
        f'<div class="k3rec-title">{e(summary_footer(records))}</div>',
    ]
    if details:
        for rec in records:
            if rec.result.changed:
                out.append(
                    f"<details><summary>{e(rec.pass_name)} [{e(rec.phase)}]: diff</summary>"
                    f"{record_header_html(rec)}{diff_table_html(rec.before.lines, rec.after.lines, max_rows)}</details>"
                )
    out.append("</div>")
    return "".join(out)


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


#: One stylesheet for every block, scoped to ``.k3rec`` so that nothing leaks into the page.
#: Notebook front ends style every table of an output (JupyterLab and nbconvert's lab
#: template: cells right-aligned, ``white-space: normal``, padding, zebra rows, centred
#: tables; the classic template: the same plus black text), with selectors up to
#: ``:not(.jp-RenderedMarkdown).jp-RenderedHTMLCommon td``. Rules here either outrank
#: those (class + element selectors under ``.k3rec``) or, for alignment and wrapping, are
#: ``!important``: graph lines keep their spaces and never break inside a name
#: (``white-space: pre``, no ``word-break``); a wide diff scrolls in its own box.
STYLE = """<style>
.k3rec{font-family:ui-sans-serif,system-ui,-apple-system,"Segoe UI",sans-serif;font-size:13px;line-height:1.4;margin:4px 0;text-align:left}
.k3rec .k3rec-scope,.k3rec .k3rec-kv,.k3rec table.k3rec-diff,.k3rec table.k3sum td.k3sum-num{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,"DejaVu Sans Mono","Liberation Mono",monospace}
.k3rec table.k3rec-diff,.k3rec table.k3rec-meta,.k3rec table.k3rec-reasons,.k3rec table.k3sum{border-collapse:collapse;border-spacing:0;border:none;margin:0;color:inherit;table-layout:auto}
.k3rec table tr,.k3rec table tbody tr:nth-child(odd),.k3rec table tbody tr:hover{background:transparent}
.k3rec table th,.k3rec table td{text-align:left!important;vertical-align:top;line-height:1.4;max-width:none;border:none;color:inherit}
.k3rec-title{margin:2px 0 4px}
.k3rec-tag{display:inline-block;padding:0 6px;border-radius:8px;background:rgba(127,127,127,.18);font-size:12px}
.k3rec .k3rec-changed{background:rgba(250,200,40,.35)}
.k3rec table.k3rec-meta th{padding:1px 8px 1px 0;font-weight:600}
.k3rec table.k3rec-meta td{padding:1px 0}
.k3rec-kv{display:inline-block;margin-right:10px;font-size:12px;white-space:nowrap}
.k3rec-neg b{color:#c0392b}.k3rec-pos b{color:#1e8449}
.k3rec .k3rec-ok{color:#1e8449}.k3rec .k3rec-fail{color:#c0392b;font-weight:700}
.k3rec-skipped{margin:4px 0}
.k3rec table.k3rec-reasons td,.k3rec table.k3rec-reasons th{padding:1px 8px;font-size:12px;white-space:normal;word-break:normal;overflow-wrap:break-word}
.k3rec table.k3rec-reasons td:first-child{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;white-space:nowrap}
.k3rec .k3rec-scroll{overflow-x:auto;max-width:100%;margin:2px 0}
.k3rec table.k3rec-diff{font-size:12px;width:max-content;min-width:100%}
.k3rec table.k3rec-diff th{padding:1px 6px;font-weight:600;border-bottom:1px solid rgba(127,127,127,.4)}
.k3rec table.k3rec-diff td{padding:0 6px;white-space:pre!important;word-break:normal!important;overflow-wrap:normal!important;word-wrap:normal!important}
.k3rec table.k3rec-diff th.k3rec-no,.k3rec table.k3rec-diff td.k3rec-no{width:1%;text-align:right!important;color:rgba(127,127,127,.9);user-select:none}
.k3rec table.k3rec-diff td.k3rec-del{background:rgba(231,76,60,.22)}
.k3rec table.k3rec-diff td.k3rec-add{background:rgba(46,204,113,.22)}
.k3rec table.k3rec-diff td.k3rec-chg{background:rgba(241,196,15,.25)}
.k3rec table.k3rec-diff td.k3rec-nil{background:rgba(127,127,127,.08)}
.k3rec .k3rec-hl{background:rgba(241,150,15,.45);border-radius:2px}
.k3rec table.k3rec-diff tr.k3rec-fold td{color:rgba(127,127,127,.95);font-style:italic;background:rgba(127,127,127,.07);font-family:ui-sans-serif,system-ui,sans-serif}
.k3rec table.k3sum{font-size:13px;margin:6px 0}
.k3rec table.k3sum th,.k3rec table.k3sum td{padding:2px 10px;white-space:nowrap;border-bottom:1px solid rgba(127,127,127,.25)}
.k3rec table.k3sum td.k3sum-num,.k3rec table.k3sum th.k3sum-num{text-align:right!important}
.k3rec table.k3sum tr.k3sum-changed td:first-child{border-left:3px solid rgba(241,196,15,.9)}
.k3rec details>summary{cursor:pointer;display:list-item}
</style>"""
