"""Write an HF-style K3 model directory with seeded random weights.

``config.json`` plus sharded safetensors and ``model.safetensors.index.json``, under the
real tensor names and shapes (the shard specs of the model built at TP1 on ``meta`` are
the list of tensors). Each tensor is drawn from its own generator seeded by (seed, name),
so the weights do not depend on write order or shard size, and tensors are written shard
by shard: at most about one shard is in memory, so a few real-size layers fit on a laptop.

Scales keep activations well-conditioned through every layer: linear weights
N(0, 1/in), output projections further divided by sqrt(2 * layers); norm weights near 1;
decay parameters spread so some heads forget quickly and others slowly.

Routed experts are drawn directly in their stored format, MXFP4 (see
:func:`random_mxfp4`): uniformly random E2M1 codes and one E8M0 scale byte per 32 input
values, the scales chosen so the weight's rms is close to the std of the rule above. A bf16
checkpoint holds the exact dequantisation of the same draw, so the bf16 and mxfp4
checkpoints of one seed hold bit-identical expert weights, and a real-shape slice costs
random bytes rather than randn plus quantisation (about 1 ms per expert tensor).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import torch
from safetensors.torch import save_file

from k3compile.checkpoint.mxfp4 import GROUP_SIZE, is_routed_expert, unpack_mxfp4
from k3compile.config import EXPERT_FORMATS, ExpertFormat, K3Config, config_to_hf_dict
from k3compile.sharding import CHECKPOINT_TORCH_DTYPES, ParallelPlan, ShardSpec, shard_specs

_OUTPUT_PROJECTIONS = ("o_proj", "down_proj", "w2", "routed_expert_up_proj")

_PACKED, _SCALE = ".weight_packed", ".weight_scale"

#: rms of a uniformly random E2M1 code (all 16 nibbles equally likely): the magnitudes
#: 0, .5, 1, 1.5, 2, 3, 4, 6 have mean square 68.5 / 8 = 8.5625.
E2M1_UNIFORM_RMS = math.sqrt(8.5625)
#: rms of 2**d for a scale offset d uniform in {-1, 0, +1}: sqrt((1/4 + 1 + 4) / 3).
SCALE_SPREAD_RMS = math.sqrt(1.75)
_E8M0_BIAS = 127

#: Experts drawn at once are at most this many stored bytes (and a shard), or, for bf16,
#: this many elements (unpack_mxfp4 holds about 17 bytes of temporaries per element).
_MXFP4_CHUNK_BYTES = 256 << 20
_BF16_CHUNK_ELEMENTS = 16 << 20


@dataclass(frozen=True)
class GenerateOptions:
    #: How routed experts are stored; None: the config's ``expert_format``.
    experts: ExpertFormat | None = None
    seed: int = 0
    shard_bytes: int = 2 << 30


@dataclass
class GenerateStats:
    """Where generate_model_dir's time went (filled when passed in)."""

    draw_s: float = 0.0  #: drawing values and converting them to their storage dtype
    draw_experts_s: float = 0.0  #: the routed experts' part of draw_s
    write_s: float = 0.0  #: safetensors shards, renames, index and config.json
    total_s: float = 0.0  #: everything, the meta model that lists the tensors included
    bytes: int = 0  #: tensor bytes written (the index's total_size)
    tensors: int = 0  #: tensors written (packed and scale count separately)
    shards: int = 0
    experts: str = ""  #: the expert format written


def checkpoint_tensors(cfg: K3Config) -> Iterator[tuple[str, ShardSpec]]:
    """(checkpoint name without prefix, spec) of every tensor of the text model."""
    for spec in _checkpoint_specs(cfg):
        for name in spec.names:
            yield name, spec


def _checkpoint_specs(cfg: K3Config) -> list[ShardSpec]:
    from k3compile.model import K3ForCausalLM  # the model imports checkpoint helpers

    with torch.device("meta"):
        model = K3ForCausalLM(cfg, ParallelPlan())
    return list(shard_specs(model).values())


class NotEnoughSpace(ValueError):
    """The checkpoint would not fit the free disk space where it is to be written."""


def stored_bytes(cfg: K3Config) -> int:
    """Bytes of the checkpoint's tensors as stored (MXFP4 experts: half a byte per value
    and one scale byte per 32), before any is drawn."""
    total = 0
    for _, spec in checkpoint_tensors(cfg):
        numel = math.prod(spec.shape)
        total += numel // 2 + numel // 32 if spec.quantized and cfg.expert_format == "mxfp4" else \
            numel * CHECKPOINT_TORCH_DTYPES[spec.dtype].itemsize
    return total


