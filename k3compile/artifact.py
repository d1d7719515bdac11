"""The compiled artifact: a directory the runtime loads on every rank.

This module is the reader: a leaf that both the runtime and the compiler read (it imports
config, sharding, checkpoint index names and torch, nothing of the compiler). The JSON
files are parsed and checked by :mod:`k3compile.artifact_manifest`;
:mod:`k3compile.artifact_writer` writes artifacts from a captured model.

Layout of ``OUT/``::

    manifest.json            what this is and how it was made (below), and the sha256 and
                             size of every other file
    manifest.sha256          the sha256 of manifest.json (an edited manifest is rejected)
    decode.pt2               one torch.export program per phase (``torch.export.save``);
    prefill.pt2              parameters were captured on ``meta``: no weights inside
    sharding/rank0.json      per rank: for every parameter, the checkpoint tensor(s), their
    sharding/rank1.json      dtype and full shape, the split dim and the [start, stop)
    ...                      range this rank reads, whether they may be mxfp4; and the
                             per-rank constants (e.g. the rank's first vocab id)
    code/decode.py           a readable dump of each program (for humans: never executed)
    code/prefill.py

The JSON files' fields: :mod:`k3compile.artifact_manifest`.

Weights stay in the original checkpoint; each rank reads only its slices at load time.

Safety. There is no pickle anywhere: before saving, each program's example inputs are
dropped (``torch.export.save`` would otherwise write them with ``torch.save`` into
``data/sample_inputs/model.pt``), and every written archive is scanned. Loading never
executes code from the artifact: the manifest and rank files are JSON, the ``code/``
dumps are only hashed, and each ``.pt2`` is scanned *before* ``torch.export.load`` sees
it against an allow-list of what k3compile writes (:mod:`k3compile.archive_check`:
member names, payloads, shape expressions, guards, node targets), so
``torch.export.load`` only parses JSON and raw tensor bytes and resolves operators. Nothing compiled is stored either: an artifact lowered with Inductor
(``"lowering": "inductor"``) is compiled by the runtime when it loads.

Writes (:mod:`k3compile.artifact_writer`) are atomic: everything is written and fsynced
in a hidden temporary sibling of ``OUT`` (``.OUT.tmp-*``) and renamed onto ``OUT``;
replacing an existing artifact renames the old one away first and deletes it last, so a
failure leaves the old ``OUT`` or none, never a partial one. Loading checks format and
version, every file's size and sha256, missing and unexpected files, the world size, and
the source checkpoint's index hash and each shard's identity (size, header and sampled
content: :mod:`k3compile.checkpoint.identity`), and raises :class:`ArtifactError` naming the file
and field that is wrong. Loading the programs also refuses an artifact whose manifest
names another torch release than the running one (``2.13.0+cpu`` and ``2.13.0+cu128``
are one release), naming both, unless the caller passes ``check_torch="warn"`` (or
``False``) or :data:`ALLOW_OTHER_TORCH` is set to 1; it then warns and loads.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch.export import ExportedProgram

from k3compile.archive_check import check_archive
from k3compile.artifact_manifest import (
    MANIFEST,
    MANIFEST_SEAL,
    MANIFEST_SIGNATURE,
    SIGN_KEY_ENV,
    ArtifactError,
    ArtifactInfo,
    parse_constants,
    parse_manifest,
    parse_rank_file,
)
from k3compile.checkpoint.identity import CheckpointChanged, check_identity
from k3compile.checkpoint.loader import INDEX_FILE
from k3compile.config import K3Config
from k3compile.sharding import ParallelPlan, ShardOffset, ShardSpec

#: Set to 1 to load an artifact written by another torch release with a warning instead
#: of an error (the runtime and the CLI load with the default check).
ALLOW_OTHER_TORCH = "K3COMPILE_ALLOW_OTHER_TORCH"


class ArtifactWarning(UserWarning):
    """Something about an artifact is off but loading goes on (``check_checkpoint="warn"``)."""


@dataclass
class LoadedArtifact:
    path: Path
    info: ArtifactInfo
    programs: dict[str, ExportedProgram]
    specs: dict[str, ShardSpec]  # by the programs' parameter names
    constants: dict[str, ShardOffset] = field(default_factory=dict)  # per-rank buffers by name

    @property
    def config(self) -> K3Config:
        return self.info.config

    def plan(self, rank: int) -> ParallelPlan:
        """The artifact's parallel plan seen from ``rank``."""
        return ParallelPlan(self.info.tp, rank, self.info.dcp, self.info.dcp_interleave)

    def ranges(self, rank: int) -> dict[str, tuple[int, int] | None]:
        """[start, stop) along each parameter's split dim that ``rank`` reads."""
        plan = self.plan(rank)
        return {name: spec.split_range(plan) for name, spec in self.specs.items()}


