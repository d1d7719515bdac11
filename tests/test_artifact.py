"""The compiled artifact: save/load round trip on real captured programs and a real
generated checkpoint, the programs running with real weights after loading, and every
way loading must refuse a damaged artifact."""

from __future__ import annotations

import hashlib
import io
import json
import pickle
import os
import shutil
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path

import pytest
import torch

from k3compile.artifact import (
    ALLOW_OTHER_TORCH,
    ArtifactError,
    ArtifactWarning,
    load_artifact,
    read_artifact_info,
    torch_release,
)
from k3compile.archive_check import check_archive
from k3compile.artifact_manifest import FORMAT_NAME, FORMAT_VERSION
from k3compile.artifact_writer import check_output_dir, save_artifact, write_manifest
from k3compile.batch import CacheShape, flatten_caches
from k3compile.capture import capture
from k3compile.checkpoint.generate import GenerateOptions, generate_model_dir
from k3compile.checkpoint.identity import CheckpointChanged, check_full_hashes, has_full_hashes
from k3compile.checkpoint.loader import INDEX_FILE
from k3compile.config import PRESETS
from k3compile.reference import ReferenceEngine, load_reference
from k3compile.sharding import ParallelPlan

from checkpoint_files import flip_unsampled_byte

PASSES = [{"name": "remove_noop_views", "phase": "decode", "changed": True, "stats": {"nodes_removed": 3.0}}]


# ---------------------------------------------------------------------------
# Fixtures (module-scoped: capture takes seconds)
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return generate_model_dir(PRESETS["tiny"], tmp_path_factory.mktemp("ckpt") / "tiny", GenerateOptions(seed=1))


@pytest.fixture(scope="module")
def captured():
    return capture(PRESETS["tiny"], ParallelPlan(), torch.float32)


@pytest.fixture(scope="module")
def captured_tp2():
    return capture(PRESETS["tiny"], ParallelPlan(tp=2, rank=0), torch.float32, phases=("decode",))


@pytest.fixture(scope="module")
def saved(tmp_path_factory, captured, model_dir):
    return save_artifact(tmp_path_factory.mktemp("art") / "tiny-tp1", captured, model_dir, "cpu", PASSES)


@pytest.fixture(scope="module")
def loaded(saved):
    return load_artifact(saved, world_size=1)


@pytest.fixture
def copy(saved, tmp_path):
    """A private copy of the saved artifact to damage."""
    return Path(shutil.copytree(saved, tmp_path / "out"))


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _rehash(root: Path, name: str) -> None:
    """Update the manifest entry of ``name`` (so only the check under test can fail)."""
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["files"][name] = {"sha256": _sha(root / name), "size": (root / name).stat().st_size}
    write_manifest(root, manifest)


def _snapshot(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): _sha(p) for p in sorted(root.rglob("*")) if p.is_file()}


def _hidden(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if p.name.startswith(".")]


# ---------------------------------------------------------------------------
# Round trip
# ---------------------------------------------------------------------------


def test_layout_and_manifest(saved, captured, model_dir):
    files = sorted(p.relative_to(saved).as_posix() for p in saved.rglob("*") if p.is_file())
    assert files == [
        "code/decode.py",
        "code/prefill.py",
        "decode.pt2",
        "manifest.json",
        "manifest.sha256",
        "prefill.pt2",
        "sharding/rank0.json",
    ]
    m = json.loads((saved / "manifest.json").read_text())
    assert m["format"] == FORMAT_NAME and m["format_version"] == FORMAT_VERSION == 5
    assert m["torch_version"] == torch.__version__ and m["k3compile_version"]
    assert m["config"] == json.loads(json.dumps(PRESETS["tiny"].to_dict()))
    assert m["model_dir"] == str(Path(model_dir).resolve()) and Path(m["model_dir"]).is_absolute()
    assert m["checkpoint_index_sha256"] == _sha(Path(model_dir) / INDEX_FILE)
    assert (m["dtype"], m["block_size"], m["parallel"], m["target"]) == ("float32", 16, {"tp": 1, "dcp": 1, "dcp_interleave": 1}, "cpu")
    assert m["kv_cache_dtype"] == "float32"  # auto: the model dtype
    assert m["lowering"] == "eager"  # the default of save_artifact (the compiler passes the target's)
    assert m["passes"] == PASSES and m["phases"] == ["decode", "prefill"]
    assert m["capture_stats"]["nodes"] == captured.stats.nodes
    assert set(m["files"]) == set(files) - {"manifest.json", "manifest.sha256"}
    for name, entry in m["files"].items():
        assert entry == {"sha256": _sha(saved / name), "size": (saved / name).stat().st_size}
    code = (saved / "code" / "decode.py").read_text()
    assert "def forward" in code and "torch.ops.k3." in code


