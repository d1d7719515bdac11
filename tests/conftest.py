"""Shared fixtures: generated tiny K3 checkpoints (real safetensors files), one per preset."""

from __future__ import annotations

import os
from pathlib import Path

import torch

# Without a GPU, Triton kernels run in Triton's interpreter. The mode is fixed when Triton
# is first imported, so it is set here, before any test module imports it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from k3compile.checkpoint.generate import GenerateOptions, generate_model_dir
from k3compile.config import PRESETS


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory):
    """model_dirs(preset, experts="bf16") -> Path of a generated checkpoint (cached per session)."""
    root = tmp_path_factory.mktemp("models")
    cache: dict[tuple[str, str], Path] = {}

    def get(preset: str, experts: str = "bf16") -> Path:
        key = (preset, experts)
        if key not in cache:
            cache[key] = generate_model_dir(
                PRESETS[preset], root / f"{preset}-{experts}", GenerateOptions(experts=experts, seed=1, shard_bytes=256_000)
            )
        return cache[key]

    return get
