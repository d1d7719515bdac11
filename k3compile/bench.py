"""Measure a compiled artifact through the runtime: time per decode step and time to
first token, against the floor of the bytes a step must move (``k3compile bench``).

    rt = runtime.load(artifact, options=RuntimeOptions(max_sequences=16, max_context=2048))
    report = run_bench(rt, BenchOptions(batches=(1, 16), contexts=(1024,), prompt_lens=(128,)))

Decode, for each context and batch: ``batch`` sequences start with ``context - 1`` cached
positions of random history (:func:`fill_random_history`; no prefill runs), then
``warmup`` + ``steps`` decode steps through the public API, each fed the previous step's
greedy tokens. Per step: the wall time of ``Runtime.decode`` (host batch building, input
copies, the CUDA graph's replay, logits back on the host; median) and, under CUDA graphs,
the device time of one replay of that step's graph (CUDA events, median); then ``steps``
greedy steps in one ``Runtime.decode_tokens`` call (what ``generate`` runs: tokens fed on
the device, read back at the end), wall clock per step. The floor
(:func:`step_floor`): the bytes one step moves on this rank over the copy bandwidth
measured in the same run.

Prefill: the time to first token of one prompt of each length (random ids): the wall time
of ``Runtime.prefill`` until its logits are on the host, median after one warm-up.

Where the time goes (``profile``): device time by kernel over one decode step (GPU: the
kernels of a graph replay; CPU: aten ops, self time) and by layer type (an eager step whose
nodes run inside profiler ranges named by :func:`k3compile.placement.groups.node_groups`),
with the kernels each layer type launches.

Peers (``peers``), timed the same way in the same run: "eager", the reference model
(``k3compile.reference``: the rank-local model run eagerly, the artifact's TP without its
passes) and "compile", the same model's forward under ``torch.compile``: what a torch
user who does not use this project would run.

Under ``torchrun`` every rank runs the same steps (SPMD); each reports its own rank.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
from torch import fx

from k3compile.batch import CacheShape, KDALayerCache, MLALayerCache
from k3compile.distributed import world_tp_group
from k3compile.mla_cache_fp8 import is_fp8_cache, quantize_rows
from k3compile.placement.groups import GROUPS, node_groups
from k3compile.reference import ReferenceEngine, load_reference
from k3compile.runtime.engine import Runtime
from k3compile.sharding import ParallelPlan

__all__ = ["PEERS", "BenchOptions", "BenchReport", "DecodeResult", "PrefillResult", "StepFloor", "copy_bandwidth",
           "fill_random_history", "run_bench", "start_sequences", "step_floor"]


#: peers timed beside the artifact (``BenchOptions.peers``)
PEERS = ("eager", "compile")


@dataclass(frozen=True)
class BenchOptions:
    """What ``run_bench`` measures."""

    batches: tuple[int, ...] = (1,)
    contexts: tuple[int, ...] = (1024,)  # tokens per sequence at the first timed step
    prompt_lens: tuple[int, ...] = (128,)  # time to first token of one prompt of each length; () for none
    steps: int = 20
    warmup: int = 3
    prefill_repeats: int = 3
    profile: bool = True
    peers: tuple[str, ...] = ()  # of PEERS
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("batches", "contexts"):
            values = getattr(self, name)
            if not values or any(not isinstance(v, int) or v < 1 for v in values):
                raise ValueError(f"BenchOptions.{name}: positive integers needed, got {values!r}")
        if any(not isinstance(v, int) or v < 1 for v in self.prompt_lens):
            raise ValueError(f"BenchOptions.prompt_lens: positive integers needed, got {self.prompt_lens!r}")
        for name in ("steps", "prefill_repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"BenchOptions.{name}: at least 1, got {getattr(self, name)}")
        if self.warmup < 0:
            raise ValueError(f"BenchOptions.warmup: at least 0, got {self.warmup}")
        unknown = [p for p in self.peers if p not in PEERS]
        if unknown:
            raise ValueError(f"BenchOptions.peers: unknown peer {unknown[0]!r}; choose from {', '.join(PEERS)}")

    def capacity(self) -> tuple[int, int]:
        """(sequences, tokens per sequence) a runtime needs for these measurements."""
        decode = max(self.contexts) + self.warmup + 2 * self.steps + 3  # + greedy steps, profiled steps
        return max(self.batches), max([decode, *self.prompt_lens])


@dataclass(frozen=True)
class StepFloor:
    """Bytes one decode step moves on one rank, at least."""

    dense_weights: int  # every weight that is not a routed expert, read once (the embedding: the batch's rows)
    routed_experts: float  # the distinct experts the batch picks, in expectation (uniform routing)
    mla_history: int  # the MLA cache this rank reads (its share under DCP), in the cache's own bytes
    kda_state: int  # recurrent and conv states, read and written
    distinct_experts_per_layer: float

    @property
    def total(self) -> float:
        return self.dense_weights + self.routed_experts + self.mla_history + self.kda_state


@dataclass
class DecodeResult:
    batch: int
    context: int
    step_ms: float  # Runtime.decode, wall clock, median
    device_ms: float | None  # one CUDA graph replay, median (None without CUDA graphs)
    greedy_step_ms: float  # Runtime.decode_tokens (what generate runs) over ``steps`` steps, wall clock / steps
    tokens_per_s: float  # batch / greedy step time
    floor_ms: float
    floor: StepFloor
    #: profile only: device time per kernel (GPU) or aten op (CPU) of one step, largest first
    kernels: list[dict[str, object]] = field(default_factory=list)
    #: profile only: per layer type, ms of device time (CPU: time) and kernels (CPU: ops) per step
    groups: dict[str, dict[str, float]] = field(default_factory=dict)
    #: per peer: its step time (wall clock, median, ms)
    peer_step_ms: dict[str, float] = field(default_factory=dict)

    @property
    def step_over_floor(self) -> float:
        return self.step_ms / self.floor_ms


@dataclass
class PrefillResult:
    prompt_len: int
    ttft_ms: float  # Runtime.prefill until the logits are on the host, median

    @property
    def tokens_per_s(self) -> float:
        return self.prompt_len / self.ttft_ms * 1e3


@dataclass
class BenchReport:
    device: str
    rank: int
    world_size: int
    copy_bandwidth: float  # bytes per second (read + written) of a large copy on this device
    cuda_graphs: bool
    lowering: str  # how the runtime ran the programs (targets.LOWERINGS)
    decode: list[DecodeResult]
    prefill: list[PrefillResult]
    prefill_chunk: int | None = None  # the runtime's tokens per prefill step (None: whole prompts)
    #: GPU only: GiB of device memory this rank's runtime holds (weights, caches, graph pools)
    #: and the most allocated at once while decode steps and prefills were timed
    memory_gib: dict[str, float] | None = None

    def to_dict(self) -> dict[str, object]:
        """JSON-ready, with the derived ratios."""
        out = asdict(self)
        for d, r in zip(out["decode"], self.decode, strict=True):
            d["step_over_floor"] = r.step_over_floor
            d["device_over_floor"] = r.device_ms / r.floor_ms if r.device_ms is not None else None
            d["greedy_over_device"] = r.greedy_step_ms / r.device_ms if r.device_ms is not None else None
            d["floor"]["total"] = r.floor.total
            d["peer_over_this"] = {p: ms / r.step_ms for p, ms in r.peer_step_ms.items()}
        for d, r in zip(out["prefill"], self.prefill, strict=True):
            d["tokens_per_s"] = r.tokens_per_s
        return out


def run_bench(rt: Runtime, options: BenchOptions,
              on_progress: Callable[[str], None] | None = None) -> BenchReport:
    """Decode and prefill measurements of ``options`` on a loaded runtime (see the module
    docstring); ``on_progress(label)`` after each measurement. The runtime must hold
    ``options.capacity()`` and no sequences."""
    sequences, tokens = options.capacity()
    have = (rt.options.max_sequences, rt.options.max_context)
    if sequences > have[0] or tokens > have[1]:
        raise ValueError(f"the runtime holds {have[0]} sequences of {have[1]} tokens; these measurements need "
                         f"{sequences} of {tokens}")
    if rt.table.sequences:
        raise ValueError(f"the runtime already holds {len(rt.table.sequences)} sequences")
    progress = on_progress or (lambda label: None)
    gen = torch.Generator(device=rt.device).manual_seed(options.seed)
    fill_random_history(rt, gen)
    bandwidth = copy_bandwidth(256 << 20 if rt.device.type == "cpu" else 2 << 30, 10, rt.device)
    held = _held_memory(rt.device)  # after the bandwidth's buffers are freed: the runtime's own

    decode = []
    for context in options.contexts:
        for batch in options.batches:
            ids = start_sequences(rt, batch, context)
            step_ms, device_ms = time_decode(rt, ids, options.steps, options.warmup)
            greedy_ms = time_greedy(rt, ids, options.steps)
            floor = step_floor(rt, batch, context)
            result = DecodeResult(batch, context, step_ms, device_ms, greedy_ms, batch / greedy_ms * 1e3,
                                  floor.total / bandwidth * 1e3, floor)
            if options.profile:
                result.kernels = kernel_times(rt, ids)
                result.groups = group_times(rt, ids)
            decode.append(result)
            for s in ids:
                rt.release(s)
            progress(f"decode batch {batch}, context {context}")
    for peer in options.peers:
        engine = load_peer(rt, peer)
        fill_random_history(engine, gen)
        for result in decode:
            ids = start_sequences(engine, result.batch, result.context)
            result.peer_step_ms[peer], _ = time_decode(engine, ids, options.steps, options.warmup)
            for s in ids:
                engine.release(s)
            progress(f"{peer} reference, batch {result.batch}, context {result.context}")
        del engine
    prefill = []
    vocab = rt.cfg.vocab_size
    for length in options.prompt_lens:
        prompt = torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(options.seed)).tolist()
        times = []
        for _ in range(options.prefill_repeats + 1):
            _sync(rt.device)
            start = time.perf_counter()
            ids, logits = rt.prefill([prompt])
            logits.argmax(-1).tolist()
            times.append(time.perf_counter() - start)
            rt.release(ids[0])
        prefill.append(PrefillResult(length, 1e3 * statistics.median(times[1:])))
        progress(f"prefill {length} tokens")
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    memory = None if held is None else {"held": held, "peak": torch.cuda.max_memory_allocated(rt.device) / 2**30}
    return BenchReport(str(rt.device), rt.rank, world, bandwidth, rt.graphs is not None, rt.lowering, decode, prefill,
                       rt.options.prefill_chunk, memory)


def _held_memory(device: torch.device) -> float | None:
    """GiB allocated on a GPU now, its peak counter restarted from there; None on a CPU."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device) / 2**30


