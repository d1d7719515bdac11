"""What a pass reports about one run: :class:`PassResult` with its rewrites and skips.

These types sit below both the pipeline (which passes them around) and the records
(which render them), so neither has to import the other to name them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: Stats every pass may report (counts per rank per step of the phase it ran on), in
#: the order summaries list them.
STANDARD_STATS = ("nodes_removed", "nodes_added", "launches_removed", "bytes_removed", "flops_removed")


@dataclass(frozen=True)
class Skipped:
    """A candidate a pass looked at and left alone, and why."""

    node: str
    reason: str


@dataclass(frozen=True)
class Rewrite:
    """One candidate a pass rewrote: where, what it did, and its own stats (e.g. per layer)."""

    node: str
    detail: str
    stats: dict[str, float] = field(default_factory=dict)


@dataclass
class PassResult:
    """Whether a pass changed the graph, how many candidates it matched, its stats (the
    standard ones and its own), and every candidate it rewrote or skipped."""

    changed: bool
    matches: int = 0
    stats: dict[str, float] = field(default_factory=dict)
    skipped: list[Skipped] = field(default_factory=list)
    rewrites: list[Rewrite] = field(default_factory=list)

    def add_rewrite(self, rewrite: Rewrite) -> None:
        """Record one rewritten candidate: a match whose stats add to the pass totals."""
        self.rewrites.append(rewrite)
        self.add_stats(rewrite.stats)
        self.matches += 1

    def add_stats(self, stats: dict[str, float]) -> None:
        """Accumulate per-rewrite stats into the pass totals."""
        for key, value in stats.items():
            self.stats[key] = self.stats.get(key, 0) + value


def key_stats(stats: dict[str, object], limit: int = 4) -> list[tuple[str, object]]:
    """The nonzero stats, the standard ones first, at most ``limit`` of them."""
    items = [(k, v) for k, v in stats.items() if v not in (0, 0.0, None, False)]
    items.sort(key=lambda kv: STANDARD_STATS.index(kv[0]) if kv[0] in STANDARD_STATS else len(STANDARD_STATS))
    return items[:limit]
