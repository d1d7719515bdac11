"""Translation validation: run a graph before and after a pass on identical random inputs.

The inputs are a *valid* random step of the phase, so every path of the graph does
real work: several sequences with different prior context lengths, random KDA conv and
recurrent states, a random MLA latent cache in randomly permuted blocks, and random
weights (the generator's per-tensor seeded values, sliced for the rank by the same
shard specs the loader uses). Both graphs run on copies of the same inputs; the step's
outputs and every cache tensor the step updated in place are compared. The error is
the largest absolute difference over the largest reference magnitude of each tensor.

TP1 programs are validated in-process (one intra-op thread: the tiny graphs are all
op overhead, and a second thread only waits, or stalls the step when another process
holds the other core); TP > 1 programs on real gloo ranks in spawned processes, each
with its slice of the weights, so rewrites across ranks (a resharded parameter, a moved
collective) are checked as they will run. Meant for tiny configs.

A program's results on the steps (:class:`ProgramRun`) are what a check compares, so the
pipeline runs each version of a program once: the run after one pass is the reference
for the next (:meth:`TranslationValidator.run` and :meth:`TranslationValidator.compare`),
and no copy of the program is needed.
"""

from __future__ import annotations

import functools
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

import k3compile.ops  # noqa: F401  (ranks unpack programs that call torch.ops.k3.*)
from k3compile.batch import CacheShape, KDALayerCache, allocate_caches, flatten_caches
from k3compile.checkpoint.generate import stored_random_tensor
from k3compile.config import K3Config
from k3compile.context_parallel import ContextLayout, localize_step, mla_cache_indices, program_layout
from k3compile.distributed import RankPool, RankPools, init_context_parallel
from k3compile.mla_cache_fp8 import cache_rows_as_values, is_fp8_dtype, quantize_rows
from k3compile.rank_program import RankProgram
from k3compile.sharding import ParallelPlan, ShardOffset, ShardSpec


@dataclass
class ValidationReport:
    max_error: float
    tolerance: float
    ok: bool
    errors: dict[str, float] = field(default_factory=dict)  # per compared tensor
    seconds: float = 0.0  # running the programs and comparing them
    worst: str = ""  # the tensor with the largest error ("output0", "cache3@17": the second step's)
    rank: int = 0  # the rank where it was largest

    def where(self) -> str:
        """Where the largest error is, for messages: ``cache3@17 on rank 1``."""
        return f"{self.worst} on rank {self.rank}" if self.worst else "nothing compared"


@functools.lru_cache(maxsize=1)
def _draws(cfg: K3Config) -> dict[tuple[str, ShardSpec, int], Tensor]:
    """The checkpoint tensors drawn for ``cfg`` so far; only the last config's are kept."""
    return {}


def _stored(cfg: K3Config, name: str, spec: ShardSpec, seed: int) -> Tensor:
    """The generator's checkpoint tensor, drawn once: validation draws the same weights for
    every version of a program."""
    draws, key = _draws(cfg), (name, spec, seed)
    if key not in draws:
        draws[key] = stored_random_tensor(cfg, name, spec, seed)
    return draws[key]


def random_parameters(
    cfg: K3Config,
    program: RankProgram,
    specs: dict[str, ShardSpec],
    plan: ParallelPlan,
    seed: int = 0,
    constants: dict[str, ShardOffset] | None = None,
) -> dict[str, Tensor]:
    """This rank's slice of the generator's random weights for every program parameter (in
    the storage its spec declares: MXFP4 experts as codes and scales), and its per-rank
    constant buffers."""
    params: dict[str, Tensor] = {name: c.tensor(plan) for name, c in (constants or {}).items()}
    for kind, name in program.inputs:
        if kind != InputKind.PARAMETER:
            continue
        spec = specs[name]
        dtype = program.dtypes[name]
        parts = [_stored(cfg, n, spec, seed)[spec.local_index(plan)] for n in spec.names]
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
    min_tokens: int = 0,
    kv_cache_dtype: torch.dtype | None = None,
) -> list:
    """User inputs of one valid random step of ``phase`` (StepModule order), the MLA caches
    in ``kv_cache_dtype`` (default ``dtype``; FP8 rows hold quantised random values). With
    ``fresh_prefill`` a prefill step starts every sequence (no earlier context), as
    context-parallel prefill requires. A prefill step below ``min_tokens`` new tokens gets
    the missing ones, spread over its sequences (a decode step has one per sequence)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    prior = [rng.randint(0 if phase == "prefill" else 1, 2 * block_size + 3) for _ in range(num_seqs)]
    if fresh_prefill and phase == "prefill":
        prior = [0] * num_seqs
    new = [1 if phase == "decode" else rng.randint(1, 6) for _ in range(num_seqs)]
    if phase == "prefill":
        for i in range(max(0, min_tokens - sum(new))):
            new[i % num_seqs] += 1
    elif min_tokens > num_seqs:
        raise ValueError(f"a decode step of {num_seqs} sequences has {num_seqs} tokens, not {min_tokens}")
    blocks_needed = [-(-(p + n) // block_size) for p, n in zip(prior, new)]
    num_blocks = sum(blocks_needed) + 3
    shape = CacheShape(num_slots=num_seqs + 2, num_blocks=num_blocks, block_size=block_size)
    caches = allocate_caches(cfg, plan, shape, dtype, kv_cache_dtype=kv_cache_dtype)
    for c in caches:
        tensors = (c.conv_q, c.conv_k, c.conv_v, c.state) if isinstance(c, KDALayerCache) else (c.kv,)
        for t in tensors:
            if is_fp8_dtype(t.dtype):
                values = torch.randn(t.shape[0] * t.shape[1], cfg.mla_cache_width, generator=gen)
                t.copy_(quantize_rows(values, cfg.kv_lora_rank, t.dtype).view(t.shape))
                continue
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


def run_graph(program: RankProgram, params: dict[str, Tensor], user_inputs: list) -> list[Tensor]:
    """Call a program's graph with its parameters and flattened user inputs."""
    flat_user = torch.utils._pytree.tree_leaves(user_inputs)
    it = iter(flat_user)
    lifted = (InputKind.PARAMETER, InputKind.BUFFER)
    args = [params[name] if kind in lifted else next(it) for kind, name in program.inputs]
    out = program.graph_module(*args)
    return list(out) if isinstance(out, (list, tuple)) else [out]


