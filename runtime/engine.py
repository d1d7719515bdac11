"""Execute a compiled artifact on one rank: weights, caches, prefill, decode, generate.

One process per TP rank (``torchrun`` sets RANK/WORLD_SIZE; gloo on CPU, NCCL/RCCL on
GPU). Every rank runs the same programs on the same requests (SPMD) with its own slice of
the weights, read from the original checkpoint at load.

Caches are allocated once and updated in place by the programs: a paged MLA latent cache
per MLA layer and KDA conv + recurrent state slots per KDA layer. Slot 0 and block 0 are
scratch: padding rows of a CUDA-graph batch bucket write there, so a padded decode step
needs no data-dependent masking.

Under decode context parallelism (an artifact compiled with ``--dcp D``) each rank's MLA
caches hold only the positions it owns (k3compile/context_parallel.py): they are sized
for its share of ``max_context``, its block tables and slot mappings are its own (tokens
it does not own go to the scratch block), and its DCP process group is registered under
the name the programs' collectives use. Prefill then starts new sequences only.

The k3 ops run their Triton kernels on GPUs and their torch references on the CPU, or
as ``RuntimeOptions.kernels`` chooses (:data:`KERNELS`; "triton" on the CPU runs the
GPU's kernels under Triton's interpreter, for tests).

On GPU, decode runs under CUDA/HIP graphs, one per batch bucket (1, 2, 4, ... up to the
slot count): the step's metadata is copied into static buffers and the graph replayed.
Prefill runs eagerly (its packed shapes vary).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

from k3compile.artifact import LoadedArtifact, load_artifact
from k3compile.batch import (
    KV_CACHE_DTYPE_CHOICES,
    Batch,
    CacheShape,
    allocate_caches,
    check_kv_cache_dtype,
    flatten_caches,
    zero_state_slot,
)
from k3compile.checkpoint.identity import CheckpointChanged, check_full_hashes, has_full_hashes
from k3compile.checkpoint.loader import CheckpointError, CheckpointReader, LoadReport, fill_parameter
from k3compile.context_parallel import ContextLayout
from k3compile.distributed import init_context_parallel
from k3compile.runtime.decode_graphs import DecodeGraphs
from k3compile.runtime.memory_budget import cache_bytes, check_fits, weight_bytes
from k3compile.runtime.rank_group import RankFailed, RanksMissing, RankWatch, init_distributed
from k3compile.runtime.weight_layout import grouped_parameters
from k3compile.runtime.sampling import SamplingParams, sample
from k3compile.sequences import (Generation, GenerationStopped, RequestError, SequenceTable, check_max_new_tokens,
                                  generate_tokens, is_whole_number)
from k3compile.sharding import ParallelPlan
from k3compile.targets import LOWERINGS, get_target

__all__ = ["KERNELS", "RankFailed", "RanksMissing", "Runtime", "RuntimeOptions", "load", "RequestError"]


#: What runs the k3 ops (``RuntimeOptions.kernels``): "auto" the Triton kernels on GPUs and
#: the torch references on the CPU; "reference" the torch references everywhere; "triton"
#: the Triton kernels everywhere, on the CPU under Triton's interpreter (TRITON_INTERPRET=1
#: before triton is first imported: slow, for tests of the GPU dispatch without a GPU).
KERNELS = ("auto", "reference", "triton")


class NonFiniteLogits(RuntimeError):
    """A step produced NaN or Inf logits (raised under ``RuntimeOptions.check_finite``)."""


@dataclass(frozen=True)
class RuntimeOptions:
    """Cache capacity and execution choices of one runtime."""

    max_sequences: int = 8
    max_context: int = 4096  # tokens per sequence
    device: str | None = None  # default: cuda:<local rank> if available, else cpu
    cuda_graphs: bool | None = None  # default: on for GPU devices
    check_checkpoint: bool = True
    kernels: str = "auto"  # one of KERNELS
    #: the MLA cache dtype the caller expects (one of KV_CACHE_DTYPE_CHOICES), checked against
    #: the artifact's (a mismatch is an error before anything loads); None: the artifact's
    kv_cache_dtype: str | None = None
    #: how to run the programs (one of targets.LOWERINGS); None: as the artifact records on a
    #: GPU, op by op on the CPU (where artifacts for GPU targets run for tests and checks)
    lowering: str | None = None
    #: a debug check: name a weight holding NaN or Inf when loading, and refuse every step
    #: whose logits are not finite (one device synchronisation per step; decode_tokens then
    #: steps through the host, each step's logits checked)
    check_finite: bool = False
    #: hash every byte of the checkpoint against the full hashes the artifact records
    #: (compiled with hash_weights) before loading; ranks share the work
    verify_weights: bool = False
    #: seconds a rank waits for the others to join the process group, and for any
    #: collective, before it stops with an error (a rank that died leaves the rest waiting)
    rank_timeout_s: float = 300.0
    #: tokens of a prompt per prefill step: a longer prompt is prefilled in chunks, each
    #: against the cache the earlier ones wrote (prefill memory bounded by the chunk, and
    #: under DCP the gathered queries); None: whole prompts in one step
    prefill_chunk: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.rank_timeout_s, (int, float)) or not 0 < self.rank_timeout_s < float("inf"):
            raise ValueError(f"RuntimeOptions.rank_timeout_s: a positive number of seconds needed, "
                             f"got {self.rank_timeout_s!r}")
        for name in ("max_sequences", "max_context"):
            value = getattr(self, name)
            if not is_whole_number(value) or value < 1:
                raise ValueError(f"RuntimeOptions.{name}: a whole number >= 1 needed, got {value!r}")
        if self.prefill_chunk is not None and (not is_whole_number(self.prefill_chunk) or self.prefill_chunk < 1):
            raise ValueError(f"RuntimeOptions.prefill_chunk: a whole number >= 1 or None needed, "
                             f"got {self.prefill_chunk!r}")
        if self.kernels not in KERNELS:
            raise ValueError(f"RuntimeOptions.kernels: unknown choice {self.kernels!r}; "
                             f"choose one of {', '.join(KERNELS)}")
        if self.lowering is not None and self.lowering not in LOWERINGS:
            raise ValueError(f"RuntimeOptions.lowering: unknown choice {self.lowering!r}; "
                             f"choose one of {', '.join(LOWERINGS)}")
        if self.kv_cache_dtype is not None and self.kv_cache_dtype not in KV_CACHE_DTYPE_CHOICES:
            raise ValueError(f"RuntimeOptions.kv_cache_dtype: unknown choice {self.kv_cache_dtype!r}; "
                             f"choose one of {', '.join(KV_CACHE_DTYPE_CHOICES)}")


def resolve_device(name: str | None) -> torch.device:
    """``"cpu"``, ``"cuda"`` or ``"cuda:N"`` as a device (None: cuda when a GPU is visible,
    else cpu); a GPU without an index is this process's local rank's. Anything else, or a
    GPU where torch sees none, is a ValueError that says what to choose."""
    if name is not None and not re.fullmatch(r"cpu|cuda(:\d+)?", name):
        raise ValueError(f"unknown device {name!r}; choose cpu or cuda (or cuda:N)")
    kind = name or ("cuda" if torch.cuda.is_available() else "cpu")
    if kind.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"{kind}: torch sees no CUDA/ROCm GPU here; use cpu")
    device = torch.device(kind)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return device


def _device(options: RuntimeOptions) -> torch.device:
    """The options' device (:func:`resolve_device`)."""
    return resolve_device(options.device)


