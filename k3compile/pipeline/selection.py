"""Which passes run, in which order, with which options: read from the passes' own
declarations (:class:`~k3compile.pipeline.interface.GraphPass`), never from a list of
names.

- Selection: a target runs the passes whose ``default_on`` holds its device kind; the
  user's ``enable`` adds passes and ``disable`` drops them by name; a pass whose
  ``required_by(plan)`` gives a reason joins any pipeline for that plan and cannot be
  disabled.
- Order: registration order (``k3compile.passes`` imports its modules in pipeline
  order), except that a pass's ``after`` (and every ``before`` naming it) runs first;
  a cycle fails.
- Options: a mapping of pass name -> its ``Config`` (an instance, or a mapping of its
  fields), checked against the registered class, so callers pass options through
  without importing a pass.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any


from k3compile.pipeline.interface import PASSES, GraphPass, check_config, literal_choices
from k3compile.sharding import ParallelPlan
from k3compile.targets import Target


@dataclass(frozen=True)
class PipelineOptions:
    """Which passes run, with which options, and what is checked after each."""

    target: str = "cpu"
    enable: tuple[str, ...] = ()  # passes to add to the target's default list
    disable: tuple[str, ...] = ()  # passes to drop (by name)
    validate: bool = False  # translation validation after each pass
    rtol: float = 1e-4  # validation tolerance, relative to the output's max magnitude
    #: pass name -> its options: a ``Config`` instance or a mapping of its fields
    pass_configs: Mapping[str, Any] = field(default_factory=dict)


def registered_passes() -> dict[str, type[GraphPass]]:
    """Every registered pass by name (the built-in ones register on import)."""
    import k3compile.passes  # noqa: F401  (each pass module registers its pass)

    return PASSES


def pass_class(name: str) -> type[GraphPass]:
    """The registered pass called ``name``; ValueError naming the known ones otherwise."""
    registry = registered_passes()
    if name not in registry:
        raise ValueError(f"unknown pass {name!r}; known passes: {', '.join(sorted(registry))}")
    return registry[name]


def pipeline_order(names: Iterable[str] | None = None) -> list[str]:
    """The registered passes (or those in ``names``) in pipeline order: registration
    order, except that the passes a pass must follow (its ``after``, and those naming it
    in ``before``) run first. Relations are resolved over every registered pass, so they
    hold through passes that do not run; a cycle fails."""
    registry = registered_passes()
    first: dict[str, set[str]] = {name: set() for name in registry}  # pass -> the passes that run before it
    for name, cls in registry.items():
        for relation, others in (("after", cls.after), ("before", cls.before)):
            for other in others:
                if other not in registry:
                    raise ValueError(f"pass {name} declares {relation}={other!r}, which is not a registered pass")
                if relation == "after":
                    first[name].add(other)
                else:
                    first[other].add(name)
    index = {name: i for i, name in enumerate(registry)}
    order: list[str] = []
    visiting: list[str] = []

    def place(name: str) -> None:
        """Append ``name`` after what must precede it (depth first, registration order)."""
        if name in order:
            return
        if name in visiting:
            cycle = " -> ".join([*visiting[visiting.index(name):], name])
            raise ValueError(f"the passes' after/before relations form a cycle: {cycle}")
        visiting.append(name)
        for before in sorted(first[name], key=index.__getitem__):
            place(before)
        visiting.pop()
        order.append(name)

    for name in registry:
        place(name)
    if names is None:
        return order
    wanted = set(names)
    return [n for n in order if n in wanted]


def default_pass_names(target: Target) -> tuple[str, ...]:
    """The passes ``target`` runs by default, in pipeline order."""
    registry = registered_passes()
    return tuple(n for n in pipeline_order() if target.device in registry[n].default_on)


def pass_config(name: str, value: Any = None) -> Any:
    """The checked ``Config`` of pass ``name`` from ``value``: None (its defaults), a
    ``Config`` instance, or a mapping of its fields. ValueError on an unknown pass, an
    unknown field or a value outside a ``Literal`` field's choices."""
    cls = pass_class(name)
    if value is None:
        config = cls.Config()
    elif isinstance(value, cls.Config):
        config = value
    elif isinstance(value, Mapping):
        fields = {f.name for f in dataclasses.fields(cls.Config)}
        unknown = sorted(set(value) - fields)
        if unknown:
            known = ", ".join(sorted(fields)) or "none"
            raise ValueError(f"pass {name} has no option(s) {', '.join(unknown)}; its options: {known}")
        config = cls.Config(**value)
    else:
        raise TypeError(f"pass {name}: config must be {cls.Config.__name__} or a mapping, got {type(value).__name__}")
    check_config(name, config)
    return config


def pass_configs(values: Mapping[str, Any]) -> dict[str, Any]:
    """:func:`pass_config` of every (pass name, value) in ``values``."""
    return {name: pass_config(name, value) for name, value in values.items()}


def config_choices(name: str, option: str) -> tuple[Any, ...]:
    """The allowed values of option ``option`` (a ``Literal`` field) of pass ``name``'s
    ``Config``, e.g. for a command-line choice."""
    cls = pass_class(name)
    choices = literal_choices(typing.get_type_hints(cls.Config).get(option))
    if choices is None:
        raise ValueError(f"pass {name}: {cls.Config.__name__}.{option} is not an option with fixed choices")
    return choices


def resolve_passes(target: Target, options: PipelineOptions, plan: ParallelPlan | None = None) -> list[GraphPass]:
    """The ordered pass instances for ``target`` after ``options``' enable/disable, with
    their configs, plus what ``plan`` requires. Unknown names fail."""
    registry = registered_passes()
    configs = dict(options.pass_configs)
    for name in (*options.enable, *options.disable, *configs):
        pass_class(name)
    disabled = set(options.disable)
    names = {n for n in default_pass_names(target) if n not in disabled}
    names |= {n for n in options.enable if n not in disabled}
    if plan is not None:
        for name, cls in registry.items():
            reason = cls.required_by(plan)
            if reason is None:
                continue
            if name in disabled:
                raise ValueError(f"{reason} needs pass {name}; it cannot be disabled")
            names.add(name)
    return [registry[n](pass_config(n, configs.get(n))) for n in pipeline_order(names)]