def load_peer(rt: Runtime, kind: str) -> ReferenceEngine:
    """The reference model on ``rt``'s rank, device and dtype with caches of its capacity
    (the artifact's TP, no DCP); "compile": its forward under ``torch.compile``."""
    info = rt.artifact.info
    plan = ParallelPlan(info.tp, rt.rank)
    model = load_reference(info.model_dir, plan, world_tp_group(), info.dtype, rt.device)
    if kind == "compile":
        model.forward = torch.compile(model.forward)
    blocks = -(-rt.options.max_context // info.block_size)
    shape = CacheShape(rt.options.max_sequences, rt.options.max_sequences * blocks, info.block_size)
    return ReferenceEngine(model, shape, rt.device)


def fill_random_history(rt: Runtime | ReferenceEngine, gen: torch.Generator) -> None:
    """Random cache contents, as after long prompts: MLA latents of order 1 (quantised rows
    in an FP8 cache), small KDA states and conv inputs."""
    for c in rt.caches:
        tensors = (c.conv_q, c.conv_k, c.conv_v, c.state) if isinstance(c, KDALayerCache) else (c.kv,)
        for t in tensors:
            if is_fp8_cache(t):
                for part in t.split(1024):  # fp32 values of the whole cache may not fit
                    rows = part.shape[0] * part.shape[1]
                    values = torch.randn(rows, rt.cfg.mla_cache_width, generator=gen, device=t.device)
                    part.copy_(quantize_rows(values, rt.cfg.kv_lora_rank, t.dtype).view(part.shape))
                continue
            scale = 0.05 if t is getattr(c, "state", None) else 1.0
            for part in t.split(1024):
                part.copy_(torch.randn(part.shape, generator=gen, device=t.device) * scale)


def start_sequences(rt: Runtime | ReferenceEngine, batch: int, context: int) -> list[int]:
    """``batch`` new sequences whose first ``context - 1`` positions count as cached (their
    blocks reserved, nothing computed)."""
    ids = [rt.table.new_sequence() for _ in range(batch)]
    rt.table.reserve(ids, [context - 1] * batch)
    rt.table.advance(ids, [context - 1] * batch)
    return ids


def step_floor(rt: Runtime, batch: int, context: int) -> StepFloor:
    """The bytes a decode step of ``batch`` sequences at ``context`` moves on this rank."""
    cfg = rt.cfg
    experts = {n: t for n, t in rt.weights.items() if ".mlp.experts." in n}
    # the embedding table: only the batch's rows are read
    dense = sum(batch * t[0].nbytes if n.endswith("embed_tokens.weight") else t.nbytes
                for n, t in rt.weights.items() if n not in experts)
    moe_layers = len({n.split(".mlp.experts.")[0] for n in experts})
    E, k = cfg.num_experts, cfg.num_experts_per_token
    distinct = E * (1 - (1 - k / E) ** batch) if moe_layers else 0.0
    per_expert = sum(t.nbytes for t in experts.values()) / (moe_layers * E) if moe_layers else 0.0
    local = rt.layout.max_local_length(context)
    mla = sum(batch * local * c.kv[0, 0].nbytes for c in rt.caches if isinstance(c, MLALayerCache))
    kda = sum(2 * batch * (c.state[0].nbytes + c.conv_q[0].nbytes + c.conv_k[0].nbytes + c.conv_v[0].nbytes)
              for c in rt.caches if isinstance(c, KDALayerCache))
    return StepFloor(dense, moe_layers * distinct * per_expert, mla, kda, distinct)


def copy_bandwidth(nbytes: int, repeats: int, device: torch.device | str = "cuda") -> float:
    """Bytes per second of a large copy on ``device``, counting bytes read and written.

    GPU: timed eagerly with events, not in a CUDA graph: a copy captured in a graph becomes
    a memcpy node, which ran at 2.75 TB/s on an H200 against 4.2 TB/s for the same copy
    launched eagerly; the higher figure is the bandwidth kernels can reach."""
    device = torch.device(device)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    if device.type == "cuda":
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(repeats):
            start.record()
            dst.copy_(src)
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop) / 1e3)
    else:
        for _ in range(repeats):
            begin = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - begin)
    return 2 * nbytes / statistics.median(times)


