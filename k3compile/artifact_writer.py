"""Write a captured (and optimized) model as an artifact: the compiler's side of the format.

The format, and everything that reads and verifies an artifact, is in
:mod:`k3compile.artifact`, which the runtime imports; this module depends on the capture
(:class:`~k3compile.capture.CapturedModel`) and so stays out of serving. It writes the
programs without pickle, scans each written archive, fills the manifest and the per-rank
sharding files, and installs the result atomically (temp dir + rename).
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import io
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch.export import ExportedProgram

import k3compile
from k3compile.archive_check import check_archive
from k3compile.artifact import checkpoint_index_hash, list_files, manifest_signature, sha256_file
from k3compile.checkpoint.identity import CheckpointChanged, checkpoint_identity
from k3compile.artifact_manifest import (
    DTYPES,
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST,
    MANIFEST_SEAL,
    MANIFEST_SIGNATURE,
    SHARDING_FORMAT,
    SIGN_KEY_ENV,
    ArtifactError,
)
from k3compile.capture import CapturedModel
from k3compile.sharding import ParallelPlan, ShardOffset, ShardSpec
from k3compile.targets import LOWERINGS, get_target

__all__ = ["save_artifact", "save_program", "write_manifest"]


# ---------------------------------------------------------------------------
# Files, written durably
# ---------------------------------------------------------------------------


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return  # not supported on this platform/filesystem
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _write_json(path: Path, obj: Any) -> None:
    _write_bytes(path, (json.dumps(obj, indent=1) + "\n").encode())


# ---------------------------------------------------------------------------
# Programs, manifest and sharding files
# ---------------------------------------------------------------------------


def save_program(program: ExportedProgram, f: Path | io.BytesIO) -> None:
    """``torch.export.save`` without the example inputs (the only pickle it writes for
    programs captured on meta: ``data/sample_inputs/model.pt``)."""
    saved = program._example_inputs
    program._example_inputs = None
    try:
        torch.export.save(program, f)
    finally:
        program._example_inputs = saved


def _save_program(program: ExportedProgram, path: Path) -> None:
    save_program(program, path)
    _fsync_file(path)


def _write_manifest_bytes(root: Path, data: bytes) -> None:
    """The manifest, its checksum, and with a key in ``K3COMPILE_SIGN_KEY`` its signature
    (without one, a signature left from before is removed: it no longer matches)."""
    _write_bytes(root / MANIFEST, data)
    _write_bytes(root / MANIFEST_SEAL, (hashlib.sha256(data).hexdigest() + "\n").encode())
    key = os.environ.get(SIGN_KEY_ENV)
    if key:
        _write_bytes(root / MANIFEST_SIGNATURE, (manifest_signature(key, data) + "\n").encode())
    else:
        (root / MANIFEST_SIGNATURE).unlink(missing_ok=True)


def write_manifest(root: str | Path, manifest: dict[str, Any]) -> None:
    """Rewrite an artifact's manifest and its checksum (for deliberate edits, e.g. after
    moving the source checkpoint; loading verifies the result like any manifest)."""
    _write_manifest_bytes(Path(root), (json.dumps(manifest, indent=1) + "\n").encode())


def _dtype_name(dtype: torch.dtype) -> str:
    for name, dt in DTYPES.items():
        if dt == dtype:
            return name
    raise ArtifactError(f"model dtype {dtype} is not one of {', '.join(DTYPES)}")


def _rank_file(
    specs: dict[str, ShardSpec], constants: dict[str, ShardOffset], tp: int, rank: int, prefix: str
) -> dict[str, Any]:
    plan = ParallelPlan(tp, rank)
    params = {}
    for name, spec in sorted(specs.items()):
        rng = spec.split_range(plan)
        params[name] = {
            "checkpoint_names": list(spec.names),
            "dtype": spec.dtype,
            "shape": list(spec.shape),
            "dim": spec.dim,
            "extent": spec.extent,
            "range": None if rng is None else list(rng),
            "local_shape": list(spec.local_shape(plan)),
            "quantized": spec.quantized,
        }
    consts = {
        name: {"kind": "shard_offset", "extent": off.extent, "period": off.period, "value": off.value(plan)}
        for name, off in sorted(constants.items())
    }
    return {
        "format": SHARDING_FORMAT, "rank": rank, "tp": tp, "checkpoint_prefix": prefix,
        "params": params, "constants": consts,
    }


# ---------------------------------------------------------------------------
# Save
# ---------------------------------------------------------------------------


def _check_params_have_specs(captured: CapturedModel) -> None:
    for phase, program in captured.programs.items():
        missing = [n for n in program.graph_signature.parameters if n not in captured.specs]
        if missing:
            raise ArtifactError(f"{phase} program: parameters without a shard spec: {missing[:5]}")


def _is_artifact(path: Path) -> bool:
    try:
        return json.loads((path / MANIFEST).read_bytes()).get("format") == FORMAT_NAME
    except (OSError, ValueError, AttributeError):
        return False


def check_output_dir(out_dir: str | Path, overwrite: bool = False) -> None:
    """Raise :class:`ArtifactError` unless an artifact may be written at ``out_dir``: it
    does not exist or, with ``overwrite``, it is a k3compile artifact or an empty
    directory (never a user's data). Callers check before minutes of compiling;
    :func:`save_artifact` checks again."""
    out = Path(out_dir).absolute()
    if out.exists() or out.is_symlink():
        if not overwrite:
            raise ArtifactError(f"{out} already exists (pass overwrite=True to replace it)")
        if not out.is_dir() or out.is_symlink() or not (_is_artifact(out) or not any(out.iterdir())):
            raise ArtifactError(f"refusing to overwrite {out}: it is not a k3compile artifact")
    ancestor = out.parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ArtifactError(f"cannot write {out}: {ancestor} is not a directory")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise ArtifactError(f"cannot write {out}: {ancestor} is not writable")


def _temporary(out: Path, kind: str) -> Path:
    """A fresh hidden sibling of ``out`` named after this process (``.OUT.<kind>-<pid>-*``).
    Half-written ``tmp`` siblings that processes no longer alive left (an interrupted save)
    are removed first; an ``old`` one holds a whole previous artifact and is left alone."""
    for stale in out.parent.glob(f".{glob.escape(out.name)}.tmp-*-*") if kind == "tmp" else []:
        pid = stale.name[len(out.name) + len(".tmp-") + 1:].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f".{out.name}.{kind}-{os.getpid()}-", dir=out.parent))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def save_artifact(
    out_dir: str | Path,
    captured: CapturedModel,
    model_dir: str | Path,
    target: str,
    pass_summaries: list[Any],
    overwrite: bool = False,
    lowering: str = "eager",
    hash_weights: bool = False,
) -> Path:
    """Write ``captured`` as an artifact at ``out_dir`` atomically; returns its path.

    ``model_dir`` is the checkpoint the runtime will read weights from (its index is
    hashed); ``pass_summaries`` is any JSON-serialisable list (one entry per pass run);
    ``lowering`` how the runtime is to run the programs (one of targets.LOWERINGS);
    ``hash_weights`` records each shard's full sha256 (reading the whole checkpoint) for
    loads that verify every byte.
    An existing ``out_dir`` is refused unless ``overwrite``, and even then only if it is
    a k3compile artifact or an empty directory."""
    out = Path(out_dir).absolute()
    model_dir = Path(model_dir).resolve()
    try:
        get_target(target)
    except ValueError as e:
        raise ArtifactError(str(e)) from e
    if lowering not in LOWERINGS:
        raise ArtifactError(f"lowering {lowering!r}: expected one of {', '.join(LOWERINGS)}")
    check_output_dir(out, overwrite)
    if not captured.programs:
        raise ArtifactError("nothing to save: the captured model has no programs")
    for phase in captured.programs:
        if not phase.isidentifier():
            raise ArtifactError(f"phase name {phase!r} is not an identifier (it names the artifact's files)")
    _check_params_have_specs(captured)
    index_sha = checkpoint_index_hash(model_dir)
    try:
        shards = checkpoint_identity(model_dir, full_hashes=hash_weights)
    except CheckpointChanged as e:
        raise ArtifactError(str(e)) from e
    tp = captured.plan.tp
    dtype = _dtype_name(captured.dtype)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temporary(out, "tmp")
    try:
        for phase, program in captured.programs.items():
            path = tmp / f"{phase}.pt2"
            _save_program(program, path)
            check_archive(path, f"{phase}.pt2")
            header = f"# k3compile artifact: the {phase} program, for reading only (never executed).\n\n"
            _write_bytes(tmp / "code" / f"{phase}.py", (header + str(program)).encode())
        for rank in range(tp):
            _write_json(
                tmp / "sharding" / f"rank{rank}.json",
                _rank_file(captured.specs, captured.constants, tp, rank, captured.config.checkpoint_prefix),
            )
        files = {
            rel: {"sha256": sha256_file(p), "size": p.stat().st_size} for rel, p in sorted(list_files(tmp).items())
        }
        manifest = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "k3compile_version": k3compile.__version__,
            "torch_version": torch.__version__,
            "config": captured.config.to_dict(),
            "model_dir": str(model_dir),
            "checkpoint_index_sha256": index_sha,
            "checkpoint_shards": {name: identity.to_dict() for name, identity in shards.items()},
            "dtype": dtype,
            "block_size": captured.block_size,
            "kv_cache_dtype": str(captured.mla_cache_dtype).removeprefix("torch."),
            "lowering": lowering,
            "parallel": {"tp": tp, "dcp": captured.plan.dcp, "dcp_interleave": captured.plan.dcp_interleave},
            "target": target,
            "phases": list(captured.programs),
            "passes": pass_summaries,
            "capture_stats": dataclasses.asdict(captured.stats),
            "files": files,
        }
        try:
            text = json.dumps(manifest, indent=1)
        except (TypeError, ValueError) as e:
            raise ArtifactError(
                f"manifest.json: field 'passes' (or 'capture_stats') is not JSON-serialisable: {e}"
            ) from e
        _write_manifest_bytes(tmp, (text + "\n").encode())
        for d in (tmp / "code", tmp / "sharding", tmp):
            _fsync_dir(d)
        _install(tmp, out, overwrite)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _install(tmp: Path, out: Path, overwrite: bool) -> None:
    """Rename the finished ``tmp`` onto ``out``; an existing ``out`` is renamed away first
    and deleted last, and restored if the rename in fails."""
    if not (out.exists() or out.is_symlink()):
        os.replace(tmp, out)
        _fsync_dir(out.parent)
        return
    if not overwrite:  # appeared while we were writing
        raise ArtifactError(f"{out} already exists (pass overwrite=True to replace it)")
    old = _temporary(out, "old")
    os.rmdir(old)  # a unique name for the old artifact
    os.replace(out, old)
    try:
        os.replace(tmp, out)
    except BaseException:
        os.replace(old, out)
        raise
    _fsync_dir(out.parent)
    shutil.rmtree(old, ignore_errors=True)
