"""Load one rank's slice of a sharded safetensors checkpoint into the rank-local model.

``model.safetensors.index.json`` maps tensor names (with the ``language_model.`` prefix
for kimi_k3 checkpoints) to shard files. For each parameter the loader reads, through
safetensors slicing, only the rows/columns its :class:`ShardSpec` assigns to this rank:
a tensor the rank does not hold is never materialised. Routed experts may be stored as
``mxfp4-pack-quantized`` (``weight_packed`` + ``weight_scale``), which is dequantised
exactly; whether a tensor is packed is read from the index, not from the config's
``ignore`` regexes.

A missing tensor, an unexpected shape or dtype, a missing or corrupt file: a
:class:`CheckpointError` naming the tensor and the file. On ``meta`` parameters only
the headers are read and checked, so configs far larger than memory can be validated.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from k3compile.checkpoint.mxfp4 import E8M0_NAN, GROUP_SIZE, check_mxfp4_shapes, is_routed_expert, unpack_mxfp4
from k3compile.config import ExpertFormat, K3Config, load_config
from k3compile.sharding import ParallelPlan, ShardSpec, shard_specs

INDEX_FILE = "model.safetensors.index.json"
_SAFETENSORS_DTYPES = {"bf16": "BF16", "f32": "F32", "u8": "U8"}


class CheckpointError(ValueError):
    """The checkpoint does not hold what the model expects."""


@dataclass
class LoadReport:
    """What a rank read: tensors touched and bytes actually read from disk."""

    tensors: int = 0
    bytes_read: int = 0


class CheckpointReader:
    """Lazily opened shard files of one model directory, addressed by tensor name."""

    def __init__(self, model_dir: str | Path, prefix: str):
        self.dir = Path(model_dir)
        self.prefix = prefix
        index_path = self.dir / INDEX_FILE
        if not index_path.is_file():
            raise CheckpointError(f"{index_path}: missing safetensors index")
        try:
            index = json.loads(index_path.read_bytes())
            weight_map = index["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise TypeError("'weight_map' must map tensor names to shard file names")
            self.weight_map: dict[str, str] = dict(weight_map)
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index_path}: not a safetensors index ({e})") from e
        self.index_path = index_path
        self._stack = ExitStack()
        self._files: dict[str, Any] = {}

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def has(self, name: str) -> bool:
        return self.prefix + name in self.weight_map

    def file_of(self, name: str) -> Path:
        key = self.prefix + name
        if key not in self.weight_map:
            raise CheckpointError(f"tensor '{key}' is missing from {self.index_path}")
        return self.dir / self.weight_map[key]

    def slice(self, name: str) -> Any:
        """A safetensors slice handle (shape/dtype from the header, data read on indexing)."""
        path = self.file_of(name)
        key = self.prefix + name
        handle = self._files.get(path.name)
        if handle is None:
            if not path.is_file():
                raise CheckpointError(f"tensor '{key}': shard file {path} does not exist")
            try:
                handle = self._stack.enter_context(safe_open(str(path), framework="pt"))
            except (SafetensorError, OSError, ValueError) as e:
                raise CheckpointError(f"tensor '{key}': cannot open {path}: corrupt safetensors file ({e})") from e
            self._files[path.name] = handle
        try:
            return handle.get_slice(key)
        except (SafetensorError, KeyError) as e:
            raise CheckpointError(f"tensor '{key}' is listed in the index but not found in {path}") from e


def stored_expert_format(model_dir: str | Path, cfg: K3Config) -> ExpertFormat:
    """How the checkpoint in ``model_dir`` stores its routed experts, read from the
    safetensors index (it has the last word over ``quantization_config``): "mxfp4" when
    they are ``weight_packed`` + ``weight_scale``, "bf16" when they are plain weights, the
    config's own value when the model has no routed experts. A mix is an error."""
    with CheckpointReader(model_dir, cfg.checkpoint_prefix) as reader:
        kinds: set[ExpertFormat] = {
            "mxfp4" if name.endswith("_packed") else "bf16"
            for name in reader.weight_map if is_routed_expert(name.removesuffix("_packed"))
        }
    if len(kinds) > 1:
        raise CheckpointError(f"{reader.index_path}: some routed experts are MXFP4 (weight_packed) and some bf16")
    return kinds.pop() if kinds else cfg.expert_format


def load_checkpoint_config(model_dir: str | Path) -> K3Config:
    """``model_dir``'s config with the experts' format as its safetensors index has them."""
    cfg = load_config(model_dir)
    return cfg.replace(expert_format=stored_expert_format(model_dir, cfg))


def _read(reader: CheckpointReader, name: str, index: tuple[slice, ...], report: LoadReport) -> torch.Tensor:
    handle = reader.slice(name)
    try:
        t = handle[index]
    except Exception as e:  # safetensors raises several types for truncated data
        raise CheckpointError(f"tensor '{reader.prefix}{name}' in {reader.file_of(name)}: cannot read ({e})") from e
    report.bytes_read += t.numel() * t.element_size()
    return t


