"""Triton MLA kernels (runtime/kernels/mla_*.py) against the fp32 torch reference.

Without a GPU the kernels run under the Triton interpreter: tests/conftest.py sets
TRITON_INTERPRET before anything imports Triton (the mode is fixed at that import).
Under the interpreter the launchers NaN-fill every output and scratch buffer, so an
element a kernel fails to write fails the comparison.

Tolerances (tests/tolerances.py: MLA_O, MLA_LSE; the reference is fp32 on the same
low-precision values upcast, for an FP8 cache its dequantised values): scores are exact products summed in fp32, so lse agrees to
fp32 rounding of the score sums (24 u(fp32) of max |lse|); o loses the rounding of the
probabilities to the model dtype before the value product and of o itself: 2 u of the
row's own max |o| (a row over one token is ~1, over 300 tokens ~0.1); the interpreter
rounds to nearest even as GPUs do (conftest's interpreter_rounds_like_gpus: Triton 3.9's
own truncates fp32 -> bf16 and carries wrongly into fp8). The fixed 1e-2 absolute this
replaced passed o rows that lost a split: at 4,100 tokens, 14 of 16 heads' rows without
their last 64 tokens (MLA_O: 2 of 16; lse catches every one); at K3's contexts of 128-300
tokens every row that loses its last split fails MLA_O
(test_o_tolerance_catches_a_dropped_split). A split too small to move o beyond bf16's
resolution is left to lse.

FP8 caches (k3compile/mla_cache_fp8.py): here at K3's per-rank shapes; the small-shape
FP8 tests and the FP8 cache write kernel are in tests/test_kernel_mla_fp8.py. The cases
both files build (paged caches, the reference, the check) are in tests/mla_cases.py.

K3's per-rank shapes (the ``test_k3_*`` tests): real widths (576 = 512 latent + 64 k_pe,
value 512), the h200 target's 64-token cache blocks, one layer's worth of small batch and
context, with the launch plan split_kv_config / choose_num_splits pick for an H200 and an
MI355X; their interpreter is sped up by tests/fast_interpreter.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from fast_interpreter import fast_interpreter
from mla_cases import DEVICE, case, check, poison_past_contexts, reference, without_poison
from tolerances import MLA_LSE, MLA_O, assert_close_scaled, reference_scale, unit_roundoff

import k3compile.ops  # noqa: F401  (registers torch.ops.k3)
from k3compile.runtime.kernels import aot, kernel_launches, reset_kernel_launches
from k3compile.runtime.kernels import mla_attention as ak
from k3compile.runtime.kernels import mla_cache_write as cw
from k3compile.runtime.kernels import mla_common as mc
from k3compile.runtime.kernels import mla_decode as mk
from k3compile.runtime.kernels import mla_split_kv as sk


# The interpreter evaluates the masked-out branches of tl.where too (0/0 for an empty
# context's o, log2(0) for its lse): numpy warns, the kernels select the right value.
pytestmark = [
    pytest.mark.usefixtures("faster_interpreter", "interpreter_rounds_like_gpus"),
    pytest.mark.filterwarnings("ignore:(divide by zero|invalid value) encountered:RuntimeWarning"),
]


def test_interpreter_poisons_outputs():
    """The NaN checks below only mean something if unwritten outputs are NaN."""
    if mc._INTERPRETED:
        assert mc._empty((4,), torch.float32, torch.device("cpu")).isnan().all()


@pytest.mark.parametrize("H", [16, 32, 48])
@pytest.mark.parametrize("num_splits", [None, 3])  # None: the default choice (3 splits at these lengths)
def test_split_kv_matches_reference(H, num_splits):
    # lengths 0 and 1, lengths that are not multiples of the block size or of BLOCK_N;
    # 48 heads: three head-tile programs per (sequence, split)
    q, cache, table, seq_lens, scale = case(H, 64, 8, [0, 1, 37, 70], block_size=16, seed=H)
    got = sk.mla_decode_split_kv(q, cache, table, seq_lens, scale, 64, num_splits=num_splits, num_sms=4)
    o, lse = got
    assert o.dtype == torch.bfloat16 and lse.dtype == torch.float32 and o.shape == (4, H, 64)
    assert (o[0] == 0).all() and torch.isneginf(lse[0]).all()  # empty context: o = 0, lse = -inf
    check(got, reference(q, cache, table, seq_lens, scale, 64))


@pytest.mark.parametrize("block_n", [16, 32])
def test_split_kv_tiles_and_splits_cover_the_context(block_n):
    """More splits than tiles (empty splits), block size smaller than a tile, KV rows from
    two blocks in one tile: every tiling gives the same answer."""
    q, cache, table, seq_lens, scale = case(16, 64, 8, [45, 3], block_size=4, seed=7)
    want = reference(q, cache, table, seq_lens, scale, 64)
    check(sk.mla_decode_split_kv(q, cache, table, seq_lens, scale, 64, num_splits=5, block_n=block_n), want)


@pytest.fixture
def guarded(monkeypatch):
    """The split-KV launcher's outputs and partials as views into NaN buffers three times
    their size, with a guard band before and after; call the fixture's value after a
    launch to check that no program wrote into a guard (outside its outputs: on a GPU,
    into other memory)."""
    bands: list[tuple[torch.Tensor, int]] = []

    def empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        n = max(1, torch.Size(shape).numel())
        buffer = torch.full((3 * n,), float("nan"), dtype=dtype, device=device)
        bands.append((buffer, n))
        return buffer[n:2 * n].view(shape)

    def assert_no_writes_outside() -> None:
        for buffer, n in bands:
            outside = torch.cat([buffer[:n], buffer[2 * n:]])
            assert outside.isnan().all(), f"{int((~outside.isnan()).sum())} elements written outside an output"

    monkeypatch.setattr(sk, "_empty", empty)
    return assert_no_writes_outside


@pytest.mark.parametrize("H, block_h", [(32, 32), (48, 64), (48, 32), (32, 16)])
def test_split_kv_head_tiles(guarded, H, block_h):
    """Head tiles other than split_kv_config's: one tile wider than the heads (48 in 64:
    masked head rows), a last tile half full (48 = 32 + 16), two tiles for 32 heads; with
    more splits than KV tiles (2 tiles of 32 rows, 8 splits) and a KV tile larger than
    the block size. The padding rows of a partial head tile are written nowhere."""
    q, cache, table, seq_lens, scale = case(H, 64, 8, [0, 50, 17], block_size=16, seed=H + block_h)
    config = sk.SplitKVConfig(block_h=block_h, block_n=32, num_warps=4, num_stages=3, programs_per_sm=1)
    got = sk.mla_decode_split_kv(q, cache, table, seq_lens, scale, 64, num_splits=8, config=config)
    guarded()
    check(got, reference(q, cache, table, seq_lens, scale, 64))


@pytest.mark.parametrize("H, block_n, block_size", [(16, 32, 32), (16, 32, 64), (32, 16, 64)])
def test_split_kv_tensor_descriptor_tiles(H, block_n, block_size):
    """KV tiles by tensor descriptors (config.tma, the sm_90 default): whole tiles go from
    the cache to the dots unmasked, the context's last partial tile through the 16-row
    gather. Contexts ending on, just after and just before a tile / block boundary;
    NaN in every cache row past the contexts (the descriptor reads the rest of the last
    block) must not reach the outputs; the pointer gathers give the same answer."""
    q, cache, table, seq_lens, scale = case(H, 64, 8, [0, 1, 31, 32, 33, 100, 129], block_size, seed=H + block_size)
    cache = poison_past_contexts(cache, table, seq_lens)
    want = reference(q, without_poison(cache), table, seq_lens, scale, 64)
    tma = sk.SplitKVConfig(block_h=H, block_n=block_n, num_warps=4, num_stages=3, programs_per_sm=1, tma=True)
    assert sk._kv_descriptors(cache, 64, block_n) is not None
    for splits in (1, 3, 7):
        got = sk.mla_decode_split_kv(q, cache, table, seq_lens, scale, 64, num_splits=splits, config=tma)
        check(got, want)
        pointers = sk.mla_decode_split_kv(q, cache, table, seq_lens, scale, 64, num_splits=splits,
                                          config=dataclasses.replace(tma, tma=False))
        assert_close_scaled(got[1], pointers[1], torch.float32, roundings=MLA_LSE, what="lse, descriptors vs pointers")


def test_split_kv_tensor_descriptors_only_where_the_cache_allows():
    """A tile must lie in one block and blocks must be stored back to back; elsewhere the
    launcher gathers through pointers (same answer)."""
    q, cache, table, seq_lens, scale = case(16, 64, 8, [0, 37, 70], block_size=32, seed=4)
    assert sk._kv_descriptors(cache, 64, 32) is not None
    assert sk._kv_descriptors(cache, 64, 64) is None  # a 64-row tile spans two blocks
    wide = torch.zeros(cache.shape[0], 2, *cache.shape[1:], dtype=cache.dtype, device=cache.device)
    wide[:, 0] = cache
    strided = wide[:, 0]  # blocks not back to back (every other block-sized slab)
    assert sk._kv_descriptors(strided, 64, 32) is None
    tma = sk.SplitKVConfig(block_h=16, block_n=32, num_warps=4, num_stages=3, programs_per_sm=1, tma=True)
    check(sk.mla_decode_split_kv(q, strided, table, seq_lens, scale, 64, num_splits=3, config=tma),
          reference(q, cache, table, seq_lens, scale, 64))


def test_split_kv_combines_more_splits_than_one_step():
    """300 splits: the combine takes its splits in three steps of 128 (the last one
    partly masked). 4100 tokens fill 257 splits of 16 rows, so every step holds real
    partials; the short context leaves most splits empty, the empty one all."""
    assert sk._combine_constexprs(64, 300)["BLOCK_S"] == 128
    q, cache, table, seq_lens, scale = case(16, 64, 8, [0, 37, 4100], block_size=16, seed=9)
    check(sk.mla_decode_split_kv(q, cache, table, seq_lens, scale, 64, num_splits=300, block_n=16),
          reference(q, cache, table, seq_lens, scale, 64))


def test_split_kv_real_k3_widths():
    q, cache, table, seq_lens, scale = case(16, 512, 64, [0, 1, 21], block_size=8, seed=3)
    check(sk.mla_decode_split_kv(q, cache, table, seq_lens, scale, 512, num_splits=2),
          reference(q, cache, table, seq_lens, scale, 512))


def test_o_tolerance_catches_a_dropped_split():
    """The combine's mutant on o alone (lse not compared): at K3 widths, every (sequence,
    head) row whose last non-empty KV split is dropped (the reference over the context
    without that split's tokens, renormalised as the combine would) fails MLA_O, even with
    a doubled bf16 u (what a truncating cast would need)."""
    q, cache, table, seq_lens, scale = case(16, 512, 64, [128, 256, 300], block_size=64, seed=1)
    want = reference(q, cache, table, seq_lens, scale, 512)[0]
    bound = MLA_O(torch.bfloat16) * unit_roundoff(torch.bfloat16, truncates=True) * reference_scale(want, -1)
    for splits in (2, 4, 10):
        per_split = ((seq_lens + splits - 1) // splits + 31) // 32 * 32  # the kernel's cut: whole KV tiles of 32
        kept = (seq_lens - 1) // per_split * per_split  # the last non-empty split's first position
        dropped = reference(q, cache, table, kept.int(), scale, 512)[0]
        assert ((dropped - want).abs() > bound).any(-1).all(), splits


# --------------------------------------------------------------------------- K3 per-rank shapes

K3_LATENT, K3_ROPE, K3_BLOCK = 512, 64, 64  # cache rows of 576, value 512; h200's 64-token blocks


@pytest.fixture
def fast():
    """Triton's interpreter without its per-element reduce, per-helper patching and integer
    overflow checks (tests/fast_interpreter.py; no offset here comes near 2^31)."""
    with fast_interpreter():
        yield


def k3_split_kv(q: torch.Tensor, target: str, lens: list[int], seed: int, plan: tuple[int, bool, int],
                kv_dtype: torch.dtype | None = None):
    """K3-width cache (64-token blocks, NaN past every context; of ``kv_dtype``) for
    ``lens``; split-KV on ``q`` with the launch the launcher picks on ``target``
    (asserted: head tile, descriptor tiles, splits); returns the outputs and the cache,
    table, seq_lens, scale."""
    _, cache, table, seq_lens, scale = case(1, K3_LATENT, K3_ROPE, lens, K3_BLOCK, seed=seed, kv_dtype=kv_dtype)
    cache = poison_past_contexts(cache, table, seq_lens)
    config = sk.split_kv_config(target, q.shape[1], q.dtype, kv_dtype)
    units = aot.TARGETS[target].compute_units
    splits = sk.choose_num_splits(q.shape[0], q.shape[1], table.shape[1] * K3_BLOCK, units, config)
    descriptors = config.tma and sk._kv_descriptors(cache, K3_LATENT, config.block_n) is not None
    assert (config.block_h, config.block_n, descriptors, splits) == (plan[0], 32, plan[1], plan[2])
    got = sk.mla_decode_split_kv(q, cache, table, seq_lens, scale, K3_LATENT, num_splits=splits, config=config)
    return got, (without_poison(cache), table, seq_lens, scale)


# (head tile, KV tiles by tensor descriptors, splits) the launcher picks on each target
# (over an FP8 cache sm_90 gathers through pointers: split_kv_config)
@pytest.mark.parametrize("target, kv_dtype, plan", [
    ("sm_90", None, (16, True, 10)), ("gfx950", None, (16, False, 10)),
    ("sm_90", torch.float8_e4m3fn, (16, False, 10)), ("gfx950", torch.float8_e4m3fn, (16, False, 10))],
    ids=["sm90-bf16-cache", "gfx950-bf16-cache", "sm90-fp8-cache", "gfx950-fp8-cache"])
def test_k3_split_kv_twelve_heads_padded_to_16(fast, target, kv_dtype, plan):
    """K3 at TP8: 12 heads per rank, zero-padded to 16 by k3::pad_heads (what the
    pad_attention_heads pass inserts), split-KV, the padding cut off by k3::narrow_heads:
    the 12 real heads equal the reference on 12 heads. Contexts: empty, one token, a block
    boundary and one past it, 300 tokens. A bf16 and an FP8 cache (592-byte rows: the
    descriptors and gathers of 16-byte aligned rows, the scales beside them)."""
    lens = [0, 1, 64, 65, 300]
    gen = torch.Generator().manual_seed(12)
    q12 = torch.randn(len(lens), 12, K3_LATENT + K3_ROPE, generator=gen).bfloat16().to(DEVICE)
    (o, lse), args = k3_split_kv(torch.ops.k3.pad_heads(q12, 16), target, lens, seed=12, plan=plan,
                                 kv_dtype=kv_dtype)
    check((torch.ops.k3.narrow_heads(o, 12), torch.ops.k3.narrow_heads(lse, 12)), reference(q12, *args, K3_LATENT))


def test_k3_split_kv_96_gathered_heads(fast):
    """K3 at TP8 x DCP8: the 96 heads gathered over the DCP group, three head tiles of 32,
    with an H200's plan (MI355X's differs only by pointer gathers, run at 16 heads above;
    the combine's 4 programs per (sequence, head) cost the interpreter ~3 s a sequence)."""
    lens = [65, 300]
    gen = torch.Generator().manual_seed(96)
    q = torch.randn(len(lens), 96, K3_LATENT + K3_ROPE, generator=gen).bfloat16().to(DEVICE)
    got, args = k3_split_kv(q, "sm_90", lens, seed=96, plan=(32, True, 10))
    check(got, reference(q, *args, K3_LATENT))


@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn], ids=["bf16-cache", "fp8-cache"])
def test_k3_generic_decode_and_prefill_twelve_heads(fast, kv_dtype):
    """The kernels that take K3's 12 heads per rank unpadded, at real widths and 64-token
    blocks: generic decode, and absorbed prefill of a chunk of 8 new tokens after 92 cached
    ones and of a fresh 37-token prompt (16-row tiles of (token, head) rows). A bf16 and
    an FP8 cache."""
    q, cache, table, seq_lens, scale = case(12, K3_LATENT, K3_ROPE, [1, 65, 300], K3_BLOCK, seed=121,
                                            kv_dtype=kv_dtype)
    check(ak.mla_decode_generic(q, cache, table, seq_lens, scale, K3_LATENT),
          reference(q, cache, table, seq_lens, scale, K3_LATENT))
    ctx, new = [100, 37], [8, 37]
    _, cache, table, seq_lens, scale = case(12, K3_LATENT, K3_ROPE, ctx, K3_BLOCK, seed=122, kv_dtype=kv_dtype)
    gen = torch.Generator().manual_seed(122)
    q = torch.randn(sum(new), 12, K3_LATENT + K3_ROPE, generator=gen).bfloat16().to(DEVICE)
    cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    seq = torch.repeat_interleave(torch.arange(len(new)), torch.tensor(new))
    pos = torch.cat([torch.arange(c - n, c) for c, n in zip(ctx, new, strict=True)])
    check(ak.mla_prefill_absorbed(q, cache, cu, table, seq_lens, scale, K3_LATENT),
          reference(q, cache, table.cpu()[seq], (pos + 1).int(), scale, K3_LATENT))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_split_kv_other_dtypes(dtype):
    q, cache, table, seq_lens, scale = case(16, 64, 8, [9, 30], block_size=16, dtype=dtype, seed=5)
    check(sk.mla_decode_split_kv(q, cache, table, seq_lens, scale, 64, num_splits=2),
          reference(q, cache, table, seq_lens, scale, 64), dtype)


