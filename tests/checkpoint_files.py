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


def flip_unsampled_byte(shard: Path) -> int:
    """Flip one data byte of ``shard`` that the cheap identity does not sample (between two
    of its fixed sample blocks); returns its offset. The shard must be large enough to have
    such gaps (more than SAMPLES x SAMPLE_BYTES of data)."""
    import struct

    from k3compile.checkpoint.identity import SAMPLE_BYTES, SAMPLES

    data = bytearray(shard.read_bytes())
    start = 8 + struct.unpack("<Q", data[:8])[0]
    step = (len(data) - start - SAMPLE_BYTES) // (SAMPLES - 1)
    assert step > SAMPLE_BYTES + 1, f"{shard.name}: too small to have unsampled bytes"
    offset = start + SAMPLE_BYTES + (step - SAMPLE_BYTES) // 2  # between the first two sample blocks
    data[offset] ^= 0x40
    shard.write_bytes(bytes(data))
    return offset
