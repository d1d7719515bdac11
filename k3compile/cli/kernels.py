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


def _added_op(passes: list[Any], phase: str, op: str) -> bool:
    """Whether split_mla_context's record of ``phase`` shows ``op`` nodes added."""
    return any(isinstance(r, dict) and r.get("pass") == "split_mla_context" and r.get("phase") == phase
               and any(op in name for name in r.get("op_count_delta", {})) for r in passes)


def dcp_prefill(passes: list[Any]) -> str:
    """split_mla_context's prefill option as the artifact's pass records show it: "partial"
    where its prefill rewrite added k3.mla_prefill_partial nodes, else "gathered"."""
    return "partial" if _added_op(passes, "prefill", "mla_prefill_partial") else "gathered"


def dcp_merge(passes: list[Any]) -> str:
    """split_mla_context's merge option as the records show it: "reduce-scatter" where its
    decode rewrite added k3.dcp_rescale nodes, else "all-to-all"."""
    return "reduce-scatter" if _added_op(passes, "decode", "dcp_rescale") else "all-to-all"


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
    from k3compile.runtime.kernels.launch_report import StepShapes, launch_report, reference_fallbacks

    spec = TARGETS[target]
    shapes = StepShapes.of_model(info.config, info.tp, info.dcp, batch, context, info.dtype, info.kv_cache_dtype,
                                 dcp_prefill(info.passes), dcp_merge(info.passes), info.block_size)
    with console.status(f"compiling the step's kernels for {target} ({spec.arch})"):
        rows = launch_report(spec.arch, shapes)
    where = f"{target} ({spec.arch}, {spec.compute_units} compute units), one rank of TP{info.tp}" + (
        f" / DCP{info.dcp}" if info.dcp > 1 else "")
    console.print(kernel_table("decode", rows, f"Decode step: {batch} sequences at {context:,} positions on {where}"))
    console.print(kernel_table("prefill", rows, f"Prefill: {batch} prompts of {context:,} tokens on {where}"))
    for fallback in reference_fallbacks(shapes):
        console.print(f"[yellow]torch reference instead of a kernel: {fallback}[/]", soft_wrap=True)
    console.print("[dim]fill: programs over the device's resident slots (compute units x resident per unit); "
                  "resident from the compiled registers and LDS. Every Triton kernel of the runtime is listed; "
                  "vendor GEMMs and Inductor's kernels are not.[/]", soft_wrap=True)
