"""The kernel launch report (runtime/kernels/launch_report.py) at one K3 TP8 rank's shapes:
the grids it plans are the launchers' (checked against the counts written out here), and
every launch the runtime picks on gfx950 and gfx942 at batch 1, 16 and 64 and contexts
1K, 32K and 128K compiles within its target's LDS, without spills, with at least one
program resident per CU and the split-KV kernel at the occupancy its plan assumes
(issue #24)."""

from __future__ import annotations

import dataclasses
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is first imported

import pytest  # noqa: E402
import triton  # noqa: E402

from k3compile.config import PRESETS  # noqa: E402
from k3compile.runtime.kernels import aot, mla_split_kv  # noqa: E402
from k3compile.runtime.kernels.launch_report import (  # noqa: E402
    LaunchRow,
    StepShapes,
    planned_launches,
    reference_fallbacks,
)

AMD = ("gfx950", "gfx942")
STEPS = [(b, t) for b in (1, 16, 64) for t in (1024, 32768, 131072)]


def k3_rank(batch: int, context: int, dcp: int = 1) -> StepShapes:
    return StepShapes.of_model(PRESETS["k3"], 8, dcp, batch, context, torch.bfloat16)


def aot_requests() -> dict[tuple, aot.CompileRequest]:
    """Every distinct launch the report plans on the AMD targets for STEPS."""
    return {(t, p.launch.key): p.launch.request(t) for t in AMD for b, c in STEPS
            for p in planned_launches(t, k3_rank(b, c))}


def rows(aot_reports: dict, target: str, shapes: StepShapes) -> dict[str, LaunchRow]:
    units = aot.TARGETS[target].compute_units
    return {p.name: LaunchRow(p, aot_reports[(target, p.launch.key)], units) for p in planned_launches(target, shapes)}


def test_k3_shapes_of_a_tp8_rank():
    s = k3_rank(1, 32768)
    assert (s.kda_heads, s.kda_head_dim, s.mla_heads, s.mla_prefill_heads) == (12, 128, 16, 12)
    assert (s.experts, s.top_k, s.expert_hidden, s.expert_intermediate) == (896, 16, 3584, 384)
    assert k3_rank(1, 32768, dcp=8).mla_heads == 96  # the group's gathered heads
    with pytest.raises(ValueError, match="batch >= 1"):
        StepShapes(0, 1024)


@pytest.mark.parametrize("target", AMD)
def test_every_planned_launch_fits_without_spills(aot_reports, target):
    for batch, context in STEPS:
        for name, row in rows(aot_reports, target, k3_rank(batch, context)).items():
            r = row.resources
            assert r.fits and r.spills == 0 and row.resident >= 1, (target, batch, context, name, r)


@pytest.mark.parametrize("target", AMD)
def test_split_kv_runs_at_the_occupancy_its_plan_assumes(aot_reports, target):
    """choose_num_splits sizes its waves with SplitKVConfig.programs_per_sm: the compiled
    kernel must hold that many programs per CU."""
    for batch, context in STEPS:
        row = rows(aot_reports, target, k3_rank(batch, context))["mla decode split-KV"]
        assert row.resident == mla_split_kv.split_kv_config(target, 16).programs_per_sm, (target, batch, context)


def test_decode_grids_at_batch_1_on_mi355x(aot_reports):
    """12 KDA heads x 128 values in tiles of 16: 96 workgroups on 256 CUs, reported idle;
    the split-KV kernel at its chosen splits, the combine over them."""
    got = rows(aot_reports, "gfx950", k3_rank(1, 32768))
    kda = got["kda decode (fused)"]
    assert kda.planned.programs == 96 and kda.warnings[0] == "160 of 256 compute units idle"
    config = mla_split_kv.split_kv_config("gfx950", 16)
    splits = mla_split_kv.choose_num_splits(1, 16, 32768, 256, config)
    assert got["mla decode split-KV"].planned.programs == splits > 1
    combine = got["mla split combine"].planned
    assert combine.programs == 16 * triton.cdiv(512, combine.launch.constexprs["BLOCK_L"])


