"""Export a stack of repeated layers by tracing one layer of each structure.

``torch.export`` traces the rank-local model op by op on fake tensors with symbolic
sizes, a few milliseconds per node: the full K3 decode step (93 layers, ~8,000 nodes)
took 47 s. Its layers come in four structures (KDA or MLA attention, dense or MoE
MLP, whether the layer starts an Attention Residuals block), so :func:`export_stacked`
traces the first layer of each structure and puts one stub node in the graph for every
other layer; after the export it replaces each stub with a copy of its template's nodes
that reads the layer's own parameters, caches and activations.

The result is, node for node, the program ``torch.export`` gives for the whole model
(``tests/test_capture.py`` compares them): the same nodes in the same order, the same
names (at a stub the tracer's name counters advance by what the template used,
including nodes that export later removed as dead), the same ``torch.cond`` branch
modules (numbered as the tracer numbers them), and the same metadata (module paths name
the stamped layer, and ``torch_fn`` counters advance like the names). Copies share the
template's fake values (``val``, ``tensor_meta``): the shapes are the same, and shape
propagation replaces a node's value rather than changing it.

A layer is called as ``layer(activation, earlier, *rest)``: the running activation, a
list of earlier activations (Attention Residuals' finished blocks: it grows along the
stack, so a copy's mix reads the stamped layer's whole list), then any per-layer or
shared inputs (the batch, the layer's cache); it returns the new activation and the list
for the next layer, made of its inputs. Two layers share a structure when their modules
have the same classes, attributes, parameter shapes and dtypes, and their calls the
same argument kinds and whether ``earlier`` is empty. A module's ``layer`` index and the
checkpoint names of its parameters (``shard_specs``) are not structure.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind
from torch.fx import GraphModule, Node
from torch.fx.experimental import proxy_tensor

#: Module attributes that name a layer's index or its checkpoint tensors rather than shape
#: its graph.
NAMING_ATTRIBUTES = frozenset({"layer", "shard_specs"})


@torch.library.custom_op("k3compile_capture::layer_stub", mutates_args=())
def layer_stub(activations: list[Tensor], layer: int) -> Tensor:
    """Stands for a layer during the trace; :func:`export_stacked` replaces it."""
    raise RuntimeError("layer_stub only exists while a program is being captured")


@layer_stub.register_fake
def _(activations: list[Tensor], layer: int) -> Tensor:
    return torch.empty_like(activations[0])


class StampError(RuntimeError):
    """A layer cannot be stamped from its template (an assumption of this module broke)."""


def _plain(value: Any) -> Hashable:
    """A hashable summary of a module attribute (structure, not identity)."""
    if isinstance(value, (bool, int, float, str, type(None), torch.dtype)):
        return value
    if isinstance(value, (tuple, list)):
        return tuple(_plain(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return (type(value).__qualname__, tuple(_plain(getattr(value, f.name)) for f in dataclasses.fields(value)))
    if isinstance(value, dict):
        return tuple(sorted((str(k), _plain(v)) for k, v in value.items()))
    return type(value).__qualname__


def structure_key(layer: nn.Module) -> Hashable:
    """What a layer's traced graph depends on besides its inputs: module classes, plain
    attributes (but ``NAMING_ATTRIBUTES``), parameter and buffer shapes and dtypes."""
    parts = []
    for name, module in layer.named_modules():
        attrs = tuple(sorted((k, _plain(v)) for k, v in vars(module).items()
                             if not k.startswith("_") and k not in NAMING_ATTRIBUTES and k != "training"))
        tensors = tuple((n, tuple(t.shape), t.dtype) for n, t in
                        [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)])
        parts.append((name, type(module).__module__, type(module).__qualname__, attrs, tensors))
    return tuple(parts)


def _leaves(value: Any) -> Iterator[Any]:
    """Tensors and plain values of a call argument (dataclasses by field)."""
    if isinstance(value, (list, tuple)):
        for v in value:
            yield from _leaves(v)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield from _leaves(getattr(value, f.name))
    else:
        yield value


def _call_key(args: tuple) -> Hashable:
    """The kinds of a layer call's arguments: dtypes and static sizes of its tensors (each
    input's dynamic sizes have symbols of their own while tracing), plain values."""
    activation, earlier, *rest = args
    return (bool(earlier), tuple(
        (t.dtype, tuple(d if isinstance(d, int) else None for d in t.shape)) if isinstance(t, Tensor) else _plain(t)
        for t in _leaves([activation, earlier[:1], rest])))


