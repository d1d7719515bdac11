"""A seeded fuzzer of hostile program archives: 500 mutations of a real artifact's decode
archive, each of a kind that must be refused (a pickle under a member name torch treats
specially, code in a shape expression, in a guard, a node target outside the operator
namespaces, a payload config naming a member of its choice). Every one must be refused by
``check_archive`` with an :class:`ArchiveRefused` naming the archive; every 50th is also
resealed into a whole artifact and loaded, which must fail with an ``ArtifactError`` before
the payload (it would create a marker file) runs."""

from __future__ import annotations

import json
import pickle
import random
import zipfile
from pathlib import Path

import pytest

from k3compile.archive_check import ArchiveRefused, check_archive
from k3compile.artifact import ArtifactError, load_artifact
from test_hostile_artifacts import _edit_program, _first, _Touch, saved  # noqa: F401  (fixture)

MUTATIONS = 500
SEED = 20261202

SPECIAL_MEMBERS = ["data/constants/custom_obj_{i}", "data/constants/opaque_obj_{i}", "data/sample_inputs/model.pt",
                   "data/sample_inputs/other_{i}.pt", "data/weights/weight_{i}9", "data/constants/tensor_{i}9",
                   "data/aotinductor/model/model_{i}.so", "data/executorch/p{i}", "data/mtia/p{i}",
                   "data/xl_weights/w{i}", "extra/e{i}", "models/other_{i}.json", "code/{i}.py"]
CODE = ["__import__('os').system('touch {m}')", "eval('1')", "exec('1')", "open('{m}', 'w')",
        "().__class__.__bases__[0]", "Symbol('s0').__class__", "lambda: 0", "getattr(Integer, 'x')",
        "Integer(1)[0]", "'{m}'"]
TARGETS = ["torch.os.system", "torch.load", "torch.save", "torch._C._set_print_stack_traces_on_fatal_signal",
           "builtins.exec", "builtins.eval", "os.system", "subprocess.run", "#custom:op", "torch.ops.aten.add.Tensor ",
           "torch.ops.os.system", "_operator.call", "math.os", "torch.sym_exec", "torch.ops.k3.x.y.z"]
PATHS = ["../model.json", "../../x", "/etc/passwd", "weight_0/../../models/model.json", "weights", "custom_obj_0",
         "weight_", "tensor_x", "weight_0 ", "weight_0\\..\\x"]


def _mutate(rng: random.Random, members: dict[str, bytes], program: dict, marker: Path) -> str:
    """Apply one hostile mutation in place; returns what it did."""
    kind = rng.randrange(5)
    i = rng.randrange(10)
    if kind == 0:
        name = rng.choice(SPECIAL_MEMBERS).format(i=i)
        members[name] = pickle.dumps(_Touch(marker), protocol=rng.choice([0, 2, 5]))
        return f"pickle member {name}"
    code = rng.choice(CODE).format(m=marker)
    if kind == 1:
        exprs = []
        _collect(program, "expr_str", exprs)
        expr = rng.choice(exprs)
        text = expr["expr_str"]
        cut = rng.randrange(len(text) + 1)
        expr["expr_str"] = text[:cut] + code + text[cut:]
    elif kind == 2:
        guards = program["guards_code"]
        at = rng.randrange(len(guards) + 1)
        guards.insert(at, rng.choice([code, f"{code} == 0", f"L['seq_lens'].size()[0] == {code}"]))
    elif kind == 3:
        nodes = []
        _collect(program, "target", nodes, need="inputs")
        rng.choice(nodes)["target"] = rng.choice(TARGETS)
    else:
        name = rng.choice(["data/weights/model_weights_config.json", "data/constants/model_constants_config.json"])
        config = json.loads(members[name])
        entry = {"path_name": rng.choice(PATHS), "is_param": False, "use_pickle": False, "tensor_meta": {}}
        config["config"][f"injected_{i}"] = entry
        members[name] = json.dumps(config).encode()
        return f"payload path {entry['path_name']!r} in {name}"
    members["models/model.json"] = json.dumps(program).encode()
    return ["", "shape expression", "guard", "node target"][kind]


def _collect(value, key: str, out: list, need: str | None = None) -> None:
    if isinstance(value, dict):
        if isinstance(value.get(key), str) and (need is None or need in value):
            out.append(value)
        for v in value.values():
            _collect(v, key, out, need)
    elif isinstance(value, list):
        for v in value:
            _collect(v, key, out, need)


@pytest.mark.slow
def test_500_hostile_mutations_are_refused_and_never_run(saved, tmp_path):  # noqa: F811
    marker = tmp_path / "pwned"
    with zipfile.ZipFile(saved / "decode.pt2") as z:
        root = z.namelist()[0].split("/", 1)[0]
        original = {i.filename[len(root) + 1:]: z.read(i) for i in z.infolist()}
    rng = random.Random(SEED)
    kinds: dict[str, int] = {}
    for n in range(MUTATIONS):
        members = dict(original)
        program = json.loads(members["models/model.json"])
        what = _mutate(rng, members, program, marker)
        kinds[what.split(" ")[0]] = kinds.get(what.split(" ")[0], 0) + 1
        path = tmp_path / "m.pt2"
        with zipfile.ZipFile(path, "w") as z:
            for name, data in members.items():
                z.writestr(f"{root}/{name}", data)
        with pytest.raises(ArchiveRefused, match=r"^decode\.pt2: ") as refused:
            check_archive(path, "decode.pt2")
        assert len(str(refused.value)) < 400, (what, str(refused.value))  # one clear line, not a dump
        if n % 50 == 0:
            hostile = _edit_program(saved, tmp_path / f"whole{n}", lambda m: (m.clear(), m.update(members)))
            with pytest.raises(ArtifactError):
                load_artifact(hostile)
    assert not marker.exists()
    assert len(kinds) == 5 and min(kinds.values()) >= 60, kinds  # every kind was tried
