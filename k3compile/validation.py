"""Translation validation: run a graph before and after a pass on identical random inputs.

The inputs are a *valid* random step of the phase, so every path of the graph does
real work: several sequences with different prior context lengths, random KDA conv and
recurrent states, a random MLA latent cache in randomly permuted blocks, and random
weights (the generator's per-tensor seeded values, sliced for the rank by the same
shard specs the loader uses). Both graphs run on copies of the same inputs; the step's
outputs and every cache tensor the step updated in place are compared. The error is
the largest absolute difference over the largest reference magnitude of each tensor.

Validation runs in-process for TP1 programs at a tiny config (the tests' setting).
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind
from torch.fx import GraphModule

from k3compile.batch import CacheShape, KDALayerCache, allocate_caches
from k3compile.capture import flatten_caches
from k3compile.checkpoint.generate import random_tensor
from k3compile.config import K3Config
from k3compile.sharding import ParallelPlan, ShardOffset, ShardSpec


@dataclass
class ValidationReport:
    max_error: float
    tolerance: float
    ok: bool
    errors: dict[str, float] = field(default_factory=dict)  # per compared tensor


def random_parameters(
    cfg: K3Config,
    program: ExportedProgram,
    specs: dict[str, ShardSpec],
    plan: ParallelPlan,
    seed: int = 0,
    constants: dict[str, ShardOffset] | None = None,
) -> dict[str, Tensor]:
    """This rank's slice of the generator's random weights for every program parameter,
    and its per-rank constant buffers."""
    params: dict[str, Tensor] = {name: c.tensor(plan) for name, c in (constants or {}).items()}
    for spec_in in program.graph_signature.input_specs:
        if spec_in.kind != InputKind.PARAMETER:
            continue
        name = spec_in.target
        spec = specs[name]
        dtype = program.state_dict[name].dtype
        parts = [random_tensor(cfg, n, spec, seed)[spec.local_index(plan)] for n in spec.names]
        params[name] = (torch.stack(parts) if spec.stacked else parts[0]).to(dtype).contiguous()
    return params


def random_step_inputs(
    cfg: K3Config,
    plan: ParallelPlan,
    phase: str,
    dtype: torch.dtype,
    block_size: int,
    seed: int = 0,
    num_seqs: int = 3,
) -> list:
    """User inputs of one valid random step of ``phase`` (StepModule order)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    prior = [rng.randint(0 if phase == "prefill" else 1, 2 * block_size + 3) for _ in range(num_seqs)]
    new = [1 if phase == "decode" else rng.randint(1, 6) for _ in range(num_seqs)]
    blocks_needed = [-(-(p + n) // block_size) for p, n in zip(prior, new)]
    num_blocks = sum(blocks_needed) + 3
    shape = CacheShape(num_slots=num_seqs + 2, num_blocks=num_blocks, block_size=block_size)
    caches = allocate_caches(cfg, plan, shape, dtype)
    for c in caches:
        tensors = (c.conv_q, c.conv_k, c.conv_v, c.state) if isinstance(c, KDALayerCache) else (c.kv,)
        for t in tensors:
            scale = 0.1 if t is getattr(c, "state", None) else 1.0
            t.copy_(scale * torch.randn(t.shape, generator=gen))
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(blocks_needed)
    table = torch.zeros(num_seqs, width, dtype=torch.int32)
    slot_mapping: list[int] = []
    for i, (p, n, nb) in enumerate(zip(prior, new, blocks_needed)):
        blocks = [pool.pop() for _ in range(nb)]
        table[i, :nb] = torch.tensor(blocks, dtype=torch.int32)
        slot_mapping += [blocks[pos // block_size] * block_size + pos % block_size for pos in range(p, p + n)]
    cu = [0]
    for n in new:
        cu.append(cu[-1] + n)
    tokens = cu[-1]
    return [
        torch.randint(0, cfg.vocab_size, (tokens,), generator=gen),
        torch.tensor(cu, dtype=torch.int32),
        torch.tensor([p + n for p, n in zip(prior, new)], dtype=torch.int32),
        torch.tensor(rng.sample(range(shape.num_slots), num_seqs), dtype=torch.int64),
        table,
        torch.tensor(slot_mapping, dtype=torch.int64),
        torch.arange(tokens, dtype=torch.int64),
        flatten_caches(caches),
    ]


def run_graph(gm: GraphModule, program: ExportedProgram, params: dict[str, Tensor], user_inputs: list) -> list[Tensor]:
    """Call a program's graph with its parameters and flattened user inputs."""
    flat_user = torch.utils._pytree.tree_leaves(user_inputs)
    it = iter(flat_user)
    lifted = (InputKind.PARAMETER, InputKind.BUFFER)
    args = [params[s.target] if s.kind in lifted else next(it) for s in program.graph_signature.input_specs]
    out = gm(*args)
    return list(out) if isinstance(out, (list, tuple)) else [out]


def _error(a: Tensor, ref: Tensor) -> float:
    scale = ref.abs().max().item() if ref.numel() else 0.0
    diff = (a.float() - ref.float()).abs().max().item() if ref.numel() else 0.0
    if diff != diff:  # NaN
        return float("inf")
    return diff / max(scale, 1e-30)


class TranslationValidator:
    """Callable for ``run_pipeline``: compares the graph before and after a pass."""

    def __init__(
        self, rtol: float = 1e-4, seed: int = 0, block_size: int = 16, constants: dict[str, ShardOffset] | None = None
    ):
        self.constants = constants or {}
        self.rtol = rtol
        self.seed = seed
        self.block_size = block_size

    def __call__(self, phase: str, before: GraphModule, after: GraphModule, ctx) -> ValidationReport:
        if ctx.plan.tp != 1:
            raise NotImplementedError("in-process translation validation needs a TP1 program")
        program: ExportedProgram = ctx.program
        dtype = next(iter(program.state_dict.values())).dtype
        params = random_parameters(ctx.config, program, ctx.specs, ctx.plan, self.seed, self.constants)
        inputs = random_step_inputs(ctx.config, ctx.plan, phase, dtype, self.block_size, self.seed)
        ins_before, ins_after = copy.deepcopy(inputs), copy.deepcopy(inputs)
        with torch.no_grad():
            out_before = run_graph(before, program, params, ins_before)
            out_after = run_graph(after, program, params, ins_after)
        errors: dict[str, float] = {}
        for i, (a, b) in enumerate(zip(out_after, out_before)):
            errors[f"output{i}"] = _error(a, b)
        for i, (a, b) in enumerate(zip(ins_after[-1], ins_before[-1])):
            errors[f"cache{i}"] = _error(a, b)
        worst = max(errors.values()) if errors else 0.0
        return ValidationReport(worst, self.rtol, worst <= self.rtol, errors)