# -- the tracer's state (torch.fx.experimental.proxy_tensor, torch 2.13) ---------------


def _tracer() -> Any:
    tracer = proxy_tensor._CURRENT_MAKE_FX_TRACER
    if tracer is None or tracer.fx_tracer is None:
        raise StampError("export_stacked must run inside torch.export's make_fx trace")
    return tracer.fx_tracer


def _node(tensor: Tensor) -> Node:
    return proxy_tensor.get_proxy_slot(tensor, _tracer()).proxy.node


def _input_nodes(rest: Sequence[Any]) -> list[Node | None]:
    return [_node(t) if isinstance(t, Tensor) else None for t in _leaves(list(rest))]


_NUMBERED = re.compile(r"(.*?)(?:_(\d+))?$")


def _base(name: str) -> str:
    return _NUMBERED.match(name).group(1)


def _number(name: str) -> int:
    n = _NUMBERED.match(name).group(2)
    return int(n) if n else 0


# -- trace time --------------------------------------------------------------------------


@dataclass
class _Template:
    """The first traced layer of a structure, as recorded during the trace."""

    qualname: str
    activations: list[Node]  # [activation, *earlier]
    rest: list[Node | None]
    region: list[Node]  # the nodes its trace created, in order
    output: Node
    keeps_earlier: bool  # the returned list starts with all of ``earlier``
    appended: list[int]  # then these inputs (indices into ``activations``)
    names: dict[str, list[str]]  # base -> the node names the layer took, in order (dead ones too)
    graphs: list[list[str]]  # cond branch modules it registered, grouped by their number
    torch_fns: dict[Any, tuple[int, int]]  # torch function -> its call counter before and after


@dataclass
class _Stub:
    """A layer stamped from ``template``: its stub node and the names it reserved."""

    qualname: str
    node: Node
    rest: list[Node | None]
    template: _Template
    names: dict[str, str] = field(default_factory=dict)  # template node name -> this layer's
    graphs: dict[str, str] = field(default_factory=dict)  # template branch module -> this layer's
    torch_fn_shift: dict[str, int] = field(default_factory=dict)  # "<class>.<name>" -> counter shift


