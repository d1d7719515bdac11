"""Write an HF-style K3 model directory with seeded random weights.

``config.json`` plus sharded safetensors and ``model.safetensors.index.json``, under the
real tensor names and shapes (the shard specs of the model built at TP1 on ``meta`` are
the list of tensors). Each tensor is drawn from its own generator seeded by (seed, name),
so the weights do not depend on write order or shard size, and tensors are written shard
by shard: at most one shard is in memory, so a few real-size layers fit on a laptop.

Scales keep activations well-conditioned through every layer: linear weights
N(0, 1/in), output projections further divided by sqrt(2 * layers); norm weights near 1;
decay parameters spread so some heads forget quickly and others slowly.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Literal

import torch
from safetensors.torch import save_file

from k3compile.checkpoint.mxfp4 import pack_mxfp4
from k3compile.config import K3Config, config_to_hf_dict
from k3compile.sharding import CHECKPOINT_TORCH_DTYPES, ParallelPlan, ShardSpec, shard_specs

ExpertFormat = Literal["bf16", "mxfp4"]

_OUTPUT_PROJECTIONS = ("o_proj", "down_proj", "w2", "routed_expert_up_proj")
MXFP4_QUANTIZATION_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "mxfp4-pack-quantized",
    "config_groups": {
        "routed_experts": {
            "targets": ["re:.*block_sparse_moe\\.experts\\.\\d+\\.w[123]$"],
            "weights": {"num_bits": 4, "type": "float", "group_size": 32, "strategy": "group", "scale_dtype": "e8m0"},
        }
    },
}


@dataclass(frozen=True)
class GenerateOptions:
    experts: ExpertFormat = "bf16"
    seed: int = 0
    shard_bytes: int = 2 << 30


def checkpoint_tensors(cfg: K3Config) -> Iterator[tuple[str, ShardSpec]]:
    """(checkpoint name without prefix, spec) of every tensor of the text model."""
    from k3compile.model import K3ForCausalLM  # the model imports checkpoint helpers

    with torch.device("meta"):
        model = K3ForCausalLM(cfg, ParallelPlan())
    for spec in shard_specs(model).values():
        for name in spec.names:
            yield name, spec


def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


def random_tensor(cfg: K3Config, name: str, spec: ShardSpec, seed: int) -> torch.Tensor:
    """The fp32 value of checkpoint tensor ``name`` for ``seed``."""
    gen = _generator(seed, name)
    shape = spec.shape
    leaf = name.rsplit(".", 2)
    short = leaf[-1] if leaf[-1] != "weight" else leaf[-2]
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
    std = 1.0 / math.sqrt(shape[1])
    if short in _OUTPUT_PROJECTIONS:
        std /= math.sqrt(2 * cfg.num_hidden_layers)
    return std * randn(*shape)


def generate_model_dir(cfg: K3Config, out_dir: str | Path, options: GenerateOptions = GenerateOptions()) -> Path:
    """Write ``out_dir`` (which must not exist) atomically: a temp dir renamed at the end."""
    out = Path(out_dir)
    if options.experts not in ("bf16", "mxfp4"):
        raise ValueError(f"unknown expert format {options.experts!r}; choose 'bf16' or 'mxfp4'")
    if options.shard_bytes <= 0:
        raise ValueError(f"shard_bytes must be positive, got {options.shard_bytes}")
    if out.exists():
        raise FileExistsError(f"{out} already exists; choose a new directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    tmp.chmod(0o755)
    try:
        _write(cfg, tmp, options)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _write(cfg: K3Config, out: Path, options: GenerateOptions) -> None:
    prefix = cfg.checkpoint_prefix
    weight_map: dict[str, str] = {}
    total = 0
    pending: dict[str, torch.Tensor] = {}
    pending_bytes = 0
    shard_names: list[list[str]] = []

    def flush() -> None:
        nonlocal pending, pending_bytes
        if not pending:
            return
        index = len(shard_names)
        path = out / f"model-{index:05d}.safetensors.tmp"
        save_file(pending, str(path), metadata={"format": "pt"})
        path.chmod(0o644)  # safetensors creates files readable by the owner only
        shard_names.append(list(pending))
        pending, pending_bytes = {}, 0

    for name, spec in checkpoint_tensors(cfg):
        value = random_tensor(cfg, name, spec, options.seed)
        if spec.quantized and options.experts == "mxfp4":
            base = name.removesuffix(".weight")
            packed, scale = pack_mxfp4(value)
            tensors = {f"{prefix}{base}.weight_packed": packed, f"{prefix}{base}.weight_scale": scale}
        else:
            tensors = {f"{prefix}{name}": value.to(CHECKPOINT_TORCH_DTYPES[spec.dtype]).contiguous()}
        for key, t in tensors.items():
            nbytes = t.numel() * t.element_size()
            if pending and pending_bytes + nbytes > options.shard_bytes:
                flush()
            pending[key] = t
            pending_bytes += nbytes
            total += nbytes
    flush()

    count = len(shard_names)
    for i, names in enumerate(shard_names):
        final = f"model-{i + 1:05d}-of-{count:05d}.safetensors"
        os.replace(out / f"model-{i:05d}.safetensors.tmp", out / final)
        weight_map.update({n: final for n in names})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")

    hf = config_to_hf_dict(cfg)
    if options.experts == "mxfp4":
        hf["quantization_config"] = MXFP4_QUANTIZATION_CONFIG
    hf["torch_dtype"] = "bfloat16"
    hf["k3compile_generated"] = {"seed": options.seed, "experts": options.experts}
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
