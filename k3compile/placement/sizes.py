"""Concrete sizes for the symbolic shapes of a captured program (for the cost model).

Symbolic sizes in ``node.meta["val"]`` are evaluated with the ``sizes`` given by name:
a dimension's ``torch.export.Dim`` name (``batch``, ``tokens``, ``seqs``, ``logits``,
``max_blocks``, ...), its symbol (``s37``), or ``<input>.<dim>`` (``logit_indices.0``).
An unknown name is an error listing the program's dims; a symbol with no size raises
:class:`MissingSizes`, which :func:`~k3compile.placement.redundant_work` collects into one
error listing what is needed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import sympy
import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind
from torch.fx import GraphModule

from k3compile.placement.nodes import _expr


class MissingSizes(Exception):
    """An expression needs the sizes of these symbols, which were not given."""

    def __init__(self, symbols: Sequence[sympy.Symbol]):
        super().__init__(", ".join(map(str, symbols)))
        self.symbols = list(symbols)


class SizeEvaluator:
    """Evaluates symbolic sizes with sizes given by Dim name, symbol name or ``input.dim``."""

    def __init__(self, gm: GraphModule, program: ExportedProgram, sizes: Mapping[str, int]):
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        user = {s.arg.name for s in program.graph_signature.input_specs
                if s.kind == InputKind.USER_INPUT and hasattr(s.arg, "name")}
        dim_names: dict[sympy.Symbol, list[str]] = {}
        input_dims: dict[sympy.Symbol, list[str]] = {}
        for n in placeholders:
            val = n.meta.get("val")
            if n.name in user and isinstance(val, torch.Tensor):
                for d, s in enumerate(val.shape):
                    e = _expr(s)
                    if isinstance(e, sympy.Symbol):
                        input_dims.setdefault(e, []).append(f"{n.name}.{d}")
        # Dim names, from the shape environment export traced with.
        fake_mode = torch._guards.detect_fake_mode([n.meta.get("val") for n in placeholders])
        shape_env = getattr(fake_mode, "shape_env", None)
        if shape_env is not None:
            debug = getattr(shape_env, "source_name_to_debug_name", {}) or {}
            for sym, sources in getattr(shape_env, "var_to_sources", {}).items():
                for src in sources:
                    name = debug.get(src.name)
                    if name and name.isidentifier() and name not in dim_names.get(sym, []):
                        dim_names.setdefault(sym, []).append(name)
        #: every name a symbol answers to, the preferred (Dim name) first
        self.aliases: dict[sympy.Symbol, list[str]] = {
            sym: [*dim_names.get(sym, []), *input_dims.get(sym, []), str(sym)]
            for sym in {*dim_names, *input_dims}
        }
        known = {a for names in self.aliases.values() for a in names}
        unknown = sorted(set(sizes) - known)
        if unknown:
            dims = sorted({self.aliases[s][0] for s in input_dims})
            raise ValueError(f"sizes names unknown dims {unknown}; this program's dims: {', '.join(dims)}")
        self.values: dict[sympy.Symbol, int] = {}
        for sym, names in self.aliases.items():
            given = {n: int(sizes[n]) for n in names if n in sizes}
            if len(set(given.values())) > 1:
                raise ValueError(f"conflicting sizes for one dimension: {given}")
            if given:
                self.values[sym] = next(iter(given.values()))
        self._cache: dict[Any, int] = {}

    def describe(self, sym: sympy.Symbol) -> str:
        """The names a symbol answers to, for error messages."""
        names = self.aliases.get(sym, [str(sym)])
        return f"{names[0]!r}" + (f" (also {', '.join(repr(a) for a in names[1:])})" if len(names) > 1 else "")

    def size(self, s: Any) -> int:
        """A size (int or SymInt) at the given sizes; :class:`MissingSizes` if one is not given."""
        if isinstance(s, int):
            return s
        e = _expr(s)
        if e in self._cache:
            return self._cache[e]
        missing = sorted((sym for sym in e.free_symbols if sym not in self.values), key=str)
        if missing:
            raise MissingSizes(missing)
        v = int(e.subs(self.values))
        self._cache[e] = v
        return v

    def shape(self, val: torch.Tensor) -> tuple[int, ...]:
        return tuple(self.size(s) for s in val.shape)

    def numel(self, val: torch.Tensor) -> int:
        return math.prod(self.shape(val))

    def nbytes(self, val: torch.Tensor) -> int:
        return self.numel(val) * val.dtype.itemsize