def test_prefill_grids_of_one_32k_prompt_on_mi355x(aot_reports):
    """513 chunk programs a head (512 chunks and the worst-case partial one), 4 state tiles
    of 32 columns, groups of 103 chunks (five: about two summary programs a CU, 2 x 256 //
    (12 heads x 8 summary tiles)), the expanded MLA kernel's 256 row tiles of 128 tokens at
    12 heads, the experts' 64-pair blocks over 524,288 pairs."""
    got = rows(aot_reports, "gfx950", k3_rank(1, 32768))
    assert got["kda prefill preparation"].planned.programs == 513 * 12
    # groups: the launcher's worst-case grid, cdiv(513, 103) + 1 = 6 segments (5 real)
    assert got["kda prefill chunk groups"].planned.programs == 1  # the 6 segments' table, one launch
    assert got["kda prefill group summaries"].planned.programs == 6 * 12 * 8
    assert got["kda prefill group scan"].planned.programs == 12 * 4
    assert got["kda prefill state pass"].planned.programs == 6 * 12 * 4
    assert got["mla prefill (expanded)"].planned.programs == 256 * 12
    blocks = 524288 // 64 + 896  # the long-prefill plan's blocks of 64 pairs, each expert's last partial
    assert got["experts w13"].planned.programs == blocks * 384 // 64
    assert got["experts w2"].planned.programs == blocks * 3584 // 64
    assert got["kda prefill preparation"].resident >= 2  # issue #23: two workgroups per CU
    # tensors of 2 GiB or more compile without buffer loads (ROCm's JIT): the fp32 y of
    # 524,288 pairs x 3,584 (7.5 GB), not h (0.4 GB) nor the KDA preparation's scratch
    # (bf16 q and k, fp32 G: 0.4 GB at 32K); at 512K tokens the gate and that scratch (3.2 GB)
    assert got["experts w2"].planned.launch.pointers_over_2gib == ("out_ptr",)
    assert got["experts w13"].planned.launch.pointers_over_2gib == ()
    assert got["kda prefill preparation"].planned.launch.pointers_over_2gib == ()
    at_512k = {p.name: p for p in planned_launches("gfx950", k3_rank(1, 524288))}
    assert at_512k["kda prefill preparation"].launch.pointers_over_2gib == ("g_ptr", "qk_ptr", "gc_ptr")


def test_prefill_under_dcp_by_the_pass_option():
    """gathered (the default): the DCP1 prefill on the rank's 12 heads over the whole
    history; partial: the absorbed kernel over the member's share for the group's 96 heads."""
    gathered = {p.name: p for p in planned_launches("gfx950", k3_rank(1, 4096, dcp=8))}
    assert gathered["mla prefill (expanded)"].programs == 4096 // 128 * 12
    shapes = StepShapes.of_model(PRESETS["k3"], 8, 8, 1, 4096, torch.bfloat16, dcp_prefill="partial")
    partial = {p.name: p for p in planned_launches("gfx950", shapes)}
    mla = partial["mla prefill (absorbed, DCP share)"]
    assert mla.programs == triton.cdiv(4096 * 96, mla.launch.constexprs["BLOCK_M"])
    assert "mla prefill (expanded)" not in partial
    with pytest.raises(ValueError, match="dcp_prefill"):
        StepShapes.of_model(PRESETS["k3"], 8, 8, 1, 4096, torch.bfloat16, dcp_prefill="absorbed")


def launch_ints(kernel, run) -> list[dict[str, int]]:
    """The integer arguments of every launch of ``kernel`` while ``run()`` runs (a pre-run
    hook on the real kernel, under the interpreter here)."""
    calls = []

    def record(*args, **kwargs):
        named = {**dict(zip(kernel.arg_names, args)), **kwargs}
        calls.append({n: v for n, v in named.items() if type(v) is int and kernel.arg_names.index(n) < len(args)})

    kernel.add_pre_run_hook(record)
    try:
        run()
    finally:
        kernel.pre_run_hooks.remove(record)
    return calls


def jit_classes(launch: aot.KernelLaunch, names) -> dict[str, str]:
    """How ``launch`` declares each integer argument: a constant 1, divisible by 16, or plain."""
    return {n: "one" if launch.signature[n] == "constexpr" and launch.constexprs[n] == 1
            else "div" if n in launch.divisible_by_16 else "plain" for n in names}


def value_classes(kernel, ints: dict[str, int]) -> dict[str, str]:
    """How Triton's JIT specialises these values (its do_not_specialize arguments plain)."""
    plain = aot._not_specialised(kernel)
    return {n: "plain" if n in plain else "one" if v == 1 else "div" if v % 16 == 0 else "plain"
            for n, v in ints.items()}