class _Recorder:
    """Replaces the layers' forwards during the trace: a template's records its nodes,
    a later layer of the same structure calls the stub and reserves its names."""

    def __init__(self, root: nn.Module, layers: Sequence[nn.Module]):
        qualnames = {id(m): n for n, m in root.named_modules()}
        self.layers = [(layer, qualnames[id(layer)], structure_key(layer)) for layer in layers]
        self.templates: dict[Hashable, _Template] = {}
        self.stubs: list[_Stub] = []

    @contextmanager
    def installed(self) -> Iterator[None]:
        for index, (layer, qualname, key) in enumerate(self.layers):
            layer.forward = self._wrap(index, layer, qualname, key)
        try:
            yield
        finally:
            for layer, _, _ in self.layers:
                del layer.forward

    def _wrap(self, index: int, layer: nn.Module, qualname: str, key: Hashable) -> Callable[..., Any]:
        original = type(layer).forward.__get__(layer)

        def call(*args: Any) -> Any:  # not named "forward": the tracer's stack traces skip it
            with torch._C.DisableTorchFunction():  # inspecting tensors must not advance torch_fn counters
                full_key = (key, _call_key(args))
            template = self.templates.get(full_key)
            if template is None:
                self.templates[full_key], result = self._trace(original, qualname, args)
                return result
            return self._stub(index, qualname, template, args)

        return call

    def _trace(self, forward: Callable[..., Any], qualname: str, args: tuple) -> tuple[_Template, Any]:
        """Trace a template layer, recording the nodes, names, branch modules and torch
        function calls it adds."""
        activation, earlier, *rest = args
        tracer = _tracer()
        graph, namespace = tracer.graph, tracer.graph._graph_namespace
        last, used = graph._root.prev, set(namespace._used_names)
        modules = {n for n, _ in tracer.root.named_children()}
        fns = dict(tracer.torch_fn_counts)
        out, returned = forward(*args)
        with torch._C.DisableTorchFunction():
            inputs = [activation, *earlier]
            if any(out is t for t in inputs) or (out.shape, out.dtype, out.stride()) != (
                    activation.shape, activation.dtype, activation.stride()):
                raise StampError(f"{qualname}: the layer's output is not a new tensor like its input activation")
            keeps = len(returned) >= len(earlier) and all(r is e for r, e in zip(returned, earlier))
            appended = []
            for t in returned[len(earlier) if keeps else 0:]:
                match = [i for i, x in enumerate(inputs) if x is t]
                if not match:
                    raise StampError(f"{qualname}: a tensor of the returned list is not one of the layer's inputs")
                appended.append(match[0])
            region, node = [], last.next
            while node is not graph._root:
                region.append(node)
                node = node.next
            new_modules = [n for n, _ in tracer.root.named_children() if n not in modules]
            attrs = {n.target for n in region if n.op == "get_attr"}
            if set(new_modules) != attrs or not all(isinstance(tracer.root.get_submodule(n), GraphModule)
                                                    for n in new_modules):
                raise StampError(f"{qualname}: a stamped layer may create torch.cond branch modules, nothing else")
            names: dict[str, list[str]] = {}
            for name in sorted((n for n in namespace._used_names if n not in used and n not in attrs), key=_number):
                names.setdefault(_base(name), []).append(name)
            groups: dict[int, list[str]] = {}
            for n in new_modules:
                groups.setdefault(_number(n), []).append(n)
            counters = {f: (fns.get(f, 0), c) for f, c in tracer.torch_fn_counts.items() if c != fns.get(f, 0)}
            template = _Template(qualname, [_node(t) for t in inputs], _input_nodes(rest), region, _node(out),
                                 keeps, appended, names, list(groups.values()), counters)
        return template, (out, returned)

    def _stub(self, index: int, qualname: str, template: _Template, args: tuple) -> Any:
        """Call the stub for a layer of ``template``'s structure and advance the tracer's
        counters as tracing the layer would have."""
        activation, earlier, *rest = args
        inputs = [activation, *earlier]
        out = torch.ops.k3compile_capture.layer_stub(inputs, index)
        tracer = _tracer()
        stub = _Stub(qualname, _node(out), _input_nodes(rest), template)
        namespace = tracer.graph._graph_namespace
        for base, names in template.names.items():  # as if the layer's nodes were created now
            for name in names:
                stub.names[name] = namespace.create_name(base, None)
        for group in template.graphs:  # cond numbers its branch modules by the first free number
            number = 0
            while any(hasattr(tracer.root, f"{_base(n)}_{number}") for n in group):
                number += 1
            for n in group:
                new = f"{_base(n)}_{number}"
                tracer.root.register_module(new, tracer.root.get_submodule(n))
                stub.graphs[n] = namespace.create_name(new, None)
        for fn, (start, end) in template.torch_fns.items():  # metadata names fns "<class>.<name>"
            stub.torch_fn_shift.setdefault(f"{fn.__class__.__name__}.{fn.__name__}",
                                           tracer.torch_fn_counts.get(fn, 0) - start)
            tracer.torch_fn_counts[fn] = tracer.torch_fn_counts.get(fn, 0) + end - start
        self.stubs.append(stub)
        return out, [*(earlier if template.keeps_earlier else []), *(inputs[i] for i in template.appended)]


# -- after the export ----------------------------------------------------------------------


def _relocate(meta: dict[str, Any], old: str, new: str, torch_fn_shift: dict[str, int]) -> dict[str, Any]:
    """A template node's metadata for the stamped layer: module paths under ``old`` moved
    to ``new`` (``nn_module_stack``), the ``torch_fn`` counter advanced as the layer's own
    trace would have."""
    meta = dict(meta)
    stack = meta.get("nn_module_stack")
    if stack:
        moved = {}
        for key, (path, kind) in stack.items():
            new_path = new + path[len(old):] if path == old or path.startswith(old + ".") else path
            moved[key[: len(key) - len(path)] + new_path if path and key.endswith(path) else key] = (new_path, kind)
        meta["nn_module_stack"] = moved
    torch_fn = meta.get("torch_fn")
    if torch_fn and torch_fn[1] in torch_fn_shift:
        name, kind = torch_fn
        meta["torch_fn"] = (f"{name[: name.rindex('_')]}_{_number(name) + torch_fn_shift[kind]}", kind)
    return meta


