"""The package's layers: every import (module level or inside a function) points down.

docs/compiler.md draws these layers; this test reads every module's imports with ``ast``
(nothing is imported) and fails on an import that points up or sideways, on an import
cycle, and on a generic layer that names a pass.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import networkx as nx
import pytest

REPO = Path(__file__).resolve().parents[1]
# Source folder -> the package it installs as (pyproject.toml's package-dir).
FOLDERS = {"k3compile": "k3compile", "passes": "k3compile.passes", "runtime": "k3compile.runtime"}

# Layers, bottom to top: a module's group and the groups it may import.
GROUPS: dict[str, tuple[str, ...]] = {
    # The package root, configs, sharding specs, targets, cache layouts (FP8 rows too), sequences,
    # process groups, the MXFP4 format and checkpoint reading: no torch.ops.k3 use.
    "foundation": ("k3compile", "k3compile.config", "k3compile.sharding", "k3compile.targets",
                   "k3compile.batch", "k3compile.context_parallel", "k3compile.distributed",
                   "k3compile.sequences", "k3compile.mla_cache_fp8", "k3compile.device_memory", "k3compile.checkpoint",
                   "k3compile.checkpoint.mxfp4",
                   "k3compile.checkpoint.loader"),
    # Op semantics: custom ops, fakes, torch references.
    "ops": ("k3compile.ops",),
    # The reference model, the checkpoint generator, the eager reference engine.
    "model": ("k3compile.model", "k3compile.checkpoint.generate", "k3compile.reference"),
    # The artifact format: read by the runtime, written by the compiler.
    "artifact": ("k3compile.artifact", "k3compile.artifact_manifest", "k3compile.archive_check"),
    # Serving.
    "runtime": ("k3compile.runtime",),
    # The placement analysis and the k3 ops' rules.
    "placement": ("k3compile.placement",),
    # Capture, passes, pipeline, records, validation, memory plans, the compile driver.
    "compiler": ("k3compile.capture", "k3compile.stamping", "k3compile.artifact_writer", "k3compile.pipeline",
                 "k3compile.records", "k3compile.passes",
                 "k3compile.validation", "k3compile.compiler", "k3compile.memory",
                 "k3compile.kernel_tables", "k3compile.bench", "k3compile.export"),
    "cli": ("k3compile.cli", "k3compile.__main__"),
}
MAY_IMPORT: dict[str, set[str]] = {
    "foundation": {"foundation"},
    "ops": {"foundation", "ops"},
    "model": {"foundation", "ops", "model"},
    "artifact": {"foundation", "ops", "artifact"},
    "runtime": {"foundation", "ops", "artifact", "runtime"},
    "placement": {"foundation", "ops", "placement"},
    "compiler": {"foundation", "ops", "model", "artifact", "runtime", "placement", "compiler"},
    "cli": set(GROUPS),
}


def _modules() -> dict[str, Path]:
    mods = {}
    for folder, package in FOLDERS.items():
        for path in (REPO / folder).rglob("*.py"):
            rel = path.relative_to(REPO / folder).with_suffix("")
            if folder == "k3compile" and rel.parts[0] in ("passes", "runtime"):
                continue
            parts = [p for p in rel.parts if p != "__init__"]
            mods[".".join([package, *parts])] = path
    return mods


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The k3compile modules ``name`` imports anywhere in its file."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = name.split(".")[: len(name.split(".")) - (0 if is_package else 1) - (node.level - 1)]
                base = ".".join(parent + ([node.module] if node.module else []))
            # ``from pkg import mod`` imports the submodule; ``from mod import name`` the module.
            found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names}
    return {m for m in found if m.startswith("k3compile") and m != name}


IMPORTS = {name: _imports(name, path) for name, path in MODULES.items()}


def group_of(module: str) -> str:
    best = max(((p, g) for g, ps in GROUPS.items() for p in ps if module == p or module.startswith(p + ".")),
               key=lambda pg: len(pg[0]), default=None)
    if best is None:
        raise AssertionError(f"{module} is in no layer: add it to GROUPS (and docs/compiler.md)")
    return best[1]


def test_every_module_is_in_a_layer():
    for module in MODULES:
        group_of(module)


@pytest.mark.parametrize("group", list(GROUPS))
def test_imports_point_down(group: str):
    wrong = [f"{m} imports {dep} ({group_of(dep)})"
             for m in MODULES if group_of(m) == group
             for dep in sorted(IMPORTS[m]) if group_of(dep) not in MAY_IMPORT[group]]
    assert not wrong, "imports against the layers:\n" + "\n".join(wrong)


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_no_import_cycles():
    """Counting every import, also the deferred ones; a package's ``__init__`` importing
    its own modules is no cycle of the design, so edges into a parent package are not counted."""
    graph = nx.DiGraph()
    graph.add_nodes_from(MODULES)
    for m, deps in IMPORTS.items():
        graph.add_edges_from((m, d) for d in deps if d in MODULES and not _within(m, d))
    cycles = list(nx.simple_cycles(graph, length_bound=12))
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c + [c[0]]) for c in cycles[:10])


def test_no_generic_layer_names_a_pass():
    passes = {m for m in MODULES if m.startswith("k3compile.passes.")}
    wrong = [f"{m} imports {dep}" for m in MODULES if not m.startswith("k3compile.passes")
             for dep in IMPORTS[m] & passes]
    assert not wrong, "passes are found through the registry, not by name:\n" + "\n".join(wrong)


def test_the_rules_see_real_imports():
    """The scanner itself: known edges are found (a scanner that saw nothing would pass)."""
    assert "k3compile.config" in IMPORTS["k3compile.checkpoint.loader"]
    assert "k3compile.config" in IMPORTS["k3compile.model.k3"]
    assert group_of("k3compile.runtime.kernels.moe") == "runtime"
    assert group_of("k3compile.checkpoint.generate") == "model"


# What a fresh interpreter actually loads: the static scan above cannot see an import
# made through a name it does not resolve (importlib, a registry), this can.
LOADED = "import json, sys, {0}; print(json.dumps(sorted(m for m in sys.modules if m.startswith('k3compile'))))"


@pytest.mark.parametrize("module, may_load", [
    ("k3compile", {"foundation"}),
    ("k3compile.ops", {"foundation", "ops"}),
    ("k3compile.artifact", {"foundation", "ops", "artifact"}),
    ("k3compile.runtime", MAY_IMPORT["runtime"]),
    ("k3compile.cli", {"foundation", "cli"}),  # --help stays fast: commands import the rest
])
def test_importing_loads_only_lower_layers(module: str, may_load: set[str]):
    out = subprocess.run([sys.executable, "-c", LOADED.format(module)], capture_output=True, text=True,
                         check=True).stdout
    wrong = [m for m in json.loads(out.splitlines()[-1]) if m in MODULES and group_of(m) not in may_load]
    assert not wrong, f"import {module} loads {wrong}"


def test_cli_and_package_root_do_not_import_torch():
    code = "import sys, k3compile.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
