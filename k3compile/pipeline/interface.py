"""The pass interface: what a pass is, declares, receives and returns, and how it
registers itself.

A pass is one class in one file of ``passes/``, decorated with :func:`register_pass`:

    @register_pass
    class SplitMLAContext(GraphPass):
        name = "split_mla_context"
        after = ()                          # passes it must follow when both run
        default_on = frozenset()            # device kinds whose targets run it by default

        @dataclass(frozen=True)
        class Config:                       # its options; Literal fields list the choices
            merge: Literal["reduce-scatter", "all-to-all"] = "all-to-all"

        @classmethod
        def required_by(cls, plan):         # a plan that cannot run without it
            return f"dcp={plan.dcp}" if plan.dcp > 1 else None

        def run(self, gm, ctx) -> PassResult: ...

The pipeline (:mod:`k3compile.pipeline.selection`) selects and orders passes from these
declarations only, so no generic layer names a pass (as TensorRT-LLM AutoDeploy's
transform registry). ``run`` rewrites the graph of one phase in place and reports what
it did (:class:`~k3compile.records.result.PassResult`).
"""

from __future__ import annotations

import dataclasses
import typing
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, TypeVar

from torch.export import ExportedProgram
from torch.fx import GraphModule

from k3compile.config import K3Config
from k3compile.records.result import STANDARD_STATS, PassResult, Rewrite, Skipped
from k3compile.sharding import ParallelPlan, ShardOffset, ShardSpec
from k3compile.targets import DEVICE_KINDS, DeviceKind, Target

__all__ = [
    "GRAPH_FACTS", "PASSES", "STANDARD_STATS", "GraphFact", "GraphPass", "NoConfig", "PassContext", "PassError",
    "PassResult", "Rewrite", "Skipped", "check_config", "literal_choices", "register_pass",
]

#: Facts about a graph's nodes a pass may declare in ``needs``; the pipeline provides
#: them before the pass runs (placements: ``node.meta["placement"]``).
GraphFact = Literal["placements"]
GRAPH_FACTS: tuple[str, ...] = typing.get_args(GraphFact)


class PassError(RuntimeError):
    """A pass broke the graph (lint, shapes) or changed its numerics beyond tolerance;
    ``report`` is then the failed validation report (per-tensor errors, the worst one's
    tensor and rank)."""

    def __init__(self, message: str, report: Any = None):
        super().__init__(message)
        self.report = report


@dataclass(frozen=True)
class NoConfig:
    """For passes without options."""


@dataclass
class PassContext:
    """What a pass may read (and, for ``specs``, update) besides the graph."""

    config: K3Config
    plan: ParallelPlan
    target: Target
    phase: str
    program: ExportedProgram
    #: Parameter name -> shard spec, shared by all phases: a pass that reshards a
    #: parameter updates it here (and must do the same in every phase).
    specs: dict[str, ShardSpec]
    #: Per-rank constant buffers by name, shared by all phases (``graph_edits.add_rank_constant``).
    constants: dict[str, ShardOffset] = field(default_factory=dict)


class GraphPass(ABC):
    """Base class of every pass: ``name``, ``Config``, the declarations the pipeline
    selects and orders passes by, and ``run``."""

    name: ClassVar[str]
    #: Its options: a dataclass whose fields all have defaults. A ``Literal`` field's
    #: values are its only choices (checked on construction, offered by the CLI).
    Config: ClassVar[type] = NoConfig
    #: Device kinds ("cuda", "hip", "cpu") whose targets run the pass by default; empty:
    #: only when enabled by name or required by the parallel plan.
    default_on: ClassVar[frozenset[DeviceKind]] = frozenset()
    #: Passes (by name) that must run before / after this one whenever both run.
    after: ClassVar[tuple[str, ...]] = ()
    before: ClassVar[tuple[str, ...]] = ()
    #: Facts about the graph's nodes the pass reads (:data:`GRAPH_FACTS`); the
    #: pipeline computes any that are missing before it runs the pass.
    needs: ClassVar[frozenset[GraphFact]] = frozenset()

    @classmethod
    def required_by(cls, plan: ParallelPlan) -> str | None:
        """Why ``plan`` cannot be served without this pass (e.g. ``"dcp=2"``), or None.
        A required pass joins every pipeline for the plan and cannot be disabled."""
        return None

    def __init__(self, config: Any | None = None):
        self.config = config if config is not None else self.Config()
        if not isinstance(self.config, self.Config):
            raise TypeError(f"pass {self.name}: config must be {self.Config.__name__}, got {type(self.config).__name__}")
        check_config(self.name, self.config)

    @abstractmethod
    def run(self, gm: GraphModule, ctx: PassContext) -> PassResult: ...


def literal_choices(annotation: Any) -> tuple[Any, ...] | None:
    """The values of a ``Literal[...]`` annotation, or None for any other annotation."""
    return typing.get_args(annotation) if typing.get_origin(annotation) is Literal else None


def check_config(pass_name: str, config: Any) -> None:
    """Fail (ValueError) when a ``Literal`` field of a dataclass config holds another value."""
    if not dataclasses.is_dataclass(config):
        return
    hints = typing.get_type_hints(type(config))
    for f in dataclasses.fields(config):
        choices = literal_choices(hints.get(f.name))
        value = getattr(config, f.name)
        if choices is not None and value not in choices:
            raise ValueError(f"{pass_name}: {f.name} must be one of {', '.join(map(str, choices))}, got {value!r}")


#: Every registered pass by name, in registration order (``k3compile.passes`` imports its
#: modules in pipeline order; ``after``/``before`` constrain it, see ``selection``).
PASSES: dict[str, type[GraphPass]] = {}

P = TypeVar("P", bound=type[GraphPass])


def register_pass(cls: P) -> P:
    """Class decorator: add pass ``cls`` to :data:`PASSES` under its ``name``, after
    checking its declarations (a name, a dataclass ``Config``, known device kinds and
    graph facts)."""
    name = getattr(cls, "name", None)
    if not (isinstance(cls, type) and issubclass(cls, GraphPass)) or not isinstance(name, str) or not name:
        raise TypeError(f"{cls!r}: a pass is a GraphPass subclass with a name")
    previous = PASSES.get(name)
    # The same class again (a reloaded module) replaces itself; another class may not.
    if previous is not None and (previous.__module__, previous.__qualname__) != (cls.__module__, cls.__qualname__):
        raise ValueError(f"pass {name!r} is already registered by {previous.__module__}.{previous.__qualname__}")
    if not dataclasses.is_dataclass(cls.Config):
        raise TypeError(f"pass {name}: Config must be a dataclass")
    for what, values, known in (("default_on", cls.default_on, DEVICE_KINDS), ("needs", cls.needs, GRAPH_FACTS)):
        unknown = set(values) - set(known)
        if unknown:
            raise ValueError(f"pass {name}: {what} has {sorted(unknown)}; choose from {', '.join(known)}")
    PASSES[name] = cls
    return cls