def _check_header(reader: CheckpointReader, name: str, shape: tuple[int, ...], dtype: str) -> None:
    handle = reader.slice(name)
    got_shape, got_dtype = tuple(handle.get_shape()), handle.get_dtype()
    where = f"tensor '{reader.prefix}{name}' in {reader.file_of(name)}"
    if got_shape != shape:
        raise CheckpointError(f"{where}: shape {list(got_shape)}, expected {list(shape)}")
    if got_dtype != dtype:
        raise CheckpointError(f"{where}: dtype {got_dtype}, expected {dtype}")


def _dim_index(ndim: int, dim: int | None, rng: tuple[int, int] | None, divisor: int = 1) -> tuple[slice, ...]:
    index = [slice(None)] * ndim
    if dim is not None and rng is not None:
        index[dim] = slice(rng[0] // divisor, rng[1] // divisor)
    return tuple(index)


def read_local_tensor(
    reader: CheckpointReader, name: str, spec: ShardSpec, plan: ParallelPlan, dtype: torch.dtype, meta: bool,
    report: LoadReport,
) -> torch.Tensor | None:
    """This rank's slice of checkpoint tensor ``name`` (dequantised), or None on meta."""
    rng = spec.split_range(plan)
    base = name.removesuffix(".weight")
    packed_name, scale_name = f"{base}.weight_packed", f"{base}.weight_scale"
    report.tensors += 1
    if spec.quantized and not reader.has(name) and reader.has(packed_name):
        p_shape = tuple(reader.slice(packed_name).get_shape())
        s_shape = tuple(reader.slice(scale_name).get_shape())
        try:
            check_mxfp4_shapes(p_shape, s_shape, spec.shape)
        except ValueError as e:
            files = sorted({str(reader.file_of(packed_name)), str(reader.file_of(scale_name))})
            raise CheckpointError(f"tensor '{reader.prefix}{base}' in {' and '.join(files)}: {e}") from e
        for n in (packed_name, scale_name):
            if reader.slice(n).get_dtype() != "U8":
                raise CheckpointError(
                    f"tensor '{reader.prefix}{n}' in {reader.file_of(n)}: dtype {reader.slice(n).get_dtype()}, expected U8"
                )
        if meta:
            return None
        if spec.dim == 1 and rng is not None and rng[0] % GROUP_SIZE:
            raise CheckpointError(
                f"tensor '{reader.prefix}{base}': --tp {plan.tp} splits its input dim into slices of "
                f"{rng[1] - rng[0]}, which cut its MXFP4 scale groups of {GROUP_SIZE}"
            )
        if spec.dim == 1:  # split along the input dim: packed bytes and scale groups
            packed = _read(reader, packed_name, _dim_index(2, 1, rng, 2), report)
            scale = _read(reader, scale_name, _dim_index(2, 1, rng, GROUP_SIZE), report)
        else:
            packed = _read(reader, packed_name, _dim_index(2, spec.dim, rng), report)
            scale = _read(reader, scale_name, _dim_index(2, spec.dim, rng), report)
        try:
            return unpack_mxfp4(packed, scale, dtype)
        except ValueError as e:
            raise CheckpointError(f"tensor '{reader.prefix}{base}' in {reader.file_of(packed_name)}: {e}") from e
    _check_header(reader, name, spec.shape, _SAFETENSORS_DTYPES[spec.dtype])
    if meta:
        return None
    value = _read(reader, name, spec.local_index(plan), report)
    if name.endswith(".weight_scale") and bool((value == E8M0_NAN).any()):
        # A NaN scale would poison a whole group of 32 weights: the checkpoint is corrupt.
        raise CheckpointError(
            f"tensor '{reader.prefix}{name}' in {reader.file_of(name)}: holds NaN scale bytes (0xFF)"
        )
    return value.to(dtype)


def fill_parameter(
    reader: CheckpointReader, fqn: str, spec: ShardSpec, plan: ParallelPlan, param: torch.Tensor, report: LoadReport
) -> None:
    """Copy this rank's slice of every checkpoint tensor behind ``spec`` into ``param``
    (on ``meta`` only the headers are checked)."""
    meta = param.device.type == "meta"
    for i, name in enumerate(spec.names):
        value = read_local_tensor(reader, name, spec, plan, param.dtype, meta, report)
        if value is None:
            continue
        target = param.data[i] if spec.stacked else param.data
        if value.shape != target.shape:
            raise CheckpointError(
                f"tensor '{reader.prefix}{name}': rank {plan.rank} slice has shape {list(value.shape)}, "
                f"parameter {fqn} expects {list(target.shape)}"
            )
        target.copy_(value)


def load_weights(model: nn.Module, model_dir: str | Path, plan: ParallelPlan, prefix: str) -> LoadReport:
    """Fill every parameter of ``model`` with this rank's slice from ``model_dir``.

    Parameters on ``meta`` are only checked against the headers (nothing is read)."""
    report = LoadReport()
    params = dict(model.named_parameters())
    with CheckpointReader(model_dir, prefix) as reader:
        for fqn, spec in shard_specs(model).items():
            fill_parameter(reader, fqn, spec, plan, params[fqn], report)
    return report