def time_decode(rt: Runtime | ReferenceEngine, ids: list[int], steps: int, warmup: int) -> tuple[float, float | None]:
    """(ms of ``Runtime.decode``, wall clock; ms of one replay of its CUDA graph or None),
    medians; each step is fed the previous step's greedy tokens."""
    tokens = _some_tokens(rt, len(ids))
    walls = []
    for i in range(warmup + steps):
        _sync(rt.device)
        start = time.perf_counter()
        tokens = rt.decode(ids, tokens).argmax(-1).tolist()
        if i >= warmup:
            walls.append(time.perf_counter() - start)
    graph = _graph_of(rt, len(ids))
    if graph is None:
        return 1e3 * statistics.median(walls), None
    # The last step left its inputs in the static buffers: replay that graph alone.
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    device = []
    for _ in range(steps):
        torch.cuda._sleep(1_000_000)  # the GPU waits while the host queues the replay
        begin.record()
        graph.replay()
        end.record()
        end.synchronize()
        device.append(begin.elapsed_time(end))
    return 1e3 * statistics.median(walls), statistics.median(device)


def time_greedy(rt: Runtime, ids: list[int], steps: int) -> float:
    """ms per step of ``Runtime.decode_tokens`` over ``steps`` steps, wall clock until the
    tokens are on the host."""
    tokens = _some_tokens(rt, len(ids))
    _sync(rt.device)
    start = time.perf_counter()
    rt.decode_tokens(ids, tokens, steps)
    return 1e3 * (time.perf_counter() - start) / steps