def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


def _linear_std(cfg: K3Config, short: str, shape: Sequence[int]) -> float:
    std = 1.0 / math.sqrt(shape[1])
    if short in _OUTPUT_PROJECTIONS:
        std /= math.sqrt(2 * cfg.num_hidden_layers)
    return std


def _short_name(name: str) -> str:
    leaf = name.rsplit(".", 2)
    return leaf[-1] if leaf[-1] != "weight" else leaf[-2]


def mxfp4_nominal_exponent(std: float) -> int:
    """The E8M0 exponent around which a random MXFP4 weight of rms ``std`` draws its scales:
    log2 of the power of two nearest (in log space) to std / (rms of a random code x rms of
    the scale spread), so the drawn rms is within a factor 2**0.5 of ``std``."""
    return round(math.log2(std / (E2M1_UNIFORM_RMS * SCALE_SPREAD_RMS)))


def _expert_shape(name: str, shape: Sequence[int]) -> tuple[int, int]:
    if not is_routed_expert(name):
        raise ValueError(f"{name} is not a routed-expert weight (model.layers.L.block_sparse_moe.experts.E.wN.weight)")
    if len(shape) != 2:
        raise ValueError(f"{name}: a routed-expert weight is 2-D [rows, cols], got shape {list(shape)}")
    return int(shape[0]), int(shape[1])


def _nominal_byte(cfg: K3Config, name: str, shape: tuple[int, int]) -> int:
    """The scale byte of offset 0 (offsets -1/0/+1 must stay finite E8M0 bytes, 0..254)."""
    byte = _E8M0_BIAS + mxfp4_nominal_exponent(_linear_std(cfg, _short_name(name), shape))
    if not 1 <= byte <= 253:
        raise ValueError(f"{name}: nominal E8M0 scale byte {byte} leaves no room for the +-1 spread")
    return byte


def _draw_experts(
    cfg: K3Config, names: Sequence[str], shape: Sequence[int], seed: int, pad: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and scales of the experts ``names`` (of one layer and projection, so all of
    logical ``shape`` and one std), stacked:
    packed uint8 [k, rows, cols/2], scale uint8 [k, rows, cols/32].

    Each expert's draw comes from its own generator: packed bytes first (uniform over all
    256 values, so both nibbles are uniform E2M1 codes), then one offset in {-1, 0, +1}
    per group of 32 input values, added to the nominal scale byte. With ``pad`` a ``cols``
    that is not a multiple of 32 is drawn as the next multiple (bf16 experts only: the
    caller cuts the dequantised columns back); otherwise it is an error."""
    rows, cols = _expert_shape(names[0], shape)
    if cols % GROUP_SIZE:
        if not pad:
            raise ValueError(
                f"{names[0]}: input dim {cols} is not a multiple of {GROUP_SIZE}; "
                "it cannot be stored as MXFP4 (one scale per 32 input values)"
            )
        cols += GROUP_SIZE - cols % GROUP_SIZE
    groups = cols // GROUP_SIZE
    nominal = _nominal_byte(cfg, names[0], (rows, int(shape[1])))
    packed = torch.empty(len(names), rows * cols // 2, dtype=torch.uint8)
    scale = torch.empty(len(names), rows, groups, dtype=torch.uint8)
    words = packed.view(torch.int64)  # rows * cols / 2 is a multiple of 16 bytes
    for i, name in enumerate(names):
        gen = _generator(seed, name)
        # from = int64 min and no upper bound: the full 64-bit range, exactly uniform bytes.
        words[i].random_(-(2**63), None, generator=gen)
        scale[i].random_(0, 3, generator=gen)  # 32-bit draws mod 3: bias below 2**-31
    scale += nominal - 1
    return packed.view(len(names), rows, cols // 2), scale


def random_mxfp4(cfg: K3Config, name: str, shape: Sequence[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The stored MXFP4 form of routed-expert weight ``name`` (logical ``shape`` [rows, cols],
    cols the input dim, a multiple of 32) for ``seed``: (packed uint8 [rows, cols/2],
    scale uint8 [rows, cols/32]).

    Codes are uniformly random bytes; each group's scale byte is 127 + e + d with e the
    nominal exponent for the std of the linear-weight rule (:func:`mxfp4_nominal_exponent`)
    and d uniform in {-1, 0, +1}."""
    packed, scale = _draw_experts(cfg, [name], shape, seed)
    return packed[0], scale[0]


