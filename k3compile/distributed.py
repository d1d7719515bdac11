"""Tensor-parallel collectives for the rank-local model.

The model calls torch's *functional* collectives (``_c10d_functional.all_reduce`` and
friends): they are pure ops that ``torch.export`` records as single graph nodes, with
no dependence on a live process group at trace time beyond its name. At TP1 no
collective is emitted at all.
"""

from __future__ import annotations

import io
import os
import queue as queue_module
import socket
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.multiprocessing as mp


@dataclass(frozen=True)
class TPGroup:
    """The tensor-parallel group as the model sees it: its size and its process group.

    ``group`` may be None for a size > 1 when the model is only built (e.g. on ``meta``
    to count parameters or check shapes); running a collective then fails clearly."""

    size: int = 1
    group: dist.ProcessGroup | None = None

    def _group(self) -> dist.ProcessGroup:
        if self.group is None:
            raise RuntimeError(f"TP group of size {self.size} has no process group; initialise torch.distributed")
        return self.group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of ``x`` over the group (Partial -> Replicate)."""
        if self.size == 1:
            return x
        return funcol.all_reduce(x, "sum", self._group())

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Concatenation of every rank's ``x`` along ``dim`` (Shard(dim) -> Replicate)."""
        if self.size == 1:
            return x
        # Gather along dim 0 (one all_gather_into_tensor node: stacks the ranks), then lay
        # them out along ``dim``. (all_gather_tensor: all_gather_single is not in torch 2.11.)
        stacked = funcol.all_gather_tensor(x.contiguous(), 0, self._group())
        d = dim % x.dim()
        return stacked.unflatten(0, (self.size, -1)).movedim(0, d).flatten(d, d + 1)


def init_context_parallel(plan) -> None:
    """Create the DCP process groups of ``plan`` (every rank must call this, in the same
    order) and register this rank's group under :data:`~k3compile.context_parallel.DCP_GROUP_NAME`,
    the name the DCP collectives in a program use. Nothing to do at dcp=1."""
    from k3compile.context_parallel import DCP_GROUP_NAME, dcp_groups

    if plan.dcp == 1:
        return
    if not dist.is_initialized() or dist.get_world_size() != plan.tp:
        raise RuntimeError(f"dcp={plan.dcp} needs the default process group of tp={plan.tp} ranks")
    mine = None
    for ranks in dcp_groups(plan.tp, plan.dcp):
        group = dist.new_group(ranks) if plan.dcp < plan.tp else dist.group.WORLD
        if plan.rank in ranks:
            mine = group
    try:
        dist.distributed_c10d._unregister_process_group(DCP_GROUP_NAME)
    except Exception:  # noqa: BLE001 - nothing registered under the name yet
        pass
    dist.distributed_c10d._register_process_group(DCP_GROUP_NAME, mine)


def world_tp_group() -> TPGroup:
    """The default process group as the TP group (one process per rank, e.g. torchrun)."""
    if not dist.is_initialized():
        return TPGroup()
    return TPGroup(dist.get_world_size(), dist.group.WORLD)


# ---------------------------------------------------------------------------
# Spawned gloo ranks on one machine (validation and tests)
# ---------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, jobs: Any, results: Any) -> None:
    """One rank of a :class:`RankPool`: joins the gloo group once, then runs each job
    ``(fn, args)`` from its queue until it gets None."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        while (job := jobs.get()) is not None:
            fn, args = job
            try:
                result = fn(rank, world, *args)
                # Serialise to bytes: tensors sent through a queue live in shared memory that
                # disappears when this process exits before the parent reads them.
                buf = io.BytesIO()
                torch.save(result, buf)
                results.put((rank, "ok", buf.getvalue()))
            except BaseException:  # report, so the parent fails with the rank's traceback
                results.put((rank, "error", traceback.format_exc()))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class RankPool:
    """``world`` real gloo ranks in spawned processes, started once and reused for many
    jobs (starting a rank costs seconds: a Python process importing torch). Jobs run on
    every rank in lockstep; a failed or stuck job ends the pool (its peers may be blocked
    in a collective), so the next job needs a new pool.

        with RankPool(2) as pool:
            per_rank = pool.run(fn, *args)      # fn(rank, world, *args) on each rank
    """

    def __init__(self, world: int):
        self.world = world
        ctx = mp.get_context("spawn")
        self._results = ctx.Queue()
        self._jobs = [ctx.Queue() for _ in range(world)]
        port = _free_port()
        # daemons: a pool never closed (an exception, a test) ends with this process
        self._procs = [ctx.Process(target=_worker, args=(r, world, port, self._jobs[r], self._results), daemon=True)
                       for r in range(world)]
        for p in self._procs:
            p.start()
        self._broken = False

    @property
    def broken(self) -> bool:
        """A job failed or timed out: the ranks are gone."""
        return self._broken

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 300.0) -> list[Any]:
        """``fn(rank, world, *args)`` on each rank (``fn`` must be importable); the results
        by rank."""
        if self._broken:
            raise RuntimeError("this rank pool ended with an earlier job's failure")
        for q in self._jobs:
            q.put((fn, args))
        results: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(results) < self.world:
                try:
                    rank, status, value = self._results.get(timeout=1.0)
                except queue_module.Empty:
                    # A rank that died without reporting (killed, crashed in the interpreter)
                    # would otherwise leave its peers blocked in a collective until the timeout.
                    dead = [r for r, p in enumerate(self._procs) if r not in results and not p.is_alive()]
                    if dead:
                        raise RuntimeError(f"rank {dead[0]} died (exit code {self._procs[dead[0]].exitcode}) "
                                           "without a result")
                    if time.monotonic() > deadline:
                        missing = sorted(set(range(self.world)) - set(results))
                        raise TimeoutError(f"ranks {missing} gave no result in {timeout:.0f} s")
                    continue
                if status != "ok":
                    raise RuntimeError(f"rank {rank} failed:\n{value}")
                results[rank] = torch.load(io.BytesIO(value), weights_only=True)
        except BaseException:
            self._broken = True
            self.close()
            raise
        return [results[r] for r in range(self.world)]

    def close(self) -> None:
        """Stop the ranks (at once if the pool is broken)."""
        for q, p in zip(self._jobs, self._procs):
            if p.is_alive() and not self._broken:
                q.put(None)
        for p in self._procs:
            p.join(timeout=0 if self._broken else 30)
            if p.is_alive():
                p.kill()
                p.join()

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RankPools:
    """One :class:`RankPool` per world size, started on first use and kept for every later
    job of that size (a pool whose job failed is replaced). For callers that run many
    multi-rank jobs in one process, e.g. a test session or a notebook: starting ranks costs
    seconds each time. Jobs must leave nothing in a rank that changes a later job (the DCP
    groups are re-registered per plan; kernel registrations are process-wide, so a job that
    registers kernels needs a pool of its own)."""

    def __init__(self) -> None:
        self._pools: dict[int, RankPool] = {}

    def get(self, world: int) -> RankPool:
        """The pool of ``world`` ranks, started now if there is none or the last one broke."""
        pool = self._pools.get(world)
        if pool is None or pool.broken:
            pool = self._pools[world] = RankPool(world)
        return pool

    def close(self) -> None:
        """Stop every pool."""
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()

    def __enter__(self) -> RankPools:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 300.0) -> list[Any]:
    """``fn(rank, world, *args)`` on each of ``world`` real gloo ranks in spawned processes
    (``fn`` must be importable), once; returns the results by rank (see :class:`RankPool`
    to run several jobs on the same ranks)."""
    with RankPool(world) as pool:
        return pool.run(fn, *args, timeout=timeout)