#: name prefixes of collectives in a profile: NCCL / RCCL kernels on a GPU, the c10d ops
#: (functional and in place) on a CPU
COLLECTIVE_PREFIXES = ("nccl", "rccl", "_c10d_functional::", "c10d::")


def kernel_times(rt: Runtime, ids: list[int], top: int = 15) -> list[dict[str, object]]:
    """Device time per kernel of one decode step (GPU: a replay of its CUDA graph, or an
    eager step without graphs; CPU: self time per aten and c10d op of an eager step),
    largest first, after an "(all)" row and a "(collectives)" row (the kernels or ops of
    :data:`COLLECTIVE_PREFIXES`: a TP / DCP step's communication, waits included)."""
    from torch.profiler import ProfilerActivity, profile

    graph = _graph_of(rt, len(ids))
    gpu = rt.device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA] if gpu else [ProfilerActivity.CPU]) as prof:
        if graph is not None:
            graph.replay()
        else:
            rt.decode(ids, [1] * len(ids))
        _sync(rt.device)
    totals: dict[str, list[float]] = {}
    for e in prof.events():
        if gpu and e.device_type.name == "CUDA":
            totals.setdefault(e.name, []).append(e.device_time / 1e3)
        elif not gpu and e.name.startswith(("aten::", *COLLECTIVE_PREFIXES)):
            totals.setdefault(e.name, []).append(e.self_cpu_time_total / 1e3)
    rows = sorted(({"kernel": name[:100], "ms": sum(t), "calls": len(t)} for name, t in totals.items()),
                  key=lambda r: -r["ms"])
    collectives = [r for r in rows if r["kernel"].lower().startswith(COLLECTIVE_PREFIXES)]
    return [_sum_row("(all)", rows), _sum_row("(collectives)", collectives), *rows[:top]]