def random_tensor(cfg: K3Config, name: str, spec: ShardSpec, seed: int) -> torch.Tensor:
    """The fp32 value of checkpoint tensor ``name`` (a logical tensor: ``.weight``, never
    ``.weight_packed``/``.weight_scale``) for ``seed``.

    Routed experts are the exact dequantisation of :func:`random_mxfp4` (with a
    ``cols`` that is not a multiple of 32, of the draw for the next multiple, cut back)."""
    shape = spec.shape
    if name.endswith((_PACKED, _SCALE)):
        raise ValueError(f"{name} is stored MXFP4 bytes, not a logical tensor; use stored_random_tensor")
    if is_routed_expert(name):
        packed, scale = _draw_experts(cfg, [name], shape, seed, pad=True)
        return unpack_mxfp4(packed[0], scale[0], torch.float32)[:, : shape[1]].contiguous()
    gen = _generator(seed, name)
    short = _short_name(name)
    randn = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    if short == "A_log":
        return torch.log(torch.empty(shape).uniform_(0.5, 4.0, generator=gen))
    if short == "dt_bias":
        return randn(*shape) - 1.0
    if short == "e_score_correction_bias":
        return 0.01 * randn(*shape)
    if short.endswith("conv1d"):
        return 0.5 * randn(*shape)
    if short.endswith("norm") or short.endswith("layernorm"):
        return 1.0 + 0.1 * randn(*shape)
    if short == "embed_tokens":
        return randn(*shape)
    if len(shape) != 2:
        raise ValueError(f"no initialisation rule for {name} of shape {shape}")
    return randn(*shape).mul_(_linear_std(cfg, short, shape))


def stored_random_tensor(cfg: K3Config, name: str, spec: ShardSpec, seed: int) -> torch.Tensor:
    """Checkpoint tensor ``name`` for ``seed`` as the file stores it under ``spec``'s dtype.

    ``<base>.weight_packed`` / ``<base>.weight_scale`` (``spec.dtype`` "u8", ``spec.shape``
    [rows, cols/2] / [rows, cols/32]): the codes / scales of :func:`random_mxfp4` for the
    routed expert ``<base>.weight`` of logical shape [rows, cols]. Anything else:
    :func:`random_tensor` cast to the storage dtype (exact for experts in bf16)."""
    for suffix, per_byte in ((_PACKED, 2), (_SCALE, GROUP_SIZE)):
        if not name.endswith(suffix):
            continue
        if spec.dtype != "u8" or len(spec.shape) != 2:
            raise ValueError(
                f"{name}: MXFP4 {suffix[1:]} is a 2-D u8 tensor; the spec says {spec.dtype} {list(spec.shape)}"
            )
        rows, cols = spec.shape[0], spec.shape[1] * per_byte
        packed, scale = random_mxfp4(cfg, name.removesuffix(suffix) + ".weight", (rows, cols), seed)
        return packed if suffix == _PACKED else scale
    if spec.dtype == "u8":
        raise ValueError(f"{name}: a u8 spec must name a .weight_packed or .weight_scale tensor")
    return random_tensor(cfg, name, spec, seed).to(CHECKPOINT_TORCH_DTYPES[spec.dtype])


def generate_model_dir(
    cfg: K3Config,
    out_dir: str | Path,
    options: GenerateOptions = GenerateOptions(),
    *,
    stats: GenerateStats | None = None,
) -> Path:
    """Write ``out_dir`` (which must not exist) atomically: a temp dir renamed at the end.

    Routed experts are written in ``options.experts`` (default: ``cfg.expert_format``), and
    config.json's ``quantization_config`` follows the format written."""
    start = time.perf_counter()
    out = Path(out_dir)
    fmt = cfg.expert_format if options.experts is None else options.experts
    if fmt not in EXPERT_FORMATS:
        raise ValueError(f"unknown expert format {fmt!r}; choose 'bf16' or 'mxfp4'")
    if options.shard_bytes <= 0:
        raise ValueError(f"shard_bytes must be positive, got {options.shard_bytes}")
    if out.exists():
        raise FileExistsError(f"{out} already exists; choose a new directory")
    # The config that describes what is written (validated: mxfp4 needs whole scale groups).
    written = cfg if cfg.expert_format == fmt else cfg.replace(expert_format=fmt)
    stats = stats if stats is not None else GenerateStats()
    stats.experts = fmt
    out.parent.mkdir(parents=True, exist_ok=True)
    need, free = stored_bytes(written), shutil.disk_usage(out.parent).free
    if need > free:
        raise NotEnoughSpace(f"the checkpoint would take {need / 2**30:.1f} GiB; {out.parent} has {free / 2**30:.1f} "
                         "GiB free (check the config's sizes)")
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    tmp.chmod(0o755)
    try:
        _write(written, tmp, options.seed, options.shard_bytes, stats)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    stats.total_s = time.perf_counter() - start
    return out