def test_no_pickle_in_programs(saved, captured):
    for phase in ("decode", "prefill"):
        check_archive(saved / f"{phase}.pt2")
        with zipfile.ZipFile(saved / f"{phase}.pt2") as z:
            for info in z.infolist():
                if info.filename.endswith((".pt", ".pkl")):
                    assert info.file_size == 0, info.filename
                assert not z.read(info).startswith(b"\x80"), info.filename
        # saving restored the captured program's example inputs
        assert captured.programs[phase].example_inputs is not None


def _targets(program) -> list[str]:
    return [str(n.target) for n in program.graph.nodes if n.op == "call_function"]


def test_load_round_trip(loaded, captured, saved):
    info = loaded.info
    assert info.config == PRESETS["tiny"] == loaded.config
    assert (info.tp, info.dcp, info.dtype, info.block_size, info.target) == (1, 1, torch.float32, 16, "cpu")
    assert info.passes == PASSES and info.phases == ("decode", "prefill")
    assert info.capture_stats == captured.stats
    assert loaded.specs == captured.specs
    for phase, original in captured.programs.items():
        program = loaded.programs[phase]
        assert len(program.graph.nodes) == len(original.graph.nodes)
        assert _targets(program) == _targets(original)
        assert any(t.startswith("k3.") for t in _targets(program))
        assert program.example_inputs is None
        params = program.graph_signature.parameters
        assert all(t.device.type == "meta" for n, t in program.state_dict.items() if n in params)


def test_loaded_program_runs_like_the_original(loaded, captured, model_dir):
    ref = load_reference(model_dir)
    weights = {f"k3.{k}": v for k, v in ref.state_dict().items()}
    engine = ReferenceEngine(ref, CacheShape(4, 32, 16))
    ids, _ = engine.prefill([[1, 2, 3, 4, 5], [7], [9, 8]])
    tokens = [[11], [13], [16]]
    engine.table.reserve(ids, [1, 1, 1])  # what engine.step does before running the model
    b = engine.table.make_batch(ids, [1, 1, 1], True, False, engine.device)
    x = torch.tensor([t[0] for t in tokens])
    step = (x, b.cu_seqlens, b.seq_lens, b.state_slots, b.block_table, b.slot_mapping, b.logit_indices)

    outs, caches = [], []
    for program in (captured.programs["decode"], loaded.programs["decode"]):
        gm = program.module()
        gm.load_state_dict(weights, assign=True)
        flat = [c.clone() for c in flatten_caches(engine.caches)]
        outs.append(gm(*step, flat))
        caches.append(flat)
    expected = engine.step(ids, tokens)
    assert outs[0].shape == (3, PRESETS["tiny"].vocab_size)
    assert torch.equal(outs[0], outs[1])
    assert all(torch.equal(a, b) for a, b in zip(*caches))  # same in-place cache updates
    torch.testing.assert_close(outs[1], expected, rtol=1e-4, atol=1e-4)