class _Stamper:
    """Replaces the stubs of one exported program by copies of their templates."""

    def __init__(self, program: ExportedProgram):
        self.gm = program.graph_module
        self.graph = self.gm.graph
        self.namespace = self.graph._graph_namespace
        self.lifted = {s.target: n for s, n in zip(program.graph_signature.input_specs,
                                                   (n for n in self.graph.nodes if n.op == "placeholder"))
                       if s.kind in (InputKind.PARAMETER, InputKind.BUFFER)}
        self.replaced: dict[Node, Node] = {}  # stub -> the stamped layer's output

    def _name(self, wanted: str) -> str:
        self.namespace._used_names.discard(wanted)  # reserved during the trace
        return wanted

    def stamp(self, stub: _Stub) -> None:
        template = stub.template
        activations = list(stub.node.args[0])
        if len(activations) < len(template.activations):
            raise StampError(f"{stub.qualname}: fewer earlier activations than its template's")
        # A template's inputs may be stubs replaced since the trace (its region reads their copies).
        template_activations = [self.replaced.get(n, n) for n in template.activations]
        env: dict[Node, Any] = dict(zip(template_activations, activations))
        env.update((t, s) for t, s in zip(template.rest, stub.rest) if t is not None)
        earlier, stamped_earlier = template_activations[1:], activations[1:]
        prefix = template.qualname + "."
        env.update((node, self.lifted[stub.qualname + "." + target[len(prefix):]])
                   for target, node in self.lifted.items() if target.startswith(prefix))

        def arg(a: Any) -> Any:
            if isinstance(a, Node):
                return env.get(a, a)
            if isinstance(a, (list, tuple)):
                items = list(a)
                if earlier and items[: len(earlier)] == earlier:  # the whole list of earlier activations
                    return type(a)([*stamped_earlier, *(arg(x) for x in items[len(earlier):])])
                return type(a)(arg(x) for x in items)
            if isinstance(a, dict):
                return {k: arg(v) for k, v in a.items()}
            return a

        with self.graph.inserting_before(stub.node):
            for node in template.region:
                if node._erased or node.op == "placeholder":
                    continue
                if isinstance(node.meta.get("val"), (torch.SymInt, torch.SymBool, torch.SymFloat)):
                    continue  # a size expression: the tracer keeps one node for it, shared by every layer
                if node.op == "get_attr":  # a cond branch: copied when its cond is
                    new = self.graph.create_node("get_attr", stub.graphs[node.target],
                                                 name=self._name(stub.graphs[node.target]))
                else:
                    new = self.graph.create_node(node.op, node.target, arg(node.args), arg(node.kwargs),
                                                 name=self._name(stub.names[node.name]), type_expr=node.type)
                new.meta = _relocate(node.meta, template.qualname, stub.qualname, stub.torch_fn_shift)
                if "eager_input_vals" in new.meta:  # the fake inputs of the op, as the tracer records them
                    new.meta["eager_input_vals"] = torch.fx.node.map_aggregate(
                        (new.args, new.kwargs), lambda a: a.meta.get("val") if isinstance(a, Node) else None)
                if node.target is torch.ops.higher_order.cond:
                    for template_branch, branch in zip(node.args[1:3], new.args[1:3]):
                        self.gm.register_module(branch.target, _copy_branch(
                            self.gm.get_submodule(template_branch.target), node.args[3], new.args[3]))
                env[node] = new
        stub.node.replace_all_uses_with(env[template.output])
        self.graph.erase_node(stub.node)
        self.replaced[stub.node] = env[template.output]


def _copy_branch(branch: GraphModule, operands: Sequence[Any], stamped_operands: Sequence[Any]) -> GraphModule:
    """A copy of a template's cond branch for the stamped cond (node metadata shared
    shallowly). Its inputs are named like the stamped operands, as export names them,
    where the template's were named like the template's operands."""
    graph = copy.deepcopy(branch.graph)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for ph, old, new in zip(placeholders, operands, stamped_operands):
        if isinstance(old, Node) and ph.name == old.name:
            ph._rename(new.name)
            ph.target = ph.name  # a placeholder's target is its argument name
    return GraphModule(branch, graph, class_name=type(branch).__name__)


def export_stacked(
    module: nn.Module, args: tuple, dynamic_shapes: Any, layers: Sequence[nn.Module]
) -> ExportedProgram:
    """``torch.export.export(module, args, dynamic_shapes=..., strict=False)`` with every
    layer of ``layers`` whose structure an earlier one has stamped from it (see the module
    docstring)."""
    recorder = _Recorder(module, layers)
    with recorder.installed():
        program = torch.export.export(module, args, dynamic_shapes=dynamic_shapes, strict=False)
    stamper = _Stamper(program)
    counts = dict(stamper.namespace._base_count)
    for stub in recorder.stubs:
        stamper.stamp(stub)
    stamper.namespace._base_count = counts  # as the trace left them: explicit names lowered some
    gm = program.graph_module  # branch modules in the order the trace registers them: graph order
    order = {n.target: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "get_attr")}
    gm._modules = dict(sorted(gm._modules.items(), key=lambda item: order.get(item[0], len(order))))
    return program