def _error(a: Tensor, ref: Tensor) -> float:
    scale = ref.abs().max().item() if ref.numel() else 0.0
    diff = (a.float() - ref.float()).abs().max().item() if ref.numel() else 0.0
    if diff != diff:  # NaN
        return float("inf")
    return diff / max(scale, 1e-30)


#: New tokens of each validation step (at least): the first step stays below, the second
#: reaches the 16 tokens at which the GEMM dispatch (model/gemm.py) takes its tiled branch,
#: so both branches of every ``torch.cond`` run. A decode step has one token per sequence;
#: a prefill step has three sequences.
VALIDATION_TOKENS = (3, 17)
PREFILL_SEQS = 3


@dataclass(frozen=True)
class _Job:
    """What a rank needs to run one program on the validation steps."""

    config: K3Config
    phase: str
    seed: int
    block_size: int
    constants: dict[str, ShardOffset]
    specs: dict[str, ShardSpec]
    tokens: tuple[int, ...]
    plan: ParallelPlan  # any rank's: the parallel layout
    split: bool  # the program is in the context-parallel MLA cache layout (k3compile/context_parallel.py)
    kv_cache_dtype: torch.dtype | None  # of the MLA caches; None: the model dtype


@dataclass
class ProgramRun:
    """One program's results on the validation steps, on each rank: per step its outputs,
    its caches after the step (the MLA caches of a context-parallel program at the
    positions the rank owns) and, for such a program, where those positions are in the
    global cache."""

    phase: str
    tokens: tuple[int, ...]
    ranks: list[list[dict]]  # rank -> step -> {"outputs", "caches", "global_slots" (or None)}


@contextmanager
def one_thread() -> Iterator[None]:
    """torch's intra-op work on one thread, restored after: the programs and references
    run here are small, and extra threads only add overhead (and stall when other
    processes load the CPU)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _run_steps(job: _Job, plan: ParallelPlan, program: RankProgram) -> list[dict]:
    """``program``'s results on this rank's slice of the validation steps. A program in the
    context-parallel layout gets each step as this rank sees it there (its own MLA
    positions, block table and slot mapping)."""
    dtype = next(d for d in program.dtypes.values() if d.is_floating_point)  # the model's
    layout = ContextLayout.of(plan)
    mla = mla_cache_indices(job.config.layer_kinds)
    params = random_parameters(job.config, program, job.specs, plan, job.seed, job.constants)
    steps = []
    for tokens in job.tokens:
        num_seqs = tokens if job.phase == "decode" else PREFILL_SEQS
        inputs = random_step_inputs(job.config, plan, job.phase, dtype, job.block_size, job.seed, num_seqs,
                                    fresh_prefill=plan.dcp > 1, min_tokens=tokens, kv_cache_dtype=job.kv_cache_dtype)
        local = localize_step(job.config.layer_kinds, inputs, layout) if job.split else None
        inputs = local.inputs if local else inputs
        with torch.no_grad():
            outputs = run_graph(program, params, inputs)
        caches = list(inputs[-1])
        if local is not None:  # the owned positions, in the order of the global ones
            for k in mla:
                caches[k] = caches[k].view(-1, caches[k].shape[-1])[local.local_slots]
        for k in mla:  # compared as values: an FP8 row's scale bytes are no FP8 numbers
            caches[k] = cache_rows_as_values(caches[k], job.config.kv_lora_rank)
        steps.append({"outputs": outputs, "caches": caches, "global_slots": local.global_slots if local else None})
    return steps


def _compare_steps(before: list[dict], after: list[dict], tokens: tuple[int, ...], mla: list[int]) -> dict[str, float]:
    """Errors of ``after`` against ``before`` (one rank's steps; keys of steps after the
    first carry ``@<tokens>``). Where one program is in the context-parallel layout and the
    other is not, the global one's MLA caches are compared at the positions the rank owns."""
    errors: dict[str, float] = {}
    for i, (b, a) in enumerate(zip(before, after)):
        caches_b, caches_a = list(b["caches"]), list(a["caches"])
        if (a["global_slots"] is None) != (b["global_slots"] is None):
            slots = a["global_slots"] if b["global_slots"] is None else b["global_slots"]
            target = caches_b if b["global_slots"] is None else caches_a
            for k in mla:
                target[k] = target[k].view(-1, target[k].shape[-1])[slots]
        suffix = f"@{tokens[i]}" if i else ""
        errors.update({f"output{k}{suffix}": _error(x, y) for k, (x, y) in enumerate(zip(a["outputs"], b["outputs"]))})
        errors.update({f"cache{k}{suffix}": _error(x, y) for k, (x, y) in enumerate(zip(caches_a, caches_b))})
    return errors


