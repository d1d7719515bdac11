"""``bench``: time a compiled artifact's decode steps and prefills through the runtime,
against the floor of the bytes a step moves (:mod:`k3compile.bench`)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.table import Table

from k3compile.cli.app import UserError, app, console, err_console
from k3compile.cli.artifact import (
    ArtifactArgument,
    Launch,
    check_runtime_choices,
    load_runtime,
    read_runtime_artifact,
    run_header,
    runtime_errors,
)
from k3compile.cli.options import (KV_CACHE_DTYPE_HELP, InductorOption, PrefillChunkOption, RankTimeoutOption,
                                   VerifyWeightsOption, at_least_one, check_rank_timeout, choice, lowering_choice)


def parse_counts(text: str, option: str, allow_empty: bool = False) -> tuple[int, ...]:
    """``"1,16,64"`` as (1, 16, 64): positive integers; a UserError naming ``option`` else."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items and allow_empty:
        return ()
    if not items or not all(t.isdigit() and int(t) > 0 for t in items):
        raise UserError(f"{option}: expected positive integers separated by commas (e.g. 1,16,64), got {text!r}")
    return tuple(int(t) for t in items)


@app.command("bench")
def bench_command(
    out: ArtifactArgument,
    batch: Annotated[str, typer.Option(help="Sequences decoded together, one run per value. Example: --batch 1,16,64")] = "1",
    context: Annotated[
        str, typer.Option(help="Tokens already cached per sequence (random history), one run per value. "
                          "Example: --context 1024,32768")] = "1024",
    prompt_len: Annotated[
        str, typer.Option(help="Prompt lengths whose time to first token is measured; empty for none. "
                          "Example: --prompt-len 128,1024")] = "128",
    steps: Annotated[int, typer.Option(help="Timed decode steps per run (the median is reported). Example: --steps 50")] = 20,
    warmup: Annotated[int, typer.Option(help="Untimed decode steps before them. Example: --warmup 5")] = 3,
    profile: Annotated[
        bool, typer.Option("--profile/--no-profile",
                           help="Also break one step's time down by kernel and by layer type (torch.profiler).")] = True,
    peers: Annotated[
        str, typer.Option(help="Also time these peers' decode steps in the same run: eager (the reference model, "
                          "run eagerly) and compile (its forward under torch.compile). Example: --peers eager,compile")] = "",
    json_out: Annotated[
        Optional[Path], typer.Option("--json", help="Write the results as JSON to this file. Example: --json bench.json",
                                     show_default=False)] = None,
    device: Annotated[
        Optional[str], typer.Option(help="cpu or cuda (default: cuda when a GPU is visible, else cpu). Example: --device cpu",
                                    show_default=False)] = None,
    cuda_graphs: Annotated[
        bool, typer.Option("--cuda-graphs/--no-cuda-graphs", help="On a GPU, replay decode steps as CUDA/HIP graphs.")] = True,
    kernels: Annotated[
        str, typer.Option(help="What runs the k3 ops: auto, reference or triton (see 'k3compile run --help').")] = "auto",
    kv_cache_dtype: Annotated[
        Optional[str], typer.Option(help=KV_CACHE_DTYPE_HELP + " A check against the artifact's.", show_default=False)] = None,
    inductor: InductorOption = None,
    prefill_chunk: PrefillChunkOption = None,
    rank_timeout: RankTimeoutOption = 300.0,
    verify_weights: VerifyWeightsOption = False,
) -> None:
    """Measure an artifact: decode time per step and time to first token, against the floor.

    For each --context and --batch: that many sequences start with that many cached tokens of random history (nothing is prefilled), then --warmup and --steps decode steps run through the runtime's public decode call. Reported per run: the wall time of one decode call (host work, input copies, CUDA graph replay, logits back), of one step of greedy decoding as generate runs it (tokens fed on the device), the device time of one graph replay (GPU), tokens per second of greedy decoding, and the floor: the bytes one step must move on this rank (weights, the routed experts the batch picks, MLA history, KDA state) over the copy bandwidth measured in the same run. Then the time to first token of one prompt of each --prompt-len (in chunks of --prefill-chunk tokens, if given). With --profile, one step's time by layer type and by kernel. With --peers, the reference model's decode steps (eager, and under torch.compile) at the same batches and contexts, and how many times slower they are.

    An artifact compiled with --tp N runs on N processes: torchrun --nproc-per-node N -m k3compile bench OUT (each rank measures; rank 0 prints and writes --json).

    Example: k3compile bench ./tiny.k3c --batch 1,4 --context 256 --prompt-len 64 --json bench.json
    """
    import torch.distributed as dist

    from k3compile.bench import PEERS, BenchOptions, run_bench
    from k3compile.runtime import RuntimeOptions

    launch = Launch.from_env()
    try:
        launch.check()
        at_least_one(steps=steps, prefill_chunk=prefill_chunk)
        if warmup < 0:
            raise UserError(f"--warmup: at least 0, got {warmup}")
        peer_names = tuple(p.strip() for p in peers.split(",") if p.strip())
        for p in peer_names:
            choice(p, PEERS, "--peers", "peer")
        options = BenchOptions(parse_counts(batch, "--batch"), parse_counts(context, "--context"),
                               parse_counts(prompt_len, "--prompt-len", allow_empty=True), steps, warmup,
                               profile=profile, peers=peer_names)
        if json_out is not None and not json_out.parent.is_dir():
            raise UserError(f"--json: the folder {json_out.parent} does not exist")
        check_runtime_choices(device, kernels)
        check_rank_timeout(rank_timeout)
        info = read_runtime_artifact(out, launch, kv_cache_dtype, "bench")
        sequences, tokens = options.capacity()
        runtime_options = RuntimeOptions(max_sequences=sequences, max_context=tokens, device=device,
                                         cuda_graphs=None if cuda_graphs else False, kernels=kernels,
                                         kv_cache_dtype=kv_cache_dtype, lowering=lowering_choice(inductor),
                                         rank_timeout_s=rank_timeout, verify_weights=verify_weights,
                                         prefill_chunk=prefill_chunk)
        rt, load_s = load_runtime(out, runtime_options, launch)
        header = run_header(out, info, rt.device, rt.graphs is not None, rt.triton_kernels and rt.device.type == "cpu",
                            rt.lowering)
        from rich.progress import Progress

        total = len(options.batches) * len(options.contexts) * (1 + len(peer_names)) + len(options.prompt_lens)
        with Progress(console=err_console, transient=True, disable=launch.rank != 0 or not err_console.is_terminal) as bar:
            task = bar.add_task("measuring", total=total)
            report = run_bench(rt, options, lambda label: bar.update(task, advance=1, description=label))
        rt.close()
    except runtime_errors() as e:
        launch.fail(e)
    if launch.rank == 0:
        console.print(header + f"; loaded in {load_s:.1f} s", soft_wrap=True)
        print_report(report)
        if json_out is not None:
            data = {"artifact": str(out), "load_s": load_s, "options": options.__dict__, **report.to_dict()}
            tmp = json_out.with_name(f".{json_out.name}.tmp-{os.getpid()}")
            tmp.write_text(json.dumps(data, indent=1))
            tmp.replace(json_out)
    if dist.is_initialized():
        dist.destroy_process_group()


