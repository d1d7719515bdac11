"""Launch tables by target (runtime/kernels/targets.py): which table a device takes, and
tables that cover every target CI compiles for (aot.TARGETS), so that what CI checks for
a target is what a runtime on it launches."""

from __future__ import annotations

import torch

from k3compile.runtime.kernels import aot, kda_prefill, kda_prefill_scan, mla_prefill_expanded, mla_split_kv, moe_plans
from k3compile.runtime.kernels.targets import AMD_TARGETS, NVIDIA_TARGETS, device_target, on_nvidia, register_cap


def test_the_cpu_interpreter_takes_the_h200_table():
    assert device_target(torch.device("cpu")) == "sm_90"


def test_tables_cover_every_compile_target():
    assert set(AMD_TARGETS) | set(NVIDIA_TARGETS) == set(aot.TARGETS)
    tables = {"kda_prefill.WARPS": kda_prefill.WARPS, "kda_prefill.SCAN_STAGES": kda_prefill.SCAN_STAGES,
              "kda_prefill.SUMMARY_STAGES": kda_prefill.SUMMARY_STAGES,
              "kda_prefill.GROUP_SCAN_STAGES": kda_prefill.GROUP_SCAN_STAGES,
              "kda_prefill.HEAD_SLICE": kda_prefill.HEAD_SLICE, "kda_prefill_scan.BLOCK_X": kda_prefill_scan.BLOCK_X,
              "moe_plans.PLANS": moe_plans.PLANS}
    for name, table in tables.items():
        assert set(table) == set(aot.TARGETS), name


def test_mla_launches_by_target():
    """The MLA launch choices by target: tensor-descriptor tiles and 64-head tiles only on
    sm_90, one software-pipeline stage on AMD (both AMD targets alike until measured)."""
    for target in aot.TARGETS:
        split_kv = mla_split_kv.split_kv_config(target, 16)
        expanded = mla_prefill_expanded.expanded_config(target, torch.bfloat16)
        amd = target in AMD_TARGETS
        assert split_kv.tma == (not amd) and expanded.num_stages == (1 if amd else 3), target
        assert (64 in mla_split_kv.split_kv_head_tiles(target)) == (not amd), target


def test_register_caps_reach_nvidia_targets_only():
    """maxnreg is an NVIDIA option: a ROCm device (torch's "cuda" type too) never gets it,
    and every cap in a launch table names an NVIDIA target."""
    assert register_cap("sm_90", 168) == {"maxnreg": 168} and register_cap("sm_90", None) == {}
    assert all(register_cap(t, 168) == {} for t in AMD_TARGETS)
    assert set(kda_prefill.PREP_MAX_REGISTERS) <= set(NVIDIA_TARGETS)


def test_the_vendor_is_read_in_one_place():
    """Issue #24: the runtime selects by target (``device_target``), never by
    ``torch.version.hip`` elsewhere."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    readers = sorted(str(p.relative_to(root)) for folder in ("runtime", "k3compile", "passes")
                     for p in (root / folder).rglob("*.py") if "version.hip" in p.read_text())
    assert readers == ["runtime/kernels/targets.py"]
    assert not on_nvidia(torch.device("cpu"))
