"""Hostile artifacts: an attacker edits a real artifact's program archive and recomputes
every hash (the manifest's hashes are unkeyed), then someone loads it. Each route from
archive content to code execution that ``torch.export.load`` or ``ExportedProgram.module()``
has is tried with a payload that would create a marker file; loading must refuse, name
what it refused, and the marker must never appear (k3compile/archive_check.py)."""

from __future__ import annotations

import hashlib
import json
import pickle
import shutil
import struct
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from k3compile.archive_check import ArchiveRefused, check_guard, check_shape_expr, check_target
from k3compile.artifact import ArtifactError, load_artifact
from k3compile.artifact_writer import save_artifact, write_manifest
from k3compile.capture import capture
from k3compile.checkpoint.generate import GenerateOptions, generate_model_dir
from k3compile.config import PRESETS
from k3compile.sharding import ParallelPlan


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    model_dir = generate_model_dir(PRESETS["tiny"], tmp_path_factory.mktemp("ckpt") / "tiny", GenerateOptions(seed=1))
    captured = capture(PRESETS["tiny"], ParallelPlan(), torch.float32, phases=("decode",))
    return save_artifact(tmp_path_factory.mktemp("art") / "tiny", captured, model_dir, "cpu", [])


@pytest.fixture
def marker(tmp_path) -> Path:
    """The file a payload creates if it runs: it must never exist."""
    path = tmp_path / "pwned"
    yield path
    assert not path.exists(), "a payload in the artifact ran"


