"""The prefill kernels at one TP8 rank's real shapes on a GPU (skipped without one): what
the interpreter tests check at small shapes, at K3's widths and lengths past a few
chunks, row tiles and expert groups. Run on the GPU machine:

    python -m pytest -q -m gpu tests/test_gpu_prefill.py

Tolerances as in the small-shape tests (tests/test_kernel_kda_prefill.py,
tests/test_kernel_mla_prefill_expanded.py, tests/test_kernel_moe_dequant.py).
"""

from __future__ import annotations

import pytest
import torch

import k3compile.ops  # noqa: F401  (registers torch.ops.k3)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA / ROCm GPU")]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


def kda_inputs() -> dict[str, torch.Tensor]:
    """12 heads, D = DV = 128, bf16, K3's gate; ragged sequences of 1,000, 2,065 and 64
    tokens in state slots 2, 0 and 3 of 4, random states."""
    from k3compile.ops.kda import kda_gate

    gen = torch.Generator(device="cuda").manual_seed(0)
    lens, H, D = [1000, 2065, 64], 12, 128
    T = sum(lens)
    r = lambda *s: torch.randn(*s, generator=gen, device="cuda")  # noqa: E731
    q, k, v = (r(T, H, D).bfloat16() for _ in range(3))
    return {"q": q, "k": k, "v": v, "g": kda_gate(r(T, H, D), r(H) * 0.5, r(H * D), -5.0),
            "beta": torch.rand(T, H, generator=gen, device="cuda"), "state": r(4, H, D, D) * 0.1,
            "cu": torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda"),
            "slots": torch.tensor([2, 0, 3], device="cuda")}


def run_kda_kernels(x: dict[str, torch.Tensor], group_chunks: int | None = None):
    """(o, states) of the Triton KDA prefill from a copy of the states."""
    from k3compile.runtime.kernels import kda_prefill

    state = x["state"].clone()
    o = kda_prefill.kda_prefill(x["q"], x["k"], x["v"], x["g"], x["beta"], state, x["cu"], x["slots"],
                                x["q"].shape[-1] ** -0.5, group_chunks=group_chunks)
    return o, state


@pytest.mark.parametrize("group_chunks", [0, 4, None])
def test_kda_prefill_at_k3_shapes(group_chunks):
    """With and without chunk groups (None: the launcher's choice), against the fp32
    reference; the slot no sequence uses untouched."""
    from k3compile.ops.kda import kda_prefill_reference

    x = kda_inputs()
    o, s_kernel = run_kda_kernels(x, group_chunks)
    s_ref = x["state"].clone()
    o_ref = kda_prefill_reference(x["q"], x["k"], x["v"], x["g"], x["beta"], s_ref, x["cu"], x["slots"],
                                  x["q"].shape[-1] ** -0.5)
    # the states: 2^-7 (the keys' bf16 rounding summed over every token; tests/test_kernel_kda_prefill.py)
    assert rel_err(o, o_ref) <= 2.0**-7 and rel_err(s_kernel, s_ref) <= 2.0**-7
    assert torch.equal(s_kernel[1], x["state"][1])


def test_kda_prefill_against_fla_chunk_kda():
    """The peer as a cross-check (skipped without fla-core): fla's ``chunk_kda`` on the same
    packed sequences, its initial states the slots' (fla multiplies in bf16 too: within
    2^-6 of the largest value, about 1% measured, BENCHMARKS.md)."""
    chunk_kda = pytest.importorskip("fla.ops.kda").chunk_kda
    x = kda_inputs()
    o, s_kernel = run_kda_kernels(x)
    b = lambda t: t[None]  # noqa: E731  (fla packs varlen batches as batch 1)
    o_fla, s_fla = chunk_kda(b(x["q"]), b(x["k"]), b(x["v"]), b(x["g"]), b(x["beta"]), scale=x["q"].shape[-1] ** -0.5,
                             initial_state=x["state"][x["slots"]], output_final_state=True,
                             use_qk_l2norm_in_kernel=True, cu_seqlens=x["cu"].long())
    assert rel_err(o, o_fla[0]) <= 2.0**-6
    assert rel_err(s_kernel[x["slots"]], s_fla) <= 2.0**-6