# ---------------------------------------------------------------------------
# Small file helpers
# ---------------------------------------------------------------------------


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def checkpoint_index_hash(model_dir: Path) -> str:
    """The sha256 of a checkpoint's index: the identity an artifact records and checks."""
    index = model_dir / INDEX_FILE
    if not index.is_file():
        raise ArtifactError(f"{index}: missing checkpoint index (the artifact's weights are read from {model_dir})")
    return sha256_file(index)


def list_files(root: Path) -> dict[str, Path]:
    """Every regular file under ``root`` by its posix path relative to ``root``; refuses
    symlinks and other special files (they could point outside the artifact)."""
    out: dict[str, Path] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*dirnames, *filenames]:
            p = Path(dirpath) / name
            rel = p.relative_to(root).as_posix()
            if p.is_symlink():
                raise ArtifactError(f"{root}: '{rel}' is a symbolic link; an artifact holds only regular files")
        for name in filenames:
            p = Path(dirpath) / name
            rel = p.relative_to(root).as_posix()
            if not p.is_file():
                raise ArtifactError(f"{root}: '{rel}' is not a regular file")
            out[rel] = p
    return out


# ---------------------------------------------------------------------------
# Load
# ---------------------------------------------------------------------------


def _verify_files(root: Path, info: ArtifactInfo, files: dict[str, dict[str, Any]]) -> None:
    expected = {f"{p}.pt2" for p in info.phases} | {f"code/{p}.py" for p in info.phases}
    expected |= {f"sharding/rank{r}.json" for r in range(info.tp)}
    unlisted, unknown = sorted(expected - set(files)), sorted(set(files) - expected)
    if unlisted:
        raise ArtifactError(f"{MANIFEST}: field 'files' does not list '{unlisted[0]}', which phases/tp require")
    if unknown:
        raise ArtifactError(
            f"{MANIFEST}: field 'files' lists '{unknown[0]}', which is not part of this artifact's layout"
        )
    present = list_files(root)
    present.pop(MANIFEST, None)
    present.pop(MANIFEST_SEAL, None)
    present.pop(MANIFEST_SIGNATURE, None)
    missing, extra = sorted(set(files) - set(present)), sorted(set(present) - set(files))
    if missing:
        raise ArtifactError(f"{root / missing[0]}: missing (listed in {MANIFEST})")
    if extra:
        raise ArtifactError(f"{root / extra[0]}: unexpected file (not listed in {MANIFEST})")
    for name, entry in sorted(files.items()):
        path = present[name]
        size = path.stat().st_size
        if size != entry["size"]:
            raise ArtifactError(
                f"{path}: size {size} differs from {entry['size']} in {MANIFEST} (modified or truncated)"
            )
        digest = sha256_file(path)
        if digest != entry["sha256"]:
            raise ArtifactError(f"{path}: sha256 {digest} differs from {MANIFEST} (the file was modified)")


