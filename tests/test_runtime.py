"""The compiled artifact through the runtime reproduces the reference model, at TP1 and TP2."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from k3compile import runtime
from k3compile.batch import CacheShape
from k3compile.reference import ReferenceEngine, load_reference
from k3compile.runtime import RequestError, RuntimeOptions, SamplingParams
from k3compile.runtime.sampling import sample, sample_on_device, sampling_tensor

PROMPTS = [[5, 9, 100, 7, 3, 44, 21, 8, 90, 11], [17], [300, 301, 302]]
NEW_TOKENS = 16
OPTIONS = RuntimeOptions(max_sequences=4, max_context=64)


@pytest.fixture(scope="module")
def model_dir(model_dirs) -> Path:
    return model_dirs("tiny", "mxfp4")


@pytest.fixture(scope="module")
def artifact_tp1(compile_once) -> Path:
    return compile_once("tiny", "mxfp4", dtype="float32").out_dir  # validated


@pytest.fixture(scope="module")
def reference(model_dir):
    model = load_reference(model_dir)
    shape = CacheShape(num_slots=4, num_blocks=32, block_size=16)
    _, logits = ReferenceEngine(model, shape).prefill(PROMPTS)
    tokens = ReferenceEngine(model, shape).generate(PROMPTS, NEW_TOKENS)
    return logits, tokens


def test_artifact_reproduces_reference_at_tp1(artifact_tp1, reference):
    ref_logits, ref_tokens = reference
    rt = runtime.load(artifact_tp1, rank=0, world_size=1, options=OPTIONS)  # on a GPU where there is one
    ids, logits = rt.prefill(PROMPTS)
    torch.testing.assert_close(logits.cpu(), ref_logits, rtol=1e-4, atol=1e-4 * ref_logits.abs().max().item())
    for s in ids:
        rt.release(s)
    assert rt.generate(PROMPTS, NEW_TOKENS) == ref_tokens


@pytest.mark.parametrize("chunk", [1, 3, 4])
def test_chunked_prefill_reproduces_the_reference(artifact_tp1, reference, chunk):
    """prefill_chunk: the 10-, 1- and 3-token prompts in chunks of 1, 3 or 4 tokens, each
    against the cache the earlier chunks wrote (chunks of 1: every step a decode step),
    give the reference's last-token logits and greedy tokens."""
    ref_logits, ref_tokens = reference
    rt = runtime.load(artifact_tp1, rank=0, world_size=1, options=replace(OPTIONS, prefill_chunk=chunk))
    ids, logits = rt.prefill(PROMPTS)
    torch.testing.assert_close(logits.cpu(), ref_logits, rtol=1e-4, atol=1e-4 * ref_logits.abs().max().item())
    assert [rt.table.sequences[s].length for s in ids] == [len(p) for p in PROMPTS]
    for s in ids:
        rt.release(s)
    assert rt.generate(PROMPTS, NEW_TOKENS) == ref_tokens
    with pytest.raises(ValueError, match="prefill_chunk: a whole number >= 1 or None needed, got 0"):
        RuntimeOptions(prefill_chunk=0)
    with pytest.raises(RequestError, match="at least one sequence"):
        rt.prefill([])


def _rank_main(rank: int, world: int, out: Path):
    torch.set_num_threads(1)
    rt = runtime.load(out, rank=rank, world_size=world, options=replace(OPTIONS, device="cpu"))  # gloo ranks
    ids, logits = rt.prefill(PROMPTS)
    for s in ids:
        rt.release(s)
    return logits, rt.generate(PROMPTS, NEW_TOKENS)


@pytest.mark.slow
def test_artifact_reproduces_reference_at_tp2(compile_once, reference, rank_pools):
    ref_logits, ref_tokens = reference
    out = compile_once("tiny", "mxfp4", tp=2, dtype="float32").out_dir
    for logits, tokens in rank_pools.get(2).run(_rank_main, out):
        torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4 * ref_logits.abs().max().item())
        assert tokens == ref_tokens


