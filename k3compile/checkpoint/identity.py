"""A checkpoint's identity, cheap enough to check at every load of a 1.5 TB checkpoint.

Per safetensors shard the index names: its size, the sha256 of its header (the 8-byte
length and the JSON that lists every tensor's name, dtype, shape and offsets), and the
sha256 of ``SAMPLES`` blocks of ``SAMPLE_BYTES`` read at fixed, evenly spaced offsets of
its data (256 KiB per shard). The header alone does not change when the weights are
regenerated with the same layout; the sampled content does (for all but a change confined
to the bytes between samples, which a full hash would catch and this does not).

On request (``optimize --hash-weights``) the artifact also records each shard's full
sha256, which ``run --verify-weights`` checks: every byte, read once (hashing threads
across shards, at the disk's speed rather than one core's).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from k3compile.checkpoint.loader import INDEX_FILE

SAMPLES = 64
SAMPLE_BYTES = 4096
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit
READ_BYTES = 16 << 20  # per read when hashing a whole shard


class CheckpointChanged(ValueError):
    """A checkpoint is missing a shard or a shard differs from what was recorded; the message names it."""


@dataclass(frozen=True)
class ShardIdentity:
    size: int
    header_sha256: str
    sample_sha256: str
    sha256: str | None = None  # of the whole file; recorded only on request

    def to_dict(self) -> dict[str, object]:
        return {k: v for k, v in asdict(self).items() if v is not None}


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


def file_sha256(path: Path) -> str:
    """The sha256 of a whole file, read in READ_BYTES pieces."""
    digest = hashlib.sha256()
    try:
        with path.open("rb") as f:
            while piece := f.read(READ_BYTES):
                digest.update(piece)
    except OSError as e:
        raise CheckpointChanged(f"{path}: cannot read it ({e})") from e
    return digest.hexdigest()


def _hash_files(paths: list[Path]) -> list[str]:
    """:func:`file_sha256` of each path, several at once (hashlib releases the GIL)."""
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1, max(len(paths), 1))) as pool:
        return list(pool.map(file_sha256, paths))


def checkpoint_identity(model_dir: Path, full_hashes: bool = False) -> dict[str, ShardIdentity]:
    """Every shard's identity, by file name; with ``full_hashes`` also each whole file's sha256."""
    names = shard_names(model_dir)
    identities = {name: shard_identity(model_dir / name) for name in names}
    if full_hashes:
        digests = _hash_files([model_dir / name for name in names])
        identities = {name: replace(identities[name], sha256=d) for name, d in zip(names, digests)}
    return identities


def check_full_hashes(model_dir: Path, recorded: dict[str, ShardIdentity], names: list[str] | None = None) -> None:
    """Hash every byte of the shards ``names`` (default: all) and raise :class:`CheckpointChanged`
    naming the first that differs from its recorded sha256. The caller has checked that the
    artifact records them (:func:`has_full_hashes`) and the cheap identity."""
    names = sorted(recorded) if names is None else names
    for name, digest in zip(names, _hash_files([model_dir / name for name in names])):
        if digest != recorded[name].sha256:
            raise CheckpointChanged(f"{model_dir / name}: its content changed since compilation "
                                    f"(sha256 {digest}, recorded {recorded[name].sha256})")


def has_full_hashes(recorded: dict[str, ShardIdentity]) -> bool:
    return bool(recorded) and all(identity.sha256 is not None for identity in recorded.values())


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
