"""``k3compile inspect --kernels``: the kernel launches of one rank's decode and prefill
step on a GPU target, with their grids, resources and fill of the device
(``k3compile.runtime.kernels.launch_report``)."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from k3compile.cli.app import UserError, console
from k3compile.cli.options import choice
from k3compile.targets import GPU_DEVICES, TARGETS

#: the GPU targets a report can be made for
REPORT_TARGETS = tuple(name for name, t in TARGETS.items() if t.device in GPU_DEVICES)


def check_report_choices(target: str, batch: int, context: int) -> None:
    """The report's options, before any work."""
    choice(target, REPORT_TARGETS, "--target", "GPU target")
    if batch < 1:
        raise UserError(f"--batch: at least 1 sequence, got {batch}")
    if context < 1:
        raise UserError(f"--context: at least 1 token, got {context}")


def dcp_prefill(passes: list[Any]) -> str:
    """split_mla_context's prefill option as the artifact's pass records show it: "partial"
    where its prefill rewrite added k3.mla_prefill_partial nodes, else "gathered"."""
    for record in passes:
        if isinstance(record, dict) and record.get("pass") == "split_mla_context" and record.get("phase") == "prefill":
            if any("mla_prefill_partial" in op for op in record.get("op_count_delta", {})):
                return "partial"
    return "gathered"


def kernel_table(phase: str, rows: list[Any], title: str) -> Table:
    """One phase's launches as a table (rows: ``launch_report.LaunchRow``)."""
    table = Table(title=title, title_justify="left")
    for col in ("kernel", "plan", "programs", "resident / CU", "fill", "LDS KiB", "regs", "warnings"):
        table.add_column(col, justify="right" if col in ("programs", "resident / CU", "fill", "LDS KiB", "regs")
                         else "left", overflow="fold")
    for row in rows:
        if row.planned.phase != phase:
            continue
        r = row.resources
        fill = "-" if row.fill is None else f"{row.fill:.2f}"
        warnings = "; ".join(row.warnings)
        table.add_row(row.planned.name, row.planned.plan, f"{row.planned.programs:,}", "-" if row.resident is None else str(row.resident), fill,
                      f"{r.shared_bytes / 1024:.0f}", str(r.registers or "-"),
                      f"[yellow]{warnings}[/]" if warnings else "")
    return table


def print_kernel_report(info: Any, target: str, batch: int, context: int) -> None:
    """The report for artifact ``info``'s model and parallelism on ``target``."""
    from k3compile.runtime.kernels.launch_report import StepShapes, launch_report

    spec = TARGETS[target]
    shapes = StepShapes.of_model(info.config, info.tp, info.dcp, batch, context, info.dtype, info.kv_cache_dtype,
                                 dcp_prefill(info.passes))
    with console.status(f"compiling the step's kernels for {target} ({spec.arch})"):
        rows = launch_report(spec.arch, shapes)
    where = f"{target} ({spec.arch}, {spec.compute_units} compute units), one rank of TP{info.tp}" + (
        f" / DCP{info.dcp}" if info.dcp > 1 else "")
    console.print(kernel_table("decode", rows, f"Decode step: {batch} sequences at {context:,} positions on {where}"))
    console.print(kernel_table("prefill", rows, f"Prefill: {batch} prompts of {context:,} tokens on {where}"))
    console.print("[dim]fill: programs over the device's resident slots (compute units x resident per unit); "
                  "resident from the compiled registers and LDS. Covered: the attention, KDA and routed-expert "
                  "kernels (the small per-token ones are not listed).[/]", soft_wrap=True)
