"""Checkpoint loading: each rank's slice, mxfp4 experts, and the errors of broken checkpoints
(the generator's own tests: test_generate.py).

Checkpoints are real sharded safetensors directories written by ``generate_model_dir``
into pytest's tmp dirs (the ``ckpt`` fixture); broken ones are copies with one thing
changed on disk.
"""

from __future__ import annotations

import json
import re
import shutil
import struct
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoint_files import P, headers, stored, weight_map
from k3compile.checkpoint.loader import (
    INDEX_FILE,
    CheckpointError,
    CheckpointReader,
    LoadReport,
    load_weights,
    read_local_tensor,
)
from k3compile.checkpoint.mxfp4 import unpack_mxfp4
from k3compile.config import PRESETS, load_config
from k3compile.model import K3ForCausalLM
from k3compile.reference import load_reference
from k3compile.sharding import ParallelPlan, Replicate, Shard, ShardSpec, shard_specs

TINY = PRESETS["tiny"]
O_PROJ = "model.layers.0.self_attn.o_proj.weight"  # row-parallel, early in load order
W2 = "model.layers.1.block_sparse_moe.experts.3.w2"  # an expert's down projection (input dim split)


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------


def params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in model.named_parameters()}


def build(d: Path, plan: ParallelPlan = ParallelPlan(), meta: bool = False):
    """The rank-local fp32 model for ``plan`` (left on meta if asked) and its LoadReport.

    Loading runs no collective, so a TP rank's model is built without a process group."""
    cfg = load_config(d)
    with torch.device("meta"):
        model = K3ForCausalLM(cfg, plan, dtype=torch.float32)
    if not meta:
        model = model.to_empty(device="cpu")
    report = load_weights(model, d, plan, cfg.checkpoint_prefix)
    return model, report


