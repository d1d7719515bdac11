"""Shared fixtures: generated tiny K3 checkpoints (real safetensors files), cached per session."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

# Without a GPU, Triton kernels run in Triton's interpreter. The mode is fixed when Triton
# is first imported, so it is set here, before any test module imports it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from checkpoint_files import SHARD_BYTES
from k3compile.checkpoint.generate import GenerateOptions, generate_model_dir
from k3compile.config import PRESETS


@pytest.hookimpl(tryfirst=True)  # before -m selects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests a module names in ``SWEEP_ONLY`` (their ids, parameters included) are marked
    ``sweep``: one case of a parametrised module fixture that CI's time cannot hold."""
    for item in items:
        if item.name in getattr(item.module, "SWEEP_ONLY", ()):
            item.add_marker(pytest.mark.sweep)


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory: pytest.TempPathFactory):
    """ckpt(preset, experts, seed, shard_bytes) -> a generated model dir (cached per session)."""
    root = tmp_path_factory.mktemp("ckpt")
    cache: dict[tuple, Path] = {}

    def get(preset: str = "tiny", experts: str = "bf16", seed: int = 7, shard_bytes: int = SHARD_BYTES) -> Path:
        key = (preset, experts, seed, shard_bytes)
        if key not in cache:
            out = root / f"{preset}-{experts}-{seed}-{shard_bytes}"
            opts = GenerateOptions(experts=experts, seed=seed, shard_bytes=shard_bytes)
            assert generate_model_dir(PRESETS[preset], out, opts) == out
            cache[key] = out
        return cache[key]

    return get


@pytest.fixture(scope="session")
def model_dirs(ckpt):
    """model_dirs(preset, experts="bf16") -> Path of a generated checkpoint (seed 1)."""
    return lambda preset, experts="bf16": ckpt(preset, experts, seed=1, shard_bytes=256_000)


@pytest.fixture(scope="session")
def rank_pools():
    """Gloo rank pools by world size, shared by every multi-rank test and validated compile
    of the session (starting ranks costs seconds each time; k3compile.distributed.RankPools)."""
    from k3compile.distributed import RankPools

    with RankPools() as pools:
        yield pools


@pytest.fixture(scope="session")
def captures():
    """Captured models shared by every compile of the session (k3compile.capture.CaptureCache):
    the tests compile the same tiny configs many ways, and each export takes seconds."""
    from k3compile.capture import CaptureCache

    return CaptureCache()


@pytest.fixture(scope="session")
def optimize_shared(rank_pools, captures):
    """``k3compile.compiler.optimize`` with the session's rank pools and captures."""
    from k3compile.compiler import optimize

    return functools.partial(optimize, ranks=rank_pools, captures=captures)


@pytest.fixture(scope="session")
def compile_once(model_dirs, optimize_shared, tmp_path_factory):
    """compile_once(preset, experts="bf16", **options) -> the CompileResult of
    ``model_dirs(preset, experts)`` compiled with ``CompileOptions(**options)``, once per
    session. At TP1 it is translation-validated unless ``validate=False`` is asked (cheap
    there, and one artifact then serves tests that check the pass records and tests that
    only run it); at TP > 1 only when asked (validation runs on gloo ranks). Shared: a test
    must not change the result or the artifact directory (copy it first)."""
    from k3compile.compiler import CompileOptions

    root = tmp_path_factory.mktemp("compiled")
    cache: dict[str, object] = {}

    def get(preset: str, experts: str = "bf16", **options):
        options.setdefault("validate", options.get("tp", 1) == 1)
        key = repr((preset, experts, CompileOptions(**options)))
        if key not in cache:
            out = root / f"{preset}-{experts}-{len(cache)}"
            cache[key] = optimize_shared(model_dirs(preset, experts), out, CompileOptions(**options))
        return cache[key]

    return get


@pytest.fixture
def faster_interpreter():
    """The test under tests/fast_interpreter.py with its integer overflow checks kept (the
    same numerics as the plain interpreter for kernels without a combine function of their
    own); kernel test modules ask for it with ``pytestmark``."""
    from fast_interpreter import fast_interpreter

    with fast_interpreter(overflow_checks=True):
        yield


@pytest.fixture
def interpreter_rounds_like_gpus():
    """Triton's interpreter rounding fp32 -> bf16 / fp8 to nearest even, as GPUs do
    (tests/interpreter_rounding.py); kernel test modules ask for it with ``pytestmark``."""
    from interpreter_rounding import rounds_like_gpus

    with rounds_like_gpus():
        yield


@pytest.fixture(scope="session")
def _aot_batch(request: pytest.FixtureRequest) -> dict[str, dict]:
    """Every AOT compile the session's selected tests need, in one ``aot.compile_many``
    (under the interpreter: one batch of subprocesses, one per core, paying their start-up
    once). Each test module that uses ``aot_reports`` lists its requests, keyed as it
    likes, in a module-level ``aot_requests()``."""
    from k3compile.runtime.kernels import aot

    modules = sorted({item.module for item in request.session.items if "aot_reports" in item.fixturenames},
                     key=lambda m: m.__name__)
    jobs = {(m.__name__, key): r for m in modules for key, r in m.aot_requests().items()}
    batch: dict[str, dict] = {m.__name__: {} for m in modules}
    for (module, key), result in zip(jobs, aot.compile_many(list(jobs.values())), strict=True):
        batch[module][key] = result
    return batch


@pytest.fixture
def aot_reports(request: pytest.FixtureRequest, _aot_batch: dict[str, dict]) -> dict:
    """This module's ``aot_requests()`` compiled (from the session's one batch), same keys:
    resources for a CompileRequest, the compiled text for an AsmRequest."""
    return _aot_batch[request.module.__name__]


@pytest.fixture(autouse=True)
def _cpu_kernels_stay_the_references():
    """Registering the Triton kernels for "cpu" is process-wide and for good: a test that
    did it in this process would hand every later test's CPU ops to the interpreter. Only
    spawned ranks may (tests/test_triton_cpu.py)."""
    yield
    from k3compile.runtime.kernels import registered

    assert not registered("cpu"), "this test registered the Triton kernels for cpu in the pytest process"


@pytest.fixture
def outside_torchrun(monkeypatch):
    """No torchrun environment (WORLD_SIZE, RANK, LOCAL_RANK): the CLI's run and bench read it."""
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)