def _run_rank(rank: int, world: int, job: _Job, program: bytes) -> list[dict]:
    """One gloo rank of a multi-rank run (by ``RankPool``): ``program`` is a packed
    :class:`RankProgram`."""
    torch.set_num_threads(1)
    plan = job.plan.for_rank(rank)
    init_context_parallel(plan)
    return _run_steps(job, plan, RankProgram.unpack(program))


class TranslationValidator:
    """Runs programs on the validation steps and compares their results.

    TP1 programs run in this process. TP > 1 programs run on ``tp`` real gloo ranks in
    spawned processes (the collectives in the graphs execute), each rank with its slice
    of the same random weights; the error is the worst over ranks. The ranks start at the
    first multi-rank run and serve every later one until :meth:`close` (or the end of a
    ``with`` block); with ``ranks``, the caller's pools serve instead and outlive it.

    ``run_pipeline`` calls :meth:`run` on a program before the first pass that changes it
    and after every pass that changes it, and :meth:`compare` on consecutive runs; calling
    the validator compares two programs directly."""

    def __init__(
        self,
        rtol: float = 1e-4,
        seed: int = 0,
        block_size: int = 16,
        constants: dict[str, ShardOffset] | None = None,
        tokens: tuple[int, ...] = VALIDATION_TOKENS,
        ranks: RankPools | None = None,
        kv_cache_dtype: torch.dtype | None = None,
    ):
        self.constants = constants or {}
        self.kv_cache_dtype = kv_cache_dtype
        self.tokens = tokens
        self.rtol = rtol
        self.seed = seed
        self.block_size = block_size
        self._pool: RankPool | None = None  # this validator's ranks, started once for every pass and phase
        self._shared = ranks  # or the caller's pools, which outlive this validator

    def close(self) -> None:
        """Stop the validation ranks (if this validator started any)."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def __enter__(self) -> TranslationValidator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _ranks(self, world: int) -> RankPool:
        if self._shared is not None:
            return self._shared.get(world)
        if self._pool is None or self._pool.world != world or self._pool.broken:
            self.close()
            self._pool = RankPool(world)
        return self._pool

    def run(self, phase: str, program: ExportedProgram, specs: dict[str, ShardSpec], ctx) -> ProgramRun:
        """``program`` (with parameters sliced by ``specs``) on the validation steps."""
        constants = {**self.constants, **getattr(ctx, "constants", {})}  # a pass may have added some
        job = _Job(ctx.config, phase, self.seed, self.block_size, constants, dict(specs), self.tokens, ctx.plan,
                   program_layout(program.graph_module) is not None, self.kv_cache_dtype)
        if ctx.plan.tp == 1:
            with one_thread():
                return ProgramRun(phase, self.tokens, [_run_steps(job, ctx.plan, RankProgram.of(program))])
        packed = RankProgram.of(program).pack()
        return ProgramRun(phase, self.tokens, self._ranks(ctx.plan.tp).run(_run_rank, job, packed))

    def compare(self, before: ProgramRun, after: ProgramRun, ctx) -> ValidationReport:
        """The errors of ``after`` against ``before``: the worst over ranks per tensor."""
        mla = mla_cache_indices(ctx.config.layer_kinds)
        per_rank = [_compare_steps(b, a, self.tokens, mla) for b, a in zip(before.ranks, after.ranks)]
        errors = {key: max(r[key] for r in per_rank) for key in per_rank[0]}
        if not errors:
            return ValidationReport(0.0, self.rtol, True)
        worst = max(errors, key=errors.__getitem__)
        rank = max(range(len(per_rank)), key=lambda r: per_rank[r][worst])
        return ValidationReport(errors[worst], self.rtol, errors[worst] <= self.rtol, errors, worst=worst, rank=rank)

    def __call__(
        self,
        phase: str,
        before: ExportedProgram,
        before_specs: dict[str, ShardSpec],
        after: ExportedProgram,
        ctx,
    ) -> ValidationReport:
        """Run both programs and compare them (``ctx.specs``: the parameter specs of ``after``)."""
        start = time.perf_counter()
        report = self.compare(self.run(phase, before, before_specs, ctx), self.run(phase, after, ctx.specs, ctx), ctx)
        report.seconds = time.perf_counter() - start
        return report