def test_tp2_rank_files(tmp_path, captured_tp2, model_dir):
    out = save_artifact(tmp_path / "tp2", captured_tp2, model_dir, "mi355x", [])
    assert sorted(p.name for p in (out / "sharding").iterdir()) == ["rank0.json", "rank1.json"]
    ranks = [json.loads((out / "sharding" / f"rank{r}.json").read_text()) for r in range(2)]
    sharded = 0
    for name, spec in captured_tp2.specs.items():
        r0, r1 = ranks[0]["params"][name], ranks[1]["params"][name]
        for r, entry in enumerate((r0, r1)):
            assert entry["checkpoint_names"] == list(spec.names)
            assert (entry["dtype"], entry["shape"], entry["dim"], entry["quantized"]) == (
                spec.dtype,
                list(spec.shape),
                spec.dim,
                spec.quantized,
            )
            rng = spec.split_range(ParallelPlan(2, r))
            assert entry["range"] == (None if rng is None else list(rng))
        if spec.dim is not None:
            sharded += 1
            extent = spec.extent or spec.shape[spec.dim]
            assert r0["range"] == [0, extent // 2] and r1["range"] == [extent // 2, extent]
    assert sharded > 10
    assert any(s["quantized"] for s in ranks[0]["params"].values())  # routed experts may be mxfp4

    art = load_artifact(out, world_size=2)
    assert art.info.tp == 2 and art.info.target == "mi355x" and art.specs == captured_tp2.specs
    assert art.ranges(1) == {n: s.split_range(ParallelPlan(2, 1)) for n, s in captured_tp2.specs.items()}
    collectives = [n for n in art.programs["decode"].graph.nodes if "_c10d_functional" in str(n.target)]
    assert collectives
    with pytest.raises(ArtifactError, match=r"parallel.tp' is 2 but the world size is 1"):
        load_artifact(out, world_size=1)


# ---------------------------------------------------------------------------
# Refusals
# ---------------------------------------------------------------------------


def test_tampered_program(copy):
    data = bytearray((copy / "decode.pt2").read_bytes())
    data[len(data) // 2] ^= 0x01
    (copy / "decode.pt2").write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match=r"decode\.pt2: sha256 .* differs"):
        load_artifact(copy)


def test_truncated_code_dump(copy):
    path = copy / "code" / "prefill.py"
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(ArtifactError, match=r"code/prefill\.py: size .* differs"):
        load_artifact(copy)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("format_version", 6, r"'format_version' is 6 \(written by a newer k3compile\)"),
        ("format_version", 4, r"'format_version' is 4; this k3compile reads version 5"),
        ("format_version", "1", r"'format_version' has type str"),
        ("format", "something-else", r"field 'format' is 'something-else'"),
        ("dtype", "int8", r"field 'dtype' is 'int8'"),
        ("kv_cache_dtype", "float8_e5m2", r"field 'kv_cache_dtype' is 'float8_e5m2', expected one of"),
        ("lowering", "aot", r"field 'lowering' is 'aot', expected one of inductor, eager"),
        ("config", {"hidden_size": 3}, r"field 'config' is not a valid K3 config"),
        ("parallel", {"tp": 1, "dcp": 2}, r"parallel.dcp"),
        ("checkpoint_shards", {"a.safetensors": {"size": 1}}, r"'a.safetensors' needs exactly 'size', 'header_sha256'"),
        ("checkpoint_shards", {"a.safetensors": {"size": -1, "header_sha256": "0" * 64, "sample_sha256": "0" * 64}},
         r"'size' must be a non-negative integer"),
        ("checkpoint_shards", {"a.safetensors": {"size": 1, "header_sha256": "x", "sample_sha256": "0" * 64}},
         r"the hashes must be 64 hex digits"),
        ("checkpoint_shards", {"a.safetensors": {"size": 1, "header_sha256": "0" * 64, "sample_sha256": "0" * 64,
                                                 "sha256": "0" * 63}}, r"the hashes must be 64 hex digits"),
        ("checkpoint_shards", {"a.safetensors": {"size": 1, "header_sha256": "0" * 64, "sample_sha256": "0" * 64,
                                                 "code": "x"}}, r"needs exactly 'size', 'header_sha256'"),
    ],
)
def test_bad_manifest_field(copy, field, value, message):
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest[field] = value
    write_manifest(copy, manifest)
    with pytest.raises(ArtifactError, match=message):
        load_artifact(copy)


def test_edited_manifest_is_rejected(copy):
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["config"]["hidden_size"] = 128
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match=r"manifest\.json: sha256 differs from manifest\.sha256"):
        load_artifact(copy)
    (copy / "manifest.sha256").unlink()
    with pytest.raises(ArtifactError, match=r"manifest\.sha256: missing"):
        load_artifact(copy)


