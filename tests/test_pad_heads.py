"""The pad-attention-heads pass, its target tables and its ops.

Tables: derived from the Triton kernels' declarations (GPU targets) and the torch
reference (cpu). Ops: ``k3::mla_decode_split_kv`` is ``k3::mla_decode`` restricted to
multiples of 16 heads, and zero-padding the heads then narrowing the outputs back is
exact. The pass: ``tiny-h24`` (24 MLA heads) pads 12 local heads to 16 at TP2 and 24 to 32
at TP1, is validated in the pipeline (TP2 on two gloo ranks), leaves head counts the fast
kernel already takes alone (the DCP case), says why for every node, and the runtime on
the padded artifact gives the unpadded artifact's decode logits and greedy tokens.

The Triton kernel module is imported only by the tests that need it: the tables of GPU
targets import it, ``import k3compile`` and the cpu table must not (checked).
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

import k3compile.ops  # noqa: F401  (registers torch.ops.k3)
from k3compile import runtime
from k3compile.artifact import load_artifact
from k3compile.capture import capture
from k3compile.compiler import CompileOptions
from k3compile.config import get_preset
from k3compile.kernel_tables import ReferenceKernel, fast_attention_kernel, kernel_table, next_accepted_heads
from k3compile.ops import mla
from k3compile.passes.pad_attention_heads import PadAttentionHeads
from k3compile.pipeline import PassContext
from k3compile.placement import op_rule, propagate_placements
from k3compile.sharding import ParallelPlan
from k3compile.targets import get_target

k3 = torch.ops.k3
bf16 = torch.bfloat16
GPU_TARGETS = ("h200", "mi355x", "mi300x")
PROMPTS = [[5, 9, 100, 7, 3, 44, 21], [17, 4], [300]]
NEW_TOKENS = 12


@pytest.fixture(autouse=True)
def with_pass(monkeypatch):
    """Register the pass by name (the pipeline resolves passes through ALL_PASSES)."""
    from k3compile import passes

    monkeypatch.setitem(passes.ALL_PASSES, PadAttentionHeads.name, PadAttentionHeads)


def _other_passes() -> tuple[str, ...]:
    """Every pass but the one under test, so that its records and validation stand alone."""
    from k3compile import passes

    return tuple(name for name in passes.ALL_PASSES if name != PadAttentionHeads.name)


# ---------------------------------------------------------------------------
# Target tables
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("target", GPU_TARGETS)
def test_gpu_tables_come_from_the_kernel_declarations(target):
    from k3compile.runtime.kernels import mla_attention as ak
    from k3compile.runtime.kernels import mla_decode as mk
    from k3compile.runtime.kernels import mla_split_kv as sk

    table = kernel_table(target)
    assert [k.declaration for k in table.decode] == mk.MLA_DECODE_KERNELS
    assert [k.declaration for k in table.prefill] == mk.MLA_PREFILL_KERNELS
    fast = fast_attention_kernel(target, "decode")
    assert fast.declaration is sk.SPLIT_KV and fast.op == "k3::mla_decode_split_kv"
    assert [fast.accepts(h, bf16, 576, 512) for h in (12, 16, 24, 32, 96)] == [False, True, False, True, True]
    assert "multiple of 16" in fast.reason_rejected(12, bf16, 576, 512)
    assert [next_accepted_heads(target, h, bf16, 576, 512) for h in (1, 12, 16, 24, 96)] == [16, 16, 16, 32, 96]
    # no head count makes the kernel take a dtype or a width it does not support
    assert next_accepted_heads(target, 12, torch.int8, 576, 512) is None
    assert next_accepted_heads(target, 12, bf16, 1088, 1024) is None
    prefill = fast_attention_kernel(target, "prefill")
    assert prefill.declaration is ak.PREFILL and prefill.accepts(12, bf16, 576, 512)
    assert next_accepted_heads(target, 12, bf16, 576, 512, phase="prefill") == 12


def test_cpu_table_is_the_reference_and_takes_every_head_count():
    fast = fast_attention_kernel("cpu", "decode")
    assert isinstance(fast.declaration, ReferenceKernel) and fast.op == "k3::mla_decode"
    assert all(fast.accepts(h, dtype, 40, 32) for h in (1, 3, 12, 24) for dtype in (bf16, torch.float32))
    assert next_accepted_heads("cpu", 12, bf16, 576, 512) == 12
    assert fast_attention_kernel("cpu", "prefill").accepts(12, bf16, 576, 512)
    assert "floating" in fast.reason_rejected(12, torch.int8, 576, 512)
    with pytest.raises(ValueError, match="unknown target"):
        kernel_table("tpu")


def test_import_and_cpu_table_do_not_import_triton():
    code = ("import sys, k3compile; from k3compile.kernel_tables import kernel_table; kernel_table('cpu'); "
            "import k3compile.passes.pad_attention_heads; assert 'triton' not in sys.modules, 'triton imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------------------
# Ops
# ---------------------------------------------------------------------------


def _decode_case(heads: int, gen: torch.Generator):
    B, W, L, bs, nb, width = 3, 40, 32, 4, 16, 5
    q = torch.randn(B, heads, W, generator=gen)
    kv = torch.randn(nb, bs, W, generator=gen)
    table = torch.randint(0, nb, (B, width), dtype=torch.int32, generator=gen)
    seq_lens = torch.tensor([0, 7, width * bs], dtype=torch.int32)  # empty, partial, full context
    return q, kv, table, seq_lens, 0.3, L


def test_split_kv_op_is_mla_decode_for_multiples_of_16():
    from k3compile.runtime.kernels import mla_common as mc
    from k3compile.runtime.kernels import mla_split_kv as sk

    assert mla.SPLIT_KV_HEAD_MULTIPLE == sk.SPLIT_KV.head_multiple == mc.HEAD_TILE
    gen = torch.Generator().manual_seed(0)
    args = _decode_case(16, gen)
    for got, want in zip(k3.mla_decode_split_kv(*args), k3.mla_decode(*args)):
        assert torch.equal(got, want)
    with pytest.raises(ValueError, match="multiple of 16, got \\(3, 12, 40\\)"):
        k3.mla_decode_split_kv(*_decode_case(12, gen))
    # one placement rule (and cost) for both decode ops
    assert op_rule(k3.mla_decode_split_kv.default) is op_rule(k3.mla_decode.default)


@pytest.mark.parametrize("heads,padded", [(12, 16), (24, 32)])
def test_padding_heads_is_exact(heads, padded):
    q, *rest = _decode_case(heads, torch.Generator().manual_seed(heads))
    o, lse = k3.mla_decode(q, *rest)
    q_pad = k3.pad_heads(q, padded)
    assert q_pad.shape == (3, padded, 40) and torch.equal(q_pad[:, :heads], q) and not q_pad[:, heads:].any()
    o_pad, lse_pad = k3.mla_decode_split_kv(q_pad, *rest)
    assert torch.equal(k3.narrow_heads(o_pad, heads), o) and torch.equal(k3.narrow_heads(lse_pad, heads), lse)
    assert lse[0].eq(float("-inf")).all()  # the empty context stays empty


@pytest.mark.parametrize(
    "op,args",
    [
        ("mla_decode_split_kv", lambda: _decode_case(16, torch.Generator().manual_seed(1))),
        ("pad_heads", lambda: (torch.randn(2, 3, 5), 16)),
        ("narrow_heads", lambda: (torch.randn(2, 16, 5), 3)),
    ],
)
def test_opcheck(op, args):
    torch.library.opcheck(getattr(k3, op), args())


# ---------------------------------------------------------------------------
# The pass, in-process
# ---------------------------------------------------------------------------


def _run_pass(cfg, tp: int, target: str):
    captured = capture(cfg, ParallelPlan(tp, 0), torch.float32, phases=("decode",))
    program = captured.programs["decode"]
    propagate_placements(program.graph_module, program, captured.specs, captured.plan)
    ctx = PassContext(cfg, captured.plan, get_target(target), "decode", program, captured.specs, captured.constants)
    return PadAttentionHeads().run(program.graph_module, ctx), program


def _mla_layers(cfg) -> list[int]:
    return [i for i, kind in enumerate(cfg.layer_kinds) if kind == "mla"]


def test_pass_pads_12_heads_to_16_and_skips_where_the_kernel_already_fits():
    cfg = get_preset("tiny-h24")
    layers = _mla_layers(cfg)
    result, program = _run_pass(cfg, 2, "mi355x")
    assert result.changed and result.matches == len(layers) == 2
    assert [r.detail for r in result.rewrites] == [
        "k3.model.layers.3.self_attn: heads 12 -> 16 for mla_decode_split_kv (mla_decode_split_kv)",
        "k3.model.layers.4.self_attn: heads 12 -> 16 for mla_decode_split_kv (mla_decode_split_kv_1)",
    ]
    assert layers == [3, 4]
    per_layer = {
        "heads_added": 4,
        "query_bytes_added_per_sequence": 4 * cfg.mla_cache_width * 4,  # 4 zero heads of fp32
        "launches_added": 2,  # the pad, and the narrow of o (the model drops the LSE)
    }
    assert all(r.stats == per_layer for r in result.rewrites)
    assert result.stats == {k: 2 * v for k, v in per_layer.items()}
    ops = [str(n.target) for n in program.graph.nodes if str(n.target).startswith("k3.")]
    assert "k3.mla_decode.default" not in ops
    assert ops.count("k3.pad_heads.default") == ops.count("k3.narrow_heads.default") == 2

    # cpu: the reference takes every head count, nothing to pad
    result, _ = _run_pass(cfg, 2, "cpu")
    assert not result.changed
    assert [s.reason for s in result.skipped] == ["12 heads: already accepted by k3::mla_decode reference"] * 2


def test_pass_leaves_accepted_head_counts_alone():
    """16 heads per rank (32 at TP2), as after DCP's all-gather of the heads: the fast
    kernel takes them, the graph keeps k3.mla_decode."""
    cfg = dataclasses.replace(get_preset("tiny-h24"), num_attention_heads=32, num_key_value_heads=32)
    result, program = _run_pass(cfg, 2, "h200")
    assert not result.changed and result.matches == 0
    assert [s.reason for s in result.skipped] == ["16 heads: already accepted by mla_decode_split_kv"] * 2
    assert sum(n.target is k3.mla_decode.default for n in program.graph.nodes) == 2


def test_pass_says_when_no_head_count_helps():
    cfg = dataclasses.replace(get_preset("tiny-h24"), kv_lora_rank=1024)  # values wider than the kernel's 512
    result, _ = _run_pass(cfg, 1, "h200")
    assert not result.changed
    assert [s.reason for s in result.skipped] == [
        "not padded to 32 heads: mla_decode_split_kv supports value_dim in 1..512, got 1024"] * 2


def test_memory_plan_runs_the_pass_and_sees_no_memory_change():
    """``k3compile plan`` runs a GPU target's passes: padding changes no weight or cache."""
    from k3compile.memory import MemoryOptions, plan_memory

    options = MemoryOptions(tp=2, target="mi355x", context=64, enable=(PadAttentionHeads.name,),
                            disable=_other_passes())
    plan = plan_memory(get_preset("tiny-h24"), options)
    assert plan.unchanged == [PadAttentionHeads.name] and plan.saved_by(PadAttentionHeads.name) == 0
    assert sum(n.target is k3.mla_decode_split_kv.default for n in plan.program.graph.nodes) == 2


