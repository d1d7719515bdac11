"""What a program archive (``<phase>.pt2``) of an artifact may hold, checked before
``torch.export.load`` reads it.

The manifest's hashes are unkeyed: anyone can edit an artifact and recompute them, so the
reader cannot trust an archive because its hash matches. ``torch.export.load`` has routes
from archive content to code execution, each closed here by an allow-list of what
k3compile itself writes (an archive the writer made passes; it is checked after every
save):

- **Members unpickled by name.** torch's loader unpickles some members whatever the
  payload configs say (``data/sample_inputs/model.pt``: a protocol-0 pickle there, which
  has no 0x80 header to scan for, ran when loaded with torch 2.13; custom and opaque
  objects under ``data/constants/``). Only the members the writer makes are allowed: the
  archive's version files, ``models/model.json``, the weights and constants configs (every
  payload ``use_pickle: false``), the raw payloads they name (``weight_<n>`` /
  ``tensor_<n>``), and an empty ``data/sample_inputs/model.pt``. No other name, no
  directory entry, no symlink, no path outside the archive's folder.
- **Shape expressions handed to ``sympy.sympify``** (``expr_str`` in the program JSON; a
  Python call placed there ran when loaded with torch 2.13): each must be a sympy ``srepr`` made of allow-listed sympy class names, integers, keyword
  assumptions (``positive=True``) and symbol names (``Symbol('s37', ...)``).
- **Guards turned into Python source** (``guards_code``, from which
  ``ExportedProgram.module()`` generates a guard function): each must be a comparison of input sizes, strides and
  integers (``L['seq_lens'].size()[0] == L['input_ids'].size()[0]``).
- **Node targets resolved by attribute path** (``torch.<path>``: ``torch.os.system`` would
  resolve): each must be an operator of an allow-listed namespace (``torch.ops.aten``,
  ``k3``, the functional collectives, ``higher_order``) or a Python operator.

Nothing here imports torch's serialisation code or runs a parser with ``eval``: the checks
are regular expressions over the JSON strings.
"""

from __future__ import annotations

import json
import re
import stat
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from k3compile.artifact_manifest import ArtifactError

#: version files every archive has, with the most bytes each may hold
_VERSION_FILES = {"archive_format": 16, "archive_version": 16, "byteorder": 16, ".data/version": 16,
                  ".data/serialization_id": 64}
_CONFIGS = {"data/weights/model_weights_config.json": ("data/weights/", r"weight_\d+"),
            "data/constants/model_constants_config.json": ("data/constants/", r"tensor_\d+")}
_PROGRAM = "models/model.json"
_EMPTY = "data/sample_inputs/model.pt"  # torch.export.save writes it; the writer leaves it empty
MAX_PROGRAM_BYTES = 1 << 30
MAX_CONFIG_BYTES = 64 << 20  # one small entry per weight or constant

#: sympy names a shape expression may use (srepr of torch's symbolic shapes)
_SYMPY_NAMES = frozenset({
    "Add", "Mul", "Pow", "Symbol", "Integer", "Rational", "Float", "Max", "Min", "Abs", "Mod", "PythonMod",
    "FloorDiv", "CleanDiv", "CeilToInt", "FloorToInt", "TruncToInt", "RoundToInt", "IntTrueDiv", "FloatTrueDiv",
    "ToFloat", "PowByNatural", "FloatPow", "ModularIndexing", "Where", "Identity",
    "Equality", "Unequality", "GreaterThan", "LessThan", "StrictGreaterThan", "StrictLessThan",
    "And", "Or", "Not", "BooleanTrue", "BooleanFalse", "true", "false", "True", "False",
    "Infinity", "NegativeInfinity", "IntInfinity", "NegativeIntInfinity", "oo", "zoo", "nan",
    "Zero", "One", "NegativeOne", "Half",
    # assumptions, as keyword arguments of Symbol
    "positive", "negative", "nonnegative", "nonpositive", "integer", "real", "finite", "zero", "odd", "even",
})
_EXPR_TOKEN = re.compile(r"\s*(?:(?P<name>[A-Za-z_][A-Za-z0-9_]*)|(?P<symbol>'[a-z]+[0-9]+')"
                         r"|(?P<number>-?[0-9]+(?:\.[0-9]+)?(?:e-?[0-9]+)?)|(?P<punct>[(),=]))")
_GUARD_TERM = r"L\['[A-Za-z_][A-Za-z0-9_]*'\](?:\[[0-9]+\])*\.(?:(?:size|stride)\(\)\[[0-9]+\]|storage_offset\(\))"
_GUARD_TOKEN = re.compile(rf"\s*(?:{_GUARD_TERM}|[0-9]+|==|!=|<=|>=|<|>|//|\+|-|\*|%|\(|\)|and|or|not)")
_TARGET = re.compile(r"torch\.ops\.(?:aten|k3|_c10d_functional|c10d_functional|higher_order)"
                     r"\.[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)?"
                     r"|_operator\.(?:getitem|add|sub|mul|floordiv|truediv|mod|pow|neg|pos|abs|eq|ne|lt|le|gt|ge"
                     r"|and_|or_|not_)"
                     r"|torch\.sym_(?:max|min|not|float|int|ite|sqrt|sum)|math\.(?:ceil|floor|trunc|sqrt)")


class ArchiveRefused(ArtifactError):
    """An archive holds something k3compile does not write; the message names it."""


def _tokens(pattern: re.Pattern[str], text: str, what: str) -> Iterator[re.Match[str]]:
    """The tokens of ``pattern`` that cover ``text`` end to end; refuses anything else."""
    pos = 0
    while pos < len(text):
        m = pattern.match(text, pos)
        if m is None or m.end() == pos:
            raise ArchiveRefused(f"{what} {text[:80]!r}: unexpected text at {text[pos:pos + 20]!r}")
        yield m
        pos = m.end()