#: the phases that "inductor" lowering compiles: decode only, by measurement (k3-tp8-rank
#: slice, H200: prefill of 1,024 tokens took 128 ms compiled against 83 ms op by op;
#: BENCHMARKS.md)
LOWERED_PHASES = ("decode",)


def lower(module: torch.fx.GraphModule, phase: str, lowering: str) -> Callable[..., Tensor]:
    """``module`` (the program of ``phase``) as the runtime calls it: itself ("eager", and
    phases outside LOWERED_PHASES), or compiled by Inductor at its first call ("inductor":
    ``torch.compile`` with dynamic batch sizes; the k3 ops stay calls to their kernels, the
    ops around them fuse). Compiling at load keeps the artifact free of code; Inductor's
    own on-disk cache makes later loads faster."""
    if lowering == "eager" or phase not in LOWERED_PHASES:
        return module
    return torch.compile(module, dynamic=True)


def use_kernels(kernels: str, device: torch.device) -> bool:
    """Make the k3 ops run as ``kernels`` (one of :data:`KERNELS`) on ``device``; returns
    whether they run the Triton kernels. Registration is process-wide and cannot be undone,
    so "reference" is refused where this process already registered the kernels (the
    runtime would silently run them)."""
    from k3compile.runtime import kernels as triton_kernels  # imports no Triton until it registers

    triton = kernels == "triton" or (kernels == "auto" and device.type == "cuda")
    if triton:
        # The k3 ops' Triton kernels instead of their torch references (MLA and KDA decode,
        # DCP merges, RMSNorm and add_rank_block, routing and the MXFP4 experts without host
        # syncs); on the CPU under Triton's interpreter (a ValueError without it).
        triton_kernels.register_gpu_kernels(device.type)
    elif triton_kernels.registered(device.type):
        raise ValueError(f"kernels={kernels!r}: this process already runs the k3 ops' Triton kernels on "
                         f"{device.type} (registered for good); use a fresh process for the torch references")
    return triton


