"""Translation validation: run a graph before and after a pass on identical random inputs.

The inputs are a *valid* random step of the phase, so every path of the graph does
real work: several sequences with different prior context lengths, random KDA conv and
recurrent states, a random MLA latent cache in randomly permuted blocks, and random
weights (the generator's per-tensor seeded values, sliced for the rank by the same
shard specs the loader uses). Both graphs run on copies of the same inputs; the step's
outputs and every cache tensor the step updated in place are compared. The error is
the largest absolute difference over the largest reference magnitude of each tensor.

TP1 programs are validated in-process; TP > 1 programs on real gloo ranks in spawned
processes, each with its slice of the weights, so rewrites across ranks (a resharded
parameter, a moved collective) are checked as they will run. Meant for tiny configs.
"""

from __future__ import annotations

import copy
import io
import random
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind
from torch.fx import GraphModule

import k3compile.ops  # noqa: F401  (ranks deserialize programs that call torch.ops.k3.*)
from k3compile.batch import CacheShape, KDALayerCache, allocate_caches, flatten_caches
from k3compile.checkpoint.generate import stored_random_tensor
from k3compile.config import K3Config
from k3compile.context_parallel import ContextLayout, localize_step, mla_cache_indices, program_layout
from k3compile.distributed import init_context_parallel
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
    """This rank's slice of the generator's random weights for every program parameter (in
    the storage its spec declares: MXFP4 experts as codes and scales), and its per-rank
    constant buffers."""
    params: dict[str, Tensor] = {name: c.tensor(plan) for name, c in (constants or {}).items()}
    for spec_in in program.graph_signature.input_specs:
        if spec_in.kind != InputKind.PARAMETER:
            continue
        name = spec_in.target
        spec = specs[name]
        dtype = program.state_dict[name].dtype
        parts = [stored_random_tensor(cfg, n, spec, seed)[spec.local_index(plan)] for n in spec.names]
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
    fresh_prefill: bool = False,
) -> list:
    """User inputs of one valid random step of ``phase`` (StepModule order). With
    ``fresh_prefill`` a prefill step starts every sequence (no earlier context), as
    context-parallel prefill requires."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    prior = [rng.randint(0 if phase == "prefill" else 1, 2 * block_size + 3) for _ in range(num_seqs)]
    if fresh_prefill and phase == "prefill":
        prior = [0] * num_seqs
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


@dataclass(frozen=True)
class _Job:
    """What every rank needs to validate one pass on one phase."""

    config: K3Config
    phase: str
    seed: int
    block_size: int
    constants: dict[str, ShardOffset]
    before_specs: dict[str, ShardSpec]
    after_specs: dict[str, ShardSpec]
    num_seqs: tuple[int, ...] = (3,)
    plan: ParallelPlan = ParallelPlan()  # any rank's: the parallel layout
    #: Whether each program is in the context-parallel MLA cache layout (k3compile/context_parallel.py).
    before_split: bool = False
    after_split: bool = False


def _compare(job: _Job, plan: ParallelPlan, before: ExportedProgram, after: ExportedProgram) -> dict[str, float]:
    """Errors of ``after`` against ``before`` on this rank's slice of random steps, one
    per entry of ``job.num_seqs`` (keys of steps after the first carry ``@<num_seqs>``).

    A program in the context-parallel layout gets the step as this rank sees it there
    (its own MLA positions, block table and slot mapping); its MLA caches are compared
    at the positions it owns."""
    dtype = next(iter(before.state_dict.values())).dtype
    layout = ContextLayout.of(plan)
    mla = set(mla_cache_indices(job.config.layer_kinds))
    errors: dict[str, float] = {}
    for i, num_seqs in enumerate(job.num_seqs):
        inputs = random_step_inputs(job.config, plan, job.phase, dtype, job.block_size, job.seed, num_seqs,
                                    fresh_prefill=plan.dcp > 1)
        runs = []
        for program, specs, split in ((before, job.before_specs, job.before_split),
                                      (after, job.after_specs, job.after_split)):
            params = random_parameters(job.config, program, specs, plan, job.seed, job.constants)
            ins = copy.deepcopy(inputs)
            local = localize_step(job.config.layer_kinds, ins, layout) if split else None
            ins = local.inputs if local else ins
            with torch.no_grad():
                out = run_graph(program.graph_module, program, params, ins)
            caches = list(ins[-1])
            if local is not None:  # the owned positions, in the order of the global ones
                for k in mla:
                    caches[k] = caches[k].view(-1, caches[k].shape[-1])[local.local_slots]
            runs.append((out, caches, local))
        (out_b, caches_b, local_b), (out_a, caches_a, local_a) = runs
        if (local_a is None) != (local_b is None):  # compare the global cache at the owned positions too
            local = local_a or local_b
            target = caches_b if local_b is None else caches_a
            for k in mla:
                target[k] = target[k].view(-1, target[k].shape[-1])[local.global_slots]
        suffix = f"@{num_seqs}" if i else ""
        errors.update({f"output{k}{suffix}": _error(a, b) for k, (a, b) in enumerate(zip(out_a, out_b))})
        errors.update({f"cache{k}{suffix}": _error(a, b) for k, (a, b) in enumerate(zip(caches_a, caches_b))})
    return errors


def _program_bytes(program: ExportedProgram) -> bytes:
    from k3compile.artifact_writer import save_program

    buf = io.BytesIO()
    save_program(program, buf)
    return buf.getvalue()


def _validate_rank(rank: int, world: int, job: _Job, before: bytes, after: bytes) -> dict[str, float]:
    """One gloo rank of a multi-rank validation (run by ``run_ranks``)."""
    torch.set_num_threads(1)
    plan = job.plan.for_rank(rank)
    init_context_parallel(plan)
    load = lambda b: torch.export.load(io.BytesIO(b))  # noqa: E731
    return _compare(job, plan, load(before), load(after))


class TranslationValidator:
    """Callable for ``run_pipeline``: compares the program before and after a pass.

    TP1 programs run in this process. TP > 1 programs run on ``tp`` real gloo ranks in
    spawned processes (the collectives in the graphs execute), each rank with its slice
    of the same random weights; the error is the worst over ranks. The ranks start at the
    first multi-rank check and serve every later one until :meth:`close` (or the end of a
    ``with`` block)."""

    def __init__(
        self,
        rtol: float = 1e-4,
        seed: int = 0,
        block_size: int = 16,
        constants: dict[str, ShardOffset] | None = None,
        num_seqs: tuple[int, ...] = (3,),
    ):
        self.constants = constants or {}
        self.num_seqs = num_seqs  # one random step per entry: e.g. (3, 17) takes both sides of a 16-token branch
        self.rtol = rtol
        self.seed = seed
        self.block_size = block_size
        self._pool = None  # the gloo ranks of multi-rank validations, started once for every pass and phase

    def close(self) -> None:
        """Stop the validation ranks (if any were started)."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def __enter__(self) -> TranslationValidator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _ranks(self, world: int):
        from k3compile.distributed import RankPool

        if self._pool is None or self._pool.world != world or self._pool.broken:
            self.close()
            self._pool = RankPool(world)
        return self._pool

    def __call__(
        self,
        phase: str,
        before: ExportedProgram,
        before_specs: dict[str, ShardSpec],
        after: ExportedProgram,
        ctx,
    ) -> ValidationReport:
        constants = {**self.constants, **getattr(ctx, "constants", {})}  # the pass may have added some
        job = _Job(ctx.config, phase, self.seed, self.block_size, constants, before_specs, dict(ctx.specs),
                   self.num_seqs, ctx.plan, program_layout(before.graph_module) is not None,
                   program_layout(after.graph_module) is not None)
        if ctx.plan.tp == 1:
            errors = _compare(job, ctx.plan, before, after)
        else:
            per_rank = self._ranks(ctx.plan.tp).run(_validate_rank, job, _program_bytes(before), _program_bytes(after))
            errors = {key: max(r[key] for r in per_rank) for key in per_rank[0]}
        worst = max(errors.values()) if errors else 0.0
        return ValidationReport(worst, self.rtol, worst <= self.rtol, errors)
