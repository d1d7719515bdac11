"""The FP8 MLA cache (``--kv-cache-dtype fp8``, k3compile/mla_cache_fp8.py): its row layout
and rounding, the ops that write and read it (torch references), the graph invariant, and
a compiled tiny model with an FP8 cache against the same model with a float32 cache.

The Triton kernels' FP8 paths are checked against these references in
tests/test_kernel_mla_decode.py."""

from __future__ import annotations

import json

import pytest
import torch

from k3compile import runtime
from k3compile.batch import resolve_kv_cache_dtype
from k3compile.config import PRESETS
from k3compile.mla_cache_fp8 import SCALE_BYTES, cache_value_width, dequantize_rows, fp8_row_width, quantize_rows
from k3compile.pipeline.interface import PassError
from k3compile.pipeline.mla_cache_check import check_mla_cache_use
from k3compile.sharding import ParallelPlan
from k3compile.targets import get_target

k3 = torch.ops.k3
FORMATS = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
L, R = 32, 8  # the tiny presets' latent and k_pe widths


def _rows(T: int, seed: int = 0) -> torch.Tensor:
    """[T, L + R] latents of RMS-normalised size and k_pe 30x larger (unnormalised)."""
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn(T, L + R, generator=gen)
    kv[:, L:] *= 30
    return kv


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_rows_hold_codes_then_two_scales_then_zeros(fmt):
    kv = _rows(5)
    kv[3, :L] = 0  # an all-zero latent: codes 0, no NaN
    rows = quantize_rows(kv, L, fmt)
    assert rows.dtype == fmt and rows.shape == (5, L + R + SCALE_BYTES) == (5, fp8_row_width(L + R))
    raw = rows.view(torch.uint8)
    scales = raw[:, L + R : L + R + 8].contiguous().view(torch.float32)
    fmax = torch.finfo(fmt).max
    assert torch.equal(scales[:, 1], kv[:, L:].abs().amax(-1) / fmax)
    latent_amax = kv[:, :L].abs().amax(-1)
    assert torch.equal(scales[[0, 1, 2, 4], 0], latent_amax[[0, 1, 2, 4]] / fmax)
    assert torch.equal(raw[:, L + R + 8 :], torch.zeros(5, 8, dtype=torch.uint8))
    codes = rows[:, : L + R].float()
    assert codes.abs().amax() == fmax  # each part's largest value lands on the largest code
    assert torch.equal(codes[3, :L], torch.zeros(L)) and torch.isfinite(dequantize_rows(rows, L)).all()


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_dequantised_values_are_within_half_an_fp8_step(fmt):
    """E4M3 keeps 3 mantissa bits: a normal value rounds to within 2^-4 of itself, a
    subnormal one to within half the subnormal step (smallest normal x 2^-4), times the
    part's scale."""
    kv = _rows(64, seed=1)
    kv[:, :4] *= 1e-4  # some latent values far below their row's largest: subnormal codes
    rows = quantize_rows(kv, L, fmt)
    got = dequantize_rows(rows, L)
    scales = rows.view(torch.uint8)[:, -SCALE_BYTES : -8].contiguous().view(torch.float32)
    per_value = torch.cat([scales[:, :1].expand(-1, L), scales[:, 1:].expand(-1, R)], dim=-1)
    bound = 2.0**-4 * kv.abs() + torch.finfo(fmt).smallest_normal * 2.0**-4 * per_value
    err = (got - kv).abs()
    assert (err <= bound).all(), (err / bound).max()
    assert (err > 0).any()  # it is a rounding: an identity here would mean no FP8 at all
    assert cache_value_width(rows) == L + R and cache_value_width(kv) == L + R


def test_row_width_needs_a_multiple_of_4():
    with pytest.raises(ValueError, match="multiple of 4"):
        fp8_row_width(42)
    with pytest.raises(ValueError, match="not an FP8 cache format"):
        quantize_rows(_rows(2), L, torch.bfloat16)


def test_kv_cache_dtype_choices():
    h200, mi300x = get_target("h200"), get_target("mi300x")
    assert resolve_kv_cache_dtype("auto", torch.float32, h200) == torch.float32
    assert resolve_kv_cache_dtype("fp8", torch.bfloat16, h200) == torch.float8_e4m3fn
    assert resolve_kv_cache_dtype("fp8", torch.bfloat16, mi300x) == torch.float8_e4m3fnuz  # what gfx942 converts
    assert resolve_kv_cache_dtype("bf16", torch.bfloat16, h200) == torch.bfloat16
    with pytest.raises(ValueError, match="bf16 needs the bfloat16 model dtype"):
        resolve_kv_cache_dtype("bf16", torch.float32, h200)
    with pytest.raises(ValueError, match="must be one of auto, bf16, fp8"):
        resolve_kv_cache_dtype("int8", torch.float32, h200)