def _sum_row(name: str, rows: list[dict[str, object]]) -> dict[str, object]:
    return {"kernel": name, "ms": sum(r["ms"] for r in rows), "calls": sum(r["calls"] for r in rows)}


class _GroupRanges(fx.Interpreter):
    """Runs a program node by node, each inside a profiler range named by its layer type."""

    def __init__(self, module: fx.GraphModule):
        super().__init__(module)
        self.groups = {n: g for n, (g, _, _) in node_groups(n for n in module.graph.nodes if n.op == "call_function").items()}

    def run_node(self, n: fx.Node) -> object:
        group = self.groups.get(n)
        if group is None:
            return super().run_node(n)
        with torch.profiler.record_function(f"k3group:{group}"):
            return super().run_node(n)


def group_times(rt: Runtime, ids: list[int]) -> dict[str, dict[str, float]]:
    """Per layer type (:data:`k3compile.placement.groups.GROUPS`): ms of device time (CPU:
    of time) and kernels launched (CPU: aten ops run) in one eager decode step."""
    from torch.profiler import ProfilerActivity, profile

    gpu = rt.device.type == "cuda"
    runner = _GroupRanges(rt.graph_modules["decode"])
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    step = lambda: rt.step(ids, [[1]] * len(ids), module=lambda *args: runner.run(*args))  # noqa: E731
    step()  # warm-up: the profiler's first range would also hold its own start-up
    with profile(activities=activities) as prof:
        step()
        _sync(rt.device)
    out = {g: {"ms": 0.0, "kernels": 0} for g in GROUPS}
    for e in prof.events():
        # the ranges as the host opened them (the profiler also lists each range's span on
        # the GPU under the same name: idle gaps included, so not a device time)
        if e.device_type.name != "CPU" or not e.name.startswith("k3group:"):
            continue
        g = out[e.name.removeprefix("k3group:")]
        if gpu:
            g["ms"] += e.device_time_total / 1e3
            g["kernels"] += _count(e, lambda x: len(x.kernels))
        else:
            g["ms"] += e.cpu_time_total / 1e3
            g["kernels"] += _count(e, lambda x: int(x.name.startswith("aten::") and not x.cpu_children))
    return {g: v for g, v in out.items() if v["kernels"]}


def _count(event, own: Callable[[object], int]) -> int:
    return own(event) + sum(_count(c, own) for c in event.cpu_children)


def _some_tokens(rt: Runtime | ReferenceEngine, n: int) -> list[int]:
    """``n`` valid token ids to feed a first timed step."""
    return [1 + i % (rt.cfg.vocab_size - 1) for i in range(n)]


def _graph_of(rt: Runtime | ReferenceEngine, batch: int) -> torch.cuda.CUDAGraph | None:
    if getattr(rt, "graphs", None) is None or batch > rt.graphs.max_batch:
        return None
    bucket = next(b for b in rt.graphs.buckets if b >= batch)
    return rt.graphs.graphs[bucket][0]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