def check_shape_expr(expr: str) -> None:
    """Refuse a shape expression that is not a plain sympy ``srepr`` (see the module docstring)."""
    for m in _tokens(_EXPR_TOKEN, expr, "shape expression"):
        name = m.group("name")
        if name is not None and name not in _SYMPY_NAMES:
            raise ArchiveRefused(f"shape expression {expr[:80]!r}: {name!r} is not a sympy name shapes use")


def check_guard(code: str) -> None:
    """Refuse a guard that is not a comparison of input sizes and integers."""
    for _ in _tokens(_GUARD_TOKEN, code, "guard"):
        pass


def check_target(target: str) -> None:
    """Refuse a node target outside the allow-listed operator namespaces."""
    if not _TARGET.fullmatch(target):
        raise ArchiveRefused(f"node target {target[:80]!r} is not an operator k3compile programs call")


def _nodes_and_exprs(value: Any) -> Iterator[tuple[str, str]]:
    """("target" | "expr_str", string) for every node target and shape expression in the program JSON."""
    if isinstance(value, dict):
        if isinstance(value.get("target"), str) and "inputs" in value:
            yield "target", value["target"]
        if isinstance(value.get("expr_str"), str):
            yield "expr_str", value["expr_str"]
        for v in value.values():
            yield from _nodes_and_exprs(v)
    elif isinstance(value, list):
        for v in value:
            yield from _nodes_and_exprs(v)


def _check_program(raw: bytes) -> None:
    try:
        program = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ArchiveRefused(f"'{_PROGRAM}' is not JSON ({e})") from e
    if not isinstance(program, dict):
        raise ArchiveRefused(f"'{_PROGRAM}' is not a JSON object")
    guards = program.get("guards_code", [])
    if not isinstance(guards, list) or not all(isinstance(g, str) for g in guards):
        raise ArchiveRefused(f"'{_PROGRAM}': guards_code must be a list of strings")
    for guard in guards:
        check_guard(guard)
    for kind, text in _nodes_and_exprs(program):
        (check_target if kind == "target" else check_shape_expr)(text)


def _payloads(config_name: str, raw: bytes) -> set[str]:
    """The raw payload members a weights / constants config names (every one use_pickle false)."""
    folder, pattern = _CONFIGS[config_name]
    try:
        entries = json.loads(raw)["config"].items()
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ArchiveRefused(f"'{config_name}' is not a payload config ({e})") from e
    names = set()
    for fqn, meta in entries:
        if not isinstance(meta, dict) or meta.get("use_pickle") is not False:
            raise ArchiveRefused(f"'{fqn}' in '{config_name}' is stored as a pickle")
        path = meta.get("path_name")
        if not isinstance(path, str) or not re.fullmatch(pattern, path):
            raise ArchiveRefused(f"'{fqn}' in '{config_name}' names payload {path!r}, not {pattern}")
        names.add(folder + path)
    return names


def check_archive(path: str | Path, label: str | None = None) -> None:
    """Raise :class:`ArchiveRefused` unless the archive at ``path`` holds only what
    k3compile writes (the module docstring), before anything in it is deserialised."""
    path = Path(path)
    label = label or path.name
    try:
        zf = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as e:
        raise ArchiveRefused(f"{label}: not a torch.export archive ({e})") from e
    with zf:
        infos = zf.infolist()
        roots = {i.filename.split("/", 1)[0] for i in infos}
        if len(roots) != 1:
            raise ArchiveRefused(f"{label}: expected one archive root folder, found {sorted(roots)[:5]}")
        (root,) = roots
        members: dict[str, zipfile.ZipInfo] = {}
        for info in infos:
            name = info.filename[len(root) + 1:]
            if info.is_dir() or stat.S_ISLNK(info.external_attr >> 16) or name in members:
                raise ArchiveRefused(f"{label}: member '{info.filename}' is a directory, a link or a duplicate")
            if any(part in ("", ".", "..") for part in name.split("/")) or "\\" in name:
                raise ArchiveRefused(f"{label}: member '{info.filename}' has a path outside the archive's folder")
            members[name] = info
        try:
            if _PROGRAM not in members:
                raise ArchiveRefused(f"no '{_PROGRAM}' (not a current torch.export archive)")
            allowed = {_PROGRAM, _EMPTY, *_VERSION_FILES, *_CONFIGS}
            for config in _CONFIGS:
                if config in members:
                    if members[config].file_size > MAX_CONFIG_BYTES:
                        raise ArchiveRefused(f"'{config}' is larger than {MAX_CONFIG_BYTES} bytes")
                    allowed |= _payloads(config, zf.read(members[config]))
            for name, info in members.items():
                if name not in allowed:
                    raise ArchiveRefused(f"member '{name}' is not one k3compile writes")
                if name in _VERSION_FILES and info.file_size > _VERSION_FILES[name]:
                    raise ArchiveRefused(f"member '{name}' holds {info.file_size} bytes, more than a version file")
                if name == _EMPTY and info.file_size:
                    raise ArchiveRefused(f"member '{name}' is a non-empty torch.save/pickle file")
            if members[_PROGRAM].file_size > MAX_PROGRAM_BYTES:
                raise ArchiveRefused(f"'{_PROGRAM}' is larger than {MAX_PROGRAM_BYTES} bytes")
            _check_program(zf.read(members[_PROGRAM]))
        except ArchiveRefused as e:
            raise ArchiveRefused(f"{label}: {e}") from None