def _refuse_or_warn(problem: str | None, mode: bool | Literal["warn"]) -> None:
    """Raise :class:`ArtifactError` for ``problem``, or with ``mode="warn"`` warn (at the
    caller of ``read_artifact_info`` / ``load_artifact``)."""
    if problem is None:
        return
    if mode == "warn":
        warnings.warn(problem, ArtifactWarning, stacklevel=4)
    else:
        raise ArtifactError(problem)


def _check_checkpoint(info: ArtifactInfo, mode: bool | Literal["warn"]) -> None:
    if mode is False:
        return
    try:
        digest = checkpoint_index_hash(Path(info.model_dir))
        problem = None
        if digest != info.checkpoint_index_sha256:
            problem = (
                f"{Path(info.model_dir) / INDEX_FILE}: the source checkpoint changed since compilation "
                f"(index sha256 {digest}, the artifact was compiled against {info.checkpoint_index_sha256})"
            )
        else:
            check_identity(Path(info.model_dir), info.checkpoint_shards)
    except (ArtifactError, CheckpointChanged) as e:
        problem = str(e)
    _refuse_or_warn(problem, mode)


def torch_release(version: str) -> str:
    """A torch version without its local build label: ``2.13.0+cu128`` -> ``2.13.0`` (the
    CPU, CUDA and ROCm builds of one release read the same archives)."""
    return version.split("+", 1)[0]


def _check_torch(info: ArtifactInfo, mode: bool | Literal["warn"]) -> None:
    """Programs exported by another torch release are not guaranteed to load, or to run the
    same: refuse them unless told otherwise (``mode``, or :data:`ALLOW_OTHER_TORCH`)."""
    if mode is True and os.environ.get(ALLOW_OTHER_TORCH) == "1":
        mode = "warn"
    if mode is False or torch_release(info.torch_version) == torch_release(torch.__version__):
        return
    _refuse_or_warn(
        f"{MANIFEST}: field 'torch_version' is {info.torch_version}, this is torch {torch.__version__}; "
        f"programs exported by another torch release may not load or run the same. Recompile with this "
        f"torch, or load anyway with check_torch='warn' ({ALLOW_OTHER_TORCH}=1 for the runtime and the CLI)",
        mode,
    )


def manifest_signature(key: str, manifest_bytes: bytes) -> str:
    """HMAC-SHA256 of the manifest's bytes under ``key`` (hex)."""
    return hmac.new(key.encode(), manifest_bytes, hashlib.sha256).hexdigest()


def _check_signature(root: Path, manifest_bytes: bytes) -> None:
    """With a key in ``K3COMPILE_SIGN_KEY``, the manifest must carry a signature made with
    it (an artifact edited after signing, or signed with another key, is refused); without
    a key nothing is checked: the seal alone catches damage, not an attacker."""
    key = os.environ.get(SIGN_KEY_ENV)
    if not key:
        return
    path = root / MANIFEST_SIGNATURE
    if not path.is_file():
        raise ArtifactError(f"{path}: missing: the artifact is not signed, and {SIGN_KEY_ENV} asks for a signature")
    if not hmac.compare_digest(path.read_text().strip(), manifest_signature(key, manifest_bytes)):
        raise ArtifactError(f"{path}: does not match the key in {SIGN_KEY_ENV} (signed with another key, "
                            "or the artifact was changed after signing)")