def test_split_kv_rejects_heads_not_multiple_of_16():
    q, cache, table, seq_lens, scale = case(12, 64, 8, [5], block_size=16)
    with pytest.raises(ValueError, match="multiple of 16, got 12"):
        sk.mla_decode_split_kv(q, cache, table, seq_lens, scale, 64)


@pytest.mark.parametrize("H", [3, 12])
def test_generic_matches_reference(H):
    q, cache, table, seq_lens, scale = case(H, 64, 8, [0, 1, 29], block_size=8, seed=H)
    got = ak.mla_decode_generic(q, cache, table, seq_lens, scale, 64)
    assert torch.isneginf(got[1][0]).all() and (got[0][0] == 0).all()
    check(got, reference(q, cache, table, seq_lens, scale, 64))


def test_generic_real_k3_widths():
    q, cache, table, seq_lens, scale = case(3, 512, 64, [1, 19], block_size=16, seed=11)
    check(ak.mla_decode_generic(q, cache, table, seq_lens, scale, 512),
          reference(q, cache, table, seq_lens, scale, 512))


@pytest.mark.parametrize("H", [3, 12])
def test_prefill_equals_decode_at_every_position(H):
    """Absorbed causal prefill == mla_decode of each new token over the context up to and
    including its own position (the definition of causal attention over the cache)."""
    ctx = [13, 6, 0, 21]  # cached positions after the new tokens were written
    new = [5, 6, 0, 1]  # chunked prefill, a fresh prompt, an empty sequence, one token
    _, cache, table, seq_lens, scale = case(H, 64, 8, ctx, block_size=8, seed=20 + H)
    gen = torch.Generator().manual_seed(H)
    q = torch.randn(sum(new), H, 72, generator=gen).bfloat16().to(DEVICE)
    cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    got = ak.mla_prefill_absorbed(q, cache, cu, table, seq_lens, scale, 64)
    seq = torch.repeat_interleave(torch.arange(len(new)), torch.tensor(new))
    pos = torch.cat([torch.arange(c - n, c) for c, n in zip(ctx, new, strict=True)])
    want = reference(q, cache, table.cpu()[seq], (pos + 1).int(), scale, 64)
    check(got, want)


