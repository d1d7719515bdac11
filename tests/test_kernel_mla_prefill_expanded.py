"""The expanded-form MLA prefill kernel (runtime/kernels/mla_prefill_expanded.py) against
``k3::mla_prefill``'s fp32 reference, and the form ``mla_prefill_op`` picks.

Under the interpreter the launcher NaN-fills the output, so a row the kernel fails to
write fails the comparison. Tolerance: the kernel rounds the decompressed keys and values
and the probabilities to the model dtype where the reference keeps fp32: 2^-6 of the
largest output in bf16 (observed 0.7%), 1e-5 in fp32.
"""

from __future__ import annotations

import pytest
import torch
from mla_cases import DEVICE, case, poison_past_contexts, to_fp8, without_poison

import k3compile.ops  # noqa: F401  (registers torch.ops.k3)
from k3compile.ops.mla import mla_prefill_reference
from k3compile.runtime.kernels import kernel_launches, reset_kernel_launches
from k3compile.runtime.kernels import mla_decode as mk
from k3compile.runtime.kernels import mla_prefill_expanded as ex

pytestmark = pytest.mark.usefixtures("faster_interpreter", "interpreter_rounds_like_gpus")

H, L, R, DN, DV, BS = 12, 64, 8, 16, 16, 8


def prefill_case(contexts: list[int], new: list[int], dtype: torch.dtype, seed: int = 3):
    """q for ``new`` tokens per sequence (the last of its ``contexts`` positions), a paged
    cache with NaN outside the contexts, kv_b, cu_seqlens."""
    gen = torch.Generator().manual_seed(seed)
    _, cache, table, seq_lens, _ = case(H, L, R, contexts, block_size=BS, dtype=dtype, seed=seed)
    q = torch.randn(sum(new), H, DN + R, generator=gen).to(dtype).to(DEVICE)
    kv_b = (torch.randn(H * (DN + DV), L, generator=gen) / L**0.5).to(dtype).to(DEVICE)
    cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    return q, poison_past_contexts(cache, table, seq_lens), kv_b, cu, table, seq_lens


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.cpu().float() - want.float()).abs().max() / want.float().abs().max())