def test_decode_updates_caches_in_place_without_copies(artifact_tp1):
    rt = runtime.load(artifact_tp1, rank=0, world_size=1, options=OPTIONS)
    ids, logits = rt.prefill(PROMPTS)
    ptrs = [t.data_ptr() for t in rt.cache_tensors]
    before = [t.clone() for t in rt.cache_tensors]
    rt.decode(ids, logits.argmax(-1).tolist())
    assert [t.data_ptr() for t in rt.cache_tensors] == ptrs
    assert sum(not torch.equal(a, b) for a, b in zip(before, rt.cache_tensors)) == len(before)  # all updated
    # In the decode graph a cache input is only consumed by k3 ops (no aten copy, clone or
    # copy-back), and one of them writes it in place.
    program = rt.artifact.programs["decode"]
    cache_inputs = [s.arg.name for s in program.graph_signature.input_specs if s.arg.name.startswith("caches")]
    assert len(cache_inputs) == len(rt.cache_tensors)
    nodes = {n.name: n for n in program.graph.nodes}
    for name in cache_inputs:
        writes = 0
        for user in nodes[name].users:
            assert str(user.target).startswith("k3."), (name, user.target)
            schema = user.target._schema
            arg = next(a for a, v in zip(schema.arguments, user.args) if v is nodes[name])
            writes += bool(arg.alias_info is not None and arg.alias_info.is_write)
        assert writes == 1, name
    assert len(program.graph_signature.output_specs) == 1  # logits only: no cache is returned


def test_bad_requests_leave_other_sequences_untouched(artifact_tp1):
    rt = runtime.load(artifact_tp1, rank=0, world_size=1, options=OPTIONS)
    ids, _ = rt.prefill([[1, 2, 3]])
    snapshot = [t.clone() for t in rt.cache_tensors]
    with pytest.raises(RequestError, match="empty prompt"):
        rt.prefill([[4], []])
    with pytest.raises(RequestError, match="outside the vocabulary"):
        rt.decode(ids, [rt.cfg.vocab_size])
    with pytest.raises(RequestError, match="beyond capacity"):
        rt.step(ids, [list(range(70))])
    with pytest.raises(RequestError, match="longer than max_context"):
        rt.prefill([list(range(65))])
    assert all(torch.equal(a, b) for a, b in zip(snapshot, rt.cache_tensors))
    assert rt.table.sequences[ids[0]].length == 3 and len(rt.table.sequences) == 1


def test_new_sequence_does_not_see_a_released_one(artifact_tp1):
    rt = runtime.load(artifact_tp1, rank=0, world_size=1, options=OPTIONS)
    first = rt.generate([[7, 8, 9]], 4)
    rt.generate([[100, 200, 300, 400]], 4)  # reuses the slot and blocks
    assert rt.generate([[7, 8, 9]], 4) == first


def test_sampling():
    logits = torch.tensor([[0.0, 1.0, 3.0, 2.0], [5.0, 0.0, 0.0, 0.0]])
    assert sample(logits, SamplingParams()).tolist() == [2, 0]
    gen = torch.Generator().manual_seed(0)
    assert sample(logits, SamplingParams(temperature=1.0, top_k=1), gen).tolist() == [2, 0]
    assert sample(logits, SamplingParams(temperature=1.0, top_p=0.01), gen).tolist() == [2, 0]
    # Temperature sampling follows the softmax; top-k 2 never leaves the two best tokens.
    row = logits[:1].expand(20000, -1)
    draws = sample(row, SamplingParams(temperature=1.0), torch.Generator().manual_seed(1))
    freq = torch.bincount(draws, minlength=4).float() / draws.numel()
    torch.testing.assert_close(freq, torch.softmax(logits[0], -1), atol=0.015, rtol=0)
    topk = sample(row, SamplingParams(temperature=1.0, top_k=2), torch.Generator().manual_seed(2))
    assert set(topk.tolist()) == {2, 3}
    # top-p 0.9 over probs [0.03, 0.09, 0.64, 0.24]: keeps 2 and 3 (0.88 < 0.9) and 1.
    topp = sample(row, SamplingParams(temperature=1.0, top_p=0.9), torch.Generator().manual_seed(3))
    assert set(topp.tolist()) == {1, 2, 3}
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_sample_on_device_draws_what_sample_draws(device):
    """The graph-safe sampler: the same filters as ``sample`` and draws from the same
    distribution (Gumbel-max), with no host sync."""
    logits = torch.tensor([[0.0, 1.0, 3.0, 2.0], [5.0, 0.0, 0.0, 0.0]], device=device)
    on_device = lambda rows, **p: sample_on_device(rows, sampling_tensor(SamplingParams(**p), rows.device))  # noqa: E731
    assert on_device(logits).tolist() == [2, 0]
    assert on_device(logits, temperature=1.0, top_k=1).tolist() == [2, 0]
    assert on_device(logits, temperature=1.0, top_p=0.01).tolist() == [2, 0]
    torch.manual_seed(1)
    torch.cuda.manual_seed_all(1)
    row = logits[:1].expand(40000, -1).contiguous()
    freq = torch.bincount(on_device(row, temperature=1.0), minlength=4).float().cpu() / row.shape[0]
    torch.testing.assert_close(freq, torch.softmax(logits[0].cpu(), -1), atol=0.01, rtol=0)
    hot = torch.bincount(on_device(row, temperature=2.0), minlength=4).float().cpu() / row.shape[0]
    torch.testing.assert_close(hot, torch.softmax(logits[0].cpu() / 2, -1), atol=0.01, rtol=0)
    assert set(on_device(row, temperature=1.0, top_k=2).tolist()) == {2, 3}
    assert set(on_device(row, temperature=1.0, top_p=0.9).tolist()) == {1, 2, 3}


