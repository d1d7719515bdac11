"""The MLA, MoE, SiTU, AttnRes and norm ops against independent formulas."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

import k3compile.ops  # noqa: F401  (registers torch.ops.k3)
from k3compile.checkpoint.mxfp4 import pack_mxfp4

k3 = torch.ops.k3


def paged_cache(contexts: list[torch.Tensor], block_size: int, num_blocks: int, gen: torch.Generator):
    """Scatter each sequence's [len, W] context into randomly chosen blocks."""
    W = contexts[0].shape[-1]
    cache = torch.randn(num_blocks, block_size, W, generator=gen)  # garbage where unused
    free = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(-(-len(c) // block_size) for c in contexts)
    table = torch.zeros(len(contexts), max(width, 1), dtype=torch.int32)
    for i, c in enumerate(contexts):
        n = -(-len(c) // block_size)
        blocks = [free.pop() for _ in range(n)]
        table[i, :n] = torch.tensor(blocks, dtype=torch.int32)
        for p in range(len(c)):
            cache[blocks[p // block_size], p % block_size] = c[p]
    return cache, table


def test_mla_absorbed_decode_equals_naive_form():
    gen = torch.Generator().manual_seed(0)
    H, Dn, R, L, bs = 3, 16, 8, 32, 4
    lens = [1, 5, 13]
    contexts = [torch.randn(n, L + R, generator=gen) for n in lens]
    cache, table = paged_cache(contexts, bs, 16, gen)
    kv_b = torch.randn(H * 2 * Dn, L, generator=gen) / math.sqrt(L)
    q = torch.randn(len(lens), H, Dn + R, generator=gen)
    scale = (Dn + R) ** -0.5
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    cu = torch.arange(len(lens) + 1, dtype=torch.int32)  # one new token per sequence
    naive = k3.mla_prefill(q, cache, kv_b, cu, table, seq_lens, scale)

    w = kv_b.view(H, 2 * Dn, L)
    q_abs = torch.cat([torch.einsum("bhd,hdl->bhl", q[..., :Dn], w[:, :Dn]), q[..., Dn:]], -1)
    o_lat, lse = k3.mla_decode(q_abs, cache, table, seq_lens, scale, L)
    absorbed = torch.einsum("bhl,hdl->bhd", o_lat, w[:, Dn:])
    torch.testing.assert_close(absorbed, naive, rtol=1e-5, atol=1e-5)

    # LSE is the log-sum-exp of the scaled scores over the context.
    for b, c in enumerate(contexts):
        ref = torch.logsumexp(scale * q_abs[b] @ c.t(), dim=-1)
        torch.testing.assert_close(lse[b], ref, rtol=1e-5, atol=1e-5)


def test_mla_decode_empty_context_and_lse_merge():
    """Attention over disjoint position sets merges exactly by LSE (what DCP relies on);
    an empty set gives a zero output and -inf."""
    gen = torch.Generator().manual_seed(1)
    H, L, R, bs = 2, 16, 8, 4
    ctx = torch.randn(10, L + R, generator=gen)
    q = torch.randn(1, H, L + R, generator=gen)
    parts = [ctx[0::2], ctx[1::2], ctx[:0]]
    outs, lses = [], []
    for part in parts:
        cache, table = paged_cache([part if len(part) else ctx[:1]], bs, 8, gen)
        o, lse = k3.mla_decode(q, cache, table, torch.tensor([len(part)], dtype=torch.int32), 0.3, L)
        outs.append(o)
        lses.append(lse)
    assert torch.equal(outs[2], torch.zeros_like(outs[2])) and torch.isneginf(lses[2]).all()
    total = torch.logsumexp(torch.stack(lses), dim=0)
    merged = sum(torch.exp(l - total).unsqueeze(-1) * o for o, l in zip(outs, lses))
    cache, table = paged_cache([ctx], bs, 8, gen)
    full, full_lse = k3.mla_decode(q, cache, table, torch.tensor([10], dtype=torch.int32), 0.3, L)
    torch.testing.assert_close(merged, full, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(total, full_lse)


def test_mla_prefill_is_causal_over_cached_context():
    """New tokens see the cached context and earlier new tokens, never later ones."""
    gen = torch.Generator().manual_seed(2)
    H, Dn, R, L, bs = 2, 8, 4, 16, 4
    ctx = torch.randn(7, L + R, generator=gen)
    cache, table = paged_cache([ctx], bs, 4, gen)
    kv_b = torch.randn(H * 2 * Dn, L, generator=gen)
    q = torch.randn(3, H, Dn + R, generator=gen)  # the last 3 of 7 positions are new
    out = k3.mla_prefill(q, cache, kv_b, torch.tensor([0, 3], dtype=torch.int32), table,
                         torch.tensor([7], dtype=torch.int32), 0.25)
    w = kv_b.view(H, 2 * Dn, L)
    k_nope = torch.einsum("cl,hdl->hcd", ctx[:, :L], w[:, :Dn])
    v = torch.einsum("cl,hdl->hcd", ctx[:, :L], w[:, Dn:])
    for j, pos in enumerate(range(4, 7)):
        s = 0.25 * (torch.einsum("hd,hcd->hc", q[j, :, :Dn], k_nope[:, : pos + 1]) + q[j, :, Dn:] @ ctx[: pos + 1, L:].t())
        ref = torch.einsum("hc,hcd->hd", torch.softmax(s, -1), v[:, : pos + 1])
        torch.testing.assert_close(out[j], ref, rtol=1e-5, atol=1e-5)


def test_mla_cache_write_in_place():
    cache = torch.zeros(3, 2, 4)
    ptr = cache.data_ptr()
    kv = torch.arange(12.0).view(3, 4)
    k3.mla_cache_write(cache, kv, torch.tensor([5, 2, 0]), 3)
    assert cache.data_ptr() == ptr
    flat = cache.view(-1, 4)
    assert torch.equal(flat[5], kv[0]) and torch.equal(flat[2], kv[1]) and torch.equal(flat[0], kv[2])
    assert flat[[1, 3, 4]].abs().sum() == 0


def test_router_logits_are_the_fp32_product_whatever_the_dtypes():
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 3, 64, generator=gen), torch.randn(12, 64, generator=gen)
    for xd, wd in ((torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16), (torch.float32, torch.float32)):
        got = k3.router_logits(x.to(xd), w.to(wd))
        want = torch.nn.functional.linear(x.to(xd).double(), w.to(wd).double())
        assert got.dtype == torch.float32 and got.shape == (2, 3, 12)
        # bf16 x bf16 products are exact in fp32: only the fp32 summation differs from fp64
        assert (got.double() - want).abs().max() <= 64 * 2.0**-24 * (x.abs() @ w.abs().T).max()


def test_sigmoid_topk_route_bias_selects_only():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    bias = torch.tensor([0.0, 0.0, 5.0, 0.0])  # pulls expert 2 into the top-2
    w, ids = k3.sigmoid_topk_route(logits, bias, 2, True, 2.5)
    assert sorted(ids[0].tolist()) == [0, 2]
    s = torch.sigmoid(logits[0])
    expected = {0: s[0] / (s[0] + s[2]) * 2.5, 2: s[2] / (s[0] + s[2]) * 2.5}
    for weight, e in zip(w[0], ids[0].tolist()):
        assert weight.item() == pytest.approx(expected[e].item(), rel=1e-6)
    w_raw, _ = k3.sigmoid_topk_route(logits, bias, 2, False, 1.0)
    assert sorted(w_raw[0].tolist()) == pytest.approx(sorted([s[0].item(), s[2].item()]))


def _packed(experts: int, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 codes and scales of a random [experts, rows, cols] weight."""
    return pack_mxfp4(torch.randn(experts, rows, cols))


def test_sigmoid_topk_route_breaks_ties_to_the_lower_expert():
    logits = torch.tensor([[0.5, 1.0, 0.5, 1.0, 0.5], [0.0, 0.0, 0.0, 0.0, 0.0]])
    _, ids = k3.sigmoid_topk_route(logits, torch.zeros(5), 3, True, 1.0)
    assert ids.tolist() == [[1, 3, 0], [0, 1, 2]]  # by decreasing score, equal scores by id


def test_moe_experts_mxfp4_equals_the_dense_op_on_dequantised_weights():
    from k3compile.checkpoint.mxfp4 import unpack_mxfp4

    gen = torch.Generator().manual_seed(4)
    T, D, I, E, k = 5, 64, 32, 6, 2
    weights = [_packed(E, I, D), _packed(E, I, D), _packed(E, D, I)]
    z = torch.randn(T, D, generator=gen)
    ids = torch.tensor([[0, 5], [5, 0], [2, 3], [3, 3 - 1], [4, 1]])
    w = torch.rand(T, k, generator=gen)
    packed = k3.moe_experts_mxfp4(z, w, ids, *weights[0], *weights[1], *weights[2], 4.0, 25.0)
    dense = k3.moe_experts(z, w, ids, *(unpack_mxfp4(p, s, torch.float32) for p, s in weights), 4.0, 25.0)
    assert torch.equal(packed, dense) and packed.abs().max() > 0


def test_moe_experts_equals_dense_mixture():
    gen = torch.Generator().manual_seed(3)
    T, D, I, E, k = 6, 8, 12, 5, 2
    z = torch.randn(T, D, generator=gen)
    w1, w3 = torch.randn(E, I, D, generator=gen), torch.randn(E, I, D, generator=gen)
    w2 = torch.randn(E, D, I, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    weights = torch.rand(T, k, generator=gen)
    out = k3.moe_experts(z, weights, ids, w1, w3, w2, 4.0, 25.0)
    ref = torch.zeros(T, D)
    for t in range(T):
        for j in range(k):
            e = ids[t, j]
            g, u = w1[e] @ z[t], w3[e] @ z[t]
            act = 4 * torch.tanh(g / 4) * torch.sigmoid(g) * 25 * torch.tanh(u / 25)
            ref[t] += weights[t, j] * (w2[e] @ act)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_situ_and_mul_formula():
    g = torch.linspace(-30, 30, 101, dtype=torch.float64)
    u = torch.linspace(-100, 100, 101, dtype=torch.float64)
    out = k3.situ_and_mul(g, u, 4.0, 25.0)
    ref = 4 * torch.tanh(g / 4) * torch.sigmoid(g) * 25 * torch.tanh(u / 25)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-4)  # computed in fp32 by design
    assert out.abs().max() <= 4 * 25  # both branches are soft-clipped


def test_attn_res_mix():
    gen = torch.Generator().manual_seed(4)
    T, D = 3, 8
    blocks = [torch.randn(T, D, generator=gen) * s for s in (1.0, 10.0)]
    partial = torch.randn(T, D, generator=gen)
    proj, norm = torch.randn(1, D, generator=gen), torch.rand(D, generator=gen) + 0.5
    out = k3.attn_res_mix(partial, blocks, proj, norm, 1e-5)
    cands = [*blocks, partial]
    logits = torch.stack([((c / (c.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt()) * norm * proj[0]).sum(-1) for c in cands])
    p = torch.softmax(logits, 0)
    ref = sum(p[i].unsqueeze(-1) * c for i, c in enumerate(cands))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # Scores see only the direction of a candidate: scaling one does not change its weight.
    scaled = k3.attn_res_mix(partial, [blocks[0] * 3, blocks[1]], proj, norm, 1e-5)
    torch.testing.assert_close(scaled - out, p[0].unsqueeze(-1) * 2 * blocks[0], rtol=1e-4, atol=1e-4)


def test_rms_norm():
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    w = torch.rand(16)
    ref = (x.double() / (x.double().pow(2).mean(-1, keepdim=True) + 1e-5).sqrt() * w.double()).to(torch.bfloat16)
    torch.testing.assert_close(k3.rms_norm(x, w, 1e-5), ref)


@pytest.mark.parametrize(
    "op,args",
    [
        ("rms_norm", lambda: (torch.randn(3, 8), torch.rand(8), 1e-5)),
        ("situ_and_mul", lambda: (torch.randn(3, 8), torch.randn(3, 8), 4.0, 25.0)),
        ("attn_res_mix", lambda: (torch.randn(3, 8), [torch.randn(3, 8)], torch.randn(1, 8), torch.rand(8), 1e-5)),
        ("router_logits", lambda: (torch.randn(3, 8).bfloat16(), torch.randn(6, 8).bfloat16())),
        ("sigmoid_topk_route", lambda: (torch.randn(3, 6), torch.randn(6), 2, True, 1.0)),
        ("moe_experts", lambda: (torch.randn(3, 8), torch.rand(3, 2), torch.tensor([[0, 1], [2, 3], [1, 3]]),
                                 torch.randn(4, 6, 8), torch.randn(4, 6, 8), torch.randn(4, 8, 6), 4.0, 25.0)),
        ("moe_experts_mxfp4", lambda: (torch.randn(3, 32), torch.rand(3, 2), torch.tensor([[0, 1], [2, 3], [1, 3]]),
                                       *_packed(4, 64, 32), *_packed(4, 64, 32), *_packed(4, 32, 64), 4.0, 25.0)),
        ("mla_cache_write", lambda: (torch.zeros(2, 4, 6), torch.randn(3, 6), torch.tensor([0, 5, 7]), 4)),
        ("mla_decode", lambda: (torch.randn(2, 2, 6), torch.randn(3, 4, 6), torch.tensor([[0, 1], [2, 0]], dtype=torch.int32),
                                torch.tensor([5, 3], dtype=torch.int32), 0.5, 4)),
        ("mla_prefill", lambda: (torch.randn(3, 2, 6), torch.randn(3, 4, 6), torch.randn(2 * 8, 4),
                                 torch.tensor([0, 2, 3], dtype=torch.int32), torch.tensor([[0, 1], [2, 0]], dtype=torch.int32),
                                 torch.tensor([5, 3], dtype=torch.int32), 0.5)),
    ],
)
def test_opcheck(op, args):
    torch.library.opcheck(getattr(k3, op), args())


def test_opcheck_fp8_cache_write():
    """The FP8 cache write's fake and dispatch (opcheck's schema check compares tensors with
    arithmetic torch lacks for FP8 on the CPU: the mutation is checked by test_mla_cache_fp8)."""
    args = (torch.zeros(2, 4, 24, dtype=torch.float8_e4m3fn), torch.randn(3, 8), torch.tensor([0, 5, 7]), 4)
    torch.library.opcheck(k3.mla_cache_write, args, test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))


def test_op_library_does_not_import_the_runtime():
    """Op semantics never import the runtime's kernels: the runtime registers them for the
    ops (``k3compile.runtime.kernels.register_gpu_kernels``)."""
    code = ("import sys, k3compile.ops; bad = sorted(m for m in sys.modules if m.startswith('k3compile.runtime')); "
            "assert not bad, bad; assert 'triton' not in sys.modules, 'triton imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
