"""k3 ops kept as custom ops in an export (``ExportOptions(k3_ops="keep")``).

By default an export decomposes every k3 op into standard operators
(``k3compile.export.decompositions``). Kept, every k3 op call of the program is one node
instead, whose semantics are the op's torch reference in ``k3compile/ops``:

- In the trace, :class:`KeptK3Ops` leaves every k3 op call as it is, except the ops that
  update a cache in place (``short_conv_decode``, ``kda_decode``, ``mla_cache_write``,
  ...). Those become their functional twin ``k3_functional::<name>`` (same arguments;
  results: the op's own, then the new value of each argument it mutates), followed by a
  copy into the cache, so the traced program mutates no input.
- In ONNX, each call is a node of the domain ``k3`` (version 1) whose ``op_type`` is the
  op's name. Its inputs are the op's tensor arguments in the op's order, except that a
  ``Tensor[]`` argument comes last, as ONNX's variadic input; its attributes are the
  op's scalar arguments (float -> FLOAT, int and bool -> INT, dtype -> STRING, torch's
  name of it); its outputs are the op's results, then one ``<argument>_out`` per mutated
  argument. :func:`register_onnx_schemas` registers that signature with ``onnx.defs``,
  so ``onnx.checker`` checks every node's inputs, outputs and attributes against it.

No runtime has kernels for the ``k3`` domain: such a model documents the optimized graph
(Netron, graph tools), or feeds a runtime that implements the domain itself.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode

from k3compile.export.decompositions import k3_name

#: the ONNX domain of kept k3 ops, and its version
K3_DOMAIN = "k3"
K3_DOMAIN_VERSION = 1
#: the torch namespace of the functional twins of the k3 ops that mutate an argument
FUNCTIONAL_NAMESPACE = "k3_functional"
#: k3_ops values: decomposed into standard operators (the default), or kept as custom ops
K3_OPS_MODES = ("decompose", "keep")

_ATTRIBUTE_KINDS = {"float": "FLOAT", "int": "INT", "SymInt": "INT", "bool": "INT", "ScalarType": "STRING",
                    "str": "STRING"}
_TENSOR_TYPES = [f"tensor({t})" for t in ("float", "float16", "bfloat16", "double", "int8", "int16", "int32",
                                          "int64", "uint8", "uint16", "uint32", "uint64", "bool",
                                          "float8e4m3fn", "float8e5m2")]
_library = torch.library.Library(FUNCTIONAL_NAMESPACE, "FRAGMENT")  # kept alive: it owns the twins


@dataclass(frozen=True)
class KeptSignature:
    """A k3 op's signature as a kept node (module docstring)."""

    name: str
    inputs: tuple[str, ...]  # the single-tensor arguments, in the op's order
    tensor_list: str | None  # the Tensor[] argument (ONNX's variadic last input), if any
    attributes: tuple[tuple[str, str], ...]  # (argument, ONNX attribute type)
    outputs: tuple[str, ...]  # the op's results, then ``<argument>_out`` per mutated argument
    mutated: tuple[str, ...]  # the arguments the op updates in place


@functools.cache
def kept_signature(name: str) -> KeptSignature:
    """The kept signature of k3 op ``name``, from its torch schema; a ValueError for an
    argument type that has no ONNX form here."""
    schema = getattr(torch.ops.k3, name).default._schema
    inputs, lists, attributes, mutated = [], [], [], []
    for arg in schema.arguments:
        kind = str(arg.type)
        if kind == "Tensor":
            inputs.append(arg.name)
            if arg.alias_info is not None and arg.alias_info.is_write:
                mutated.append(arg.name)
        elif kind == "List[Tensor]":
            lists.append(arg.name)
        elif kind in _ATTRIBUTE_KINDS:
            attributes.append((arg.name, _ATTRIBUTE_KINDS[kind]))
        else:
            raise ValueError(f"k3.{name}: argument {arg.name} of type {kind} has no kept form")
    if len(lists) > 1:
        raise ValueError(f"k3.{name}: {len(lists)} Tensor[] arguments; ONNX has one variadic input")
    results = [r.name or (f"output{i}" if len(schema.returns) > 1 else "output")
               for i, r in enumerate(schema.returns)]
    return KeptSignature(name, tuple(inputs), lists[0] if lists else None, tuple(attributes),
                         (*results, *(f"{m}_out" for m in mutated)), tuple(mutated))