def test_mla_prefill_both_forms_at_k3_shapes():
    """12 heads, L 512, R 64, Dn = Dv = 128, bf16, 64-token cache blocks: a 1,500-token
    prompt and a 300-token continuation after 900 cached tokens, by the expanded kernel
    and by the absorbed one, against the naive-form reference."""
    from k3compile.ops.mla import mla_prefill_reference
    from k3compile.runtime.kernels import mla_decode
    from k3compile.runtime.kernels import mla_prefill_expanded as ex

    gen = torch.Generator(device="cuda").manual_seed(1)
    H, L, R, Dn, Dv, bs = 12, 512, 64, 128, 128, 64
    contexts, new = [1500, 1200], [1500, 300]
    blocks = [-(-c // bs) for c in contexts]
    cache = torch.randn(sum(blocks) + 1, bs, L + R, generator=gen, device="cuda").bfloat16()
    table = torch.zeros(2, max(blocks), dtype=torch.int32, device="cuda")
    table[0, :blocks[0]] = torch.arange(1, blocks[0] + 1)
    table[1, :blocks[1]] = torch.arange(blocks[0] + 1, sum(blocks) + 1)
    seq_lens = torch.tensor(contexts, dtype=torch.int32, device="cuda")
    cu = torch.tensor([0, new[0], sum(new)], dtype=torch.int32, device="cuda")
    q = torch.randn(sum(new), H, Dn + R, generator=gen, device="cuda").bfloat16()
    kv_b = (torch.randn(H * (Dn + Dv), L, generator=gen, device="cuda") / L**0.5).bfloat16()
    want = mla_prefill_reference(q, cache, kv_b, cu, table, seq_lens, (Dn + R) ** -0.5)
    counts = ex.prefill_counts(cu, seq_lens)
    got = ex.mla_prefill_expanded(q, cache, kv_b, cu, table, seq_lens, (Dn + R) ** -0.5, counts)
    assert rel_err(got, want) <= 2.0**-6
    q_abs = mla_decode.absorb_queries(q, kv_b, Dn)
    o_lat, _ = mla_decode.PREFILL.launch(q_abs, cache, cu, table, seq_lens, (Dn + R) ** -0.5, L)
    assert rel_err(mla_decode.values_of_latent_output(o_lat, kv_b, Dn), want) <= 2.0**-6


def test_moe_dequantized_against_the_fused_kernels_at_k3_shapes():
    """E 896, top_k 16, D 3584, I 384, 4,096 tokens (65,536 pairs, past the dequantised
    path's threshold on sm_90): the dequantised path against the fused kernels' long-prefill plan
    (both against the op's reference would dequantise every expert per token group: the
    fused kernels are checked against it at small shapes)."""
    from k3compile.runtime.kernels import moe, moe_dequant, routing

    gen = torch.Generator(device="cuda").manual_seed(2)
    E, K, D, I, T = 896, 16, 3584, 384, 4096

    def pair(rows: int, cols: int):
        return (torch.randint(0, 256, (E, rows, cols // 2), generator=gen, device="cuda", dtype=torch.uint8),
                torch.randint(117, 122, (E, rows, cols // 32), generator=gen, device="cuda", dtype=torch.uint8))

    w = (*pair(I, D), *pair(I, D), *pair(D, I))
    weights, ids = routing.sigmoid_topk_route(torch.randn(T, E, generator=gen, device="cuda"),
                                              torch.zeros(E, device="cuda"), K, True, 1.0)
    z = torch.randn(T, D, generator=gen, device="cuda").bfloat16()
    got = moe_dequant.moe_experts_dequantized(z, weights, ids, *w, 4.0, 25.0)
    fused = moe.moe_experts_mxfp4(z, weights, ids, *w, 4.0, 25.0, plan=moe.PLANS["sm_90"].prefill)
    assert rel_err(got, fused) <= 2.0**-6
