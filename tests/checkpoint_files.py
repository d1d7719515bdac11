"""Reading generated checkpoints whole, for the checkpoint and generator tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from k3compile.checkpoint.loader import INDEX_FILE

P = "language_model."
SHARD_BYTES = 150_000  # the tiny model is ~2.3 MB: over a dozen shards


def weight_map(d: Path) -> dict[str, str]:
    return json.loads((d / INDEX_FILE).read_text())["weight_map"]


def headers(d: Path) -> dict[str, tuple[list[int], str, str]]:
    """Every tensor in every shard file: name -> (shape, dtype, file name)."""
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                s = h.get_slice(k)
                assert k not in out, f"{k} in two shards"
                out[k] = (list(s.get_shape()), s.get_dtype(), f.name)
    return out


def stored(d: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, read whole."""
    out: dict[str, torch.Tensor] = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out