def tolerance(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 2.0**-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expanded_matches_reference_on_ragged_sequences_with_history(dtype):
    """Prompts and continuations in one batch: a sequence without history, ones with
    history, one new token, a sequence with none, and one whose new tokens span several
    row tiles (past BLOCK_M) so that tiles see unmasked and diagonal position tiles."""
    block_m = ex.expanded_config("sm_90", dtype).block_m
    new = [5, 1, 0, block_m + 37, 9]
    contexts = [5, 30, 11, block_m + 61, 9 + 64]
    q, cache, kv_b, cu, table, seq_lens = prefill_case(contexts, new, dtype)
    counts = ex.prefill_counts(cu, seq_lens)
    assert counts.new_tokens == tuple(new) and counts.positions == sum(contexts)
    reset_kernel_launches()
    got = ex.mla_prefill_expanded(q, cache, kv_b, cu, table, seq_lens, 0.3, counts)
    assert kernel_launches() == {"_mla_expanded_kernel": 1}
    want = mla_prefill_reference(q.cpu(), without_poison(cache).cpu(), kv_b.cpu(), cu.cpu(), table.cpu(),
                                 seq_lens.cpu(), 0.3)
    assert got.shape == want.shape == (sum(new), H, DV) and got.dtype == dtype
    assert rel_err(got, want) <= tolerance(dtype)
    # per sequence too: a wrong sequence among large ones would hide in the global max
    for i in range(len(new)):
        rows = slice(int(cu[i]), int(cu[i + 1]))
        if new[i]:
            assert rel_err(got[rows], want[rows]) <= 2 * tolerance(dtype), i


def test_expanded_every_new_token_count_around_a_row_tile():
    """New tokens at every residue around BLOCK_M (the tile's last row and the next tile's
    first), each after a history that is not a multiple of BLOCK_N."""
    block_m = ex.expanded_config("sm_90", torch.float32).block_m
    new = [block_m - 1, block_m, block_m + 1, 2 * block_m + 3]
    contexts = [n + 13 for n in new]
    q, cache, kv_b, cu, table, seq_lens = prefill_case(contexts, new, torch.float32, seed=5)
    got = ex.mla_prefill_expanded(q, cache, kv_b, cu, table, seq_lens, 0.3, ex.prefill_counts(cu, seq_lens))
    want = mla_prefill_reference(q.cpu(), without_poison(cache).cpu(), kv_b.cpu(), cu.cpu(), table.cpu(),
                                 seq_lens.cpu(), 0.3)
    assert rel_err(got, want) <= 1e-5


def test_expanded_over_an_fp8_cache():
    """An FP8 cache's rows are dequantised before the decompression GEMM: the reference on
    the same FP8 cache (its dequantised values)."""
    q, cache, kv_b, cu, table, seq_lens = prefill_case([20, 41], [20, 7], torch.bfloat16, seed=9)
    fp8 = to_fp8(without_poison(cache), L, torch.float8_e4m3fn)
    got = ex.mla_prefill_expanded(q, fp8, kv_b, cu, table, seq_lens, 0.3, ex.prefill_counts(cu, seq_lens))
    want = mla_prefill_reference(q.cpu(), fp8.cpu(), kv_b.cpu(), cu.cpu(), table.cpu(), seq_lens.cpu(), 0.3)
    assert rel_err(got, want) <= 2.0**-6


def test_prefill_form_by_flops_at_k3_widths():
    """At K3's per-rank widths (12 heads, L 512, R 64, Dn = Dv = 128) a prompt takes the
    expanded form and a few new tokens after a long history the absorbed one. The switch
    lies where the decompression's 2 L (Dn + Dv) FLOPs per position, at the expanded form's
    rate, equal the absorbed form's 2 (2 L + R) per visible pair at its
    ABSORBED_RELATIVE_RATE (0.15): about 19 new tokens."""
    k3 = dict(heads=12, latent=512, rope=64, nope=128, value=128)
    assert ex.prefill_form(ex.PrefillCounts((4096,), (4096,)), **k3) == "expanded"
    assert ex.prefill_form(ex.PrefillCounts((64,), (64,)), **k3) == "expanded"
    assert ex.prefill_form(ex.PrefillCounts((8,), (32768,)), **k3) == "absorbed"
    assert ex.prefill_form(ex.PrefillCounts((16,), (32768,)), **k3) == "absorbed"
    assert ex.prefill_form(ex.PrefillCounts((24,), (32768,)), **k3) == "expanded"
    # a batch takes one form, by its totals: a prompt beside two long histories, or a
    # short continuation beside them (the decompression of 60,000 positions outweighs it)
    assert ex.prefill_form(ex.PrefillCounts((1, 1, 2048), (30000, 30000, 2048)), **k3) == "expanded"
    assert ex.prefill_form(ex.PrefillCounts((1, 1, 16), (30000, 30000, 16)), **k3) == "absorbed"


def test_op_runs_the_form_it_picks():
    """``mla_prefill_op`` (``k3::mla_prefill`` on GPUs) launches the expanded kernel for a
    prompt and the absorbed kernel for one new token after history, both equal to the
    reference."""
    for contexts, new, kernel in (([40, 33], [40, 33], "_mla_expanded_kernel"),
                                  ([60, 45], [1, 2], "_mla_attention_kernel")):
        q, cache, kv_b, cu, table, seq_lens = prefill_case(contexts, new, torch.float32, seed=11)
        counts = ex.prefill_counts(cu, seq_lens)
        form = ex.prefill_form(counts, H, L, R, DN, DV)
        assert form == ("expanded" if kernel == "_mla_expanded_kernel" else "absorbed")
        reset_kernel_launches()
        got = mk.mla_prefill_op(q, cache, kv_b, cu, table, seq_lens, 0.3)
        assert kernel_launches() == {kernel: 1}
        want = mla_prefill_reference(q.cpu(), without_poison(cache).cpu(), kv_b.cpu(), cu.cpu(), table.cpu(),
                                     seq_lens.cpu(), 0.3)
        assert rel_err(got, want) <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_windows_bound_the_decompressed_context(dtype):
    """Contexts over several windows of 64 positions: histories ending inside a window and
    on its edge, new tokens spanning a window's edge, a sequence that ends before the last
    windows, one without new tokens. One launch per window; equal to the reference, and to
    the one-window result up to the order of its fp32 sums."""
    new = [70, 1, 0, 9, 64]
    contexts = [70, 200, 130, 9 + 128, 64 + 100]
    q, cache, kv_b, cu, table, seq_lens = prefill_case(contexts, new, dtype, seed=11)
    counts = ex.prefill_counts(cu, seq_lens)
    whole = ex.mla_prefill_expanded(q, cache, kv_b, cu, table, seq_lens, 0.3, counts)
    reset_kernel_launches()
    got = ex.mla_prefill_expanded(q, cache, kv_b, cu, table, seq_lens, 0.3, counts, window=64)
    assert kernel_launches() == {"_mla_expanded_kernel": 4}  # positions 0-255
    want = mla_prefill_reference(q.cpu(), without_poison(cache).cpu(), kv_b.cpu(), cu.cpu(), table.cpu(),
                                 seq_lens.cpu(), 0.3)
    assert rel_err(got, want) <= tolerance(dtype)
    assert rel_err(got, whole) <= (1e-6 if dtype == torch.float32 else 2.0**-7)
    for i in range(len(new)):
        rows = slice(int(cu[i]), int(cu[i + 1]))
        if new[i]:
            assert rel_err(got[rows], want[rows]) <= 2 * tolerance(dtype), i


def test_a_window_off_the_kernels_tiles_is_refused_before_any_launch():
    q, cache, kv_b, cu, table, seq_lens = prefill_case([40, 90], [40, 3], torch.float32)
    reset_kernel_launches()
    with pytest.raises(ValueError, match="window 48: a positive multiple of the kernel's 32 positions"):
        ex.mla_prefill_expanded(q, cache, kv_b, cu, table, seq_lens, 0.3, ex.prefill_counts(cu, seq_lens), window=48)
    assert kernel_launches() == {}