def test_another_torch_release_is_refused_unless_overridden(copy, monkeypatch):
    """The compiler's artifact with its manifest edited to name another torch release and
    re-sealed (as a user who upgraded torch, or an attacker, would): loading refuses and
    names both versions; check_torch="warn" or K3COMPILE_ALLOW_OTHER_TORCH=1 loads it with
    a warning; another build of the same release (a local label) loads silently."""
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["torch_version"] = "2.99.0+cu130"
    write_manifest(copy, manifest)
    with pytest.raises(ArtifactError) as refused:
        load_artifact(copy, world_size=1)
    assert str(refused.value).startswith(
        f"manifest.json: field 'torch_version' is 2.99.0+cu130, this is torch {torch.__version__}; ")
    assert "check_torch='warn'" in str(refused.value) and f"{ALLOW_OTHER_TORCH}=1" in str(refused.value)
    assert read_artifact_info(copy).torch_version == "2.99.0+cu130"  # the manifest alone still reads (inspect)
    with pytest.warns(ArtifactWarning, match="torch_version' is 2.99.0"):
        assert set(load_artifact(copy, world_size=1, check_torch="warn").programs) == {"decode", "prefill"}
    monkeypatch.setenv(ALLOW_OTHER_TORCH, "1")
    with pytest.warns(ArtifactWarning, match="torch_version' is 2.99.0"):
        load_artifact(copy, world_size=1)
    monkeypatch.delenv(ALLOW_OTHER_TORCH)
    manifest["torch_version"] = torch_release(torch.__version__) + "+cu130"
    write_manifest(copy, manifest)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_artifact(copy, world_size=1)


def test_missing_manifest(copy):
    (copy / "manifest.json").unlink()
    with pytest.raises(ArtifactError, match=r"manifest\.json: missing manifest"):
        load_artifact(copy)
    with pytest.raises(ArtifactError, match="no artifact directory"):
        load_artifact(copy / "nope")


def test_missing_file(copy):
    (copy / "sharding" / "rank0.json").unlink()
    with pytest.raises(ArtifactError, match=r"sharding/rank0\.json: missing"):
        load_artifact(copy)


def test_unexpected_file(copy):
    (copy / "code" / "evil.py").write_text("import os\n")
    with pytest.raises(ArtifactError, match=r"code/evil\.py: unexpected file"):
        load_artifact(copy)
    # listing it in the manifest does not help: it is not part of the layout
    _rehash(copy, "code/evil.py")
    with pytest.raises(ArtifactError, match=r"lists 'code/evil\.py', which is not part"):
        load_artifact(copy)


def test_path_outside_artifact(copy):
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["files"]["../x"] = {"sha256": "0", "size": 0}
    write_manifest(copy, manifest)
    with pytest.raises(ArtifactError, match=r"invalid path '\.\./x'"):
        load_artifact(copy)


def test_world_size_mismatch(saved):
    with pytest.raises(ArtifactError, match=r"'parallel.tp' is 1 but the world size is 2"):
        load_artifact(saved, world_size=2)


@pytest.mark.parametrize(
    "member, payload, message",
    [
        ("extra/blob", pickle.dumps({"x": 1}), r"member 'extra/blob' is not one k3compile writes"),
        ("data/sample_inputs/other.pkl", pickle.dumps(1), r"'data/sample_inputs/other.pkl' is not one k3compile"),
        # torch.save output (a zip with a pickle) as a payload no config names
        ("data/weights/weight_9", None, r"'data/weights/weight_9' is not one k3compile writes"),
    ],
)
def test_pickle_inside_pt2(copy, member, payload, message):
    if payload is None:
        buf = io.BytesIO()
        torch.save(torch.zeros(2), buf)
        payload = buf.getvalue()
    path = copy / "decode.pt2"
    with zipfile.ZipFile(path, "a") as z:
        root = z.namelist()[0].split("/", 1)[0]
        z.writestr(f"{root}/{member}", payload)
    _rehash(copy, "decode.pt2")
    with pytest.raises(ArtifactError, match=rf"decode\.pt2: .*{message}"):
        load_artifact(copy)