class _Touch:
    """Unpickling this creates the marker file (what a malicious pickle would do)."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _touch_code(marker: Path) -> str:
    return f"__import__('pathlib').Path('{marker}').touch()"


def _edit_program(saved: Path, tmp_path: Path, edit: Callable[[dict[str, bytes]], None]) -> Path:
    """A copy of the artifact whose decode archive ``edit`` changed (members by name below
    the archive's folder), with the manifest's hash and size of it recomputed."""
    out = Path(shutil.copytree(saved, tmp_path / "hostile"))
    path = out / "decode.pt2"
    with zipfile.ZipFile(path) as z:
        root = z.namelist()[0].split("/", 1)[0]
        members = {i.filename[len(root) + 1:]: z.read(i) for i in z.infolist()}
    edit(members)
    with zipfile.ZipFile(path, "w") as z:
        for name, data in members.items():
            z.writestr(f"{root}/{name}", data)
    _reseal(out)
    return out


def _reseal(out: Path) -> None:
    """Recompute the manifest's hash and size of the decode archive, as an attacker would."""
    path = out / "decode.pt2"
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["files"]["decode.pt2"] = {"sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
                                       "size": path.stat().st_size}
    write_manifest(out, manifest)


def _edit_json(name: str, change: Callable[[dict], None]) -> Callable[[dict[str, bytes]], None]:
    def edit(members: dict[str, bytes]) -> None:
        value = json.loads(members[name])
        change(value)
        members[name] = json.dumps(value).encode()

    return edit


def _first(value, key: str, where: Callable[[dict], bool] = lambda d: True) -> dict:
    """The first dict in ``value`` (depth first) that has ``key`` and passes ``where``."""
    if isinstance(value, dict):
        if key in value and where(value):
            return value
        children = value.values()
    elif isinstance(value, list):
        children = value
    else:
        return {}
    for child in children:
        found = _first(child, key, where)
        if found:
            return found
    return {}


def test_the_unedited_artifact_loads(saved):
    assert load_artifact(saved).programs["decode"].graph.nodes


@pytest.mark.parametrize("member", ["data/constants/custom_obj_0", "data/constants/opaque_obj_0",
                                    "data/sample_inputs/model.pt", "data/weights/weight_99",
                                    "data/aotinductor/model/model.so", "extra/anything"])
def test_a_pickle_under_a_name_the_loader_unpickles_is_refused(saved, tmp_path, marker, member):
    """Protocol 0 pickles do not start with the 0x80 header a scan might look for."""
    payload = pickle.dumps(_Touch(marker), protocol=0)
    hostile = _edit_program(saved, tmp_path, lambda m: m.__setitem__(member, payload))
    with pytest.raises(ArtifactError, match=rf"decode\.pt2: member '{member}' is (not one k3compile writes|a non-empty)"):
        load_artifact(hostile)


def test_code_in_a_shape_expression_is_refused(saved, tmp_path, marker):
    def inject(program: dict) -> None:
        expr = _first(program, "expr_str")
        expr["expr_str"] = f"Add({expr['expr_str']}, {_touch_code(marker)})"

    hostile = _edit_program(saved, tmp_path, _edit_json("models/model.json", inject))
    with pytest.raises(ArtifactError, match=r"decode\.pt2: shape expression .*'__import__' is not a sympy name"):
        load_artifact(hostile)


def test_code_in_a_guard_is_refused(saved, tmp_path, marker):
    hostile = _edit_program(saved, tmp_path, _edit_json(
        "models/model.json", lambda p: p["guards_code"].append(f"{_touch_code(marker)} is None")))
    with pytest.raises(ArtifactError, match=r"decode\.pt2: guard \"__import__.*unexpected text"):
        load_artifact(hostile)


@pytest.mark.parametrize("target", ["torch.os.system", "builtins.exec", "torch.load", "#evil:op",
                                    "torch.ops.aten.add.Tensor; import os"])
def test_a_node_target_outside_the_operator_namespaces_is_refused(saved, tmp_path, target):
    def retarget(program: dict) -> None:
        _first(program, "target", lambda d: "inputs" in d)["target"] = target

    hostile = _edit_program(saved, tmp_path, _edit_json("models/model.json", retarget))
    with pytest.raises(ArtifactError, match=r"decode\.pt2: node target .* is not an operator"):
        load_artifact(hostile)


def test_a_payload_config_cannot_name_members_of_its_choice(saved, tmp_path):
    def rename(config: dict) -> None:
        next(iter(config["config"].values()))["path_name"] = "../../models/model.json"

    hostile = _edit_program(saved, tmp_path, _edit_json("data/weights/model_weights_config.json", rename))
    with pytest.raises(ArtifactError, match=r"names payload '\.\./\.\./models/model\.json', not weight_"):
        load_artifact(hostile)


def test_paths_outside_the_archive_links_and_oversized_version_files_are_refused(saved, tmp_path):
    for i, (edit, message) in enumerate([
        (lambda m: m.__setitem__("../escape", b"x"), r"has a path outside the archive's folder"),
        (lambda m: m.__setitem__("archive_format", b"pt2" * 100), r"holds 300 bytes, more than a version file"),
    ]):
        hostile = _edit_program(saved, tmp_path / str(i), edit)
        with pytest.raises(ArtifactError, match=rf"decode\.pt2: .*{message}"):
            load_artifact(hostile)
    # a symlink entry (zip external attributes say S_IFLNK)
    out = _edit_program(saved, tmp_path / "link", lambda m: None)
    with zipfile.ZipFile(out / "decode.pt2", "a") as z:
        info = zipfile.ZipInfo(z.namelist()[0].split("/", 1)[0] + "/models/link")
        info.external_attr = (0o120777 << 16)
        z.writestr(info, "/etc/passwd")
    _reseal(out)
    with pytest.raises(ArtifactError, match=r"is a directory, a link or a duplicate"):
        load_artifact(out)


def _declare_size(path: Path, member_suffix: str, size: int) -> None:
    """Make the zip's central directory declare ``size`` uncompressed bytes for the member
    whose name ends with ``member_suffix`` (a forged header: the data stays as it was)."""
    data = bytearray(path.read_bytes())
    at = data.find(b"PK\x01\x02")
    while at >= 0:
        name_len = struct.unpack_from("<H", data, at + 28)[0]
        if bytes(data[at + 46:at + 46 + name_len]).decode().endswith(member_suffix):
            struct.pack_into("<I", data, at + 24, size)
            path.write_bytes(bytes(data))
            return
        at = data.find(b"PK\x01\x02", at + 46)
    raise AssertionError(f"no member ending with {member_suffix}")


@pytest.mark.parametrize("member, size, message", [
    ("models/model.json", 0x7FFFFFFF, r"'models/model\.json' is larger than 1073741824 bytes"),
    ("data/weights/model_weights_config.json", 100 << 20,
     r"'data/weights/model_weights_config\.json' is larger than 67108864 bytes"),
])
def test_oversized_declared_members_are_refused_before_reading(saved, tmp_path, member, size, message):
    """A zip header declaring gigabytes for a member that loading reads whole (the program,
    a payload config) is refused from the header, before any of it is decompressed."""
    out = _edit_program(saved, tmp_path, lambda m: None)
    _declare_size(out / "decode.pt2", member, size)
    _reseal(out)
    with pytest.raises(ArtifactError, match=rf"decode\.pt2: {message}"):
        load_artifact(out)


@pytest.mark.parametrize("expr", ["Symbol('s37', positive=True, integer=True)",
                                  "Add(Symbol('s37', positive=True, integer=True), PythonMod(Mul(Integer(-1), "
                                  "Symbol('s37', positive=True, integer=True)), Integer(16)))",
                                  "GreaterThan(Symbol('s0', integer=True), Integer(16))"])
def test_what_torch_writes_passes_the_grammars(expr):
    check_shape_expr(expr)
    check_guard("L['cu_seqlens'].size()[0] == (1 + L['seq_lens'].size()[0])")
    check_guard("L['caches'][10].stride()[1] >= 2")
    check_target("torch.ops.k3.attn_res_mix_norm.default")
    check_target("torch.ops.higher_order.cond")
    check_target("_operator.getitem")


@pytest.mark.parametrize("expr", ["Symbol('s0').__class__", "Symbol('os')", "eval('1')", "Integer(1)[0]",
                                  "Symbol(\"s0\")", "lambda: 0", "Integer(1); 1"])
def test_shape_expression_grammar_refuses_anything_else(expr):
    with pytest.raises(ArchiveRefused, match="shape expression"):
        check_shape_expr(expr)


def test_a_signed_artifact_edited_without_the_key_is_refused(saved, tmp_path, monkeypatch):
    """With K3COMPILE_SIGN_KEY the writer signs the manifest (HMAC-SHA256) and loading
    requires that signature: an attacker without the key can recompute every hash but not
    the signature. Without the key nothing is checked beyond the seal."""
    monkeypatch.setenv("K3COMPILE_SIGN_KEY", "the right key")
    signed = Path(shutil.copytree(saved, tmp_path / "signed"))
    write_manifest(signed, json.loads((signed / "manifest.json").read_text()))  # re-sealed with the key: signed
    signature = (signed / "manifest.hmac").read_text()
    assert len(signature.strip()) == 64
    load_artifact(signed)

    monkeypatch.setenv("K3COMPILE_SIGN_KEY", "another key")
    with pytest.raises(ArtifactError, match=r"manifest\.hmac: does not match the key in K3COMPILE_SIGN_KEY"):
        load_artifact(signed)

    monkeypatch.delenv("K3COMPILE_SIGN_KEY")  # the attacker: edits and reseals without the key
    edited = _edit_program(signed, tmp_path / "edit", lambda m: m.__setitem__("archive_version", b"0"))
    assert not (edited / "manifest.hmac").exists()
    load_artifact(edited)  # no key: only the seal, which the attacker recomputed
    monkeypatch.setenv("K3COMPILE_SIGN_KEY", "the right key")
    with pytest.raises(ArtifactError, match=r"manifest\.hmac: missing: the artifact is not signed"):
        load_artifact(edited)
    (edited / "manifest.hmac").write_text(signature)  # the old signature copied back
    with pytest.raises(ArtifactError, match=r"does not match .* changed after signing"):
        load_artifact(edited)
