"""The artifact's JSON files, read and checked: ``manifest.json`` into an :class:`ArtifactInfo`,
``sharding/rank<r>.json`` into the rank's :class:`ShardSpec` per parameter. Every field is
checked for type and range and a bad one raises :class:`ArtifactError` naming the file and
field; nothing here touches the programs or the filesystem (:mod:`k3compile.artifact`
does, and :mod:`k3compile.artifact_writer` writes these files).

``manifest.json`` (format ``"k3compile-artifact"``, :data:`FORMAT_VERSION`)::

    {"format": "k3compile-artifact", "format_version": 5,
     "k3compile_version": "0.1.0", "torch_version": "2.13.0+cpu",
     "config": K3Config.to_dict(),
     "model_dir": "/abs/path/of/the/checkpoint",        # where the runtime reads weights
     "checkpoint_index_sha256": "<sha256 of model.safetensors.index.json>",
     "checkpoint_shards": {"model-00001-of-00002.safetensors":  # k3compile/checkpoint/identity.py
         {"size": 123, "header_sha256": "...", "sample_sha256": "...",
          "sha256": "..."}, ...},                        # the last only with --hash-weights
     "dtype": "bfloat16", "block_size": 16,
     "kv_cache_dtype": "float8_e4m3fn",                  # the MLA caches': the model dtype or FP8
     "lowering": "inductor",                             # how the runtime runs the programs
     "parallel": {"tp": 8, "dcp": 2, "dcp_interleave": 1},  # dcp divides tp
     "target": "mi355x", "phases": ["decode", "prefill"],
     "passes": [ {...}, ... ],                           # per-pass summaries, as given
     "capture_stats": {"seconds": {...}, "nodes": {...}, "peak_rss_bytes": ...},
     "files": {"decode.pt2": {"sha256": "...", "size": 123}, ...}}

``sharding/rank<r>.json``::

    {"format": "k3compile-sharding", "rank": r, "tp": 8, "checkpoint_prefix": "language_model.",
     "params": {"k3.model.layers.0.mlp.gate_proj.weight": {
         "checkpoint_names": ["model.layers.0.mlp.gate_proj.weight"],   # stacked when > 1
         "dtype": "bf16", "shape": [18432, 7168], "dim": 0, "extent": null,
         "range": [0, 2304], "local_shape": [2304, 7168], "quantized": false}, ...}}
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch

from k3compile.checkpoint.identity import ShardIdentity
from k3compile.config import K3Config
from k3compile.mla_cache_fp8 import FP8_CACHE_DTYPES
from k3compile.sharding import ParallelPlan, ShardingError, ShardOffset, ShardSpec
from k3compile.targets import LOWERINGS

FORMAT_NAME = "k3compile-artifact"
FORMAT_VERSION = 5  # 2: kv_cache_dtype (FP8 MLA caches); 3: lowering; 4: checkpoint_shards; 5: their full sha256
SHARDING_FORMAT = "k3compile-sharding"
MANIFEST = "manifest.json"
#: sha256 of manifest.json's bytes: catches edits to the manifest itself (config, paths).
MANIFEST_SEAL = "manifest.sha256"
#: HMAC-SHA256 of manifest.json's bytes under the key in SIGN_KEY_ENV, written when the key
#: is set; the manifest lists every other file's sha256, so it signs the whole artifact.
MANIFEST_SIGNATURE = "manifest.hmac"
SIGN_KEY_ENV = "K3COMPILE_SIGN_KEY"

#: Model dtypes an artifact may name (manifest string <-> torch dtype); never getattr.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
#: MLA cache dtypes an artifact may name: a model dtype or an FP8 format
KV_CACHE_DTYPES: dict[str, torch.dtype] = {**DTYPES, **FP8_CACHE_DTYPES}
_CHECKPOINT_DTYPES = ("bf16", "f32", "u8")


class ArtifactError(ValueError):
    """An artifact cannot be written or loaded; the message names the file and field."""


@dataclass
class CaptureStats:
    """What capturing cost, per phase (the manifest's ``capture_stats``)."""

    seconds: dict[str, float] = field(default_factory=dict)
    nodes: dict[str, int] = field(default_factory=dict)
    peak_rss_bytes: int = 0


@dataclass(frozen=True)
class ArtifactInfo:
    """Everything in ``manifest.json`` except the file hashes, typed."""

    format: str
    format_version: int
    k3compile_version: str
    torch_version: str
    config: K3Config
    model_dir: str
    checkpoint_index_sha256: str
    checkpoint_shards: dict[str, ShardIdentity]  # per shard file: size and hashes (checkpoint/identity.py)
    dtype: torch.dtype
    block_size: int
    kv_cache_dtype: torch.dtype  # of the MLA caches (k3compile/mla_cache_fp8.py for FP8)
    lowering: str  # how the runtime runs the programs: one of targets.LOWERINGS
    tp: int
    dcp: int
    dcp_interleave: int
    target: str
    phases: tuple[str, ...]
    passes: list[Any]
    capture_stats: CaptureStats


def parse_constants(raw: Any, label: str, plan: ParallelPlan) -> dict[str, ShardOffset]:
    consts = raw.get("constants", {})
    if not isinstance(consts, dict):
        raise ArtifactError(f"{label}: field 'constants' must be an object")
    out: dict[str, ShardOffset] = {}
    for name, c in consts.items():
        where = f"{label}: constants['{name}']"
        if not isinstance(c, dict) or c.get("kind") != "shard_offset":
            raise ArtifactError(f"{where}: must be an object with kind 'shard_offset'")
        extent, period, value = c.get("extent"), c.get("period"), c.get("value")
        if not isinstance(extent, int) or isinstance(extent, bool) or extent < 1:
            raise ArtifactError(f"{where}.extent: must be a positive integer")
        if period is not None and (not isinstance(period, int) or isinstance(period, bool) or period < 1):
            raise ArtifactError(f"{where}.period: must be a positive integer or null")
        offset = ShardOffset(extent, period)
        try:
            expected = offset.value(plan)
        except ShardingError as e:
            raise ArtifactError(f"{where}: {e}") from e
        if value != expected:
            raise ArtifactError(f"{where}.value: {value!r} but rank {plan.rank} of tp={plan.tp} starts at {expected}")
        out[name] = offset
    return out


def _int_list(value: Any, where: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ArtifactError(f"{where}: must be a list of integers, got {value!r}")
    return value


def parse_rank_file(raw: Any, label: str, tp: int, rank: int) -> dict[str, ShardSpec]:
    if not isinstance(raw, dict) or raw.get("format") != SHARDING_FORMAT:
        raise ArtifactError(f"{label}: field 'format' must be {SHARDING_FORMAT!r}")
    if raw.get("rank") != rank or raw.get("tp") != tp:
        raise ArtifactError(
            f"{label}: fields 'rank'/'tp' are {raw.get('rank')!r}/{raw.get('tp')!r}, expected {rank}/{tp}"
        )
    params = raw.get("params")
    if not isinstance(params, dict):
        raise ArtifactError(f"{label}: field 'params' must be an object")
    plan = ParallelPlan(tp, rank)
    specs: dict[str, ShardSpec] = {}
    for name, p in params.items():
        where = f"{label}: params['{name}']"
        if not isinstance(p, dict):
            raise ArtifactError(f"{where}: must be an object")
        try:
            names = p["checkpoint_names"]
            if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
                raise ArtifactError(f"{where}.checkpoint_names: must be a list of strings")
            if p["dtype"] not in _CHECKPOINT_DTYPES:
                raise ArtifactError(f"{where}.dtype: {p['dtype']!r} is not one of {_CHECKPOINT_DTYPES}")
            for key in ("dim", "extent"):
                if p[key] is not None and (not isinstance(p[key], int) or isinstance(p[key], bool)):
                    raise ArtifactError(f"{where}.{key}: must be an integer or null")
            if not isinstance(p["quantized"], bool):
                raise ArtifactError(f"{where}.quantized: must be true or false")
            spec = ShardSpec(
                names=tuple(names),
                shape=tuple(_int_list(p["shape"], f"{where}.shape")),
                dtype=p["dtype"],
                dim=p["dim"],
                extent=p["extent"],
                quantized=p["quantized"],
            )
            expected = spec.split_range(plan)
            got = None if p["range"] is None else tuple(_int_list(p["range"], f"{where}.range"))
        except KeyError as e:
            raise ArtifactError(f"{where}: missing field {e}") from e
        except ShardingError as e:
            raise ArtifactError(f"{where}: {e}") from e
        if got != expected:
            raise ArtifactError(f"{where}.range: {p['range']} but the spec gives rank {rank} of tp={tp} {expected}")
        specs[name] = spec
    return specs


def _field(raw: dict[str, Any], key: str, types: type | tuple[type, ...]) -> Any:
    if key not in raw:
        raise ArtifactError(f"{MANIFEST}: missing field '{key}'")
    value = raw[key]
    if not isinstance(value, types) or (isinstance(value, bool) and types is int):
        raise ArtifactError(
            f"{MANIFEST}: field '{key}' has type {type(value).__name__}, expected {getattr(types, '__name__', types)}"
        )
    return value


def _parse_shards(raw: dict[str, Any]) -> dict[str, ShardIdentity]:
    shards = {}
    for name, entry in raw.items():
        where = f"{MANIFEST}: field 'checkpoint_shards' entry {name!r}"
        required = {"size", "header_sha256", "sample_sha256"}
        if not isinstance(entry, dict) or not required <= set(entry) <= required | {"sha256"}:
            raise ArtifactError(f"{where} needs exactly 'size', 'header_sha256' and 'sample_sha256' "
                                "(and optionally 'sha256')")
        size, header, sample, full = entry["size"], entry["header_sha256"], entry["sample_sha256"], entry.get("sha256")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ArtifactError(f"{where}: 'size' must be a non-negative integer")
        hashes = (header, sample) if full is None else (header, sample, full)
        if not all(isinstance(h, str) and re.fullmatch(r"[0-9a-f]{64}", h) for h in hashes):
            raise ArtifactError(f"{where}: the hashes must be 64 hex digits")
        shards[name] = ShardIdentity(size, header, sample, full)
    return shards


def parse_manifest(raw: Any) -> tuple[ArtifactInfo, dict[str, dict[str, Any]]]:
    if not isinstance(raw, dict):
        raise ArtifactError(f"{MANIFEST}: top level must be a JSON object")
    fmt = raw.get("format")
    if fmt != FORMAT_NAME:
        raise ArtifactError(
            f"{MANIFEST}: field 'format' is {fmt!r}, expected {FORMAT_NAME!r} (not a k3compile artifact)"
        )
    version = _field(raw, "format_version", int)
    if version != FORMAT_VERSION:
        newer = " (written by a newer k3compile)" if version > FORMAT_VERSION else ""
        raise ArtifactError(
            f"{MANIFEST}: field 'format_version' is {version}{newer}; this k3compile reads version {FORMAT_VERSION}"
        )
    try:
        config = K3Config.from_dict(_field(raw, "config", dict))
    except ArtifactError:
        raise
    except Exception as e:  # ConfigError, TypeError for unknown/missing keys
        raise ArtifactError(f"{MANIFEST}: field 'config' is not a valid K3 config ({e})") from e
    dtype_name = _field(raw, "dtype", str)
    if dtype_name not in DTYPES:
        raise ArtifactError(f"{MANIFEST}: field 'dtype' is {dtype_name!r}, expected one of {', '.join(DTYPES)}")
    kv_name = _field(raw, "kv_cache_dtype", str)
    if kv_name not in KV_CACHE_DTYPES:
        raise ArtifactError(
            f"{MANIFEST}: field 'kv_cache_dtype' is {kv_name!r}, expected one of {', '.join(KV_CACHE_DTYPES)}"
        )
    lowering = _field(raw, "lowering", str)
    if lowering not in LOWERINGS:
        raise ArtifactError(f"{MANIFEST}: field 'lowering' is {lowering!r}, expected one of {', '.join(LOWERINGS)}")
    parallel = _field(raw, "parallel", dict)
    tp, dcp, interleave = parallel.get("tp"), parallel.get("dcp"), parallel.get("dcp_interleave", 1)
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ArtifactError(f"{MANIFEST}: field 'parallel.tp' is {tp!r}, expected a positive integer")
    if not isinstance(dcp, int) or isinstance(dcp, bool) or dcp < 1 or tp % dcp:
        raise ArtifactError(f"{MANIFEST}: field 'parallel.dcp' is {dcp!r}, expected a divisor of tp={tp}")
    if not isinstance(interleave, int) or isinstance(interleave, bool) or interleave < 1:
        raise ArtifactError(f"{MANIFEST}: field 'parallel.dcp_interleave' is {interleave!r}, expected a positive integer")
    block_size = _field(raw, "block_size", int)
    if block_size < 1:
        raise ArtifactError(f"{MANIFEST}: field 'block_size' is {block_size}, expected a positive integer")
    phases = _field(raw, "phases", list)
    if (
        not phases
        or not all(isinstance(p, str) and p.isidentifier() for p in phases)
        or len(set(phases)) != len(phases)
    ):
        raise ArtifactError(f"{MANIFEST}: field 'phases' must be a non-empty list of distinct names, got {phases!r}")
    stats = _field(raw, "capture_stats", dict)
    try:
        capture_stats = CaptureStats(**stats)
    except TypeError as e:
        raise ArtifactError(f"{MANIFEST}: field 'capture_stats' ({e})") from e
    files = _field(raw, "files", dict)
    for name, entry in files.items():
        parts = name.split("/")
        if name.startswith("/") or any(p in ("", ".", "..") for p in parts) or "\\" in name or name == MANIFEST:
            raise ArtifactError(f"{MANIFEST}: field 'files' names an invalid path {name!r}")
        if (
            not isinstance(entry, dict)
            or not isinstance(entry.get("sha256"), str)
            or not isinstance(entry.get("size"), int)
        ):
            raise ArtifactError(
                f"{MANIFEST}: field 'files' entry {name!r} needs 'sha256' (string) and 'size' (integer)"
            )
    info = ArtifactInfo(
        format=fmt,
        format_version=version,
        k3compile_version=_field(raw, "k3compile_version", str),
        torch_version=_field(raw, "torch_version", str),
        config=config,
        model_dir=_field(raw, "model_dir", str),
        checkpoint_index_sha256=_field(raw, "checkpoint_index_sha256", str),
        checkpoint_shards=_parse_shards(_field(raw, "checkpoint_shards", dict)),
        dtype=DTYPES[dtype_name],
        block_size=block_size,
        kv_cache_dtype=KV_CACHE_DTYPES[kv_name],
        lowering=lowering,
        tp=tp,
        dcp=dcp,
        dcp_interleave=interleave,
        target=_field(raw, "target", str),
        phases=tuple(phases),
        passes=_field(raw, "passes", list),
        capture_stats=capture_stats,
    )
    return info, files