def test_pickled_payload_config(copy):
    """A weights config that marks a payload as pickled is refused before torch sees it."""
    path = copy / "prefill.pt2"
    with zipfile.ZipFile(path) as z:
        members = {i.filename: z.read(i) for i in z.infolist()}
    name = next(n for n in members if n.endswith("data/weights/model_weights_config.json"))
    config = json.loads(members[name])
    first = next(iter(config["config"]))
    config["config"][first]["use_pickle"] = True
    members[name] = json.dumps(config).encode()
    with zipfile.ZipFile(path, "w") as z:
        for n, data in members.items():
            z.writestr(n, data)
    _rehash(copy, "prefill.pt2")
    with pytest.raises(ArtifactError, match=rf"prefill\.pt2: '{first}' .* stored as a pickle"):
        load_artifact(copy)


def test_changed_checkpoint(tmp_path, captured_tp2, model_dir):
    ckpt = Path(shutil.copytree(model_dir, tmp_path / "ckpt"))
    out = save_artifact(tmp_path / "art", captured_tp2, ckpt, "cpu", [])
    read_artifact_info(out)
    index = ckpt / INDEX_FILE
    index.write_text(index.read_text().replace("model-", "renamed-model-", 1))
    with pytest.raises(ArtifactError, match=r"source checkpoint changed since compilation"):
        load_artifact(out)
    with pytest.warns(ArtifactWarning, match="changed since compilation"):
        assert read_artifact_info(out, check_checkpoint="warn").tp == 2
    assert read_artifact_info(out, check_checkpoint=False).tp == 2
    index.unlink()
    with pytest.raises(ArtifactError, match="missing checkpoint index"):
        read_artifact_info(out)


def test_regenerated_or_damaged_weights_are_refused_naming_the_shard(tmp_path, captured_tp2, model_dir):
    """Weights regenerated with another seed have the same index and headers: the sampled
    content tells them apart. A shard cut short, or with another tensor list, is named too."""
    ckpt = Path(shutil.copytree(model_dir, tmp_path / "ckpt"))
    out = save_artifact(tmp_path / "art", captured_tp2, ckpt, "cpu", [])
    manifest = json.loads((out / "manifest.json").read_text())
    shards = sorted(manifest["checkpoint_shards"])
    assert shards == sorted(p.name for p in ckpt.glob("*.safetensors"))
    other = generate_model_dir(PRESETS["tiny"], tmp_path / "other", GenerateOptions(seed=2))
    assert (other / INDEX_FILE).read_text() == (ckpt / INDEX_FILE).read_text()  # same layout, other weights
    victim = ckpt / shards[-1]
    shutil.copyfile(other / shards[-1], victim)
    with pytest.raises(ArtifactError, match=rf"{victim.name}: its weights changed since compilation"):
        load_artifact(out)
    shutil.copyfile(model_dir / shards[-1], victim)
    load_artifact(out)  # restored: loads again
    with victim.open("r+b") as f:
        f.truncate(victim.stat().st_size - 4)
    with pytest.raises(ArtifactError, match=rf"{victim.name}: \d+ bytes, \d+ when the artifact was compiled"):
        load_artifact(out)
    shutil.copyfile(model_dir / shards[-1], victim)
    data = bytearray(victim.read_bytes())
    data[12] ^= 0x01  # inside the JSON header
    victim.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match=rf"{victim.name}: its tensor list \(safetensors header\) changed"):
        load_artifact(out)
    victim.unlink()
    with pytest.raises(ArtifactError, match=rf"{victim.name}: missing"):
        load_artifact(out)


def test_hash_weights_records_full_hashes_that_catch_an_unsampled_change(tmp_path, captured_tp2):
    """A byte changed between the sampled blocks passes the cheap identity at load; the full
    hashes that --hash-weights records catch it, naming the shard."""
    ckpt = generate_model_dir(PRESETS["tiny"], tmp_path / "ckpt", GenerateOptions(seed=1, shard_bytes=1_000_000))
    out = save_artifact(tmp_path / "art", captured_tp2, ckpt, "cpu", [], hash_weights=True)
    recorded = read_artifact_info(out).checkpoint_shards
    assert len(recorded) >= 2 and has_full_hashes(recorded)
    for name, identity in recorded.items():
        assert identity.sha256 == hashlib.sha256((ckpt / name).read_bytes()).hexdigest()
    check_full_hashes(ckpt, recorded)
    victim = ckpt / sorted(recorded)[1]
    flip_unsampled_byte(victim)
    load_artifact(out)  # the cheap identity does not see it
    with pytest.raises(CheckpointChanged, match=rf"{victim.name}: its content changed since compilation "
                                                rf"\(sha256 [0-9a-f]{{64}}, recorded {recorded[victim.name].sha256}\)"):
        check_full_hashes(ckpt, recorded)
    check_full_hashes(ckpt, recorded, [n for n in sorted(recorded) if n != victim.name])  # the rest still match
    plain = save_artifact(tmp_path / "plain", captured_tp2, ckpt, "cpu", [])
    assert not has_full_hashes(read_artifact_info(plain).checkpoint_shards)
    assert "sha256" not in json.loads((plain / "manifest.json").read_text())["checkpoint_shards"][victim.name]