@functools.cache
def functional_op(name: str) -> torch._ops.OpOverload:
    """``k3_functional::<name>``, the functional twin of mutating k3 op ``name``: defined
    on first use, it runs the op on copies of its mutated arguments and returns the op's
    results, then those copies."""
    op = getattr(torch.ops.k3, name).default
    signature = kept_signature(name)
    schema = op._schema
    text = str(schema)
    arguments = re.sub(r"Tensor\([^)]*\)", "Tensor", text[text.index("(") + 1:text.rindex(") ->")])
    returns = ", ".join(["Tensor"] * len(signature.outputs))
    _library.define(f"{name}({arguments}) -> " + (returns if len(signature.outputs) == 1 else f"({returns})"))
    mutated = [i for i, a in enumerate(schema.arguments) if a.name in signature.mutated]

    def run(*args):
        args = list(args)
        copies = [args[i].clone() for i in mutated]
        for i, copy in zip(mutated, copies, strict=True):
            args[i] = copy
        out = op(*args)
        out = () if out is None else (out,) if isinstance(out, torch.Tensor) else tuple(out)
        results = (*out, *copies)
        return results if len(results) > 1 else results[0]

    _library.impl(name, run, "CompositeExplicitAutograd")
    return getattr(getattr(torch.ops, FUNCTIONAL_NAMESPACE), name).default


