"""Triton MLA kernels (runtime/kernels/mla_*.py) against the fp32 torch reference.

Without a GPU the kernels run under the Triton interpreter: tests/conftest.py sets
TRITON_INTERPRET before anything imports Triton (the mode is fixed at that import).
Under the interpreter the launchers NaN-fill every output and scratch buffer, so an
element a kernel fails to write fails the comparison.

Tolerances (bf16 inputs, fp32 reference on the same bf16 values upcast): scores are
exact products summed in fp32, so lse agrees to fp32 rounding (1e-4 absolute is loose);
o loses the rounding of the probabilities to bf16 before the value product and of o
itself to bf16: 2^-9 relative each on a GPU, 2^-8 under Triton 3.9's interpreter, which
truncates fp32 -> bf16: 1e-2 absolute + 1e-2 relative.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import k3compile.ops  # noqa: F401  (registers torch.ops.k3)
from k3compile.runtime.kernels import aot
from k3compile.runtime.kernels import mla_attention as ak
from k3compile.runtime.kernels import mla_common as mc
from k3compile.runtime.kernels import mla_decode as mk
from k3compile.runtime.kernels import mla_split_kv as sk

DEVICE = "cuda" if torch.cuda.is_available() and not mc._INTERPRETED else "cpu"


# The interpreter evaluates the masked-out branches of tl.where too (0/0 for an empty
# context's o, log2(0) for its lse): numpy warns, the kernels select the right value.
pytestmark = pytest.mark.filterwarnings("ignore:(divide by zero|invalid value) encountered:RuntimeWarning")

O_TOL = {"atol": 1e-2, "rtol": 1e-2}
LSE_TOL = {"atol": 1e-4, "rtol": 0.0}


def paged(lens: list[int], W: int, block_size: int, dtype: torch.dtype, gen: torch.Generator):
    """A cache whose blocks are handed out in a random order, garbage (large values) in
    every slot no sequence owns, and a block table whose unused entries point at garbage."""
    need = [-(-n // block_size) for n in lens]
    width = max(max(need), 1)
    num_blocks = sum(need) + 3
    cache = torch.randn(num_blocks, block_size, W, generator=gen) * 100
    order = torch.randperm(num_blocks, generator=gen)
    table = torch.randint(0, num_blocks, (len(lens), width), generator=gen, dtype=torch.int32)
    taken = 0
    for i, (n, k) in enumerate(zip(lens, need, strict=True)):
        blocks = order[taken:taken + k]
        taken += k
        table[i, :k] = blocks.int()
        ctx = torch.randn(n, W, generator=gen)
        flat = (blocks[:, None] * block_size + torch.arange(block_size)).flatten()[:n]
        cache.view(-1, W)[flat] = ctx
    return cache.to(dtype).to(DEVICE), table.to(DEVICE), torch.tensor(lens, dtype=torch.int32, device=DEVICE)


def reference(q, cache, table, seq_lens, scale, value_dim):
    return torch.ops.k3.mla_decode(q.float().cpu(), cache.float().cpu(), table.cpu(), seq_lens.cpu(), scale, value_dim)


def check(got, want, o_tol=O_TOL, lse_tol=LSE_TOL):
    o, lse = got
    assert not o.isnan().any() and not lse.isnan().any(), "unwritten (NaN-poisoned) outputs"
    torch.testing.assert_close(o.float().cpu(), want[0].float(), **o_tol)
    torch.testing.assert_close(lse.cpu(), want[1], **lse_tol)


def case(H: int, L: int, R: int, lens: list[int], block_size: int, dtype=torch.bfloat16, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    cache, table, seq_lens = paged(lens, L + R, block_size, dtype, gen)
    q = torch.randn(len(lens), H, L + R, generator=gen).to(dtype).to(DEVICE)
    return q, cache, table, seq_lens, (L + R) ** -0.5


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


@pytest.mark.parametrize("H, block_h", [(32, 32), (48, 64), (48, 32), (32, 16)])
def test_split_kv_head_tiles(H, block_h):
    """Head tiles other than split_kv_config's: one tile wider than the heads (48 in 64:
    masked head rows), a last tile half full (48 = 32 + 16), two tiles for 32 heads; with
    more splits than KV tiles (2 tiles of 32 rows, 8 splits) and a KV tile larger than
    the block size."""
    q, cache, table, seq_lens, scale = case(H, 64, 8, [0, 50, 17], block_size=16, seed=H + block_h)
    config = sk.SplitKVConfig(block_h=block_h, block_n=32, num_warps=4, num_stages=3, programs_per_sm=1)
    got = sk.mla_decode_split_kv(q, cache, table, seq_lens, scale, 64, num_splits=8, config=config)
    check(got, reference(q, cache, table, seq_lens, scale, 64))


def poison_past_contexts(cache: torch.Tensor, table: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """NaN in every cache row no context covers (what unwritten cache memory may hold)."""
    owned = torch.zeros(cache.shape[0] * cache.shape[1], dtype=torch.bool)
    bs = cache.shape[1]
    for n, ctx in enumerate(seq_lens.tolist()):
        pos = torch.arange(ctx)
        owned[table[n].cpu().long()[pos // bs] * bs + pos % bs] = True
    poisoned = cache.clone()
    poisoned.view(-1, cache.shape[-1])[~owned.to(cache.device)] = float("nan")
    return poisoned


@pytest.mark.parametrize("H, block_n, block_size", [(16, 32, 32), (16, 32, 64), (32, 16, 64)])
def test_split_kv_tensor_descriptor_tiles(H, block_n, block_size):
    """KV tiles by tensor descriptors (config.tma, the sm_90 default): whole tiles go from
    the cache to the dots unmasked, the context's last partial tile through the 16-row
    gather. Contexts ending on, just after and just before a tile / block boundary;
    NaN in every cache row past the contexts (the descriptor reads the rest of the last
    block) must not reach the outputs; the pointer gathers give the same answer."""
    q, cache, table, seq_lens, scale = case(H, 64, 8, [0, 1, 31, 32, 33, 100, 129], block_size, seed=H + block_size)
    cache = poison_past_contexts(cache, table, seq_lens)
    want = reference(q, cache.nan_to_num(0.0), table, seq_lens, scale, 64)
    tma = sk.SplitKVConfig(block_h=H, block_n=block_n, num_warps=4, num_stages=3, programs_per_sm=1, tma=True)
    assert sk._kv_descriptors(cache, 64, block_n) is not None
    for splits in (1, 3, 7):
        got = sk.mla_decode_split_kv(q, cache, table, seq_lens, scale, 64, num_splits=splits, config=tma)
        check(got, want)
        pointers = sk.mla_decode_split_kv(q, cache, table, seq_lens, scale, 64, num_splits=splits,
                                          config=dataclasses.replace(tma, tma=False))
        torch.testing.assert_close(got[1], pointers[1], atol=1e-5, rtol=0.0)


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_split_kv_other_dtypes(dtype):
    q, cache, table, seq_lens, scale = case(16, 64, 8, [9, 30], block_size=16, dtype=dtype, seed=5)
    tol = ({"atol": 1e-5, "rtol": 1e-5}, {"atol": 1e-5, "rtol": 0.0}) if dtype == torch.float32 else (O_TOL, LSE_TOL)
    check(sk.mla_decode_split_kv(q, cache, table, seq_lens, scale, 64, num_splits=2),
          reference(q, cache, table, seq_lens, scale, 64), *tol)


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
    def tile(backend, heads, dtype=torch.bfloat16):
        return sk.split_kv_config(backend, heads, dtype).block_h
    assert [tile("cuda", h) for h in (16, 32, 48, 64, 96, 128)] == [16, 32, 16, 64, 32, 64]
    assert [tile("hip", h) for h in (16, 32, 48, 64, 96)] == [16, 32, 16, 32, 32]  # 64 heads spill on AMD
    assert tile("cuda", 64, torch.float32) == 16
    sm90 = sk.split_kv_config("cuda", 64)
    assert sm90.num_warps == 8 and sm90.num_stages == 3 and sm90.block_n == 32


def test_num_splits_fill_the_gpu():
    """One wave of resident programs (SMs x programs_per_sm) where the context allows,
    splits no shorter than a KV tile, the fewest splits of least cost."""
    h16 = sk.split_kv_config("cuda", 16)  # 2 programs per SM
    # batch 1 at 32K on an H200: 256 splits of 128 rows fill the 264 slots once
    assert sk.choose_num_splits(1, 16, 32768, 132, h16) == 256
    # batch 16: 16 splits = 256 programs, one wave (17 would spill 8 programs into a second)
    assert sk.choose_num_splits(16, 16, 32768, 132, h16) == 16
    # 96 heads = 3 head tiles: 11 splits x 48 = 528 programs, two whole waves
    assert sk.choose_num_splits(16, 96, 32768, 132, sk.split_kv_config("cuda", 96)) == 11
    # short contexts: never more splits than KV tiles; none for an empty table
    assert sk.choose_num_splits(1, 16, 100, 132, h16) == 4
    assert sk.choose_num_splits(1, 16, 0, 132, h16) == 1
    # a large batch fills the GPU alone
    assert sk.choose_num_splits(256, 16, 1024, 132, h16) == 1
    # MI355X: 256 CUs x 2
    assert sk.choose_num_splits(1, 16, 32768, 256, sk.split_kv_config("hip", 16)) == 256
    for batch, ctx in ((1, 1024), (4, 8192), (16, 131072), (64, 4096)):
        splits = sk.choose_num_splits(batch, 16, ctx, 132, h16)
        assert 1 <= splits <= min(sk.MAX_SPLITS, -(-ctx // h16.block_n))


def test_every_kernel_compiles_and_fits_amd_targets():
    """Real K3 widths (576/512) as the launchers specialise them on ROCm, for MI355X and
    MI300X, and on CUDA for H200: within LDS / shared memory, no registers spilled to
    scratch, at least one wave; the split-KV kernel at every head tile, as many resident
    programs per CU/SM as split_kv_config declares (choose_num_splits counts on them)."""
    builds = [(launch, target) for backend, targets in (("hip", ("gfx950", "gfx942")), ("cuda", ("sm_90",)))
              for launch in mk.aot_launches(backend, qk_dim=576, value_dim=512, dtype=torch.bfloat16)
              for target in targets]
    requests = [launch.request(target) for launch, target in builds]
    results = aot.compile_many(requests)  # one subprocess under the interpreter
    for (launch, target), res in zip(builds, results, strict=True):
        print(f"{launch.name} (stages {launch.num_stages}): {res}")
        assert res.fits and res.shared_bytes <= aot.TARGETS[target].shared_per_program_bytes, (launch.name, res)
        if res.registers is None:  # sm_90 without cuobjdump: nothing more to check
            continue
        assert res.spills == 0 and res.occupancy >= 1, (launch.name, res)
        if launch.name != "mla_decode_combine_splits":  # the matrix-unit tiles do stage through LDS
            assert res.shared_bytes > 0 and res.registers > 64
        if launch.name.startswith(sk.SPLIT_KV.name):
            block_h = launch.constexprs["BLOCK_H"]
            config = sk.split_kv_config("hip" if aot.TARGETS[target].is_amd else "cuda", block_h)
            # AMD reports waves per SIMD, 4 SIMDs per CU; NVIDIA warps per SM
            per_unit = res.occupancy * (4 if aot.TARGETS[target].is_amd else 1) // launch.num_warps
            assert per_unit == config.programs_per_sm, (launch.name, target, per_unit, config)