def verify_weights(artifact: LoadedArtifact, rank: int, watch: RankWatch | None) -> None:
    """Every byte of the checkpoint against the artifact's full shard hashes, or a
    CheckpointError naming the first shard that differs. With a :class:`RankWatch` each rank
    hashes every world-th shard and every rank raises the first difference any rank found."""
    info = artifact.info
    names = sorted(info.checkpoint_shards)
    try:
        check_full_hashes(Path(info.model_dir), info.checkpoint_shards,
                          names[rank::watch.world_size] if watch is not None else names)
        problem = ""
    except CheckpointChanged as e:
        problem = str(e)
    problems = watch.gather("verify-weights", problem) if watch is not None else [problem]
    first = next((p for p in problems if p), None)
    if first is not None:
        raise CheckpointError(first)


def load_rank_weights(
    artifact: LoadedArtifact,
    program: ExportedProgram,
    plan: ParallelPlan,
    device: torch.device,
    on_progress: Callable[[int, int], None] | None = None,
    check_finite: bool = False,
) -> tuple[dict[str, Tensor], LoadReport]:
    """Every program parameter (this rank's slice, read from the source checkpoint) and
    every per-rank constant buffer; with ``check_finite`` a floating parameter holding NaN
    or Inf is a CheckpointError naming it and its checkpoint tensors. Parameters that an op
    multiplies in one GEMM are views of one buffer (``weight_layout.grouped_parameters``)."""
    report = LoadReport()
    weights: dict[str, Tensor] = {name: c.tensor(plan, device) for name, c in artifact.constants.items()}
    grouped = grouped_parameters(program, device)
    prefix = artifact.config.checkpoint_prefix
    names = [s.target for s in program.graph_signature.input_specs if s.kind == InputKind.PARAMETER]
    with CheckpointReader(artifact.info.model_dir, prefix) as reader:
        for i, name in enumerate(names):
            meta = program.state_dict[name]
            param = grouped[name] if name in grouped else torch.empty(meta.shape, dtype=meta.dtype, device=device)
            fill_parameter(reader, name, artifact.specs[name], plan, param, report)
            if check_finite and param.is_floating_point() and not bool(torch.isfinite(param).all()):
                raise CheckpointError(f"parameter {name} (checkpoint {', '.join(artifact.specs[name].names[:2])}"
                                      f"{', ...' if len(artifact.specs[name].names) > 2 else ''}): holds NaN or Inf")
            weights[name] = param
            if on_progress:
                on_progress(i + 1, len(names))
    return weights, report


