"""Capture the rank-local model to one ``torch.export`` program per phase.

    decode   B sequences x 1 token             (B dynamic)
    prefill  T packed tokens of N sequences    (T, N dynamic)

Both take the same flat calling convention (:class:`StepModule`): the step metadata of
:class:`k3compile.batch.Batch` as tensors, then every cache tensor in layer order
(KDA: conv_q, conv_k, conv_v, state; MLA: kv), which the graph updates in place. The
number of cache blocks and state slots is dynamic too, so one program serves any
cache size. Capture runs on ``meta`` tensors: no weights are needed, and the full
2.8T configuration captures in a few hundred MB.

For TP > 1 the functional collectives need a process group at trace time; when none
exists, capture creates torch's in-process ``fake`` backend of the plan's world size
(it records collectives, it does not run them). The graph names the group ``"0"``: the
default group that the runtime's ``init_process_group`` creates.
"""

from __future__ import annotations

import copy
import resource
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.export import Dim, ExportedProgram

from k3compile.artifact_manifest import CaptureStats
from k3compile.batch import Batch, CacheShape, allocate_caches, flatten_caches, unflatten_caches
from k3compile.config import K3Config
from k3compile.distributed import TPGroup
from k3compile.model import K3ForCausalLM
from k3compile.sharding import ParallelPlan, ShardOffset, ShardSpec, rank_constants, shard_specs
from k3compile.stamping import export_stacked

Phase = Literal["decode", "prefill"]
PHASES: tuple[Phase, ...] = ("decode", "prefill")
STEP_INPUTS = ("input_ids", "cu_seqlens", "seq_lens", "state_slots", "block_table", "slot_mapping", "logit_indices")


class StepModule(nn.Module):
    """One forward step of one phase with a flat, export-friendly signature."""

    def __init__(self, model: K3ForCausalLM, phase: Phase):
        super().__init__()
        self.k3 = model
        self.phase = phase

    def forward(
        self,
        input_ids: Tensor,
        cu_seqlens: Tensor,
        seq_lens: Tensor,
        state_slots: Tensor,
        block_table: Tensor,
        slot_mapping: Tensor,
        logit_indices: Tensor,
        caches: list[Tensor],
    ) -> Tensor:
        batch = Batch(
            cu_seqlens, seq_lens, state_slots, block_table, slot_mapping, logit_indices, decode=self.phase == "decode"
        )
        return self.k3(input_ids, batch, unflatten_caches(self.k3.config, caches))


def example_inputs(
    cfg: K3Config,
    plan: ParallelPlan,
    phase: Phase,
    dtype: torch.dtype,
    block_size: int = 16,
    device: str | torch.device = "meta",
    kv_cache_dtype: torch.dtype | None = None,
) -> tuple[tuple, tuple]:
    """(args, dynamic_shapes) for exporting ``phase``. Example sizes are distinct and >= 2
    so that no dynamic dimension specialises or aliases another. The MLA block size and
    cache dtype are static: kernels tile by them, so they are fixed per artifact."""
    tokens, seqs, blocks_per_seq, n_out = (5, 5, 7, 5) if phase == "decode" else (19, 5, 7, 6)
    shape = CacheShape(num_slots=11, num_blocks=13, block_size=block_size)
    caches = flatten_caches(allocate_caches(cfg, plan, shape, dtype, device, kv_cache_dtype))
    i64, i32 = torch.int64, torch.int32
    args = (
        torch.zeros(tokens, dtype=i64, device=device),
        torch.zeros(seqs + 1, dtype=i32, device=device),
        torch.zeros(seqs, dtype=i32, device=device),
        torch.zeros(seqs, dtype=i64, device=device),
        torch.zeros(seqs, blocks_per_seq, dtype=i32, device=device),
        torch.zeros(tokens, dtype=i64, device=device),
        torch.zeros(n_out, dtype=i64, device=device),
        caches,
    )
    seq = Dim("batch" if phase == "decode" else "seqs", min=1, max=1 << 16)
    tok = seq if phase == "decode" else Dim("tokens", min=1, max=1 << 24)
    blocks = Dim("max_blocks", min=1, max=1 << 24)
    out = Dim("logits", min=1, max=1 << 24)
    slots, pool = Dim("num_slots", min=1, max=1 << 20), Dim("num_blocks", min=1, max=1 << 30)
    cache_dims = [{0: slots} if t.shape[0] == shape.num_slots else {0: pool} for t in caches]
    dynamic = ({0: tok}, {0: seq + 1}, {0: seq}, {0: seq}, {0: seq, 1: blocks}, {0: tok}, {0: out}, cache_dims)
    return args, dynamic