@pytest.mark.parametrize("batch", [1, 3])
def test_report_integers_are_what_the_launchers_pass(batch):
    """The report declares every integer argument of the split-KV kernel, its combine and
    the DCP merge kernels as the runtime's launchers pass them: captured from real launches
    (the interpreter), classed by Triton's JIT rule (a constant 1, divisible by 16, plain).
    The split-KV kernel writes its LSE partials with stride 1 (a constant to the JIT) and
    the DCP kernels take the batch, a constant at batch 1."""
    from mla_cases import case

    from k3compile.runtime.kernels import dcp_merge as dm
    from k3compile.runtime.kernels import mla_split_kv as sk

    context, block = 80, 16
    config = sk.split_kv_config("gfx950", 16)
    q, cache, table, seq_lens, scale = case(16, 512, 64, [context] * batch, block_size=block, seed=batch)
    split = launch_ints(sk._mla_decode_split_kv_kernel, lambda: launch_ints(
        sk._combine_splits_kernel, lambda: sk.mla_decode_split_kv(q, cache, table, seq_lens, scale, 512,
                                                                 num_sms=256, config=config)))
    shapes = StepShapes(batch, context, mla_heads=16, block_size=block, dcp=2, mla_prefill_heads=8)
    planned = {p.name: p.launch for p in planned_launches("gfx950", dataclasses.replace(shapes, dcp=1))}
    (kernel_ints,) = split
    assert value_classes(sk._mla_decode_split_kv_kernel, kernel_ints) == jit_classes(
        planned["mla decode split-KV"], kernel_ints)
    assert jit_classes(planned["mla decode split-KV"], ["stride_ls"]) == {"stride_ls": "one"}
    o = torch.randn(batch, 16, 512).bfloat16()
    lse = torch.randn(batch, 16)
    (pack,) = launch_ints(dm._dcp_pack_kernel, lambda: dm.dcp_pack(o, lse, 2))
    (merge,) = launch_ints(dm._dcp_merge_kernel, lambda: dm.dcp_merge(dm.dcp_pack(o, lse, 2), torch.bfloat16))
    decode = {p.name: p.launch for p in planned_launches("gfx950", shapes) if p.phase == "decode"}
    assert value_classes(dm._dcp_pack_kernel, pack) == jit_classes(decode["dcp pack"], pack)
    assert value_classes(dm._dcp_merge_kernel, merge) == jit_classes(decode["dcp merge"], merge)
    assert (jit_classes(decode["dcp pack"], ["B"]) == {"B": "one"}) == (batch == 1)


def test_every_triton_kernel_of_a_step_is_listed():
    """The per-token kernels are in the report with a program per token (and column block):
    at batch 16, 16 AttnRes mixes and routings; FP8 cache writes only with an FP8 cache; the
    DCP merge kernels only under DCP, by the merge option; a 32K prompt's short convolution
    in 16-token chunks over 1536 channels."""
    decode = {p.name: p for p in planned_launches("gfx950", k3_rank(16, 1024)) if p.phase == "decode"}
    assert decode["attn_res mix + norm"].programs == 16 and decode["moe input: routing"].programs == 16
    assert decode["attn_res mix + norm"].launch.constexprs["N"] == 9  # 8 finished blocks and the partial sum
    assert decode["mla input norms and gate"].programs == 16 * (2 + 1536 // 1024 + 1)
    assert "mla FP8 cache write" not in decode and "dcp pack" not in decode
    fp8 = StepShapes.of_model(PRESETS["k3"], 8, 8, 1, 1024, torch.bfloat16, kv_dtype=torch.float8_e4m3fn)
    names = {p.name for p in planned_launches("gfx950", fp8) if p.phase == "decode"}
    assert {"mla FP8 cache write", "dcp pack", "dcp merge"} <= names
    rescale = StepShapes.of_model(PRESETS["k3"], 8, 8, 1, 1024, torch.bfloat16, dcp_merge="reduce-scatter")
    names = {p.name for p in planned_launches("gfx950", rescale) if p.phase == "decode"}
    assert "dcp rescale" in names and "dcp pack" not in names
    prefill = {p.name: p for p in planned_launches("gfx950", k3_rank(1, 32768)) if p.phase == "prefill"}
    assert prefill["kda short conv"].programs == 32768 // 16 * 1536 // 128


def test_reference_fallbacks_name_what_runs_the_reference():
    """At K3's shapes every op has its kernel; 24 heads are no split-KV head count (the
    generic kernel), a head dim of 96 no KDA prefill kernel's: those launches are left out."""
    assert reference_fallbacks(k3_rank(1, 1024)) == []
    odd = StepShapes(1, 1024, mla_heads=24, kda_head_dim=96)
    got = reference_fallbacks(odd)
    assert any(f.startswith("mla decode: the generic kernel (24 heads") for f in got)
    assert any(f.startswith("kda prefill: the reference (head dim 96") for f in got)
    names = {p.name for p in planned_launches("gfx950", odd)}
    assert "mla decode split-KV" not in names and "kda prefill preparation" not in names