# ---------------------------------------------------------------------------
# Atomic writes
# ---------------------------------------------------------------------------


def test_refuses_existing_without_overwrite(copy, captured_tp2, model_dir):
    before = _snapshot(copy)
    with pytest.raises(ArtifactError, match="already exists"):
        save_artifact(copy, captured_tp2, model_dir, "cpu", [])
    assert _snapshot(copy) == before and _hidden(copy.parent) == []


def test_failed_save_leaves_old_artifact(copy, captured_tp2, model_dir):
    before = _snapshot(copy)
    # not JSON-serialisable: fails when the manifest is written, after the programs
    with pytest.raises(ArtifactError, match="not JSON-serialisable"):
        save_artifact(copy, captured_tp2, model_dir, "cpu", [{"bad": object()}], overwrite=True)
    assert _snapshot(copy) == before
    assert _hidden(copy.parent) == []
    assert read_artifact_info(copy).tp == 1

    fresh = copy.parent / "fresh"
    with pytest.raises(ArtifactError, match="not JSON-serialisable"):
        save_artifact(fresh, captured_tp2, model_dir, "cpu", [object()])
    assert not fresh.exists() and _hidden(copy.parent) == []


def test_an_interrupted_save_is_cleaned_up_by_the_next(tmp_path, captured_tp2, model_dir):
    """A killed ``optimize`` leaves ``.OUT.tmp-<pid>-*``: the next save of OUT removes it
    when that process is gone, and keeps a live process's (a concurrent save)."""
    out = tmp_path / "art"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f".art.tmp-{int(dead.stdout)}-x1y2"
    live = tmp_path / f".art.tmp-{os.getpid()}-z3"
    for folder in (stale, live):
        (folder / "code").mkdir(parents=True)
        (folder / "code" / "decode.py").write_text("half written")
    save_artifact(out, captured_tp2, model_dir, "cpu", [])
    assert not stale.exists() and live.exists()
    assert sorted(_hidden(tmp_path)) == [live.name]


def test_an_unwritable_output_is_refused_before_any_work(tmp_path, captured_tp2, model_dir):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ArtifactError, match=rf"cannot write {blocker}/sub/art: {blocker} is not a directory"):
        check_output_dir(blocker / "sub" / "art")
    with pytest.raises(ArtifactError, match="is not a directory"):
        save_artifact(blocker / "art", captured_tp2, model_dir, "cpu", [])


def test_overwrite_replaces(copy, captured_tp2, model_dir):
    save_artifact(copy, captured_tp2, model_dir, "h200", [{"name": "x"}], overwrite=True)
    info = read_artifact_info(copy, world_size=2)
    assert (info.tp, info.target, info.phases, info.passes) == (2, "h200", ("decode",), [{"name": "x"}])
    assert not (copy / "prefill.pt2").exists()
    assert _hidden(copy.parent) == []


def test_refuses_to_overwrite_a_non_artifact(tmp_path, captured_tp2, model_dir):
    victim = tmp_path / "data"
    victim.mkdir()
    (victim / "precious.txt").write_text("keep me")
    with pytest.raises(ArtifactError, match="not a k3compile artifact"):
        save_artifact(victim, captured_tp2, model_dir, "cpu", [], overwrite=True)
    assert (victim / "precious.txt").read_text() == "keep me"
    with pytest.raises(ArtifactError, match="unknown target"):
        save_artifact(tmp_path / "x", captured_tp2, model_dir, "tpu", [])
