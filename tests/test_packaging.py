"""The package as users install it: a wheel built from the tree, installed without
``-e`` into a fresh directory, imports every module and compiles and runs a tiny model.

Editable installs (what ``make test`` uses) resolve modules from the source tree, so a
package missing from ``pyproject.toml`` would pass every other test; this one builds the
wheel and runs it from outside the tree, and fails if anything resolves elsewhere.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SOURCES = ("k3compile", "passes", "runtime", "pyproject.toml", "README.md")

# Runs inside the installed copy: walks every module of the installed package and
# checks that each came from the install directory, not from the source tree.
IMPORT_ALL = """
import importlib, pkgutil, sys
from pathlib import Path
site = Path(sys.argv[1]).resolve()
import k3compile
names = ["k3compile"] + [m.name for m in pkgutil.walk_packages(k3compile.__path__, "k3compile.")]
for name in names:
    module = importlib.import_module(name)
    where = Path(module.__file__).resolve()
    assert site in where.parents, f"{name} imported from {where}, not from the installed wheel"
print(len(names))
"""


def _run(args: list[str], cwd: Path, env: dict[str, str]) -> str:
    proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{args} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """A wheel built from a copy of the sources, installed with --target; (site, env)."""
    root = tmp_path_factory.mktemp("packaging")
    src = root / "src"
    src.mkdir()
    for name in SOURCES:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(path, src / name)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    _run(pip + ["wheel", "--no-deps", "--no-build-isolation", "-w", str(root / "dist"), str(src)], root, env)
    (wheel,) = (root / "dist").glob("k3compile-*.whl")
    site = root / "site"
    _run(pip + ["install", "--no-deps", "--target", str(site), str(wheel)], root, env)
    env["PYTHONPATH"] = str(site)
    return site, env


def test_wheel_holds_every_source_module(installed: tuple[Path, dict[str, str]], tmp_path: Path) -> None:
    site, _ = installed
    (wheel,) = (site.parent / "dist").glob("k3compile-*.whl")
    in_wheel = {n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".py")}
    expected = set()
    for folder, package in (("k3compile", "k3compile"), ("passes", "k3compile/passes"), ("runtime", "k3compile/runtime")):
        for path in (REPO / folder).rglob("*.py"):
            rel = path.relative_to(REPO / folder)
            if folder == "k3compile" and rel.parts[0] in ("passes", "runtime"):
                continue
            expected.add(f"{package}/{rel.as_posix()}")
    assert expected - in_wheel == set(), f"modules missing from the wheel: {sorted(expected - in_wheel)}"


def test_installed_wheel_imports_every_module_from_the_install(installed: tuple[Path, dict[str, str]],
                                                                 tmp_path: Path) -> None:
    site, env = installed
    count = int(_run([sys.executable, "-c", IMPORT_ALL, str(site)], tmp_path, env).strip())
    assert count > 40  # every module of k3compile, k3compile.passes and k3compile.runtime


def test_installed_wheel_compiles_and_runs_a_tiny_model(installed: tuple[Path, dict[str, str]],
                                                        tmp_path: Path) -> None:
    """The installed CLI's greedy tokens equal the source tree's eager reference engine."""
    from k3compile.batch import CacheShape
    from k3compile.reference import ReferenceEngine, load_reference

    _, env = installed
    cli = [sys.executable, "-m", "k3compile"]
    _run(cli + ["init-model", "--preset", "tiny", "--seed", "3", "model"], tmp_path, env)
    _run(cli + ["optimize", "model", "-o", "model.k3c", "--dtype", "float32"], tmp_path, env)
    out = _run(cli + ["run", "model.k3c", "--prompt", "1 2 3", "--max-new-tokens", "4"], tmp_path, env)
    got = [[int(t) for t in m.split()] for m in re.findall(r"new tokens: ([\d ]+)", out)]
    engine = ReferenceEngine(load_reference(tmp_path / "model"), CacheShape(num_slots=1, num_blocks=4, block_size=16))
    assert got == engine.generate([[1, 2, 3]], 4), out
