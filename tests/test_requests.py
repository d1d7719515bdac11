"""Requests and sampling options are checked at the API boundary, before any work: each
bad value is refused with an error naming the field and what it accepts, and the runtime
is left as it was (no sequence started, no cache block taken). Issue #22."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from k3compile import runtime
from k3compile.runtime import RuntimeOptions, SamplingParams
from k3compile.sequences import RequestError


@pytest.fixture(scope="module")
def rt(compile_once):
    out = compile_once("tiny", dtype="float32", validate=False).out_dir
    return runtime.load(out, options=RuntimeOptions(max_sequences=2, max_context=32, device="cpu"))


def _untouched(rt) -> tuple[int, int, int]:
    return len(rt.table.sequences), len(rt.table.free_slots), len(rt.table.free_blocks)


@pytest.mark.parametrize("prompts, max_new, message", [
    ([[1, 2.5]], 2, r"request 0: token 2\.5 is not an integer token id"),
    ([[1, True]], 2, r"request 0: token True is not an integer token id"),
    (["1 2 3"], 2, r"request 0: a list of token ids needed, got '1 2 3'"),
    ([[]], 2, r"request 0: empty prompt"),
    ([[1, 2]], -1, r"max_new_tokens: a whole number >= 0 needed, got -1"),
    ([[1, 2]], 2.0, r"max_new_tokens: a whole number >= 0 needed, got 2\.0"),
    ([[1, 2]], "4", r"max_new_tokens: a whole number >= 0 needed, got '4'"),
    ([[1, 2], [3] * 20], 16, r"request 1: 20 prompt tokens and 16 new ones need 35 positions, max_context is 32"),
    ([[1], [2], [3]], 2, r"3 new sequences but only 2 free slots"),
])
def test_a_bad_generation_is_refused_before_any_work(rt, prompts, max_new, message):
    before = _untouched(rt)
    with pytest.raises(RequestError, match=message):
        rt.generate(prompts, max_new)
    assert _untouched(rt) == before


def test_a_generation_that_fits_exactly_runs(rt):
    """The last new token takes no cache position: 20 + 13 - 1 = 32 fits max_context 32."""
    tokens = rt.generate([[3] * 20], 13)
    assert len(tokens[0]) == 13


@pytest.mark.parametrize("options, message", [
    (dict(temperature=math.nan), r"temperature must be 0 \(greedy\) or a finite number >= 1e-08, got nan"),
    (dict(temperature=1e-30), r"temperature must be 0 \(greedy\) or a finite number >= 1e-08, got 1e-30"),
    (dict(temperature=math.inf), r"got inf"),
    (dict(temperature=-1.0), r"got -1\.0"),
    (dict(temperature=True), r"got True"),
    (dict(top_k=2.5), r"top_k must be a whole number >= 0, got 2\.5"),
    (dict(top_k=-1), r"top_k must be a whole number >= 0, got -1"),
    (dict(top_p=math.nan), r"top_p must be in \(0, 1\], got nan"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\], got 0\.0"),
    (dict(seed=2**64), r"seed must be a whole number in \[0, 2\*\*64\), got 18446744073709551616"),
    (dict(seed=-1), r"seed must be a whole number in \[0, 2\*\*64\), got -1"),
    (dict(seed=1.5), r"got 1\.5"),
])
def test_bad_sampling_options_are_refused_when_made(options, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**options)


def test_the_largest_seed_and_smallest_temperature_are_accepted(rt):
    params = SamplingParams(temperature=1e-8, top_k=3, seed=2**64 - 1)
    assert len(rt.generate([[5, 6]], 3, params)[0]) == 3


def test_releasing_an_unknown_sequence_is_a_request_error(rt):
    with pytest.raises(RequestError, match=r"unknown sequence 12345 \(never started, or released already\)"):
        rt.release(12345)
    (seq,), _ = rt.prefill([[1, 2]])
    rt.release(seq)
    with pytest.raises(RequestError, match=rf"unknown sequence {seq} "):
        rt.release(seq)


def test_caches_beyond_the_device_memory_are_refused_before_allocating(compile_once):
    """10^9 tokens per sequence: the caches would be hundreds of GiB; refused with the sizes."""
    out = compile_once("tiny", dtype="float32", validate=False).out_dir
    with pytest.raises(RequestError, match=r"max_sequences=2 and max_context=1000000000 need [\d.]+ GiB of caches "
                                           r"and 0\.0 GiB of weights; cpu has [\d.]+ GiB free"):
        runtime.load(out, options=RuntimeOptions(max_sequences=2, max_context=10**9, device="cpu"))


@pytest.mark.parametrize("field, value", [("max_context", 0), ("max_sequences", 2.5), ("max_context", "4096")])
def test_runtime_capacity_options_are_whole_numbers(field, value):
    with pytest.raises(ValueError, match=rf"RuntimeOptions\.{field}: a whole number >= 1 needed, got {value!r}"):
        RuntimeOptions(**{field: value})


def test_check_finite_names_a_nan_weight_and_stops_at_nan_logits(model_dirs, tmp_path):
    """A debug check (off by default): a weight holding NaN is named at load; a step whose
    logits are not finite (here a KDA state poisoned after the prefill) stops the run."""
    import shutil

    from safetensors.torch import load_file, save_file

    from k3compile.checkpoint.loader import CheckpointError
    from k3compile.compiler import CompileOptions, optimize
    from k3compile.runtime.engine import NonFiniteLogits

    model_dir = Path(shutil.copytree(model_dirs("tiny"), tmp_path / "m"))
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]
    name = "language_model.model.layers.2.post_attention_layernorm.weight"
    tensors = load_file(model_dir / index[name])
    tensors[name][5] = float("nan")
    save_file(tensors, model_dir / index[name], metadata={"format": "pt"})
    out = optimize(model_dir, tmp_path / "a", CompileOptions(dtype="float32")).out_dir
    checked = RuntimeOptions(max_sequences=1, max_context=16, device="cpu", check_finite=True)
    with pytest.raises(CheckpointError, match=r"parameter k3\.model\.layers\.2\.post_attention_layernorm\.weight "
                                              r"\(checkpoint model\.layers\.2\.post_attention_layernorm\.weight\): "
                                              r"holds NaN or Inf"):
        runtime.load(out, options=checked)

    clean = optimize(model_dirs("tiny"), tmp_path / "b", CompileOptions(dtype="float32")).out_dir
    rt = runtime.load(clean, options=checked)
    (seq,), logits = rt.prefill([[1, 2, 3]])
    state = next(t for t in rt.cache_tensors if t.dim() == 4)  # a KDA recurrent state [slots, H, D, D]
    state.fill_(float("nan"))
    with pytest.raises(NonFiniteLogits, match=rf"sequences \[{seq}\]: this step's logits hold NaN or Inf"):
        rt.decode([seq], [int(logits.argmax())])


def test_verify_weights_needs_recorded_full_hashes(compile_once):
    """An artifact compiled without hash_weights has nothing to verify every byte against:
    refused before loading; one compiled with it loads after the check."""
    from k3compile.checkpoint.loader import CheckpointError

    plain = compile_once("tiny", dtype="float32", validate=False).out_dir
    options = RuntimeOptions(max_sequences=1, max_context=16, device="cpu", verify_weights=True)
    with pytest.raises(CheckpointError, match=r"records no full checkpoint hashes to verify the weights against; "
                                              r"compile it with hash_weights \(optimize --hash-weights\)"):
        runtime.load(plain, options=options)
    hashed = compile_once("tiny", dtype="float32", validate=False, hash_weights=True).out_dir
    rt = runtime.load(hashed, options=options)
    assert len(rt.generate([[1, 2, 3]], 2)[0]) == 2


def test_a_config_edited_to_a_huge_vocabulary_is_refused_before_allocating(model_dirs, tmp_path):
    """config.json edited to a vocabulary of 10^12 (the embedding alone 256 TB): the
    reference model (``k3compile generate``) checks every header against the config on the
    meta device first and names the tensor, instead of trying the allocation."""
    import shutil

    from k3compile.checkpoint.loader import CheckpointError
    from k3compile.reference import load_reference

    model_dir = Path(shutil.copytree(model_dirs("tiny"), tmp_path / "m"))
    config = json.loads((model_dir / "config.json").read_text())
    text_config = config.get("text_config", config)
    text_config["vocab_size"] = 10**12
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"tensor 'language_model\.model\.embed_tokens\.weight' in .*: "
                                              r"shape \[512, 64\], expected \[1000000000000, 64\]"):
        load_reference(model_dir)