class KeptK3Ops(TorchFunctionMode):
    """While active, a k3 op that mutates an argument runs as its functional twin followed
    by a copy into that argument (module docstring); every other k3 op call stays."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = k3_name(func)
        if name is None or not kept_signature(name).mutated:
            return func(*args, **(kwargs or {}))
        schema = getattr(torch.ops.k3, name).default._schema
        bound = bind_arguments(schema, args, kwargs or {})
        results = functional_op(name)(*(bound[a.name] for a in schema.arguments))
        results = (results,) if isinstance(results, torch.Tensor) else tuple(results)
        mutated = kept_signature(name).mutated
        own = results[:len(results) - len(mutated)]
        for arg, value in zip(mutated, results[len(own):], strict=True):
            bound[arg].copy_(value)
        return None if not own else own[0] if len(own) == 1 else own


def bind_arguments(schema: torch._C.FunctionSchema, args: tuple, kwargs: dict) -> dict:
    """Every argument of ``schema`` by name: positional, keyword or its default (for the
    ONNX translations, which the exporter calls with the traced node's arguments)."""
    bound = {}
    for i, arg in enumerate(schema.arguments):
        if i < len(args):
            bound[arg.name] = args[i]
        elif arg.name in kwargs:
            bound[arg.name] = kwargs[arg.name]
        elif arg.has_default_value():
            bound[arg.name] = arg.default_value
        else:
            raise TypeError(f"{schema.name}: missing argument {arg.name}")
    return bound


def register_onnx_schemas(names: set[str]) -> None:
    """Register the ONNX schema of each kept k3 op in ``names`` (domain ``k3``, version 1),
    once a process."""
    import onnx.defs

    for name in sorted(names):
        if onnx.defs.has(name, K3_DOMAIN):
            continue
        onnx.defs.register_schema(onnx_schema(kept_signature(name), K3_DOMAIN, K3_DOMAIN_VERSION, reference(name)))


def onnx_schema(signature: KeptSignature, domain: str, version: int, doc: str):
    """The ONNX schema of a node with ``signature`` in ``domain``: its inputs and outputs of
    any tensor type each, its attributes required; no shape inference (the output types
    come from the trace: :func:`restore_output_types`)."""
    from onnx.defs import OpSchema

    def parameter(name: str, type_str: str, variadic: bool = False):
        option = OpSchema.FormalParameterOption.Variadic if variadic else OpSchema.FormalParameterOption.Single
        return OpSchema.FormalParameter(name, type_str, "", param_option=option, is_homogeneous=True,
                                        min_arity=0 if variadic else 1)

    inputs = [parameter(n, f"T{i}") for i, n in enumerate(signature.inputs)]
    constraints = [(f"T{i}", _TENSOR_TYPES, "") for i in range(len(signature.inputs))]
    if signature.tensor_list is not None:
        inputs.append(parameter(signature.tensor_list, "TL", variadic=True))
        constraints.append(("TL", _TENSOR_TYPES, ""))
    outputs = [parameter(n, f"O{i}") for i, n in enumerate(signature.outputs)]
    constraints += [(f"O{i}", _TENSOR_TYPES, "") for i in range(len(signature.outputs))]
    attributes = [OpSchema.Attribute(n, getattr(OpSchema.AttrType, kind), "", required=True)
                  for n, kind in signature.attributes]
    return OpSchema(signature.name, domain, version, doc, inputs=inputs, outputs=outputs,
                    type_constraints=constraints, attributes=attributes)


def reference(name: str) -> str:
    """Where k3 op ``name``'s semantics live: the module and name of its torch reference."""
    from k3compile.export.decompositions import k3_op_definitions

    return f"{k3_op_definitions()[name]._init_fn.__module__}.{name}"


def kept_calls(program: torch.export.ExportedProgram) -> list[str]:
    """The k3 op name of every kept call in ``program``'s graph (a functional twin counts
    as its op), in graph order."""
    names = []
    for node in program.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        if node.target.namespace in (K3_DOMAIN, FUNCTIONAL_NAMESPACE):
            names.append(node.target._schema.name.split("::")[1])
    return names


def onnx_translation_table(names: set[str]) -> dict:
    """``torch.onnx.export``'s ``custom_translation_table`` for the kept k3 ops ``names``
    (their schemas registered first): each call becomes one ``k3`` node."""
    register_onnx_schemas(names)
    return {(functional_op(n) if kept_signature(n).mutated else getattr(torch.ops.k3, n).default): _onnx_node(n)
            for n in sorted(names)}


def _onnx_node(name: str):
    """The translation of k3 op ``name``'s call into one ``k3`` node (module docstring)."""
    signature = kept_signature(name)
    schema = getattr(torch.ops.k3, name).default._schema

    def translate(*args, **kwargs):
        import onnxscript

        bound = bind_arguments(schema, args, kwargs)
        named = {n: onnx_attribute(name, n, kind, bound[n]) for n, kind in signature.attributes}
        if signature.tensor_list is not None:  # by name: the recorder gives a variadic input every positional one
            named[signature.tensor_list] = tuple(bound[signature.tensor_list])
        op = getattr(onnxscript.values.Opset(K3_DOMAIN, K3_DOMAIN_VERSION), name)
        return op(*(bound[n] for n in signature.inputs), **named)

    return translate


def onnx_attribute(op: str, name: str, kind: str, value: object) -> object:
    """``value`` as an ONNX attribute of type ``kind``; a ValueError for a value the trace
    left symbolic (a size of a dynamic dimension)."""
    if kind == "STRING":
        return str(value).removeprefix("torch.")
    if kind == "INTS":
        return [onnx_attribute(op, name, "INT", v) for v in value]
    if not isinstance(value, (bool, int, float)):
        raise ValueError(f"k3.{op}: argument {name} is {value!r}, not a constant: it cannot be an ONNX attribute")
    return float(value) if kind == "FLOAT" else int(value)


def restore_output_types(model, domains: tuple[str, ...] = (K3_DOMAIN,)) -> None:
    """Set the element type of the outputs of every node of ``domains`` in ``model`` (an ``onnx_ir``
    model from ``torch.onnx.export``) from the traced values: the exporter's optimizer
    clears the types of outputs of ops it has no inference for, and the full check's
    strict shape inference then finds the nodes after them untyped."""
    import onnx_ir as ir

    dtypes = {torch.float32: ir.DataType.FLOAT, torch.float16: ir.DataType.FLOAT16,
              torch.bfloat16: ir.DataType.BFLOAT16, torch.float64: ir.DataType.DOUBLE,
              torch.int64: ir.DataType.INT64, torch.int32: ir.DataType.INT32, torch.int16: ir.DataType.INT16,
              torch.int8: ir.DataType.INT8, torch.uint8: ir.DataType.UINT8, torch.bool: ir.DataType.BOOL,
              torch.float8_e4m3fn: ir.DataType.FLOAT8E4M3FN, torch.float8_e5m2: ir.DataType.FLOAT8E5M2}
    for node in model.graph:
        if node.domain not in domains:
            continue
        traced = node.meta["node"].meta["val"]
        traced = (traced,) if isinstance(traced, torch.Tensor) else tuple(traced)
        for value, example in zip(node.outputs, traced, strict=True):
            if value.dtype is None:
                value.dtype = dtypes[example.dtype]
