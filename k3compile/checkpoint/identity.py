"""A checkpoint's identity, cheap enough to check at every load of a 1.5 TB checkpoint.

Per safetensors shard the index names: its size, the sha256 of its header (the 8-byte
length and the JSON that lists every tensor's name, dtype, shape and offsets), and the
sha256 of ``SAMPLES`` blocks of ``SAMPLE_BYTES`` read at fixed, evenly spaced offsets of
its data (256 KiB per shard). The header alone does not change when the weights are
regenerated with the same layout; the sampled content does (for all but a change confined
to the bytes between samples, which a full hash would catch and this does not).
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import asdict, dataclass
from pathlib import Path

from k3compile.checkpoint.loader import INDEX_FILE

SAMPLES = 64
SAMPLE_BYTES = 4096
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit


class CheckpointChanged(ValueError):
    """A checkpoint is missing a shard or a shard differs from what was recorded; the message names it."""


@dataclass(frozen=True)
class ShardIdentity:
    size: int
    header_sha256: str
    sample_sha256: str

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def shard_names(model_dir: Path) -> list[str]:
    """The shard files the checkpoint's index maps tensors to, sorted."""
    index = model_dir / INDEX_FILE
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        names = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointChanged(f"{index}: cannot read the shard list ({e})") from e
    for name in names:
        if not isinstance(name, str) or "/" in name or "\\" in name or name in ("", ".", ".."):
            raise CheckpointChanged(f"{index}: shard name {name!r} is not a file in the checkpoint's folder")
    return names


def shard_identity(path: Path) -> ShardIdentity:
    """The identity of one safetensors file (the module docstring)."""
    try:
        with path.open("rb") as f:
            size = path.stat().st_size
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointChanged(f"{path}: shorter than a safetensors header")
            (header_len,) = struct.unpack("<Q", head)
            if header_len > min(MAX_HEADER_BYTES, size - 8):
                raise CheckpointChanged(f"{path}: header length {header_len} does not fit a {size}-byte file")
            header = hashlib.sha256(head + f.read(header_len)).hexdigest()
            start, length = 8 + header_len, size - 8 - header_len
            sample = hashlib.sha256()
            for i in range(SAMPLES):
                offset = start + (max(length - SAMPLE_BYTES, 0) * i) // (SAMPLES - 1)
                f.seek(offset)
                sample.update(f.read(SAMPLE_BYTES))
    except OSError as e:
        raise CheckpointChanged(f"{path}: cannot read it ({e})") from e
    return ShardIdentity(size, header, sample.hexdigest())


def checkpoint_identity(model_dir: Path) -> dict[str, ShardIdentity]:
    """Every shard's identity, by file name."""
    return {name: shard_identity(model_dir / name) for name in shard_names(model_dir)}


def check_identity(model_dir: Path, recorded: dict[str, ShardIdentity]) -> None:
    """Raise :class:`CheckpointChanged` naming the first shard that is missing, extra or differs."""
    names = shard_names(model_dir)
    if sorted(recorded) != names:
        missing, extra = sorted(set(recorded) - set(names)), sorted(set(names) - set(recorded))
        what = f"no longer lists {missing[0]}" if missing else f"now lists {extra[0]}, which the artifact does not know"
        raise CheckpointChanged(f"{model_dir / INDEX_FILE}: the checkpoint {what}")
    for name in names:
        path, want = model_dir / name, recorded[name]
        if not path.is_file():
            raise CheckpointChanged(f"{path}: missing")
        got = shard_identity(path)
        if got.size != want.size:
            raise CheckpointChanged(f"{path}: {got.size} bytes, {want.size} when the artifact was compiled")
        if got.header_sha256 != want.header_sha256:
            raise CheckpointChanged(f"{path}: its tensor list (safetensors header) changed since compilation")
        if got.sample_sha256 != want.sample_sha256:
            raise CheckpointChanged(f"{path}: its weights changed since compilation (sampled content differs)")