def _fp8_cache_with(kv: torch.Tensor, slots: list[int], blocks: int = 6, block_size: int = 4):
    cache = torch.zeros(blocks, block_size, fp8_row_width(L + R), dtype=torch.float8_e4m3fn)
    k3.mla_cache_write(cache, kv, torch.tensor(slots), L)
    return cache


def test_cache_write_quantises_each_new_token_at_its_slot():
    kv = _rows(3)
    cache = _fp8_cache_with(kv, [5, 2, 0])
    flat = cache.view(torch.uint8).view(-1, cache.shape[-1])
    assert torch.equal(flat[[5, 2, 0]], quantize_rows(kv, L, cache.dtype).view(torch.uint8))
    untouched = [s for s in range(flat.shape[0]) if s not in (5, 2, 0)]
    assert not flat[untouched].any()


def test_attention_ops_read_the_dequantised_values():
    """mla_decode and mla_prefill over an FP8 cache equal the same ops over a float32
    cache holding its dequantised values; mla_prefill_new_tokens (context-parallel
    prefill, over the fresh latents) attends to the same values as mla_prefill reading
    them back from an FP8 cache."""
    gen = torch.Generator().manual_seed(2)
    kv = _rows(9, seed=3)
    table = torch.tensor([[1, 4, 2]], dtype=torch.int32)
    slots = [4, 5, 6, 7, 16, 17, 18, 19, 8]  # block 1, then 4, then 2
    fp8 = _fp8_cache_with(kv, slots)
    plain = dequantize_rows(fp8, L)
    seq_lens = torch.tensor([9], dtype=torch.int32)

    q = torch.randn(1, 4, L + R, generator=gen)
    o8, lse8 = k3.mla_decode(q, fp8, table, seq_lens, 0.3, L)
    o, lse = k3.mla_decode(q, plain, table, seq_lens, 0.3, L)
    torch.testing.assert_close((o8, lse8), (o, lse), rtol=1e-6, atol=1e-6)

    H, Dn = 4, 16
    kv_b = torch.randn(H * 2 * Dn, L, generator=gen) * 0.1
    qp = torch.randn(9, H, Dn + R, generator=gen)
    cu = torch.tensor([0, 9], dtype=torch.int32)
    prefill8 = k3.mla_prefill(qp, fp8, kv_b, cu, table, seq_lens, 0.3)
    torch.testing.assert_close(prefill8, k3.mla_prefill(qp, plain, kv_b, cu, table, seq_lens, 0.3), rtol=1e-6, atol=1e-6)
    fresh = k3.mla_prefill_new_tokens(qp, kv, kv_b, cu, seq_lens, 0.3, torch.float8_e4m3fn)
    torch.testing.assert_close(fresh, prefill8, rtol=1e-6, atol=1e-6)
    unrounded = k3.mla_prefill_new_tokens(qp, kv, kv_b, cu, seq_lens, 0.3, torch.float32)
    assert (unrounded - prefill8).abs().max() > 1e-4  # the FP8 rounding is what made them agree


@pytest.fixture(scope="module")
def fp8_capture(captures):
    return captures.get(PRESETS["tiny"], ParallelPlan(), torch.float32, 16, kv_cache_dtype=torch.float8_e4m3fn)


def test_captured_caches_are_fp8_and_used_only_by_the_cache_ops(fp8_capture):
    n_mla = PRESETS["tiny"].layer_kinds.count("mla")
    for program in fp8_capture.programs.values():
        gm = program.graph_module
        caches = [n for n in gm.graph.nodes if n.op == "placeholder" and n.meta["val"].dtype == torch.float8_e4m3fn]
        assert len(caches) == n_mla and all(c.meta["val"].shape[-1] == 40 + SCALE_BYTES for c in caches)
        check_mla_cache_use(gm)


def test_the_invariant_catches_a_read_outside_the_kernels_and_a_second_write(fp8_capture):
    import copy

    program = copy.deepcopy(fp8_capture.programs["decode"])
    gm = program.graph_module
    cache = next(n for n in gm.graph.nodes if n.op == "placeholder" and n.meta["val"].dtype == torch.float8_e4m3fn)
    write = next(u for u in cache.users if u.target is k3.mla_cache_write.default)
    with gm.graph.inserting_after(write):
        second = gm.graph.call_function(k3.mla_cache_write.default, write.args)
    with pytest.raises(PassError, match="written by 2 k3::mla_cache_write nodes"):
        check_mla_cache_use(gm)
    gm.graph.erase_node(second)
    with gm.graph.inserting_after(write):
        read = gm.graph.call_function(torch.ops.aten._to_copy.default, (cache,), {"dtype": torch.float32})
    read.meta["val"] = cache.meta["val"].to(torch.float32)
    with pytest.raises(PassError, match="only the attention ops dequantise it"):
        check_mla_cache_use(gm)
    read.meta["val"] = cache.meta["val"]  # a node that makes an FP8 value: a quantise in the graph
    with pytest.raises(PassError, match="makes an FP8 value outside the cache ops"):
        check_mla_cache_use(gm)


