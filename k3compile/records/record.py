"""Pass records: one pass on one phase, as people and the manifest read it.

A :class:`PassRecord` holds the graph's snapshots before and after the pass, what the
pass said it did (its :class:`~k3compile.records.result.PassResult`), translation
validation and timing. It renders as

* text for the CLI (:meth:`PassRecord.to_text`: header and unified diff),
* a JSON-serialisable dict for the artifact manifest (:meth:`PassRecord.summary`),
* self-contained HTML in Jupyter (:meth:`PassRecord._repr_html_`, drawn by
  :mod:`k3compile.records.html_diff`).

:meth:`PassRecord.filter` narrows a record to one layer or module path.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass
from typing import Any

from k3compile.records.html_diff import record_html
from k3compile.records.result import PassResult
from k3compile.records.snapshot import GraphSnapshot
from k3compile.records.text import fmt_num, fmt_seconds, fmt_validation, json_number, validation_facts


@dataclass(repr=False)
class PassRecord:
    """One pass on one phase: the graph before and after, what the pass said it did,
    translation validation (``report``: ``max_error``, ``tolerance``, ``ok``; or None)
    and the time it took (the pass plus its after-pass checks)."""

    pass_name: str
    phase: str
    before: GraphSnapshot
    after: GraphSnapshot
    result: PassResult
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
            "stats": {str(k): json_number(v) for k, v in (getattr(result, "stats", None) or {}).items()},
            "skipped": len(skipped),
            "skipped_reasons": [{"node": str(s.node), "reason": str(s.reason)} for s in skipped[:5]],
            "rewrites": [
                {"node": str(r.node), "detail": str(r.detail), "stats": {k: json_number(v) for k, v in r.stats.items()}}
                for r in getattr(result, "rewrites", None) or []
            ],
            "nodes_before": len(self.before),
            "nodes_after": len(self.after),
            "op_count_delta": self.op_count_delta(),
            "validation": validation_facts(self.report),
            "seconds": round(float(self.seconds), 6),
        }

    def to_text(self, diff: bool = True, context: int = 3, max_skipped: int = 10) -> str:
        """Plain text for the CLI: header, stats, deltas, skipped candidates, diff."""
        s = self.summary()
        out = [
            (
                f"== {self.pass_name} [{self.phase}]{' (' + self.scope + ')' if self.scope else ''}: "
                f"{'changed' if s['changed'] else 'unchanged'}, {s['matches']} match(es), "
                f"nodes {s['nodes_before']} -> {s['nodes_after']}, {fmt_seconds(self.seconds)}"
            )
        ]
        if s["stats"]:
            out.append("   stats: " + ", ".join(f"{k}={fmt_num(v)}" for k, v in s["stats"].items()))
        if s["op_count_delta"]:
            out.append("   ops:   " + ", ".join(f"{k} {d:+d}" for k, d in s["op_count_delta"].items()))
        if s["validation"] is not None:
            out.append("   validation: " + fmt_validation(self.report))
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
        return record_html(self, max_rows, fold)