@pytest.mark.parametrize(("dcp", "interleave"), [(1, 1), (2, 1), (2, 2), (4, 1)])
def test_prefill_partial_over_a_members_positions_matches_the_reference(dcp, interleave):
    """``k3::mla_prefill_partial``'s kernel (the prefill kernel with the context split):
    each DCP member's cache holds only its positions (a sequence with history, a fresh
    prompt, one with fewer positions than members); the rows' causal limits map to the
    member's local rows. Against the op's torch reference on the same member's cache,
    for every member."""
    from k3compile.context_parallel import ContextLayout
    from k3compile.ops.mla import mla_prefill_partial_reference

    H, W, L, bs = 12, 72, 64, 8
    ctx, new = [13, 6, 2], [5, 6, 2]  # positions after the write, new tokens (the last of them)
    gen = torch.Generator().manual_seed(dcp * 10 + interleave)
    q = torch.randn(sum(new), H, W, generator=gen).bfloat16()
    cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor(ctx, dtype=torch.int32)
    for member in range(dcp):
        layout = ContextLayout(dcp, interleave, member)
        local = [layout.local_length(c) for c in ctx]
        blocks = [-(-n // bs) for n in local]
        cache = (torch.randn(1 + sum(blocks), bs, W, generator=gen) * 0.5).bfloat16()
        table = torch.zeros(len(ctx), max([1, *blocks]), dtype=torch.int32)
        first = 1
        for i, nb in enumerate(blocks):
            table[i, :nb] = torch.arange(first, first + nb)
            first += nb
        offset = torch.tensor(layout.position_offset)
        args = [t.to(DEVICE) for t in (q, cache, table, cu, seq_lens, offset)]
        o, lse = ak.mla_prefill_partial(*args, dcp, interleave, 0.3, L)
        want_o, want_lse = mla_prefill_partial_reference(q, cache, table, cu, seq_lens, offset, dcp, interleave,
                                                         0.3, L)
        check((o, lse), (want_o, want_lse))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_naive_prefill_op_through_the_absorbed_kernel_matches_its_reference(dtype):
    """``mla_prefill_op`` (what the runtime registers for ``k3::mla_prefill`` on GPUs): the
    naive form's semantics (k_nope = W_UK latent, v = W_UV latent per head) computed by the
    absorbed prefill kernel, against the op's reference: ragged new tokens after history,
    12 heads. Tolerance: the absorbed form rounds q_nope W_UK and the latent output to the
    model dtype where the reference keeps fp32 (2^-6 of the largest value in bf16)."""
    from k3compile.ops.mla import mla_prefill_reference

    from k3compile.runtime.kernels import mla_prefill_expanded as ex

    H, L, R, Dn, Dv, bs = 12, 64, 8, 16, 16, 8
    ctx, new = [90, 70, 120], [2, 1, 1]  # a few new tokens after history: the absorbed form
    assert ex.prefill_form(ex.PrefillCounts(tuple(new), tuple(ctx)), H, L, R, Dn, Dv) == "absorbed"
    gen = torch.Generator().manual_seed(7)
    _, cache, table, seq_lens, _ = case(H, L, R, ctx, block_size=bs, dtype=dtype, seed=7)
    q = torch.randn(sum(new), H, Dn + R, generator=gen).to(dtype)
    kv_b = (torch.randn(H * (Dn + Dv), L, generator=gen) / L**0.5).to(dtype)
    cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    reset_kernel_launches()
    got = mk.mla_prefill_op(q.to(DEVICE), cache, kv_b.to(DEVICE), cu.to(DEVICE), table, seq_lens, 0.25)
    assert kernel_launches() == {"_mla_attention_kernel": 1}
    want = mla_prefill_reference(q, cache.cpu(), kv_b, cu, table.cpu(), seq_lens.cpu(), 0.25)
    assert got.shape == want.shape == (sum(new), H, Dv) and got.dtype == dtype
    err = float((got.cpu().float() - want.float()).abs().max() / want.float().abs().max())
    assert err <= (1e-5 if dtype == torch.float32 else 2.0**-6), err


def test_prefill_grid_fits_cuda_limits_at_a_million_tokens():
    """CUDA grids allow 2^31 - 1 programs on the first axis, 65,535 on the others: the
    absorbed prefill's row tiles (tokens x heads / 16) go first. A 128K-token prompt at 12
    heads failed to launch with them second (98,304 tiles; H200, BENCHMARKS.md)."""
    tiles, sequences = ak.attention_grid(8, 1 << 20, 96, mc.HEAD_TILE)
    assert tiles == (1 << 20) * 96 // 16 < 2**31 and sequences == 8 <= 65535


def test_prefill_rejects_bad_cu_seqlens():
    q, cache, table, seq_lens, scale = case(3, 64, 8, [4, 4], block_size=8)
    with pytest.raises(ValueError, match="cu_seqlens must be int32"):
        ak.mla_prefill_absorbed(q, cache, torch.tensor([0, 1], dtype=torch.int32), table, seq_lens, scale, 64)


def test_declarations():
    fast, generic = mk.MLA_DECODE_KERNELS
    assert fast.splits_kv and fast.head_multiple == 16 and not generic.splits_kv
    assert fast.accepts(16, torch.bfloat16, 576, 512) and fast.accepts(96, torch.float16, 576, 512)
    assert not fast.accepts(12, torch.bfloat16, 576, 512)
    assert "multiple of 16" in fast.reason_rejected(12, torch.bfloat16, 576, 512)
    assert generic.accepts(12, torch.bfloat16, 576, 512) and generic.accepts(3, torch.float32, 72, 64)
    assert "dtypes" in generic.reason_rejected(12, torch.int8, 576, 512)
    assert "k_pe" in generic.reason_rejected(12, torch.bfloat16, 576 + 64, 512)
    assert mk.MLA_PREFILL_KERNELS[0].accepts(12, torch.bfloat16, 576, 512)
    assert fast.launch is sk.mla_decode_split_kv


def test_op_kernel_takes_the_first_kernel_that_accepts(monkeypatch):
    """What the runtime registers for ``k3::mla_decode`` (``mla_decode_op``): split-KV for
    multiples of 16 heads, else the generic kernel, else (a dtype no kernel takes) the
    reference. The launches are recorded, and answered by the reference."""
    calls = []

    def recorded(kernel: mc.MLAKernel) -> mc.MLAKernel:
        def launch(*args):
            calls.append(kernel.name)
            return reference(*args)

        return dataclasses.replace(kernel, launch=launch)

    monkeypatch.setattr(mk, "MLA_DECODE_KERNELS", [recorded(k) for k in mk.MLA_DECODE_KERNELS])
    for H, dtype, want in ((16, torch.bfloat16, "mla_decode_split_kv"), (12, torch.bfloat16, "mla_decode_generic"),
                           (12, torch.float64, None)):
        calls.clear()
        q, cache, table, seq_lens, scale = case(H, 64, 8, [0, 9], block_size=8, dtype=dtype)
        got = mk.mla_decode_op(q, cache, table, seq_lens, scale, 64)
        assert calls == ([want] if want else [])
        check(got, reference(q, cache, table, seq_lens, scale, 64))


def test_split_kv_config_head_tiles():
    """The widest head tile that divides the heads: no padded head rows computed."""
    def tile(target, heads, dtype=torch.bfloat16):
        return sk.split_kv_config(target, heads, dtype).block_h
    assert [tile("sm_90", h) for h in (16, 32, 48, 64, 96, 128)] == [16, 32, 16, 64, 32, 64]
    assert [tile("gfx950", h) for h in (16, 32, 48, 64, 96)] == [16, 32, 16, 32, 32]  # 64 heads spill on AMD
    assert tile("sm_90", 64, torch.float32) == 16
    sm90 = sk.split_kv_config("sm_90", 64)
    assert sm90.num_warps == 8 and sm90.num_stages == 3 and sm90.block_n == 32


def test_num_splits_fill_the_gpu():
    """One wave of resident programs (SMs x programs_per_sm) where the context allows,
    splits no shorter than a KV tile, the fewest splits of least cost."""
    h16 = sk.split_kv_config("sm_90", 16)  # 2 programs per SM
    # batch 1 at 32K on an H200: 256 splits of 128 rows fill the 264 slots once
    assert sk.choose_num_splits(1, 16, 32768, 132, h16) == 256
    # batch 16: 16 splits = 256 programs, one wave (17 would spill 8 programs into a second)
    assert sk.choose_num_splits(16, 16, 32768, 132, h16) == 16
    # 96 heads = 3 head tiles: 11 splits x 48 = 528 programs, two whole waves
    assert sk.choose_num_splits(16, 96, 32768, 132, sk.split_kv_config("sm_90", 96)) == 11
    # short contexts: never more splits than KV tiles; none for an empty table
    assert sk.choose_num_splits(1, 16, 100, 132, h16) == 4
    assert sk.choose_num_splits(1, 16, 0, 132, h16) == 1
    # a large batch fills the GPU alone
    assert sk.choose_num_splits(256, 16, 1024, 132, h16) == 1
    # MI355X: 256 CUs x 2 resident programs: up to one wave of 512 splits (AMD's cap is
    # the device's resident programs, the H200's the 256 its sweep chose); MI300X: 304 x 2
    # slots, 128K positions: the fewest splits of 7 KV tiles each (608 would cut the same)
    assert sk.choose_num_splits(1, 16, 32768, 256, sk.split_kv_config("gfx950", 16)) == 512
    assert sk.choose_num_splits(1, 16, 131072, 304, sk.split_kv_config("gfx942", 16)) == 586
    assert sk.choose_num_splits(1, 16, 131072, 132, h16) == 256
    for batch, ctx in ((1, 1024), (4, 8192), (16, 131072), (64, 4096)):
        splits = sk.choose_num_splits(batch, 16, ctx, 132, h16)
        assert 1 <= splits <= min(sk.MAX_SPLITS, -(-ctx // h16.block_n))


#: launches that read no cache: built once per target, with the bf16 cache's
CACHE_FREE = ("mla_decode_combine_splits", "mla_prefill_expanded", "mla_prefill_expanded_window_first",
              "mla_prefill_expanded_window_middle", "mla_prefill_expanded_window_last")


def _k3_builds() -> list[tuple[aot.KernelLaunch, str]]:
    """Every launch at real K3 widths (576/512) as the launchers specialise them on ROCm (for
    MI355X and MI300X) and on CUDA (for H200), with its target, for a bf16 cache and for the
    FP8 cache each target's ``--kv-cache-dtype fp8`` gives (E4M3; fnuz on gfx942), and the
    FP8 cache write."""
    builds = []
    for target in ("gfx950", "gfx942", "sm_90"):
        fp8 = torch.float8_e4m3fnuz if target == "gfx942" else torch.float8_e4m3fn
        for kv_dtype in (torch.bfloat16, fp8):
            builds += [(launch, target) for launch in mk.aot_launches(target, qk_dim=576, value_dim=512,
                                                                      dtype=torch.bfloat16, kv_dtype=kv_dtype)
                       if not (kv_dtype == fp8 and launch.name in CACHE_FREE)]
        builds.append((cw.aot_launch(fp8), target))
    return builds


def aot_requests() -> dict[int, aot.CompileRequest]:
    """_k3_builds by index; compiled in the session's one batch (conftest's aot_reports)."""
    return {i: launch.request(target) for i, (launch, target) in enumerate(_k3_builds())}


#: the most 32-bit words a launch over an FP8 cache may spill on sm_90: its converted tiles
#: live in registers (observed 76, at 32 heads; the sweep's fastest launches, BENCHMARKS.md)
FP8_SM90_SPILLS = 96


def test_every_kernel_compiles_and_fits_amd_targets(aot_reports):
    """Every launch of _k3_builds: within LDS / shared memory, no registers spilled to
    scratch (over an FP8 cache on sm_90 at most FP8_SM90_SPILLS words), at least one wave;
    the split-KV kernel at every head tile, as many resident programs per CU/SM as
    split_kv_config declares for its cache (choose_num_splits counts on them)."""
    builds = _k3_builds()
    assert sorted(aot_reports) == list(range(len(builds)))
    for i, (launch, target) in enumerate(builds):
        res = aot_reports[i]
        print(f"{launch.name} (stages {launch.num_stages}): {res}")
        assert res.fits and res.shared_bytes <= aot.TARGETS[target].shared_per_program_bytes, (launch.name, res)
        if res.registers is None:  # sm_90 without cuobjdump: nothing more to check
            continue
        amd, fp8 = aot.TARGETS[target].is_amd, launch.constexprs.get("KV_FP8", False)
        assert res.spills <= (FP8_SM90_SPILLS if fp8 and not amd else 0) and res.occupancy >= 1, (launch.name, res)
        if launch.name.startswith("mla_cache_write"):
            continue
        if launch.name != "mla_decode_combine_splits":  # the matrix-unit tiles do stage through LDS
            assert res.shared_bytes > 0 and res.registers > 64
        if launch.name.startswith(sk.SPLIT_KV.name):
            block_h = launch.constexprs["BLOCK_H"]
            kv_dtype = (torch.float8_e4m3fnuz if target == "gfx942" else torch.float8_e4m3fn) if fp8 else None
            config = sk.split_kv_config(target, block_h, torch.bfloat16, kv_dtype)
            assert res.programs_per_unit == config.programs_per_sm, (launch.name, target, res, config)