def test_decode_tokens_samples_as_asked(artifact_tp1):
    """Runtime.decode_tokens with a temperature (on a GPU: drawn inside the sampling CUDA
    graph): top-k 1 is greedy whatever the draws, a seed repeats its tokens, another seed
    at a high temperature does not."""
    rt = runtime.load(artifact_tp1, rank=0, world_size=1, options=OPTIONS)

    def run(sampling: SamplingParams) -> list[list[int]]:
        ids, logits = rt.prefill(PROMPTS)
        out = rt.decode_tokens(ids, logits.argmax(-1).tolist(), 12, sampling)
        for s in ids:
            rt.release(s)
        return out

    greedy = run(SamplingParams())
    assert run(SamplingParams(temperature=1.5, top_k=1, seed=3)) == greedy
    hot = SamplingParams(temperature=3.0, seed=5)
    first = run(hot)
    assert run(hot) == first and first != greedy
    assert run(SamplingParams(temperature=3.0, seed=6)) != first


def test_seeded_generation_is_reproducible(artifact_tp1):
    rt = runtime.load(artifact_tp1, rank=0, world_size=1, options=OPTIONS)
    params = SamplingParams(temperature=0.8, top_k=50, top_p=0.95, seed=7)
    a = rt.generate(PROMPTS, 8, params)
    assert a == rt.generate(PROMPTS, 8, params)
    assert a != rt.generate(PROMPTS, 8, SamplingParams(temperature=0.8, top_k=50, top_p=0.95, seed=8))


def test_decode_tokens_greedy_equals_greedy_steps_one_by_one(artifact_tp1):
    """Runtime.decode_tokens (under CUDA graphs on a GPU: tokens fed on the device, read back
    once; incremental block table rows) against decode steps one by one without graphs:
    three sequences of different lengths (a padded bucket of 4), 20 steps across 16-token
    block boundaries."""
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2]]
    fast = runtime.load(artifact_tp1, rank=0, world_size=1, options=OPTIONS)
    plain = runtime.load(artifact_tp1, rank=0, world_size=1, options=replace(OPTIONS, cuda_graphs=False))
    ids, logits = fast.prefill(prompts)
    first = logits.argmax(-1).tolist()
    got = fast.decode_tokens(ids, first, 20)
    ids2, _ = plain.prefill(prompts)
    want, tokens = [[] for _ in prompts], first
    for _ in range(20):
        tokens = plain.decode(ids2, tokens).argmax(-1).tolist()
        for w, t in zip(want, tokens):
            w.append(t)
    assert got == want
    assert [fast.table.sequences[s].length for s in ids] == [len(p) + 20 for p in prompts]
    # the caches hold the same history: one more step of each agrees
    last = [g[-1] for g in got]
    torch.testing.assert_close(fast.decode(ids, last), plain.decode(ids2, last), rtol=1e-4, atol=1e-4)
    with pytest.raises(RequestError, match="beyond capacity"):
        fast.decode_tokens(ids, last, OPTIONS.max_context)
    with pytest.raises(RequestError, match="steps"):
        fast.decode_tokens(ids, last, -1)

