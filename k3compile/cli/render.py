"""What the commands print: sizes and counts for people, the pass table (with what each
pass bought, in words), the memory plan table, step progress and generated tokens.

Number formats shared with notebooks and the manifest (seconds, stats, validation) come
from :mod:`k3compile.records.text`; this module adds the terminal layout.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from dataclasses import replace
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from rich import box
from rich.console import Console, Group
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from k3compile.cli.app import console

if TYPE_CHECKING:
    from k3compile.config import K3Config


def human_count(n: int) -> str:
    """1_160_256 -> '1.16M', 2_779_484_476_000 -> '2.78T'."""
    for div, suffix in ((10**12, "T"), (10**9, "B"), (10**6, "M"), (10**3, "K")):
        if n >= div:
            return f"{n / div:.3g}{suffix}" if n / div < 1000 else f"{n / div:.0f}{suffix}"
    return str(n)


def human_bytes(n: float) -> str:
    """4_187_593_113 -> '3.9 GiB'; below 1 KiB in bytes."""
    for div, suffix in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if abs(n) >= div:
            return f"{n / div:.1f} {suffix}"
    return f"{n:.0f} B"


def layer_kinds_summary(cfg: K3Config) -> str:
    """'4 KDA + 3 MLA  (K=KDA, M=MLA: KKMKKMM)' with the pattern elided for deep models."""
    kinds = cfg.layer_kinds
    pattern = "".join("M" if k == "mla" else "K" for k in kinds)
    if len(pattern) > 24:
        pattern = pattern[:12] + "..." + pattern[-4:]
    return f"{kinds.count('kda')} KDA + {kinds.count('mla')} MLA  (K=KDA, M=MLA: {pattern})"


def config_label(cfg: K3Config) -> str:
    """'preset tiny', 'preset tiny with mxfp4 experts' (init-model --experts), or 'custom
    config' for a configuration that is no preset."""
    from k3compile.config import PRESETS, preset_name

    name = preset_name(cfg)
    if name:
        return f"preset {name}"
    for name, preset in PRESETS.items():
        if cfg.expert_format != preset.expert_format and replace(cfg, expert_format=preset.expert_format) == preset:
            return f"preset {name} with {cfg.expert_format} experts"
    return "custom config"


def dtype_name(dtype: Any) -> str:
    """'bfloat16' for torch.bfloat16 or 'bfloat16'."""
    return str(dtype).removeprefix("torch.")


# ----- what a pass bought ----------------------------------------------------------

#: ``<quantity>[_per_<unit>]_<removed|added>[_per_<unit>|_if_<branch>]``, the shape of pass stats.
_STAT_KEY = re.compile(
    r"(?P<what>[a-z_]+?)(?:_(?P<per>per_[a-z]+))?_(?P<dir>removed|added)(?:_(?P<tail>per_[a-z]+|if_[a-z]+))?"
)
#: Quantities in words; stats are per rank (GPU) and per step of the phase.
_NOUNS = {
    "weight_bytes": "weights/GPU",
    "kv_bytes": "KV cache",
    "query_bytes": "query",
    "bytes": "traffic",
    "flops": "FLOPs",
    "cache_reads": "cache reads",
}
#: The order in which a pass's effects are named: memory first, node counts last.
_ORDER = ("weight_bytes", "kv_bytes", "bytes", "flops", "launches", "collectives")


def stat_in_words(key: str, value: Any) -> str:
    """One pass stat as people say it: ``weight_bytes_removed=4.2e9`` -> '-3.9 GiB weights/GPU',
    ``launches_removed=12`` -> '-12 launches', ``flops_removed_per_token`` -> '-1.2B FLOPs/token'."""
    from k3compile.records.text import fmt_num

    m = _STAT_KEY.fullmatch(key)
    if m is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"{fmt_num(value)} {key.replace('_', ' ')}"  # 'copies_moved=4' -> '4 copies moved'
    what = m["what"]
    sign = "-" if m["dir"] == "removed" else "+"
    amount = human_bytes(abs(value)) if what.endswith("bytes") else human_count(int(abs(value)))
    text = f"{sign}{amount} {_NOUNS.get(what, what.replace('_', ' '))}"
    for qualifier in (m["per"], m["tail"]):
        if qualifier:
            text += f"/{qualifier[4:]}" if qualifier.startswith("per_") else f" if {qualifier[3:]}"
    return text


