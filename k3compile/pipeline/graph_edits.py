"""Edits of an exported program that go beyond its graph, for passes.

A pass that changes which slice of a weight each rank holds, how a parameter is stored,
or needs a rank-dependent number inside the graph changes the program's signature,
state dict and placeholders' fake values, and the specs and constants shared by all
phases, together. These helpers do each of those edits in one call, idempotently, so
the pass can make the same call in every phase it rewrites.
"""

from __future__ import annotations

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, InputSpec, TensorArgument

from k3compile.pipeline.interface import PassContext, PassError
from k3compile.sharding import ShardOffset, ShardSpec


def reshard_parameter(ctx: PassContext, name: str, spec: ShardSpec) -> torch.fx.Node:
    """Give parameter ``name`` a new shard spec: this rank now holds ``spec``'s slice.

    Updates the shared specs (so the loader reads the new slice), the program's state
    dict entry and its placeholder's fake value (the new local shape). Returns the
    placeholder. A pass calls this in every phase it rewrites; the call is idempotent."""
    program = ctx.program
    node = _placeholder_of(program, name)
    if node is None:
        raise PassError(f"{name} is not a parameter of the {ctx.phase} program")
    old = program.state_dict[name]
    shape = spec.local_shape(ctx.plan)
    ctx.specs[name] = spec
    program.state_dict[name] = torch.nn.Parameter(
        torch.empty(shape, dtype=old.dtype, device=old.device), requires_grad=False
    )
    val = node.meta["val"]
    with torch._guards.detect_fake_mode([val]):
        node.meta["val"] = torch.empty(shape, dtype=val.dtype, device=val.device)
    return node


def _placeholder_of(program: ExportedProgram, name: str) -> torch.fx.Node | None:
    """The graph placeholder of lifted input ``name`` (a parameter or buffer), or None."""
    arg = next((s.arg.name for s in program.graph_signature.input_specs if s.target == name), None)
    if arg is None:
        return None
    return next((n for n in program.graph.find_nodes(op="placeholder", sort=False) if n.name == arg), None)


def add_parameter(ctx: PassContext, name: str, spec: ShardSpec, before: str) -> torch.fx.Node:
    """A new parameter ``name`` holding this rank's slice of ``spec`` (in the spec's storage
    dtype: MXFP4 codes stay bytes), placed in the signature just before parameter
    ``before``. Updates the shared specs, the program's state dict and signature, and
    gives the placeholder its fake value. Idempotent per program."""
    program = ctx.program
    existing = _placeholder_of(program, name)
    if existing is not None:
        return existing
    anchor = _placeholder_of(program, before)
    if anchor is None:
        raise PassError(f"{before} is not a parameter of the {ctx.phase} program")
    dtype = spec.param_dtype(program.state_dict[before].dtype)
    shape = spec.local_shape(ctx.plan)
    with program.graph.inserting_before(anchor):
        node = program.graph.placeholder("p_" + name.replace(".", "_"))
    val = anchor.meta["val"]
    with torch._guards.detect_fake_mode([val]):
        node.meta["val"] = torch.empty(shape, dtype=dtype, device=val.device)
    specs = program.graph_signature.input_specs
    position = next(i for i, s in enumerate(specs) if s.target == before)
    specs.insert(position, InputSpec(InputKind.PARAMETER, TensorArgument(node.name), name, persistent=None))
    device = program.state_dict[before].device
    program.state_dict[name] = torch.nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
    ctx.specs[name] = spec
    return node


def remove_parameter(ctx: PassContext, name: str) -> None:
    """Drop parameter ``name``, which no node may use any more, from the graph, the
    signature, the state dict and the shared specs (a pass that replaced it calls this in
    every phase; the specs entry goes with the first)."""
    program = ctx.program
    node = _placeholder_of(program, name)
    if node is None:
        raise PassError(f"{name} is not a parameter of the {ctx.phase} program")
    if node.users:
        raise PassError(f"parameter {name} is still used by {[u.name for u in node.users][:3]}")
    program.graph.erase_node(node)
    specs = program.graph_signature.input_specs
    specs.pop(next(i for i, s in enumerate(specs) if s.target == name))
    del program.state_dict[name]
    ctx.specs.pop(name, None)


def add_rank_constant(ctx: PassContext, name: str, offset: ShardOffset) -> torch.fx.Node:
    """A per-rank constant buffer ``name`` (this rank's ``offset`` value) as a graph input.

    Programs are shared by all ranks, so a rank-dependent number (where this rank's block
    starts) must be an input filled per rank at load time, never a baked-in constant. The
    buffer joins the program's signature after the existing buffers, its state dict, and
    the shared ``ctx.constants`` (which the artifact writes per rank and the validator and
    runtime fill). Idempotent per program: a second call returns the same placeholder."""
    program = ctx.program
    if ctx.constants.get(name, offset) != offset:
        raise PassError(f"rank constant {name} already exists with a different offset")
    existing = _placeholder_of(program, name)
    if existing is not None:
        return existing
    placeholders = [n for n in program.graph.nodes if n.op == "placeholder"]
    specs = program.graph_signature.input_specs
    lifted = (InputKind.PARAMETER, InputKind.BUFFER)
    position = sum(1 for s in specs if s.kind in lifted)  # after every parameter and buffer
    if any(s.kind in lifted for s in specs[position:]):
        raise PassError("program inputs are not ordered parameters, buffers, user inputs")
    value = offset.tensor(ctx.plan)
    with program.graph.inserting_before(placeholders[position]):
        node = program.graph.placeholder("b_" + name.replace(".", "_"))
    val = placeholders[0].meta["val"]
    with torch._guards.detect_fake_mode([val]):
        node.meta["val"] = torch.empty((), dtype=value.dtype, device=val.device)
    specs.insert(position, InputSpec(InputKind.BUFFER, TensorArgument(node.name), name, persistent=True))
    program.state_dict[name] = value
    ctx.constants[name] = offset
    return node
