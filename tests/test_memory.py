"""`k3compile plan` / k3compile.memory: per-GPU weights by kind, MLA KV and KDA state,
with and without each memory-changing pass, checked against sizes counted by hand."""

from __future__ import annotations

import math

import pytest
import torch
from typer.testing import CliRunner

from k3compile.cli import app
from k3compile.cli.render import human_bytes
from k3compile.config import get_preset
from k3compile.memory import MemoryOptions, plan_memory, weight_kind
from k3compile.passes.sink_copies import COND, copies_confined_to_one_branch

GiB = 2**30


def _moe_layers(cfg) -> int:
    return sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))


def _expected_caches(cfg, tp: int, context: int, sequences: int, block: int, dcp: int = 1,
                     interleave: int = 1) -> tuple[int, int]:
    lin = cfg.linear_attn
    n_mla = sum(k == "mla" for k in cfg.layer_kinds)
    n_kda = cfg.num_hidden_layers - n_mla
    # DCP member 0's share of the positions (the largest): runs of `interleave` in turn.
    stored = sum((p // interleave) % dcp == 0 for p in range(context))
    mla = n_mla * sequences * math.ceil(stored / block) * block * cfg.mla_cache_width * 2  # bf16
    heads = lin.num_heads // tp
    conv = 3 * heads * lin.head_dim * (lin.short_conv_kernel_size - 1) * 2  # q, k, v conv states, bf16
    state = heads * lin.head_dim * lin.head_dim * 4  # fp32 recurrent state
    return mla, n_kda * sequences * (conv + state)


def test_weight_kinds_follow_checkpoint_names():
    assert weight_kind("model.layers.3.block_sparse_moe.experts.7.w1.weight") == "routed experts"
    assert weight_kind("model.layers.3.block_sparse_moe.routed_expert_up_proj.weight") == "MoE latent projections"
    assert weight_kind("model.layers.3.block_sparse_moe.shared_experts.down_proj.weight") == "shared experts"
    assert weight_kind("model.layers.0.mlp.gate_proj.weight") == "dense MLP"
    assert weight_kind("model.layers.5.self_attn.kv_a_proj_with_mqa.weight") == "attention"
    assert weight_kind("model.norm.weight") == "norms and AttnRes"


def test_plan_tiny_tp2_counts_caches_and_the_dedup_saving():
    cfg = get_preset("tiny")
    tp, context, seqs, block = 2, 100, 3, 16
    plan = plan_memory(cfg, MemoryOptions(tp=tp, target="cpu", context=context, sequences=seqs, block_size=block))
    assert [name for name, _ in plan.stages] == ["no passes", "dedup_replicated_linear"]
    assert plan.unchanged == ["remove_noops", "mxfp4_experts", "sink_copies"]
    before, after = plan.stages[0][1], plan.stages[1][1]
    up_bytes = _moe_layers(cfg) * cfg.hidden_size * cfg.routed_expert_hidden_size * 2
    assert plan.saved_by("dedup_replicated_linear") == up_bytes * (tp - 1) // tp
    assert before.weights["MoE latent projections"] - after.weights["MoE latent projections"] == up_bytes // 2
    assert {k for k, v in before.weights.items() if v != after.weights[k]} == {"MoE latent projections"}
    assert (after.mla_kv, after.kda_state) == _expected_caches(cfg, tp, context, seqs, block)


def test_plan_cli_prints_the_table_and_rejects_bad_options(tmp_path):
    runner = CliRunner()
    ok = runner.invoke(app, ["plan", "--preset", "tiny", "--tp", "2", "--target", "cpu", "--context", "64"])
    assert ok.exit_code == 0, ok.output
    assert "+ dedup_replicated_linear" in ok.stdout and "saved" in ok.stdout
    assert "passes that ran without changing memory: remove_noops, mxfp4_experts, sink_copies" in ok.stdout
    assert "routed experts held as dense bfloat16" in ok.stdout  # the tiny preset's experts are bf16
    errors = {
        ("--tp", "3"): "--tp 3:",
        ("--dcp", "3"): "--tp 2 --dcp 3 --dcp-interleave 1: dcp must be a divisor of tp=2, got 3",
        ("--dcp-interleave", "0"): "--dcp-interleave 0: dcp_interleave must be >= 1, got 0",
        ("--context", "0"): "--context must be at least 1",
        ("--target", "tpu"): "--target: unknown target 'tpu'",
    }
    for args, message in errors.items():
        bad = runner.invoke(app, ["plan", "--preset", "tiny", "--tp", "2", *args])
        assert bad.exit_code == 2 and message in bad.stderr, bad.output
    both = runner.invoke(app, ["plan", str(tmp_path), "--preset", "tiny"])
    assert both.exit_code == 2 and "exactly one of MODEL" in both.stderr


def test_plan_tiny_dcp2_halves_the_mla_cache():
    cfg = get_preset("tiny")
    context, seqs, block = 96, 2, 16
    plan = plan_memory(cfg, MemoryOptions(tp=2, dcp=2, target="cpu", context=context, sequences=seqs, block_size=block))
    assert [name for name, _ in plan.stages] == ["no passes", "dedup_replicated_linear", "split_mla_context"]
    before, after = plan.stages[1][1], plan.stages[2][1]
    assert before.mla_kv == _expected_caches(cfg, 2, context, seqs, block)[0]
    assert after.mla_kv == _expected_caches(cfg, 2, context, seqs, block, dcp=2)[0] == before.mla_kv // 2
    assert plan.saved_by("split_mla_context") == before.mla_kv // 2
    assert (after.weights, after.kda_state) == (before.weights, before.kda_state)


def test_plan_cli_with_a_dcp_interleave_reports_member_0s_share_of_the_history():
    """--dcp 2 --dcp-interleave 32 over 96 tokens: member 0 owns positions 0-31 and 64-95
    (64: 4 blocks of 16), member 1 32-63. The plan reports member 0's share, the larger,
    where interleave 1 would give 48 positions (3 blocks)."""
    cfg = get_preset("tiny")
    result = CliRunner().invoke(app, ["plan", "--preset", "tiny", "--tp", "2", "--dcp", "2", "--dcp-interleave", "32",
                                      "--context", "96", "--sequences", "2", "--target", "cpu", "--block-size", "16"])
    assert result.exit_code == 0, result.output
    before = _expected_caches(cfg, 2, 96, 2, 16)[0]
    after = _expected_caches(cfg, 2, 96, 2, 16, dcp=2, interleave=32)[0]
    width = cfg.mla_cache_width * 2  # bf16 bytes per position
    assert (before, after) == (3 * 2 * 96 * width, 3 * 2 * 64 * width)  # 3 MLA layers x 2 sequences
    assert _expected_caches(cfg, 2, 96, 2, 16, dcp=2)[0] == 3 * 2 * 48 * width  # interleave 1
    row = next(line for line in result.stdout.splitlines() if "MLA latent KV" in line)
    cells = [human_bytes(v) for v in (before, before, after, before - after)]  # no passes, dedup, split, saved
    assert " ".join(row.split()) == " ".join(["MLA latent KV (3 layers, bfloat16)", *cells])
    assert cells == ["45.0 KiB", "45.0 KiB", "30.0 KiB", "15.0 KiB"]


def test_plan_cli_counts_an_fp8_cache_with_its_scales():
    """--kv-cache-dtype fp8: 40 + 16 bytes per position (the values' codes, two fp32 scales,
    8 bytes of padding), 56 / 80 of the bf16 cache's bytes; with DCP2 half of that."""
    base = ["plan", "--preset", "tiny", "--tp", "2", "--dcp", "2", "--context", "96", "--sequences", "2",
            "--target", "cpu", "--block-size", "16"]
    result = CliRunner().invoke(app, [*base, "--kv-cache-dtype", "fp8"])
    assert result.exit_code == 0, result.output
    row = next(line for line in result.stdout.splitlines() if "MLA latent KV" in line)
    full, split = 3 * 2 * 96 * 56, 3 * 2 * 48 * 56  # 3 MLA layers x 2 sequences x positions x bytes
    assert " ".join(row.split()) == " ".join(["MLA latent KV (3 layers, float8_e4m3fn + scales)",
                                              *(human_bytes(v) for v in (full, full, split, full - split))])
    refused = CliRunner().invoke(app, [*base, "--kv-cache-dtype", "bf16", "--dtype", "float32"])
    assert refused.exit_code == 2 and "bf16 needs the bfloat16 model dtype" in refused.stderr
    unknown = CliRunner().invoke(app, [*base, "--kv-cache-dtype", "int4"])
    assert unknown.exit_code == 2 and "--kv-cache-dtype: unknown choice 'int4'" in unknown.stderr


@pytest.mark.slow
def test_plan_full_k3_tp8_dcp8_reports_the_dedup_and_dcp_savings():
    """The full 2.8T config on meta, TP8 with DCP8: mxfp4_experts holds the routed experts
    as codes + scales (17/32 bytes per value instead of 2), so the model fits an MI355X
    with room for caches; the dedup pass saves 7/8 of every
    routed-expert up-projection (7168 x 3584 bf16) on each GPU, the DCP pass 7/8 of the
    MLA latent cache (24 layers x 576 bf16 per token); after sink_copies the decode graph
    has no copy left outside the one cond branch that reads it (69 KDA layers)."""
    cfg = get_preset("k3")
    context = 131072
    plan = plan_memory(cfg, MemoryOptions(tp=8, dcp=8, target="mi355x", context=context, sequences=1,
                                          dtype=torch.bfloat16))
    experts = _moe_layers(cfg) * 896 * 3 * 384 * 3584  # values per GPU: w1, w3, w2 of every expert
    assert plan.stages[0][1].weights["routed experts"] == experts * 2  # dense bf16: 633.9 GiB
    assert plan.after("mxfp4_experts").weights["routed experts"] == experts * 17 // 32  # codes + scales: 168.4 GiB
    assert plan.routed_expert_format() == "MXFP4 codes + scales (uint8)"
    assert plan.final.total + 64 * GiB < plan.hbm_bytes  # fits an MI355X with room for caches
    saved = plan.saved_by("dedup_replicated_linear")
    assert saved == _moe_layers(cfg) * 7168 * 3584 * 2 * 7 // 8
    assert 4.0 * GiB > saved > 3.5 * GiB
    assert plan.saved_by("split_mla_context") == 24 * context * 576 * 2 * 7 // 8  # 3.94 GiB at 128K
    final = plan.final
    assert (final.mla_kv, final.kda_state) == _expected_caches(cfg, 8, context, 1, 16, dcp=8)
    gm = plan.program.graph_module
    assert sum(n.target is COND for n in gm.graph.nodes) == 69
    assert copies_confined_to_one_branch(gm) == []