def pass_effect(stats: dict[str, Any], limit: int = 3) -> str:
    """What a pass bought, from its stats, in words: memory first, then FLOPs, launches and
    collectives ('-3.9 GiB weights/GPU, +2 collectives'); node counts only when nothing
    else changed; '' for a pass with no nonzero stat."""
    items = [(k, v) for k, v in stats.items() if v not in (0, 0.0, None, False)]

    def rank(item: tuple[str, Any]) -> int:
        m = _STAT_KEY.fullmatch(item[0])
        what = m["what"] if m else ""
        return _ORDER.index(what) if what in _ORDER else len(_ORDER) + (what == "nodes")

    items.sort(key=rank)
    if any(rank(i) <= len(_ORDER) for i in items):
        items = [i for i in items if not i[0].startswith("nodes_")]
    return ", ".join(stat_in_words(k, v) for k, v in items[:limit])


# ----- the pass table (optimize, inspect) --------------------------------------------


def _validation_cell(v: Any) -> str:
    """'1.2e-07 ok' from a summary's ``validation`` entry; '-' when not validated."""
    if not isinstance(v, dict):
        return "-"
    err = v.get("max_error")
    err_s = f"{err:.1e}" if isinstance(err, (int, float)) else str(err)
    return f"{err_s} {'ok' if v.get('ok', True) else 'FAIL'}"


def validation_text(v: Any) -> str:
    """'max error 1.23e-07 (tolerance 1.0e-04) ok' from a summary's ``validation`` entry."""
    from k3compile.records.text import fmt_validation

    return fmt_validation(SimpleNamespace(**v) if isinstance(v, dict) else None)


def pass_table(summaries: list[Any], title: str | None = None, width: int | None = None) -> Table:
    """A table of pass summaries (``PassRecord.summary()`` dicts, as stored in the manifest),
    one row per pass and phase, with what each pass bought. The effect gets its own column
    when ``width`` (default: the console's) leaves room for it, else a dim line under the
    pass name."""
    from k3compile.records.text import fmt_seconds

    rows: list[tuple[str, list[str], str]] = []
    for s in summaries:
        if not isinstance(s, dict):
            rows.append((str(s), ["?"] * 6, ""))
            continue
        seconds = s.get("seconds")
        rows.append((
            str(s.get("pass", s.get("name", "?"))),
            [
                str(s.get("phase", "?")),
                "[yellow]yes[/]" if s.get("changed") else "no",
                str(s.get("matches", "-")),
                str(s.get("skipped", 0)),
                escape(_validation_cell(s.get("validation"))),
                fmt_seconds(seconds) if isinstance(seconds, (int, float)) else "-",
            ],
            pass_effect(s.get("stats") or {}),
        ))

    longest = max((len(name) for name, _, _ in rows), default=4)

    def build(effect_column: bool | None, pass_width: int = longest) -> Table:
        """effect_column: True a column, False under the pass name, None left out."""
        table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
        table.add_column("pass", no_wrap=effect_column is not False, min_width=pass_width)
        table.add_column("phase", no_wrap=True)
        table.add_column("changed", no_wrap=True)
        table.add_column("matches", justify="right", no_wrap=True)
        table.add_column("skipped", justify="right", no_wrap=True)
        table.add_column("max error", justify="right", no_wrap=True)
        table.add_column("time", justify="right", no_wrap=True)
        if effect_column:
            table.add_column("effect (per GPU, per step)", overflow="fold")
        for name, cells, effect in rows:
            first = f"[bold]{escape(name)}[/]"
            if effect_column is False and effect:
                first += f"\n[dim]  {escape(effect)}[/]"
            table.add_row(first, *cells, *([escape(effect) or "-"] if effect_column else []))
        return table

    width = width or console.width
    fixed = console.measure(build(None), options=console.options.update_width(10_000)).maximum
    longest_effect = max((len(effect) for _, _, effect in rows), default=0)
    if fixed + 3 + min(max(longest_effect, 26), 40) <= width:
        return build(True)
    return build(False, max(longest, width - fixed + longest))  # the effect lines take the room left