def read_artifact_info(
    out_dir: str | Path,
    world_size: int | None = None,
    check_checkpoint: bool | Literal["warn"] = True,
) -> ArtifactInfo:
    """Verify an artifact (manifest, versions, every file's size and hash, world size,
    source checkpoint) without loading its programs."""
    root = Path(out_dir)
    if not root.is_dir():
        raise ArtifactError(f"{root}: no artifact directory")
    manifest = root / MANIFEST
    if not manifest.is_file():
        raise ArtifactError(f"{manifest}: missing manifest (not a k3compile artifact, or an incomplete one)")
    manifest_bytes = manifest.read_bytes()
    seal = root / MANIFEST_SEAL
    if not seal.is_file():
        raise ArtifactError(f"{seal}: missing (the manifest's checksum)")
    expected = seal.read_text().strip()
    if hashlib.sha256(manifest_bytes).hexdigest() != expected:
        raise ArtifactError(f"{manifest}: sha256 differs from {MANIFEST_SEAL} (the manifest was modified)")
    _check_signature(root, manifest_bytes)
    try:
        raw = json.loads(manifest_bytes)
    except (ValueError, UnicodeDecodeError) as e:
        raise ArtifactError(f"{manifest}: not valid JSON ({e})") from e
    info, files = parse_manifest(raw)
    _verify_files(root, info, files)
    if world_size is not None and world_size != info.tp:
        raise ArtifactError(
            f"{MANIFEST}: field 'parallel.tp' is {info.tp} but the world size is {world_size}; "
            f"run with {info.tp} ranks or compile for tp={world_size}"
        )
    _check_checkpoint(info, check_checkpoint)
    return info


def load_artifact(
    out_dir: str | Path,
    world_size: int | None = None,
    check_checkpoint: bool | Literal["warn"] = True,
    check_torch: bool | Literal["warn"] = True,
) -> LoadedArtifact:
    """Verify and load an artifact: its programs (without weights) and shard specs.

    ``check_checkpoint``: True raises if the source checkpoint's index or a shard changed or is
    gone, ``"warn"`` warns (:class:`ArtifactWarning`), False skips the check.
    ``check_torch``: the same for a manifest written by another torch release (the local
    build label, ``+cu128``, does not count); :data:`ALLOW_OTHER_TORCH` set to 1 turns
    True into ``"warn"``."""
    import k3compile.ops  # noqa: F401  (the programs call torch.ops.k3.*)

    root = Path(out_dir)
    info = read_artifact_info(root, world_size, check_checkpoint)
    _check_torch(info, check_torch)
    specs: dict[str, ShardSpec] | None = None
    constants: dict[str, ShardOffset] | None = None
    for rank in range(info.tp):
        label = f"sharding/rank{rank}.json"
        try:
            raw = json.loads((root / label).read_bytes())
        except (ValueError, UnicodeDecodeError) as e:
            raise ArtifactError(f"{label}: not valid JSON ({e})") from e
        rank_specs = parse_rank_file(raw, label, info.tp, rank)
        rank_constants = parse_constants(raw, label, ParallelPlan(info.tp, rank))
        if constants is None:
            constants = rank_constants
        elif rank_constants != constants:
            raise ArtifactError(f"{label}: disagrees with sharding/rank0.json about the per-rank constants")
        if specs is None:
            specs = rank_specs
        elif rank_specs != specs:
            diff = sorted(set(specs) ^ set(rank_specs)) or [n for n in specs if specs[n] != rank_specs[n]]
            raise ArtifactError(f"{label}: disagrees with sharding/rank0.json about {diff[:3]}")
    assert specs is not None
    for phase in info.phases:
        check_archive(root / f"{phase}.pt2", f"{phase}.pt2")
    programs: dict[str, ExportedProgram] = {}
    for phase in info.phases:
        try:
            programs[phase] = torch.export.load(root / f"{phase}.pt2")
        except Exception as e:
            raise ArtifactError(
                f"{phase}.pt2: torch.export.load failed ({type(e).__name__}: {e}); written by torch "
                f"{info.torch_version}, this is torch {torch.__version__}"
            ) from e
        missing = [n for n in programs[phase].graph_signature.parameters if n not in specs]
        missing += [n for n in programs[phase].graph_signature.buffers if n not in constants]
        if missing:
            raise ArtifactError(f"{phase}.pt2: inputs without an entry in sharding/rank*.json: {missing[:5]}")
    return LoadedArtifact(root, info, programs, specs, constants or {})