def _expert_chunks(cfg: K3Config, spec: ShardSpec, fmt: str, shard_bytes: int) -> Iterator[Sequence[str]]:
    """The spec's expert names in chunks drawn together: a bounded number of stored bytes
    (never more than a shard) or, for bf16, of elements to dequantise; at least one expert."""
    rows, cols = spec.shape
    if fmt == "mxfp4":
        per_expert = rows * cols // 2 + rows * cols // GROUP_SIZE
        budget = min(shard_bytes, _MXFP4_CHUNK_BYTES)
    else:
        per_expert = rows * cols
        budget = min(shard_bytes // 2, _BF16_CHUNK_ELEMENTS)
    k = max(1, budget // per_expert)
    for i in range(0, len(spec.names), k):
        yield spec.names[i : i + k]


def _write(cfg: K3Config, out: Path, seed: int, shard_bytes: int, stats: GenerateStats) -> None:
    fmt = cfg.expert_format
    prefix = cfg.checkpoint_prefix
    total = 0
    pending: dict[str, torch.Tensor] = {}
    pending_bytes = 0
    shard_names: list[list[str]] = []

    def flush() -> None:
        nonlocal pending, pending_bytes
        if not pending:
            return
        t0 = time.perf_counter()
        index = len(shard_names)
        path = out / f"model-{index:05d}.safetensors.tmp"
        save_file(pending, str(path), metadata={"format": "pt"})
        path.chmod(0o644)  # safetensors creates files readable by the owner only
        shard_names.append(list(pending))
        pending, pending_bytes = {}, 0
        stats.write_s += time.perf_counter() - t0

    def add(key: str, t: torch.Tensor) -> None:
        nonlocal pending_bytes, total
        nbytes = t.numel() * t.element_size()
        if pending and pending_bytes + nbytes > shard_bytes:
            flush()
        pending[key] = t
        pending_bytes += nbytes
        total += nbytes
        stats.tensors += 1

    for spec in _checkpoint_specs(cfg):
        if not all(is_routed_expert(n) for n in spec.names):
            for name in spec.names:
                t0 = time.perf_counter()
                value = stored_random_tensor(cfg, name, spec, seed).contiguous()
                stats.draw_s += time.perf_counter() - t0
                add(prefix + name, value)
            continue
        # Routed experts of one (layer, projection): drawn a chunk at a time, then written as
        # slices of the chunk (disjoint views: safetensors writes each without a copy).
        for names in _expert_chunks(cfg, spec, fmt, shard_bytes):
            t0 = time.perf_counter()
            packed, scale = _draw_experts(cfg, names, spec.shape, seed, pad=fmt == "bf16")
            if fmt == "bf16":
                values = unpack_mxfp4(packed, scale, torch.bfloat16)
                if values.shape[-1] != spec.shape[1]:
                    values = values[..., : spec.shape[1]].contiguous()
                del packed, scale
            elapsed = time.perf_counter() - t0
            stats.draw_s += elapsed
            stats.draw_experts_s += elapsed
            for i, name in enumerate(names):
                if fmt == "bf16":
                    add(prefix + name, values[i])
                else:
                    base = prefix + name.removesuffix(".weight")
                    add(base + _PACKED, packed[i])
                    add(base + _SCALE, scale[i])
    flush()

    t0 = time.perf_counter()
    weight_map: dict[str, str] = {}
    count = len(shard_names)
    for i, names in enumerate(shard_names):
        final = f"model-{i + 1:05d}-of-{count:05d}.safetensors"
        os.replace(out / f"model-{i:05d}.safetensors.tmp", out / final)
        weight_map.update({n: final for n in names})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")

    hf = config_to_hf_dict(cfg)  # quantization_config follows cfg.expert_format
    hf["torch_dtype"] = "bfloat16"
    hf["k3compile_generated"] = {"seed": seed, "experts": fmt}
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    stats.write_s += time.perf_counter() - t0
    stats.bytes, stats.shards = total, count