def _pass_totals(summaries: list[Any]) -> str:
    from k3compile.records.text import fmt_seconds

    dicts = [s for s in summaries if isinstance(s, dict)]
    changed = sum(1 for s in dicts if s.get("changed"))
    failed = sum(1 for s in dicts if isinstance(s.get("validation"), dict) and not s["validation"].get("ok", True))
    validated = sum(1 for s in dicts if isinstance(s.get("validation"), dict))
    seconds = sum(s.get("seconds", 0) for s in dicts if isinstance(s.get("seconds", 0), (int, float)))
    checking = sum(s["validation"].get("seconds", 0) for s in dicts if isinstance(s.get("validation"), dict))
    text = f"{len(summaries)} pass run(s) (one per pass and phase), {changed} changed the graph"
    if validated:
        text += f", {validated} validated" + (f" ({failed} FAILED)" if failed else "")
    text += f", {fmt_seconds(seconds)} in passes"
    return text + (f", {fmt_seconds(checking)} in validation" if validated else "")


_PASS_TABLE_NOTE = (
    "[dim]effect: what the pass saved (-) or added (+) on each GPU, per step of the phase unless it says "
    "otherwise; max error: translation validation of the pass (largest output difference / largest "
    "magnitude); '-': not validated (the pass changed nothing, or compiled without --validate)[/]"
)


def print_passes(summaries: list[Any], title: str) -> None:
    """The pass table, its totals and a note on its columns; a line when no pass ran."""
    if not summaries:
        console.print(f"{title}: none ran (the target has none, or all were disabled)", soft_wrap=True)
        return
    console.print(pass_table(summaries, title=title))
    console.print(_pass_totals(summaries), soft_wrap=True)
    console.print(_PASS_TABLE_NOTE, soft_wrap=True)


def print_pass_details(s: dict[str, Any], layer_names: set[str] | None = None) -> None:
    """Everything the manifest stores about one pass run: all stats, op count changes,
    validation, skipped candidates (those of one layer when ``layer_names`` is given)."""
    from k3compile.records.text import fmt_num, fmt_seconds

    seconds = s.get("seconds")
    console.print(
        f"[bold]{escape(str(s.get('pass')))}[/] {escape('[' + str(s.get('phase')) + ']')}: "
        f"{'changed' if s.get('changed') else 'unchanged'}, {s.get('matches', 0)} match(es), "
        f"nodes {s.get('nodes_before', '?')} -> {s.get('nodes_after', '?')}, "
        f"{fmt_seconds(seconds) if isinstance(seconds, (int, float)) else '?'}",
        soft_wrap=True,
    )
    stats = s.get("stats") or {}
    if stats:
        console.print("  effect:     " + escape(pass_effect(stats, limit=len(stats)) or "none"), soft_wrap=True)
        console.print("  stats:      " + escape(", ".join(f"{k}={fmt_num(v)}" for k, v in stats.items())), soft_wrap=True)
    delta = s.get("op_count_delta") or {}
    if delta:
        console.print("  ops:        " + escape(", ".join(f"{k} {d:+d}" for k, d in delta.items())), soft_wrap=True)
    if s.get("validation") is not None:
        console.print("  validation: " + escape(validation_text(s.get("validation"))), soft_wrap=True)
    reasons = [r for r in s.get("skipped_reasons") or [] if isinstance(r, dict)]
    skipped = s.get("skipped", len(reasons))
    if skipped:
        shown, note = reasons, ""
        if layer_names is not None:
            shown = [r for r in reasons if r.get("node") in layer_names]
            note = f", {len(shown)} of the {len(reasons)} stored in the manifest are in this layer"
        elif len(reasons) < skipped:
            note = f", the first {len(reasons)} stored in the manifest"
        console.print(f"  skipped {skipped} candidate(s){note}:", soft_wrap=True)
        for r in shown:
            console.print(f"    {escape(str(r.get('node')))}: {escape(str(r.get('reason')))}", soft_wrap=True)
    if isinstance(s.get("diff"), str) and s["diff"]:
        console.print(escape(s["diff"]), soft_wrap=True, markup=False)


def capture_text(stats: Any) -> str:
    """'decode 1.2 s (812 nodes), prefill ...; peak memory 310.4 MiB' from capture statistics."""
    from k3compile.records.text import fmt_seconds

    seconds = getattr(stats, "seconds", {}) or {}
    nodes = getattr(stats, "nodes", {}) or {}
    parts = [f"{phase} {fmt_seconds(seconds[phase])} ({nodes.get(phase, '?')} nodes)" for phase in seconds]
    peak = getattr(stats, "peak_rss_bytes", 0)
    return ", ".join(parts) + (f"; peak memory {human_bytes(peak)}" if peak else "")