# ---------------------------------------------------------------------------
# End to end: validated in the pipeline, then the runtime
# ---------------------------------------------------------------------------


def _compile_pair(model_dirs, optimize_shared, tmp_path, tp: int):
    """(plain, padded) artifacts for h200; the padded one validated pass by pass."""
    model_dir = model_dirs("tiny-h24")
    plain, padded = tmp_path / "plain", tmp_path / "padded"
    others = _other_passes()
    optimize_shared(model_dir, plain, CompileOptions(tp=tp, target="h200", dtype="float32",
                                                     disable=(*others, PadAttentionHeads.name)))
    result = optimize_shared(model_dir, padded, CompileOptions(tp=tp, target="h200", dtype="float32", validate=True,
                                                               enable=(PadAttentionHeads.name,), disable=others))
    artifact = load_artifact(padded)
    assert artifact.info.block_size == 64  # h200's default: the split-KV kernel's TMA tiles fit a block
    decode = artifact.programs["decode"]  # the new ops survive the .pt2 round trip
    targets = [n.target for n in decode.graph.nodes]
    assert targets.count(k3.mla_decode_split_kv.default) == 2 and k3.mla_decode.default not in targets
    return plain, padded, [r for r in result.pipeline.records if r.pass_name == PadAttentionHeads.name]