def checkpoint_param(spec_names: tuple[str, ...], t: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
    """The full fp32 value of a parameter from the stored tensors (experts stacked)."""
    vals = []
    for name in spec_names:
        base = name.removesuffix(".weight")
        if prefix + name in t:
            vals.append(t[prefix + name].float())
        else:
            vals.append(unpack_mxfp4(t[f"{prefix}{base}.weight_packed"], t[f"{prefix}{base}.weight_scale"], torch.float32))
    return torch.stack(vals) if len(vals) > 1 else vals[0]


# ---------------------------------------------------------------------------
# Loading: values, mxfp4, tensor parallelism, bytes read
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("preset, experts", [("tiny", "bf16"), ("tiny-linear", "bf16"), ("tiny", "mxfp4")])
def test_tp1_load_equals_the_stored_tensors(ckpt, preset, experts):
    d = ckpt(preset, experts)
    cfg = PRESETS[preset]
    t = stored(d)
    model = load_reference(d)
    specs = shard_specs(model)
    H = cfg.linear_attn.num_heads
    for fqn, p in params(model).items():
        full = checkpoint_param(specs[fqn].names, t, cfg.checkpoint_prefix)
        if fqn.endswith("A_log"):
            full = full[:H]  # only the first num_heads entries are used
        assert p.dtype == torch.float32 and torch.equal(p, full), fqn
    a_log = model.model.layers[0].self_attn.A_log
    assert a_log.shape == (H,)
    assert torch.equal(a_log, t[cfg.checkpoint_prefix + "model.layers.0.self_attn.A_log"][:H])


def test_mxfp4_experts_load_as_the_exact_dequantised_values(ckpt):
    mx, bf = ckpt("tiny", "mxfp4"), ckpt("tiny", "bf16")
    wm = weight_map(mx)
    assert not any(re.search(r"experts\.\d+\.w[123]\.weight$", k) for k in wm)
    assert P + W2 + ".weight_packed" in wm and P + W2 + ".weight_scale" in wm
    hf = json.loads((mx / "config.json").read_text())
    assert hf["quantization_config"]["format"] == "mxfp4-pack-quantized"

    t = stored(mx)
    packed, scale = t[P + W2 + ".weight_packed"], t[P + W2 + ".weight_scale"]
    assert packed.dtype == scale.dtype == torch.uint8
    L, inter = TINY.routed_expert_hidden_size, TINY.moe_intermediate_size
    assert packed.shape == (L, inter // 2) and scale.shape == (L, inter // 32)

    m_mx, m_bf = load_reference(mx), load_reference(bf)
    p_mx, p_bf = params(m_mx), params(m_bf)
    for layer in range(1, TINY.num_hidden_layers):
        for proj in ("w1", "w2", "w3"):
            w = p_mx[f"model.layers.{layer}.mlp.experts.{proj}"]
            for e in range(TINY.num_experts):
                base = f"{P}model.layers.{layer}.block_sparse_moe.experts.{e}.{proj}"
                want = unpack_mxfp4(t[base + ".weight_packed"], t[base + ".weight_scale"], torch.float32)
                assert torch.equal(w[e], want), base
            # The bf16 checkpoint of the same seed holds the same values, bit for bit.
            assert torch.equal(w, p_bf[f"model.layers.{layer}.mlp.experts.{proj}"])
    # Everything but the routed experts is identical in both checkpoints.
    for k in p_bf:
        if ".experts." not in k:
            assert torch.equal(p_mx[k], p_bf[k]), k


@pytest.mark.parametrize("experts", ["bf16", "mxfp4"])
def test_tp2_ranks_hold_slices_of_the_tp1_parameters(ckpt, experts):
    d = ckpt("tiny", experts)
    full = params(load_reference(d))
    t = stored(d)
    H = TINY.linear_attn.num_heads
    L, inter, E = TINY.routed_expert_hidden_size, TINY.moe_intermediate_size, TINY.num_experts
    for r in range(2):
        model = load_reference(d, ParallelPlan(tp=2, rank=r))
        local, specs = params(model), shard_specs(model)
        assert local.keys() == full.keys()
        for fqn, p in local.items():
            placement = specs[fqn].placement
            if isinstance(placement, Shard):
                want = full[fqn].chunk(2, dim=placement.dim)[r]
            else:
                assert placement == Replicate()
                want = full[fqn]
            assert p.shape == want.shape and torch.equal(p, want), fqn

        def rows(x, n):
            return x[r * n // 2 : (r + 1) * n // 2]

        layer0, layer2, moe = model.model.layers[0], model.model.layers[2], model.model.layers[1].mlp
        kda = layer0.self_attn
        ck = lambda name: t[P + name].float()  # noqa: E731
        # Column-parallel: dim 0.
        assert torch.equal(kda.q_proj.weight, rows(ck("model.layers.0.self_attn.q_proj.weight"), H * 16))
        assert torch.equal(kda.q_conv1d.weight, rows(ck("model.layers.0.self_attn.q_conv1d.weight"), H * 16))
        assert torch.equal(layer2.self_attn.kv_b_proj.weight, rows(ck("model.layers.2.self_attn.kv_b_proj.weight"), 128))
        assert torch.equal(model.lm_head.weight, rows(ck("lm_head.weight"), TINY.vocab_size))
        # Row-parallel: dim 1.
        assert torch.equal(kda.o_proj.weight, rows(ck(O_PROJ).T, H * 16).T)
        assert torch.equal(layer0.mlp.mlp.down_proj.weight, rows(ck("model.layers.0.mlp.down_proj.weight").T, 128).T)
        # A_log: the first H of 16 stored entries, split by head.
        assert torch.equal(kda.A_log, rows(ck("model.layers.0.self_attn.A_log")[:H], H))
        assert kda.A_log.shape == (H // 2,)
        # Replicated.
        assert torch.equal(moe.routed_expert_up_proj.weight, ck("model.layers.1.block_sparse_moe.routed_expert_up_proj.weight"))
        # Routed experts: split on the intermediate dim (w1/w3 rows, w2 columns).
        assert moe.experts.w1.shape == (E, inter // 2, L) and moe.experts.w2.shape == (E, L, inter // 2)
        w2 = moe.experts.w2[3]
        if experts == "bf16":
            assert torch.equal(w2, rows(ck(W2 + ".weight").T, inter).T)
        else:  # packed bytes and scale groups split along the packed columns
            packed, scale = t[P + W2 + ".weight_packed"], t[P + W2 + ".weight_scale"]
            half = unpack_mxfp4(rows(packed.T, inter // 2).T, rows(scale.T, inter // 32).T, torch.float32)
            assert torch.equal(w2, half)
            assert torch.equal(w2, rows(unpack_mxfp4(packed, scale, torch.float32).T, inter).T)


def _replicated_and_unused_bytes(d: Path) -> tuple[int, int]:
    """Bytes of replicated tensors, and of stored A_log entries no rank uses."""
    cfg = load_config(d)
    hdr = headers(d)
    with torch.device("meta"):
        specs = shard_specs(K3ForCausalLM(cfg))
    size = {"BF16": 2, "F32": 4, "U8": 1}
    replicated = unused = 0
    for spec in specs.values():
        for name in spec.names:
            stored_names = [k for k in (name, name.removesuffix(".weight") + ".weight_packed",
                                        name.removesuffix(".weight") + ".weight_scale") if P + k in hdr]
            nbytes = sum(torch.Size(hdr[P + k][0]).numel() * size[hdr[P + k][1]] for k in stored_names)
            if spec.dim is None:
                replicated += nbytes
            if spec.extent is not None:
                unused += nbytes * (spec.shape[spec.dim] - spec.extent) // spec.shape[spec.dim]
    return replicated, unused


@pytest.mark.parametrize("experts", ["bf16", "mxfp4"])
def test_each_rank_reads_only_its_slice(ckpt, experts):
    d = ckpt("tiny", experts)
    total = json.loads((d / INDEX_FILE).read_text())["metadata"]["total_size"]
    replicated, unused = _replicated_and_unused_bytes(d)
    _, r1 = build(d)
    assert r1.bytes_read == total - unused  # everything once, but the unused A_log tail
    n_packed = sum(k.endswith(".weight_packed") for k in weight_map(d))
    assert r1.tensors == len(weight_map(d)) - n_packed  # one per logical tensor (packed + scale: one)
    per_rank = []
    for r in range(2):
        _, rep = build(d, ParallelPlan(tp=2, rank=r))
        assert 0 < rep.bytes_read < r1.bytes_read
        per_rank.append(rep.bytes_read)
    # Sharded tensors are read once across the ranks, replicated ones by every rank.
    assert sum(per_rank) == r1.bytes_read + replicated


def _read_bytes(d: Path, name: str, spec: ShardSpec, plan: ParallelPlan) -> tuple[torch.Tensor, int]:
    report = LoadReport()
    with CheckpointReader(d, P) as reader:
        value = read_local_tensor(reader, name, spec, plan, torch.float32, False, report)
    assert report.tensors == 1
    return value, report.bytes_read


def test_row_parallel_and_mxfp4_tensors_read_half_at_tp2(ckpt):
    bf, mx = ckpt("tiny", "bf16"), ckpt("tiny", "mxfp4")
    with torch.device("meta"):
        specs = shard_specs(K3ForCausalLM(TINY))
    h, L, inter = TINY.hidden_size, TINY.routed_expert_hidden_size, TINY.moe_intermediate_size
    hd = TINY.linear_attn.num_heads * TINY.linear_attn.head_dim

    o_spec = specs["model.layers.0.self_attn.o_proj.weight"]
    assert o_spec.dim == 1
    full, b1 = _read_bytes(bf, O_PROJ, o_spec, ParallelPlan())
    assert b1 == h * hd * 2  # bf16
    for r in range(2):
        part, b2 = _read_bytes(bf, O_PROJ, o_spec, ParallelPlan(2, r))
        assert b2 == b1 // 2
        assert torch.equal(part, full[:, r * hd // 2 : (r + 1) * hd // 2])

    for proj, rows, cols in (("w2", L, inter), ("w1", inter, L)):
        spec = specs[f"model.layers.1.mlp.experts.{proj}"]
        name = f"model.layers.1.block_sparse_moe.experts.3.{proj}.weight"
        assert name in spec.names and spec.quantized
        full, b1 = _read_bytes(mx, name, spec, ParallelPlan())
        assert b1 == rows * cols // 2 + rows * cols // 32  # packed bytes + scale bytes
        for r in range(2):
            part, b2 = _read_bytes(mx, name, spec, ParallelPlan(2, r))
            assert b2 == b1 // 2
            want = full.chunk(2, dim=spec.dim)[r]
            assert torch.equal(part, want), (proj, r)


@pytest.mark.parametrize("experts", ["bf16", "mxfp4"])
def test_meta_load_reads_nothing_but_checks_headers(ckpt, experts):
    d = ckpt("tiny", experts)
    model, report = build(d, meta=True)
    assert report.bytes_read == 0
    assert report.tensors == sum(len(s.names) for s in shard_specs(model).values())
    assert all(p.is_meta for p in model.parameters())
    model, report = build(d, ParallelPlan(2, 1), meta=True)
    assert report.bytes_read == 0 and all(p.is_meta for p in model.parameters())


# ---------------------------------------------------------------------------
# Errors: a CheckpointError naming the tensor and the file
# ---------------------------------------------------------------------------


def broken(src: Path, tmp_path: Path, change: Callable[[Path], None]) -> Path:
    d = tmp_path / "broken"
    shutil.copytree(src, d)
    change(d)
    return d


def rewrite_shard(d: Path, name: str, change: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    """Rewrite the shard holding ``name`` after ``change`` edits its tensors; returns its path."""
    path = d / weight_map(d)[name]
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path


def edit_index(d: Path, change: Callable[[dict[str, str]], None]) -> Path:
    path = d / INDEX_FILE
    index = json.loads(path.read_text())
    change(index["weight_map"])
    path.write_text(json.dumps(index))
    return path


def load_error(d: Path, meta: bool = False) -> str:
    with pytest.raises(CheckpointError) as info:
        if meta:
            build(d, meta=True)
        else:
            load_reference(d)
    return str(info.value)


def assert_names(msg: str, tensor: str, file: Path) -> None:
    assert f"'{tensor}'" in msg, msg
    assert str(file) in msg, msg


def first_tensor_of(d: Path, file: str, msg: str) -> None:
    """The message names some tensor that the index places in ``file``."""
    named = re.findall(r"tensor '([^']+)'", msg)
    assert named and weight_map(d)[named[0]] == file, msg
    assert str(d / file) in msg, msg


@pytest.mark.parametrize("meta", [False, True])
def test_tensor_missing_from_index(ckpt, tmp_path, meta):
    d = broken(ckpt(), tmp_path, lambda d: edit_index(d, lambda wm: wm.pop(P + O_PROJ)))
    msg = load_error(d, meta)
    assert_names(msg, P + O_PROJ, d / INDEX_FILE)
    assert "missing" in msg


def test_index_points_to_a_missing_shard_file(ckpt, tmp_path):
    d = broken(ckpt(), tmp_path, lambda d: edit_index(d, lambda wm: wm.update({P + O_PROJ: "model-00099-of-00099.safetensors"})))
    msg = load_error(d)
    assert_names(msg, P + O_PROJ, d / "model-00099-of-00099.safetensors")
    assert "does not exist" in msg


def test_deleted_shard_file(ckpt, tmp_path):
    src = ckpt()
    file = weight_map(src)[P + O_PROJ]
    d = broken(src, tmp_path, lambda d: (d / file).unlink())
    msg = load_error(d, meta=True)
    first_tensor_of(d, file, msg)


def test_tensor_listed_but_absent_from_its_shard(ckpt, tmp_path):
    def change(d):
        rewrite_shard(d, P + O_PROJ, lambda t: t.pop(P + O_PROJ))

    d = broken(ckpt(), tmp_path, change)
    msg = load_error(d)
    assert_names(msg, P + O_PROJ, d / weight_map(d)[P + O_PROJ])
    assert "not found" in msg


@pytest.mark.parametrize("meta", [False, True])
def test_wrong_shape(ckpt, tmp_path, meta):
    def change(d):
        rewrite_shard(d, P + O_PROJ, lambda t: t.update({P + O_PROJ: t[P + O_PROJ][:, :32].contiguous()}))

    d = broken(ckpt(), tmp_path, change)
    msg = load_error(d, meta)
    assert_names(msg, P + O_PROJ, d / weight_map(d)[P + O_PROJ])
    assert "shape [64, 32], expected [64, 64]" in msg


@pytest.mark.parametrize(
    "name, to, want",
    [(O_PROJ, torch.float32, "dtype F32, expected BF16"), ("model.layers.0.self_attn.A_log", torch.bfloat16, "dtype BF16, expected F32")],
)
def test_wrong_dtype(ckpt, tmp_path, name, to, want):
    def change(d):
        rewrite_shard(d, P + name, lambda t: t.update({P + name: t[P + name].to(to)}))

    d = broken(ckpt(), tmp_path, change)
    for meta in (False, True):
        msg = load_error(d, meta)
        assert_names(msg, P + name, d / weight_map(d)[P + name])
        assert want in msg


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])


def _garbage_header(path: Path) -> None:
    data = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    data[8 : 8 + n] = b"#" * n
    path.write_bytes(bytes(data))


def _huge_header(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[:8] = struct.pack("<Q", 1 << 40)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("corrupt", [_truncate, _garbage_header, _huge_header, lambda p: p.write_bytes(b"")])
def test_corrupt_shard_file(ckpt, tmp_path, corrupt):
    src = ckpt()
    file = weight_map(src)[P + O_PROJ]
    d = broken(src, tmp_path, lambda d: corrupt(d / file))
    msg = load_error(d)
    first_tensor_of(d, file, msg)
    assert "corrupt" in msg


@pytest.mark.parametrize("meta", [False, True])
def test_mxfp4_scale_with_the_wrong_shape(ckpt, tmp_path, meta):
    scale = P + W2 + ".weight_scale"

    def change(d):
        rewrite_shard(d, scale, lambda t: t.update({scale: torch.cat([t[scale], t[scale][:, :1]], 1)}))

    d = broken(ckpt("tiny", "mxfp4"), tmp_path, change)
    msg = load_error(d, meta)
    assert P + W2 in msg and "weight_scale" in msg, msg
    assert str(d / weight_map(d)[scale]) in msg, msg


def test_mxfp4_packed_with_the_wrong_dtype(ckpt, tmp_path):
    packed = P + W2 + ".weight_packed"

    def change(d):
        rewrite_shard(d, packed, lambda t: t.update({packed: t[packed].view(torch.int8)}))

    d = broken(ckpt("tiny", "mxfp4"), tmp_path, change)
    for meta in (False, True):
        msg = load_error(d, meta)
        assert_names(msg, packed, d / weight_map(d)[packed])
        assert "I8" in msg and "U8" in msg


def test_mxfp4_scale_missing_from_the_index(ckpt, tmp_path):
    scale = P + W2 + ".weight_scale"
    d = broken(ckpt("tiny", "mxfp4"), tmp_path, lambda d: edit_index(d, lambda wm: wm.pop(scale)))
    assert_names(load_error(d, meta=True), scale, d / INDEX_FILE)


def test_missing_index_file(ckpt, tmp_path):
    d = broken(ckpt(), tmp_path, lambda d: (d / INDEX_FILE).unlink())
    with pytest.raises(CheckpointError, match="missing safetensors index") as info:
        load_reference(d)
    assert str(d / INDEX_FILE) in str(info.value)


@pytest.mark.parametrize("content", ["{not json", '{"metadata": {}}', '{"weight_map": []}'])
def test_bad_index_file(ckpt, tmp_path, content):
    d = broken(ckpt(), tmp_path, lambda d: (d / INDEX_FILE).write_text(content))
    with pytest.raises(CheckpointError, match="not a safetensors index") as info:
        load_reference(d)
    assert str(d / INDEX_FILE) in str(info.value)


def test_wrong_prefix_names_the_prefixed_tensor(ckpt):
    """A kimi_linear checkpoint read with the kimi_k3 prefix: the first missing name is reported."""
    d = ckpt("tiny-linear")
    with torch.device("meta"):
        model = K3ForCausalLM(PRESETS["tiny-linear"])
    with pytest.raises(CheckpointError) as info:
        load_weights(model, d, ParallelPlan(), P)
    assert_names(str(info.value), P + "model.embed_tokens.weight", d / INDEX_FILE)




def test_the_index_decides_the_experts_format(ckpt, tmp_path):
    """quantization_config may be wrong or missing: the experts' tensors in the index decide;
    an index that holds both forms is refused."""
    from k3compile.checkpoint.loader import load_checkpoint_config

    def claim_mxfp4(d: Path) -> None:
        hf = json.loads((d / "config.json").read_text())
        hf["quantization_config"] = {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized"}
        (d / "config.json").write_text(json.dumps(hf))

    d = broken(ckpt("tiny", "bf16"), tmp_path / "claims", claim_mxfp4)
    assert load_config(d).expert_format == "mxfp4" and load_checkpoint_config(d).expert_format == "bf16"
    assert load_checkpoint_config(ckpt("tiny", "mxfp4")).expert_format == "mxfp4"

    def add_a_dense_expert(d: Path) -> None:
        index = json.loads((d / INDEX_FILE).read_text())
        name = P + "model.layers.1.block_sparse_moe.experts.0.w1.weight"
        index["weight_map"][name] = next(iter(index["weight_map"].values()))
        (d / INDEX_FILE).write_text(json.dumps(index))

    d = broken(ckpt("tiny", "mxfp4"), tmp_path / "mixed", add_a_dense_expert)
    with pytest.raises(CheckpointError, match="some routed experts are MXFP4 .* and some bf16"):
        load_checkpoint_config(d)


def test_a_checkpoint_too_large_for_the_disk_is_refused_before_writing(tmp_path):
    """A config with a vocabulary of 10^12 would need petabytes: refused up front, nothing
    written. The estimate is within 10% of what a real generation writes (headers aside)."""
    from k3compile.checkpoint.generate import GenerateOptions, generate_model_dir, stored_bytes

    huge = PRESETS["tiny"].replace(vocab_size=10**12)
    with pytest.raises(ValueError, match=r"the checkpoint would take \d+\.\d GiB; .* GiB free"):
        generate_model_dir(huge, tmp_path / "huge")
    assert list(tmp_path.iterdir()) == []
    for experts in ("bf16", "mxfp4"):
        out = generate_model_dir(PRESETS["tiny"], tmp_path / experts, GenerateOptions(seed=0, experts=experts))
        written = sum(p.stat().st_size for p in out.glob("*.safetensors"))
        cfg = PRESETS["tiny"].replace(expert_format=experts)
        assert 0.9 * written <= stored_bytes(cfg) <= written  # the safetensors headers are not counted
