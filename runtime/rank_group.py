"""The ranks' process group: joining it within a timeout, and naming the rank that failed.

The runtime creates the rendezvous store itself (a ``TCPStore`` at MASTER_ADDR:MASTER_PORT,
hosted by rank 0, or by torchrun's agent when torchrun says so) and keeps it, so that:

- at start-up every rank records that it arrived; a rank that times out waiting for the
  group names the ranks that never arrived (:class:`RanksMissing`);
- while the runtime lives, a daemon thread of every rank adds one to its own heartbeat
  counter in the store once a second (:class:`RankWatch`). The thread runs while the
  main thread waits in a collective. When a step fails with a collective error (a peer's
  connection reset, or a collective past the timeout), the runtime watches the counters
  for a few beats and raises :class:`RankFailed` naming the ranks whose counters stood
  still (stopped or frozen), or the store's host when the store itself is gone.

The same timeout bounds the start-up and every collective (the process group's timeout).
A process group the caller created before loading is used as it is, without the watch.
"""

from __future__ import annotations

import datetime
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

#: seconds between heartbeats, and how many beats a counter must stand still to call its rank stopped
BEAT_S = 1.0
STILL_BEATS = 3


class RanksMissing(RuntimeError):
    """Not every rank joined the process group in time (one failed to start or died)."""


class RankFailed(RuntimeError):
    """A step failed because another rank stopped (died or froze); the message names it."""


def _key(kind: str, rank: int) -> str:
    # torchrun's agent store outlives a restart of its workers: keep each attempt's keys apart
    return f"k3compile/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{kind}/{rank}"


def _store_host() -> str:
    """Who hosts the rendezvous store: torchrun's agent, or rank 0."""
    return "torchrun's agent" if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else "rank 0"


class RankWatch:
    """This rank's heartbeat in the store, and the question which ranks stopped beating.

    The thread also warns on stderr, once per stall, when another rank's counter stands
    still for ``warn_after_s`` (half the collective timeout): under NCCL a collective past
    the timeout aborts the process from torch's watchdog, and the warning is then what
    names the rank that stopped."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, warn_after_s: float):
        self.store, self.rank, self.world_size = store, rank, world_size
        self.warn_after_s = max(warn_after_s, STILL_BEATS * BEAT_S)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"k3compile-heartbeat-{rank}", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        seen: list[tuple[int, float]] = []  # per rank: (its count, when it last changed)
        warned: set[int] = set()
        while not self._stop.is_set():
            try:
                self.store.add(_key("beat", self.rank), 1)
                counts, now = self._counts(), time.monotonic()
            except (RuntimeError, dist.DistError):  # the store's host is gone: stopped() says so
                return
            seen = [(c, now) if not seen or seen[r][0] != c else seen[r] for r, c in enumerate(counts)]
            for r, (_, since) in enumerate(seen):
                if now - since < self.warn_after_s:
                    warned.discard(r)
                elif r != self.rank and r not in warned:
                    warned.add(r)
                    print(f"k3compile: rank {self.rank}: rank {r} has not answered for {now - since:.0f} s "
                          "(stopped or frozen)", file=sys.stderr, flush=True)
            self._stop.wait(BEAT_S)

    def _counts(self) -> list[int]:
        return [self.store.add(_key("beat", r), 0) for r in range(self.world_size)]

    def stopped(self) -> str | None:
        """Which ranks stopped, in words (watching their counters for STILL_BEATS beats), or
        None when every rank still beats."""
        try:
            before = self._counts()
            time.sleep(STILL_BEATS * BEAT_S)
            after = self._counts()
        except (RuntimeError, dist.DistError):
            return f"the rendezvous store is gone ({_store_host()} hosted it and stopped)"
        still = [r for r in range(self.world_size) if r != self.rank and after[r] == before[r]]
        if not still:
            return None
        return f"rank{'s' if len(still) > 1 else ''} {', '.join(map(str, still))} stopped answering"

    def explain(self, error: BaseException, during: str) -> RankFailed | None:
        """A :class:`RankFailed` for ``error`` (raised ``during`` a phase) when another rank
        stopped, naming it; None when every rank still beats (the error is this rank's own)."""
        who = self.stopped()
        if who is None:
            return None
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return RankFailed(f"rank {self.rank}: {during} failed because {who} ({first[:300]})")

    def gather(self, name: str, value: str) -> list[str]:
        """Every rank's ``value`` for ``name`` once all gave theirs (a step of the same name
        on every rank); :class:`RankFailed` when a rank stops meanwhile, however long the
        others take."""
        self.store.set(_key(name, self.rank), value)
        keys = [_key(name, r) for r in range(self.world_size)]
        while True:
            try:
                self.store.wait(keys, datetime.timedelta(seconds=10 * BEAT_S))
                return [self.store.get(k).decode() for k in keys]
            except (RuntimeError, dist.DistError) as e:  # not all there yet, or the store is gone
                failed = self.explain(e, name)
                if failed is not None:
                    raise failed from None

    def close(self) -> None:
        self._stop.set()


def init_distributed(world_size: int, device: torch.device, timeout_s: float = 300.0) -> tuple[int, RankWatch | None]:
    """Join (or create) the default process group, waiting at most ``timeout_s`` for the
    other ranks (the same bound then applies to every collective); returns this process's
    rank and, where this call created the group, its :class:`RankWatch`."""
    if world_size == 1:
        return 0, None
    if dist.is_initialized():
        if dist.get_world_size() != world_size:
            raise RuntimeError(f"artifact compiled for tp={world_size}, process group has {dist.get_world_size()} ranks")
        return dist.get_rank(), None
    if "RANK" not in os.environ:
        raise RuntimeError(f"the artifact needs {world_size} ranks: start it with torchrun --nproc-per-node {world_size}")
    rank, world_env = int(os.environ["RANK"]), int(os.environ.get("WORLD_SIZE", world_size))
    if world_env != world_size:
        raise RuntimeError(f"artifact compiled for tp={world_size}, WORLD_SIZE is {world_env}")
    host, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500"))
    timeout = datetime.timedelta(seconds=timeout_s)
    hosts = rank == 0 and _store_host() == "rank 0"
    try:
        store = dist.TCPStore(host, port, world_size, is_master=hosts, timeout=timeout, wait_for_workers=False)
    except (RuntimeError, dist.DistError) as e:
        raise RanksMissing(f"rank {rank}: cannot reach the rendezvous store at {host}:{port} within {timeout_s:g} s "
                           f"({_store_host()} hosts it: it failed to start or stopped); "
                           f"{str(e).strip().splitlines()[0]}") from None
    store.set(_key("arrived", rank), "1")
    try:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=rank,
                                world_size=world_size, timeout=timeout)
    except (dist.DistError, RuntimeError) as e:
        if "timed out" not in str(e).lower() and "timeout" not in str(e).lower():
            raise
        missing = [r for r in range(world_size) if not store.check([_key("arrived", r)])]
        who = f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} never arrived" if missing \
            else "one failed to start or stopped"
        raise RanksMissing(f"rank {rank}: not all {world_size} ranks joined the process group at {host}:{port} "
                           f"within {timeout_s:g} s ({who}); {str(e).strip().splitlines()[0]}") from None
    return rank, RankWatch(store, rank, world_size, warn_after_s=timeout_s / 2)