# ----- the memory plan (plan) ----------------------------------------------------------


def plan_table(result: Any) -> Group:
    """A :class:`~k3compile.memory.MemoryPlan` as a title line and a table. Rows: weight
    kinds, weight total, MLA KV, KDA state, total; columns: the stages (no passes, then
    each pass that changed memory) and what they saved. (The title is a line of its own:
    as a table title, rich would wrap it to the table's width.)"""
    cfg, o = result.config, result.options
    title = (
        f"Memory per GPU: {config_label(cfg)}, tp {o.tp}{f', dcp {o.dcp}' if o.dcp > 1 else ''}, target {o.target}, "
        f"{dtype_name(o.dtype)}, {o.sequences} sequence(s) x {o.context} tokens (block {o.block_size})"
    )
    table = Table(box=box.SIMPLE_HEAD)
    table.add_column("")
    stages = result.stages
    for i, (name, _) in enumerate(stages):
        table.add_column(name if i == 0 else f"+ {name}", justify="right")
    if len(stages) > 1:
        table.add_column("saved", justify="right")
    kinds = {k: [e.weights[k] for _, e in stages] for k in stages[0][1].weights if any(e.weights[k] for _, e in stages)}
    n_mla = cfg.layer_kinds.count("mla")
    from k3compile.mla_cache_fp8 import is_fp8_dtype

    kv = dtype_name(o.mla_cache_dtype)
    kv = f"{kv} + scales" if is_fp8_dtype(o.mla_cache_dtype) else kv
    rows = list(kinds.items()) + [
        ("weights", [e.weight_total for _, e in stages]),
        (f"MLA latent KV ({n_mla} layers, {kv})", [e.mla_kv for _, e in stages]),
        (f"KDA state ({cfg.num_hidden_layers - n_mla} layers)", [e.kda_state for _, e in stages]),
        ("total", [e.total for _, e in stages]),
    ]
    last_kind = list(kinds)[-1]
    for label, values in rows:
        cells = [human_bytes(v) for v in values]
        if len(stages) > 1:
            cells.append(human_bytes(values[0] - values[-1]) if values[0] != values[-1] else "")
        bold = label in ("weights", "total")
        table.add_row(f"[bold]{label}[/]" if bold else label, *cells, end_section=label in (last_kind, "weights"))
    return Group(Text(title, style="italic"), table)


# ----- progress and tokens ---------------------------------------------------------------


class Steps:
    """The steps of a long command as they happen: a spinner on the current step (on a
    terminal) and a line with its duration for every finished one."""

    def __init__(self, console: Console = console):
        self.console = console
        self.status = console.status("starting", spinner="dots")
        self.current: str | None = None
        self.started = 0.0

    def __enter__(self) -> Steps:
        self.status.start()
        return self

    def __call__(self, label: str) -> None:
        self._finish()
        self.current, self.started = label, time.perf_counter()
        self.status.update(f"[bold]{escape(label)}[/] ...")

    def _finish(self) -> None:
        from k3compile.records.text import fmt_seconds

        if self.current is not None:
            seconds = time.perf_counter() - self.started
            self.console.print(f"  [green]✓[/] {escape(self.current)}  [dim]{fmt_seconds(seconds)}[/]", soft_wrap=True)
            self.current = None

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is None:
            self._finish()
        self.status.stop()


def print_tokens(prompts: Sequence[Sequence[int]], new: Sequence[Sequence[int]], load_s: float | None = None,
                 prefill_s: float = 0.0, decode_s: float = 0.0) -> None:
    """Each prompt with its new tokens, then the timing: load, prefill, decode per token
    (none without ``load_s``: the tokens of a generation that stopped)."""
    for i, (p, toks) in enumerate(zip(prompts, new)):
        console.print(f"prompt {i} ({len(p)} tokens): {' '.join(map(str, p))}", soft_wrap=True)
        console.print(f"  new tokens: {' '.join(map(str, toks))}", soft_wrap=True)
    if load_s is None:
        return
    decode_steps = max((len(t) for t in new), default=1) - 1
    timing = f"timing: load {load_s * 1e3:.0f} ms, prefill {prefill_s * 1e3:.1f} ms ({sum(map(len, prompts))} tokens)"
    if decode_steps > 0:
        timing += f", decode {decode_s * 1e3 / decode_steps:.1f} ms/token ({decode_steps} steps, batch {len(prompts)})"
    console.print(timing, soft_wrap=True)