def _rank_run(rank: int, world: int, out):
    """Decode logits of one fixed step after the prompts, then greedy tokens."""
    torch.set_num_threads(1)
    rt = runtime.load(out, rank=rank, world_size=world, options=runtime.RuntimeOptions(max_sequences=3, max_context=32))
    ids, _ = rt.prefill(PROMPTS)
    logits = rt.decode(ids, [11, 12, 13])
    for seq in ids:
        rt.release(seq)
    return logits, rt.generate(PROMPTS, NEW_TOKENS)


def _check_records(records, heads: int, padded: int) -> None:
    decode, prefill = records  # pipeline order: decode, then prefill
    assert decode.result.matches == 2 and all(f"heads {heads} -> {padded}" in r.detail for r in decode.result.rewrites)
    assert decode.report is not None and decode.report.ok and decode.report.max_error == 0.0  # exact
    assert not prefill.result.changed and prefill.report is None
    assert [s.reason for s in prefill.result.skipped] == [
        f"prefill attention, {heads} heads: already accepted by mla_prefill_absorbed"] * 2


def _check_same_outputs(base, padded) -> None:
    for (logits_b, tokens_b), (logits_p, tokens_p) in zip(base, padded):
        assert torch.equal(logits_p, logits_b)
        assert tokens_p == tokens_b and all(len(t) == NEW_TOKENS for t in tokens_p)


def test_tp1_pads_24_heads_to_32_and_runs_like_the_unpadded_artifact(model_dirs, optimize_shared, tmp_path):
    plain, padded, records = _compile_pair(model_dirs, optimize_shared, tmp_path, tp=1)
    _check_records(records, 24, 32)  # validated in-process at TP1
    _check_same_outputs([_rank_run(0, 1, plain)], [_rank_run(0, 1, padded)])


@pytest.mark.slow
def test_tp2_pads_12_heads_to_16_validated_on_gloo_ranks(model_dirs, optimize_shared, tmp_path, rank_pools):
    plain, padded, records = _compile_pair(model_dirs, optimize_shared, tmp_path, tp=2)
    _check_records(records, 12, 16)  # validated on two gloo ranks
    ranks = rank_pools.get(2)
    _check_same_outputs(ranks.run(_rank_run, plain), ranks.run(_rank_run, padded))