class Runtime:
    """Prefill / decode / generate over an artifact's programs on one rank."""

    def __init__(
        self,
        artifact: LoadedArtifact,
        rank: int,
        device: torch.device,
        options: RuntimeOptions,
        on_progress: Callable[[int, int], None] | None = None,
        watch: RankWatch | None = None,
    ):
        info = artifact.info
        #: names the rank that stopped when a step fails on a collective (None: one rank, or
        #: a process group the caller made)
        self.watch = watch
        check_kv_cache_dtype(options.kv_cache_dtype, info.kv_cache_dtype, info.dtype, get_target(info.target))
        self.artifact = artifact
        self.cfg = artifact.config
        self.rank = rank
        self.device = device
        self.options = options
        self.triton_kernels = use_kernels(options.kernels, device)
        self.plan = artifact.plan(rank)
        self.layout = ContextLayout.of(self.plan)
        init_context_parallel(self.plan)
        bs = artifact.info.block_size
        local_length = self.layout.max_local_length(options.max_context)
        self.max_blocks_per_seq = -(-local_length // bs)
        shape = CacheShape.serving(options.max_sequences, local_length, bs)
        check_fits(device, weight_bytes(artifact.programs["decode"]),
                   cache_bytes(self.cfg, self.plan, shape, info.dtype, info.kv_cache_dtype),
                   f"max_sequences={options.max_sequences} and max_context={options.max_context}")
        self.caches = allocate_caches(self.cfg, self.plan, shape, info.dtype, device, info.kv_cache_dtype)
        self.cache_tensors = flatten_caches(self.caches)
        self.table = SequenceTable(self.cfg.vocab_size, shape, reserved_slots=1, reserved_blocks=1, layout=self.layout)
        self.weights, self.load_report = load_rank_weights(
            artifact, artifact.programs["decode"], self.plan, device, on_progress, options.check_finite
        )
        #: each phase's program as an fx module, and as the runtime calls it (lowered)
        self.graph_modules: dict[str, torch.fx.GraphModule] = {}
        self.modules: dict[str, Callable[..., Tensor]] = {}
        self.lowering = options.lowering or (info.lowering if device.type == "cuda" else "eager")
        for phase, program in artifact.programs.items():
            module = program.module()
            # Per-rank constants exist only in the programs whose passes added them.
            module.load_state_dict({k: v for k, v in self.weights.items() if k in program.state_dict}, assign=True)
            self.graph_modules[phase] = module
            self.modules[phase] = lower(module, phase, self.lowering)
        #: a context-parallel prefill that attends to the step's own tokens only (artifacts of
        #: the sixteenth session and before): sequences with history cannot take several tokens
        self.new_sequences_only = "prefill" in self.graph_modules and any(
            n.target is torch.ops.k3.mla_prefill_new_tokens.default for n in self.graph_modules["prefill"].graph.nodes)
        use_graphs = options.cuda_graphs if options.cuda_graphs is not None else device.type == "cuda"
        self.graphs = DecodeGraphs(self) if use_graphs else None

    # ----- requests -----------------------------------------------------------
    def _run(self, phase: str, ids: Tensor, batch: Batch, module: Callable[..., Tensor] | None = None) -> Tensor:
        return (module or self.modules[phase])(
            ids, batch.cu_seqlens, batch.seq_lens, batch.state_slots, batch.block_table,
            batch.slot_mapping, batch.logit_indices, self.cache_tensors,
        )

    @torch.no_grad()
    def step(self, seq_ids: list[int], tokens: list[list[int]], module: Callable[..., Tensor] | None = None) -> Tensor:
        """New tokens of existing sequences; fp32 logits of each sequence's last token [N, V].

        ``module``: run the step's program through this callable (the program module's
        arguments; e.g. an ``fx.Interpreter`` that annotates nodes for a profiler), eagerly,
        instead of the program or its CUDA graph."""
        self.table.check_step(seq_ids, tokens)
        return self._step(seq_ids, tokens, module)

    @torch.no_grad()
    def _step(self, seq_ids: list[int], tokens: list[list[int]], module: Callable[..., Tensor] | None = None) -> Tensor:
        """:meth:`step` of a request already checked (``SequenceTable.check_step``)."""
        counts = [len(t) for t in tokens]
        for s, n in zip(seq_ids, counts):
            if self.table.sequences[s].length + n > self.options.max_context:
                raise RequestError(f"sequence {s}: context beyond capacity ({self.options.max_context} tokens)")
            if self.new_sequences_only and n > 1 and self.table.sequences[s].length > 0:
                raise RequestError(
                    f"sequence {s}: {n} new tokens after {self.table.sequences[s].length}; this artifact's "
                    "context-parallel prefill starts new sequences only (compiled before continuation was "
                    "supported: compile it again)"
                )
        self.table.reserve(seq_ids, counts)
        decode = all(n == 1 for n in counts)
        with self._naming_failed_ranks("decode" if decode else "prefill"):
            if decode and module is None and self.graphs is not None and len(seq_ids) <= self.graphs.max_batch:
                logits = self.graphs.run(seq_ids, [t[0] for t in tokens])
            else:
                batch = self.table.make_batch(seq_ids, counts, decode, device=self.device)
                ids = torch.tensor([t for toks in tokens for t in toks], dtype=torch.int64, device=self.device)
                logits = self._run("decode" if decode else "prefill", ids, batch, module)
        self.table.advance(seq_ids, counts)
        if self.options.check_finite and not bool(torch.isfinite(logits).all()):
            raise NonFiniteLogits(f"sequences {seq_ids}: this step's logits hold NaN or Inf (check_finite)")
        return logits

    @contextmanager
    def _naming_failed_ranks(self, during: str) -> Iterator[None]:
        """Raise :class:`RankFailed` naming the rank that stopped when the work inside fails
        because of it (a collective's peer vanished or timed out); other errors pass."""
        try:
            yield
        except RuntimeError as e:
            failed = self.watch.explain(e, during) if self.watch is not None else None
            if failed is None:
                raise
            raise failed from e

    def prefill(self, prompts: list[list[int]]) -> tuple[list[int], Tensor]:
        """Start one sequence per prompt; returns their ids and last-token logits. Prompts
        longer than ``RuntimeOptions.prefill_chunk`` are prefilled chunk by chunk."""
        self.table.check_new(prompts)
        if not prompts:
            raise RequestError("need one token list per sequence and at least one sequence")
        too_long = [i for i, p in enumerate(prompts) if len(p) > self.options.max_context]
        if too_long:
            raise RequestError(f"request {too_long[0]}: prompt longer than max_context={self.options.max_context}")
        ids = [self.table.new_sequence() for _ in prompts]
        for s in ids:
            zero_state_slot(self.caches, self.table.sequences[s].slot)
        longest = max(len(p) for p in prompts)
        chunk = self.options.prefill_chunk or longest
        last: list[Tensor | None] = [None] * len(prompts)
        try:
            for start in range(0, longest, chunk):
                active = [i for i, p in enumerate(prompts) if len(p) > start]
                # new sequences with checked prompts (check_new): no second token check
                logits = self._step([ids[i] for i in active], [prompts[i][start:start + chunk] for i in active])
                for row, i in enumerate(active):
                    if len(prompts[i]) <= start + chunk:
                        last[i] = logits[row]
        except RequestError:
            for s in ids:
                self.table.release(s)
            raise
        return ids, torch.stack(last)

    def decode(self, seq_ids: list[int], tokens: list[int]) -> Tensor:
        return self.step(seq_ids, [[t] for t in tokens])

    def release(self, seq_id: int) -> None:
        self.table.release(seq_id)

    def close(self) -> None:
        """Drop the CUDA graphs (they hold the collectives they captured) after the device
        finished: call before destroying the process group."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.graphs = None
        if self.watch is not None:
            self.watch.close()

    def generate(
        self, prompts: list[list[int]], max_new_tokens: int, sampling: SamplingParams = SamplingParams()
    ) -> list[list[int]]:
        """New tokens for each prompt (all ranks sample identically: same seed, same logits)."""
        return self.generate_timed(prompts, max_new_tokens, sampling).tokens

    def generate_timed(
        self, prompts: list[list[int]], max_new_tokens: int, sampling: SamplingParams = SamplingParams()
    ) -> Generation:
        """:meth:`generate` with the prefill and decode time (device-synchronised). The first
        token of each prompt is picked on the host from the prefill's logits, the rest by
        :meth:`decode_tokens` (on the device under CUDA graphs, read back once)."""
        self._check_generation(prompts, max_new_tokens)
        gen = torch.Generator().manual_seed(sampling.seed if sampling.seed is not None else 0)
        sync = (lambda: torch.cuda.synchronize(self.device)) if self.device.type == "cuda" else (lambda: None)
        pick = lambda logits: sample(logits, sampling, gen).tolist()  # noqa: E731
        decode = lambda ids, tokens, steps: self.decode_tokens(ids, tokens, steps, sampling, gen)  # noqa: E731
        return generate_tokens(self, prompts, max_new_tokens, pick, sync, decode_tokens=decode)

    def _check_generation(self, prompts: list[list[int]], max_new_tokens: int) -> None:
        """Refuse, before any work, a generation that could not finish: bad prompts or
        ``max_new_tokens``, free slots, or final lengths beyond ``max_context`` (the cache
        holds ``max_context`` tokens for every slot, so a sequence within it has its blocks)."""
        check_max_new_tokens(max_new_tokens)
        self.table.check_new(prompts)
        # The last new token is returned, never fed back: it takes no cache position.
        lengths = [len(p) + max(max_new_tokens - 1, 0) for p in prompts]
        longest = max(range(len(prompts)), key=lambda i: lengths[i])
        if lengths[longest] > self.options.max_context:
            raise RequestError(f"request {longest}: {len(prompts[longest])} prompt tokens and {max_new_tokens} new "
                               f"ones need {lengths[longest]} positions, max_context is {self.options.max_context}")

    def decode_tokens(self, seq_ids: list[int], tokens: list[int], steps: int,
                      sampling: SamplingParams = SamplingParams(),
                      generator: torch.Generator | None = None) -> list[list[int]]:
        """``steps`` decode steps of existing sequences, the first fed ``tokens``, each later
        one the tokens its predecessor picked as ``sampling`` says; returns each sequence's
        ``steps`` new tokens. Under CUDA graphs the tokens are picked and fed on the device
        (DecodeGraphs.decode_tokens: the device generator, seeded with ``sampling.seed``)
        and the host queues step after step without waiting; otherwise each step's logits
        come back and :func:`sample` picks on the host with ``generator`` (default: a CPU
        generator seeded with ``sampling.seed``).

        A step that fails raises :class:`GenerationStopped` with the tokens picked before it
        on the host path; under CUDA graphs, where tokens come back once at the end, the
        failure itself is raised."""
        self.table.check_step(seq_ids, [[t] for t in tokens])
        if not isinstance(steps, int) or steps < 0:
            raise RequestError(f"steps: a number of decode steps >= 0 needed, got {steps!r}")
        for s in seq_ids:
            if self.table.sequences[s].length + steps > self.options.max_context:
                raise RequestError(f"sequence {s}: {steps} more tokens go beyond capacity "
                                   f"({self.options.max_context} tokens)")
        if self.graphs is None or len(seq_ids) > self.graphs.max_batch or self.options.check_finite:
            if generator is None:
                generator = torch.Generator().manual_seed(sampling.seed if sampling.seed is not None else 0)
            out: list[list[int]] = [[] for _ in seq_ids]
            try:
                for _ in range(steps):
                    tokens = sample(self.decode(seq_ids, tokens), sampling, generator).tolist()
                    for o, t in zip(out, tokens):
                        o.append(t)
            except (RuntimeError, ValueError) as e:
                raise GenerationStopped(out, e) from e
            return out
        self.table.check_room(seq_ids, [steps] * len(seq_ids))
        with self._naming_failed_ranks("decode"):
            return self.graphs.decode_tokens(seq_ids, tokens, steps, sampling)


def load(
    out_dir: str | Path,
    rank: int | None = None,
    world_size: int | None = None,
    options: RuntimeOptions = RuntimeOptions(),
    on_progress: Callable[[int, int], None] | None = None,
) -> Runtime:
    """Load an artifact on this process's rank (from torchrun's environment or arguments).

    ``on_progress(done, total)`` is called after each parameter is read."""
    device = _device(options)
    if device.type == "cuda":
        # Triton launches on the current device and NCCL binds each rank to it: make it
        # this rank's GPU (rank 1's tensors on cuda:1 would otherwise meet kernels on cuda:0).
        torch.cuda.set_device(device)
    use_kernels(options.kernels, device)  # before the artifact: a refused choice costs no load time
    info_world = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", 1))
    artifact = load_artifact(out_dir, world_size=info_world, check_checkpoint=options.check_checkpoint)
    if options.verify_weights and not has_full_hashes(artifact.info.checkpoint_shards):
        raise CheckpointError(f"{artifact.path}: the artifact records no full checkpoint hashes to verify the "
                              "weights against; compile it with hash_weights (optimize --hash-weights)")
    if rank is None:
        rank, watch = init_distributed(artifact.info.tp, device, options.rank_timeout_s)
    else:
        watch = None
    if options.verify_weights:
        verify_weights(artifact, rank, watch)
    return Runtime(artifact, rank, device, options, on_progress, watch)
