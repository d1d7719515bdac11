"""Launch tables by target (runtime/kernels/targets.py): which table a device takes, and
tables that cover every target CI compiles for (aot.TARGETS), so that what CI checks for
a target is what a runtime on it launches."""

from __future__ import annotations

import torch

from k3compile.runtime.kernels import aot, kda_prefill, kda_prefill_scan, moe_plans
from k3compile.runtime.kernels.targets import AMD_TARGETS, device_target


def test_the_cpu_interpreter_takes_the_h200_table():
    assert device_target(torch.device("cpu")) == "sm_90"


def test_tables_cover_every_compile_target():
    assert set(AMD_TARGETS) | {"sm_90"} == set(aot.TARGETS)
    tables = {"kda_prefill.WARPS": kda_prefill.WARPS, "kda_prefill.SCAN_STAGES": kda_prefill.SCAN_STAGES,
              "kda_prefill.HEAD_SLICE": kda_prefill.HEAD_SLICE, "kda_prefill_scan.BLOCK_X": kda_prefill_scan.BLOCK_X,
              "moe_plans.PLANS": moe_plans.PLANS}
    for name, table in tables.items():
        assert set(table) == set(aot.TARGETS), name
