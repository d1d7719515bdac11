"""Records as plain text: numbers, seconds and validation reports formatted once, and
the pipeline's summary table (one row per pass and phase).

The HTML renderer (:mod:`k3compile.records.html_diff`) and :class:`PassRecord`'s text
use the same helpers, so the CLI, notebooks and the manifest agree on every figure.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol

from k3compile.records.result import PassResult, key_stats
from k3compile.records.snapshot import GraphSnapshot

#: Columns of the summary table, and which of them are numbers (right-aligned).
SUMMARY_HEAD = ("pass", "phase", "changed", "matches", "nodes", "stats", "max error", "seconds")
NUMERIC_COLUMNS = frozenset({3, 4, 6, 7})


class RecordLike(Protocol):
    """What the renderers read of a :class:`~k3compile.records.record.PassRecord` (a
    protocol, so that the text and HTML renderers need not import the record)."""

    pass_name: str
    phase: str
    before: GraphSnapshot
    after: GraphSnapshot
    result: PassResult
    report: Any
    seconds: float
    scope: str

    def summary(self) -> dict[str, Any]: ...


def json_number(v: Any) -> Any:
    """``v`` (a number, tensor or numpy scalar) as a JSON value: integral floats as ints,
    non-finite ones as strings."""
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


def validation_facts(report: Any) -> dict[str, Any] | None:
    """A validation report (``max_error``, ``tolerance``, ``ok``, ``seconds`` where it
    has them) as JSON, or None."""
    if report is None:
        return None

    def num(x: Any) -> Any:
        x = float(x)
        return x if math.isfinite(x) else str(x)

    facts = {
        "max_error": num(report.max_error),
        "tolerance": num(getattr(report, "tolerance", float("nan"))),
        "ok": bool(getattr(report, "ok", True)),
    }
    if getattr(report, "seconds", None) is not None:  # time spent validating
        facts["seconds"] = round(float(report.seconds), 6)
    return facts


def fmt_validation(report: Any) -> str:
    """'max error 1.2e-06 (tolerance 1.0e-04) ok', or '-' without a report."""
    if report is None:
        return "-"
    v = validation_facts(report)
    tol = v["tolerance"]
    tol_s = f"{tol:.1e}" if isinstance(tol, float) else str(tol)
    err = v["max_error"]
    err_s = f"{err:.2e}" if isinstance(err, float) else str(err)
    return f"max error {err_s} (tolerance {tol_s}) {'ok' if v['ok'] else 'FAILED'}"


def fmt_seconds(s: float) -> str:
    """'12.3 ms' below a second, '1.23 s' above."""
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


def fmt_num(v: Any) -> str:
    """A stat for people: 3 significant digits, large counts as 12.3M."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return str(v)
    if isinstance(v, float) and not v.is_integer():
        return f"{v:.3g}"
    n = int(v)
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= 10 * scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)


def summary_cells(rec: RecordLike) -> list[str]:
    """The cells of ``rec``'s row in the summary table (:data:`SUMMARY_HEAD`)."""
    s = rec.summary()
    stats = ", ".join(f"{k}={fmt_num(v)}" for k, v in key_stats(s["stats"]))
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


def summary_footer(records: Sequence[RecordLike]) -> str:
    """'N record(s), M changed, S s' under a summary table."""
    total = sum(r.seconds for r in records)
    return f"{len(records)} record(s), {sum(1 for r in records if r.result.changed)} changed, {total:.3f} s"


def pipeline_summary_text(records: Sequence[RecordLike]) -> str:
    """A plain-text table, one row per (pass, phase)."""
    rows = [list(SUMMARY_HEAD)] + [summary_cells(r) for r in records]
    widths = [max(len(r[i]) for r in rows) for i in range(len(SUMMARY_HEAD))]

    def fmt(r: list[str]) -> str:
        return "  ".join(
            c.rjust(w) if i in NUMERIC_COLUMNS else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))
        ).rstrip()

    lines = [fmt(rows[0]), "  ".join("-" * w for w in widths)]
    lines += [fmt(r) for r in rows[1:]]
    lines.append(summary_footer(records))
    return "\n".join(lines)