@contextmanager
def tracing_process_group(world_size: int, rank: int = 0) -> Iterator[None]:
    """A default process group of ``world_size`` to trace collectives against: the live
    one if it matches, else torch's in-process ``fake`` backend as ``rank`` for the
    duration (its collectives do nothing)."""
    if world_size == 1 or dist.is_initialized():
        if dist.is_initialized() and dist.get_world_size() != world_size:
            raise RuntimeError(
                f"capture for tp={world_size} inside a process group of size {dist.get_world_size()}"
            )
        yield
        return
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def drop_device_asserts(program: ExportedProgram) -> None:
    """Remove ``aten._assert_tensor_metadata`` nodes: export inserts them for dtype
    conversions and they pin ``device=meta`` (the capture device), which the real device
    would fail. Dtypes are checked by the graph's own metadata anyway."""
    graph = program.graph
    for node in list(graph.nodes):
        if node.target is torch.ops.aten._assert_tensor_metadata.default and not node.users:
            graph.erase_node(node)
    program.graph_module.recompile()


@dataclass
class CapturedModel:
    """The per-phase programs of one rank-local model (identical on every rank: SPMD)."""

    config: K3Config
    plan: ParallelPlan
    dtype: torch.dtype
    block_size: int
    programs: dict[str, ExportedProgram]
    specs: dict[str, ShardSpec]  # by the programs' parameter names
    stats: CaptureStats
    constants: dict[str, ShardOffset] = field(default_factory=dict)  # per-rank buffers by name
    kv_cache_dtype: torch.dtype | None = None  # of the MLA caches (None: ``dtype``)

    @property
    def mla_cache_dtype(self) -> torch.dtype:
        """The MLA caches' dtype: an FP8 format (k3compile/mla_cache_fp8.py) or the model dtype."""
        return self.dtype if self.kv_cache_dtype is None else self.kv_cache_dtype


def build_step_model(cfg: K3Config, plan: ParallelPlan, dtype: torch.dtype) -> K3ForCausalLM:
    """The rank-local model on ``meta`` with a TP group of the plan's size."""
    group = dist.group.WORLD if plan.tp > 1 else None
    with torch.device("meta"):
        return K3ForCausalLM(cfg, plan, TPGroup(plan.tp, group), dtype)


def capture(
    cfg: K3Config,
    plan: ParallelPlan,
    dtype: torch.dtype = torch.bfloat16,
    block_size: int = 16,
    phases: Sequence[Phase] = PHASES,
    on_phase: Callable[[str], None] | None = None,
    kv_cache_dtype: torch.dtype | None = None,
) -> CapturedModel:
    """Export one program per phase from the model built on ``meta``, its MLA caches in
    ``kv_cache_dtype`` (default ``dtype``)."""
    stats = CaptureStats()
    programs: dict[str, ExportedProgram] = {}
    with tracing_process_group(plan.tp):
        model = build_step_model(cfg, plan, dtype)
        for phase in phases:
            if on_phase:
                on_phase(phase)
            start = time.perf_counter()
            step = StepModule(model, phase)
            args, dynamic = example_inputs(cfg, plan, phase, dtype, block_size, kv_cache_dtype=kv_cache_dtype)
            programs[phase] = export_stacked(step, args, dynamic, model.model.layers)
            drop_device_asserts(programs[phase])
            stats.seconds[phase] = time.perf_counter() - start
            stats.nodes[phase] = len(programs[phase].graph.nodes)
        step = StepModule(model, "decode")
        specs, constants = shard_specs(step), rank_constants(step)
    stats.peak_rss_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return CapturedModel(cfg, plan, dtype, block_size, programs, specs, stats, constants, kv_cache_dtype)


class CaptureCache:
    """Captured models kept for later compiles of the same config, plan, dtypes and block
    size, for callers that compile one model several ways in one process (a test session,
    a notebook comparing options): exporting takes seconds even for the tiny presets,
    copying a capture a fraction of one. Each :meth:`get` returns a copy, since passes
    rewrite the programs in place."""

    def __init__(self) -> None:
        self._captured: dict[tuple, CapturedModel] = {}

    def get(
        self,
        cfg: K3Config,
        plan: ParallelPlan,
        dtype: torch.dtype = torch.bfloat16,
        block_size: int = 16,
        on_phase: Callable[[str], None] | None = None,
        kv_cache_dtype: torch.dtype | None = None,
    ) -> CapturedModel:
        """``capture(cfg, plan, dtype, block_size, kv_cache_dtype=...)`` (every phase),
        exported on first use."""
        key = (cfg, plan, dtype, block_size, dtype if kv_cache_dtype is None else kv_cache_dtype)
        if key not in self._captured:
            self._captured[key] = capture(cfg, plan, dtype, block_size, PHASES, on_phase, kv_cache_dtype)
        elif on_phase:
            on_phase("(cached)")
        return copy.deepcopy(self._captured[key])