PROMPTS = [[5, 9, 2, 7, 1, 3] * 4, [4, 4, 8]]


def _decode_logits(out, steps: int = 12):
    """Logits of ``steps`` decode steps after the prompts (teacher-forced with fixed tokens,
    so that both caches see the same tokens) and greedy tokens from the prompts."""
    rt = runtime.load(out, rank=0, world_size=1, options=runtime.RuntimeOptions(max_sequences=2, max_context=64))
    ids, _ = rt.prefill(PROMPTS)
    logits = torch.stack([rt.decode(ids, [(7 * s + i) % 50 for i in range(len(ids))]) for s in range(steps)])
    for seq in ids:
        rt.release(seq)
    return logits, rt.generate(PROMPTS, 8)


def test_tiny_with_an_fp8_cache_is_validated_and_runs_close_to_the_float32_cache(compile_once):
    """Every pass validated with the FP8 cache (TP1, float32 model); the artifact records
    the format; over 12 decode steps (the history read back from FP8) the logits' error,
    relative to the largest logit, is ~1% in the median step, the same as the cache's own
    rounding (a misread cache gives errors of order 1). Single steps reach ~50%: the tiny
    model's random router has near ties, and a changed expert changes the logits whole
    (decision 45 has the figures)."""
    fp8 = compile_once("tiny", "mxfp4", dtype="float32", kv_cache_dtype="fp8")
    base = compile_once("tiny", "mxfp4", dtype="float32")
    assert all(r.report.ok for r in fp8.pipeline.records if r.report is not None)
    manifest = json.loads((fp8.out_dir / "manifest.json").read_text())
    assert manifest["kv_cache_dtype"] == "float8_e4m3fn" and manifest["dtype"] == "float32"
    (logits8, tokens8), (logits, tokens) = _decode_logits(fp8.out_dir), _decode_logits(base.out_dir)
    rel = (logits8 - logits).abs().amax(-1) / logits.abs().amax(-1)
    assert 0.002 < rel.median() < 0.03 and (rel < 0.05).float().mean() >= 0.75, rel
    assert tokens8[0][:2] == tokens[0][:2]  # greedy: the top-2 margins of random logits are ~1%; it diverges later


def test_runtime_refuses_another_cache_dtype(compile_once):
    fp8 = compile_once("tiny", "mxfp4", dtype="float32", kv_cache_dtype="fp8")
    options = runtime.RuntimeOptions(max_sequences=1, max_context=16, kv_cache_dtype="auto")
    with pytest.raises(ValueError, match="asks for a float32 MLA cache, but the artifact was compiled for a "
                                         "float8_e4m3fn cache"):
        runtime.load(fp8.out_dir, rank=0, world_size=1, options=options)
    with pytest.raises(ValueError, match="unknown choice 'fp4'"):
        runtime.RuntimeOptions(kv_cache_dtype="fp4")
    from typer.testing import CliRunner

    from k3compile.cli import app

    refused = CliRunner().invoke(app, ["run", str(fp8.out_dir), "--prompt", "1 2", "--kv-cache-dtype", "bf16"])
    assert refused.exit_code == 2 and "bf16 needs the bfloat16 model dtype" in refused.stderr, refused.output
    refused = CliRunner().invoke(app, ["run", str(fp8.out_dir), "--prompt", "1 2", "--kv-cache-dtype", "auto"])
    assert refused.exit_code == 2 and "compiled for a float8_e4m3fn cache" in refused.stderr, refused.output


@pytest.mark.slow
def test_dcp_and_head_padding_with_an_fp8_cache_are_validated_on_gloo_ranks(compile_once):
    """tiny-h24 for h200 at TP2 / DCP2 with an FP8 cache, every pass validated on two gloo
    ranks: the DCP pass (each rank's FP8 cache holds its own positions; prefill attends to
    the fresh latents through the FP8 rounding the cache gives them) and the head padding
    in front of the split-KV kernel change the programs and match them before."""
    result = compile_once("tiny-h24", "mxfp4", tp=2, dcp=2, target="h200", dtype="float32", kv_cache_dtype="fp8",
                          validate=True)
    checked = {(r.pass_name, r.phase): r.report for r in result.pipeline.records if r.report is not None}
    assert {("split_mla_context", "decode"), ("split_mla_context", "prefill"),
            ("pad_attention_heads", "decode")} <= set(checked)
    assert all(report.ok for report in checked.values()), checked