def print_report(report: Any) -> None:
    """The decode, prefill and breakdown tables of a :class:`k3compile.bench.BenchReport`."""
    console.print(f"copy bandwidth {report.copy_bandwidth / 1e9:.1f} GB/s on {report.device}"
                  + (f", rank {report.rank} of {report.world_size}" if report.world_size > 1 else ""))
    if report.memory_gib is not None:
        console.print(f"device memory: {report.memory_gib['held']:.2f} GiB held by the runtime, "
                      f"{report.memory_gib['peak']:.2f} GiB at most while timing")
    console.print("[bold]decode[/], per step, medians")
    table = Table()
    peers = list(dict.fromkeys(p for r in report.decode for p in r.peer_step_ms))
    for col in ("batch", "context", "step ms", "greedy ms", "device ms", "greedy / device", "tokens/s", "floor ms",
                "device / floor", *(f"{p} ms, x this" for p in peers)):
        table.add_column(col, justify="right")
    for r in report.decode:
        dev = "-" if r.device_ms is None else f"{r.device_ms:.3f}"
        greedy_ratio = "-" if r.device_ms is None else f"{r.greedy_step_ms / r.device_ms:.2f}x"
        dev_ratio = "-" if r.device_ms is None else f"{r.device_ms / r.floor_ms:.2f}x"
        table.add_row(str(r.batch), str(r.context), f"{r.step_ms:.3f}", f"{r.greedy_step_ms:.3f}", dev, greedy_ratio,
                      f"{r.tokens_per_s:.1f}", f"{r.floor_ms:.3f}", dev_ratio,
                      *(f"{r.peer_step_ms[p]:.3f}, {r.peer_step_ms[p] / r.step_ms:.2f}x" for p in peers))
    console.print(table)
    if report.prefill:
        chunks = f", in chunks of {report.prefill_chunk} tokens" if report.prefill_chunk else ""
        console.print(f"[bold]prefill[/], time to first token of one prompt{chunks}, medians")
        table = Table()
        for col in ("prompt tokens", "TTFT ms", "tokens/s"):
            table.add_column(col, justify="right")
        for p in report.prefill:
            table.add_row(str(p.prompt_len), f"{p.ttft_ms:.3f}", f"{p.tokens_per_s:.1f}")
        console.print(table)
    profiled = [r for r in report.decode if r.groups]
    if profiled:
        what = "device ms" if report.device.startswith("cuda") else "ms (CPU)"
        calls = "kernels" if report.device.startswith("cuda") else "aten ops"
        console.print(f"[bold]one eager decode step by layer type[/]: {what} ({calls})")
        table = Table()
        table.add_column("layer type")
        for r in profiled:
            table.add_column(f"batch {r.batch}, context {r.context}", justify="right")
        for group in dict.fromkeys(g for r in profiled for g in r.groups):
            cells = [f"{r.groups[group]['ms']:.3f} ({r.groups[group]['kernels']:.0f})" if group in r.groups else "-"
                     for r in profiled]
            table.add_row(group, *cells)
        console.print(table)
        r = profiled[-1]
        by = "kernel, one graph replay" if report.cuda_graphs else "kernel" if calls == "kernels" else "aten op, self time"
        console.print(f"[bold]one decode step by {by}[/]: batch {r.batch}, context {r.context}")
        table = Table()
        for col, justify in (("kernel", "left"), ("ms", "right"), ("calls", "right")):
            table.add_column(col, justify=justify)
        for k in r.kernels:
            table.add_row(str(k["kernel"]), f"{k['ms']:.3f}", f"{k['calls']:.0f}")
        console.print(table)
