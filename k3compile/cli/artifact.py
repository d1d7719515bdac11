"""Commands on compiled artifacts: ``inspect`` (verify it, show how it was made and what
each pass did) and ``run`` (load it with the runtime and generate tokens)."""

from __future__ import annotations

import os
import time
import warnings
from pathlib import Path
from dataclasses import dataclass
from typing import Annotated, Any, NoReturn, Optional

import typer
from rich.markup import escape
from rich.table import Table

from k3compile.cli.app import USAGE_ERROR, UserError, app, console, err_console, fail, warn
from k3compile.cli.kernels import REPORT_TARGETS, check_report_choices, print_kernel_report
from k3compile.cli.options import (
    KV_CACHE_DTYPE_HELP,
    InductorOption,
    PrefillChunkOption,
    PromptFileOption,
    PromptOption,
    RankTimeoutOption,
    VerifyWeightsOption,
    at_least_one,
    check_kv_cache_choice,
    check_rank_timeout,
    choice,
    lowering_choice,
    read_prompts,
)
from k3compile.cli.render import (
    capture_text,
    config_label,
    dtype_name,
    human_count,
    layer_kinds_summary,
    print_pass_details,
    print_passes,
    print_tokens,
)
from k3compile.config import ConfigError

ArtifactArgument = Annotated[
    Path,
    typer.Argument(help="An artifact directory written by 'k3compile optimize'. Example: ./tiny.k3c", show_default=False),
]


def read_info(out: Path, check_checkpoint: Any = "warn") -> Any:
    """Verify an artifact (:func:`k3compile.artifact.read_artifact_info`); its warnings (a
    changed or missing checkpoint) go to stderr as one line each."""
    from k3compile.artifact import read_artifact_info

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        info = read_artifact_info(out, check_checkpoint=check_checkpoint)
    for w in caught:
        warn(str(w.message))
    return info


def _summary_matches(s: Any, pass_name: str | None, phase: str | None) -> bool:
    if not isinstance(s, dict):
        return pass_name is None and phase is None
    return (pass_name is None or s.get("pass") == pass_name) and (phase is None or s.get("phase") == phase)


def _layer_nodes(out: Path, phases: list[str], layer: int) -> dict[str, Any]:
    """Phase -> snapshot of the compiled program's nodes of ``layer``."""
    from k3compile.artifact import load_artifact
    from k3compile.records import snapshot

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # already reported by read_info
        artifact = load_artifact(out, check_checkpoint=False)
    return {
        phase: snapshot(artifact.programs[phase].graph_module, artifact.programs[phase]).filter(layer=layer)
        for phase in phases
    }


def _print_diff_howto(info: Any, selected: list[Any], layer: int | None) -> None:
    """The manifest stores no graph diffs: show the Python that recompiles and prints one."""
    from k3compile.mla_cache_fp8 import is_fp8_dtype

    first = next((s for s in selected if isinstance(s, dict)), {})
    example_pass = first.get("pass", "remove_noops")
    example_phase = first.get("phase", "decode")
    filt = f".filter(layer={layer})" if layer is not None else ""
    console.print()
    console.print(
        "The manifest stores a summary of each pass, not its graph diff. To see the diff, compile again "
        "in Python (a notebook shows each record as a side-by-side diff):",
        soft_wrap=True,
    )
    console.print(
        "  import tempfile\n"
        "  from k3compile.compiler import CompileOptions, optimize\n"
        f"  result = optimize({info.model_dir!r}, tempfile.mkdtemp(), CompileOptions(tp={info.tp}, "
        f"dcp={info.dcp}, dcp_interleave={info.dcp_interleave}, target={info.target!r}, "
        f"dtype={dtype_name(info.dtype)!r}, kv_cache_dtype={'fp8' if is_fp8_dtype(info.kv_cache_dtype) else 'auto'!r}, "
        f"block_size={info.block_size}), overwrite=True)\n"
        f"  rec = next(r for r in result.pipeline.records if r.pass_name == {example_pass!r} "
        f"and r.phase == {example_phase!r})\n"
        f"  print(rec{filt}.to_text())   # or display(rec{filt}) in Jupyter",
        markup=False,
        soft_wrap=True,
        highlight=False,
    )


def _artifact_table(out: Path, info: Any) -> Table:
    """Versions, model, parallelism, target, dtype and capture statistics, one per row."""
    from k3compile.mla_cache_fp8 import is_fp8_dtype
    from k3compile.model import count_parameters
    from k3compile.targets import TARGETS

    cfg = info.config
    target = TARGETS.get(info.target)
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold", no_wrap=True)
    table.add_column(overflow="fold")
    table.add_row("format", f"{escape(info.format)} version {info.format_version}")
    table.add_row("written by", f"k3compile {escape(info.k3compile_version)}, torch {escape(info.torch_version)}")
    table.add_row(
        "model",
        f"{config_label(cfg)}: {human_count(count_parameters(cfg))} parameters, {cfg.num_hidden_layers} layers, "
        f"hidden {cfg.hidden_size}, vocab {cfg.vocab_size}",
    )
    table.add_row("layers", layer_kinds_summary(cfg))
    table.add_row("checkpoint", f"{escape(info.model_dir)} (weights are read from here at load)")
    run_with = f"torchrun --nproc-per-node {info.tp} -m k3compile run {escape(str(out))}"
    table.add_row("tp", f"{info.tp}" + (f" (run with: {run_with})" if info.tp > 1 else ""))
    if info.dcp > 1:
        table.add_row("dcp", f"{info.dcp} (MLA history split by position, interleave {info.dcp_interleave})")
    if target is None:
        where = " (unknown to this k3compile)"
    elif target.name == target.device == target.arch:
        where = ""
    else:
        where = f" ({target.device}, {target.arch})"
    table.add_row("target", escape(info.target) + where)
    table.add_row("dtype", dtype_name(info.dtype))
    kv = dtype_name(info.kv_cache_dtype)
    table.add_row("MLA cache", f"{kv} values + per-token scales" if is_fp8_dtype(info.kv_cache_dtype) else kv)
    table.add_row("block size", f"{info.block_size} tokens per MLA cache block")
    table.add_row("lowering", "Inductor (torch.compile at load)" if info.lowering == "inductor" else "eager (op by op)")
    table.add_row("phases", ", ".join(info.phases))
    table.add_row("capture", escape(capture_text(info.capture_stats)))
    return table


@app.command("inspect")
def inspect_command(
    out: ArtifactArgument,
    pass_name: Annotated[
        Optional[str],
        typer.Option(
            "--pass",
            help="Show only this pass, with its details (all stats, op count changes, skipped candidates). "
            "Example: --pass remove_noops",
            show_default=False,
        ),
    ] = None,
    phase: Annotated[
        Optional[str],
        typer.Option(help="Show only this phase's graph: decode or prefill. Example: --phase decode", show_default=False),
    ] = None,
    diff: Annotated[
        bool,
        typer.Option(
            "--diff",
            help="Print what the manifest stores about each pass's changes (details per pass and phase; "
            "graph diffs are not stored: the output says how to get them). Example: --diff",
        ),
    ] = False,
    layer: Annotated[
        Optional[int],
        typer.Option(
            help="Also show layer N of the compiled graphs (its op counts; skipped candidates in it). Example: --layer 0",
            show_default=False,
        ),
    ] = None,
    kernels: Annotated[
        bool,
        typer.Option(
            "--kernels",
            help="Also report the kernel launches of one rank's decode step and prefill on a GPU target: grid, "
            "registers, LDS, programs resident per compute unit and how full the device is, with a warning "
            "where a launch leaves compute units idle (compiles the kernels for the target; no GPU needed). "
            "Example: --kernels --batch 16 --context 131072 --target mi300x",
        ),
    ] = False,
    batch: Annotated[
        Optional[int],
        typer.Option(help="With --kernels: sequences in the step (default 1). Example: --batch 16", show_default=False),
    ] = None,
    context: Annotated[
        Optional[int],
        typer.Option(help="With --kernels: positions a decoding sequence attends to, and tokens of each prefilled "
                     "prompt (default 32768). Example: --context 131072", show_default=False),
    ] = None,
    target: Annotated[
        Optional[str],
        typer.Option(help="With --kernels: the GPU target (default: the artifact's, or mi355x for a CPU "
                     "artifact). Example: --target mi300x", show_default=False),
    ] = None,
) -> None:
    """Verify an artifact and show how it was compiled and what each pass did.

    Checks every file's size and sha256 against the manifest (a modified artifact is refused), then prints the versions, model, parallelism, target, dtype, capture statistics and a table of the passes (one row per pass and phase, with what each bought). A changed or missing source checkpoint is a warning here (and an error for 'k3compile run').

    With --kernels, also the kernel launches of one rank's step on a GPU target (see --kernels).

    Example: k3compile inspect ./tiny.k3c --pass remove_noops --phase decode --diff
    """
    from k3compile.artifact import ArtifactError

    try:
        info = read_info(out)
        phases = list(info.phases)
        if phase is not None:
            if phase not in info.phases:
                raise UserError(f"--phase: unknown phase {phase!r}; this artifact has {', '.join(info.phases)}")
            phases = [phase]
        if pass_name is not None:
            ran = list(dict.fromkeys(str(s.get("pass")) for s in info.passes if isinstance(s, dict)))
            if pass_name not in ran:
                raise UserError(f"--pass: pass {pass_name!r} did not run for this artifact; "
                                f"passes that ran: {', '.join(ran) or 'none'}")
        n_layers = info.config.num_hidden_layers
        if layer is not None and not 0 <= layer < n_layers:
            raise UserError(f"--layer: {layer} is outside [0, {n_layers}) (the model's layers)")
        selected = [s for s in info.passes if _summary_matches(s, pass_name, phase)]
        layer_snaps = _layer_nodes(out, phases, layer) if layer is not None else None
        report_target = target or (info.target if info.target in REPORT_TARGETS else "mi355x")
        given = [name for name, value in (("--batch", batch), ("--context", context), ("--target", target))
                 if value is not None]
        if given and not kernels:
            raise UserError(f"{given[0]} describes the kernel report: add --kernels")
        batch, context = (1 if batch is None else batch), (32768 if context is None else context)
        if kernels:
            check_report_choices(report_target, batch, context)
    except (UserError, ArtifactError) as e:
        fail(str(e))

    console.print(f"[bold green]Artifact[/] {escape(str(out))}  (verified: every file matches the manifest)", soft_wrap=True)
    console.print(_artifact_table(out, info))
    console.print()
    scope = " ".join(p for p in (f"pass {pass_name}" if pass_name else "", f"phase {phase}" if phase else "") if p)
    print_passes(selected, "Passes" + (f" ({scope})" if scope else ""))

    layer_names = None
    if layer_snaps is not None:
        console.print()
        console.print(
            f"[bold]Layer {layer}[/] ({info.config.layer_kinds[layer].upper()}) in the compiled graphs "
            "[dim](the pass numbers above are for whole graphs: the manifest does not split them by layer)[/]",
            soft_wrap=True,
        )
        for ph, snap in layer_snaps.items():
            ops = ", ".join(f"{op.removesuffix('.default')} x{n}" for op, n in snap.op_counts.items())
            console.print(f"  {ph}: {len(snap)} nodes; {escape(ops) or 'no ops'}", soft_wrap=True)
        layer_names = {line.name for snap in layer_snaps.values() for line in snap}

    if diff or pass_name is not None:
        console.print()
        for s in selected:
            if isinstance(s, dict):
                print_pass_details(s, layer_names)
    if diff and not any(isinstance(s, dict) and s.get("diff") for s in selected):
        _print_diff_howto(info, selected, layer)
    if kernels:
        console.print()
        print_kernel_report(info, report_target, batch, context)


@dataclass(frozen=True)
class Launch:
    """How this process was started: alone, or as one rank of ``torchrun``."""

    distributed: bool
    rank: int
    world_env: str | None  # WORLD_SIZE as torchrun set it

    @classmethod
    def from_env(cls) -> Launch:
        world = os.environ.get("WORLD_SIZE")
        return cls(world is not None, int(os.environ.get("RANK", "0")) if world is not None else 0, world)

    @property
    def world(self) -> int:
        return int(self.world_env) if self.world_env is not None else 1

    def check(self) -> None:
        if self.world_env is not None and not self.world_env.isdigit():
            raise UserError(f"WORLD_SIZE={self.world_env!r} is not an integer")

    def fail(self, error: Exception) -> NoReturn:
        """Leave the process group; rank 0 reports ``error`` as one line; exit status 2. An
        error caused by a rank that stopped is reported by every surviving rank (rank 0 may
        be the one that stopped), and the group is left as it is (leaving it waits for the
        stopped rank)."""
        import torch.distributed as dist

        from k3compile.runtime.rank_group import RankFailed, RanksMissing

        ranks_failed = isinstance(error, (RankFailed, RanksMissing)) or isinstance(error.__cause__, RankFailed)
        if dist.is_initialized() and not ranks_failed:
            dist.destroy_process_group()
        if self.rank == 0 or ranks_failed:
            fail(str(error))
        raise typer.Exit(USAGE_ERROR)


def runtime_errors() -> tuple[type[Exception], ...]:
    """What loading and running an artifact raise for a problem the user can fix."""
    from k3compile.artifact import ArtifactError
    from k3compile.checkpoint.loader import CheckpointError
    from k3compile.runtime.engine import NonFiniteLogits
    from k3compile.runtime.rank_group import RankFailed, RanksMissing
    from k3compile.sequences import GenerationStopped, RequestError

    return (UserError, ArtifactError, CheckpointError, ConfigError, RequestError, NonFiniteLogits, RanksMissing,
            RankFailed, GenerationStopped)


def check_runtime_choices(device: str | None, kernels: str) -> None:
    """--device and --kernels, before anything loads; --kernels triton on the CPU selects
    Triton's interpreter (it must be chosen before triton is first imported)."""
    from k3compile.runtime.engine import KERNELS, resolve_device

    if device is not None:
        try:
            resolve_device(device)
        except ValueError as e:
            raise UserError(f"--device: {e}") from None
    choice(kernels, KERNELS, "--kernels", "choice")
    if kernels == "triton" and resolve_device(device).type == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"


def read_runtime_artifact(out: Path, launch: Launch, kv_cache_dtype: str | None, command: str) -> Any:
    """The artifact's info, checked against the launch (its TP size) and --kv-cache-dtype."""
    from k3compile.batch import check_kv_cache_dtype
    from k3compile.targets import get_target

    info = read_info(out, check_checkpoint=False)
    if kv_cache_dtype is not None:
        check_kv_cache_choice(kv_cache_dtype)
        try:
            check_kv_cache_dtype(kv_cache_dtype, info.kv_cache_dtype, info.dtype, get_target(info.target))
        except ValueError as e:
            raise UserError(f"{out}: {e}") from None
    run_with = f"'torchrun --nproc-per-node {info.tp} -m k3compile {command} {out}'"
    if not launch.distributed and info.tp > 1:
        raise UserError(f"{out} was compiled for tp={info.tp}: start it on {info.tp} processes with {run_with}")
    if launch.distributed and launch.world != info.tp:
        raise UserError(f"{out} was compiled for tp={info.tp} but torchrun started {launch.world} process(es); "
                        f"use {run_with}")
    return info


def load_runtime(out: Path, options: Any, launch: Launch) -> tuple[Any, float]:
    """(the loaded runtime, seconds it took), with a progress bar on a terminal."""
    from rich.progress import Progress

    from k3compile.runtime import load

    start = time.perf_counter()
    import torch._dynamo  # noqa: F401  (torch's custom ops import it on first call: count it as load time)

    with Progress(console=err_console, transient=True, disable=not err_console.is_terminal) as bar:
        task = bar.add_task("loading weights", total=None)
        progress = lambda done, total: bar.update(task, completed=done, total=total)  # noqa: E731
        if launch.distributed:  # rank and world size from torchrun's environment
            rt = load(out, options=options, on_progress=progress)
        else:
            rt = load(out, rank=0, world_size=1, options=options, on_progress=progress)
    return rt, time.perf_counter() - start


def run_header(out: Path, info: Any, on_device: Any, with_graphs: bool, interpreted: bool, lowering: str) -> str:
    """What runs: the artifact, its model and plan, and the device (rich markup)."""
    return (f"[bold]{escape(str(out))}[/]: {config_label(info.config)}, tp {info.tp}"
            f"{f', dcp {info.dcp}' if info.dcp > 1 else ''}, {dtype_name(info.dtype)}, target {escape(info.target)}, "
            f"on {on_device}" + (", compiled by Inductor" if lowering == "inductor" else "")
            + (" with CUDA graphs" if with_graphs else "")
            + (" with the Triton kernels under Triton's interpreter" if interpreted else ""))


@app.command("run")
def run_command(
    out: ArtifactArgument,
    prompt: PromptOption = None,
    prompt_file: PromptFileOption = None,
    max_new_tokens: Annotated[
        int,
        typer.Option(help="Tokens to generate for every prompt. Example: --max-new-tokens 4"),
    ] = 16,
    temperature: Annotated[
        float,
        typer.Option(help="Sampling temperature; 0 is greedy (always the most likely token). Example: --temperature 0.7"),
    ] = 0.0,
    top_k: Annotated[
        int,
        typer.Option(help="Sample only among the k most likely tokens; 0 keeps all. Example: --top-k 50"),
    ] = 0,
    top_p: Annotated[
        float,
        typer.Option(help="Sample only among the most likely tokens that hold this much probability; 1 keeps all. Example: --top-p 0.9"),
    ] = 1.0,
    seed: Annotated[
        int,
        typer.Option(help="Random seed of sampling: the same seed gives the same tokens. Example: --seed 7"),
    ] = 0,
    max_context: Annotated[
        int,
        typer.Option(help="Cache capacity per sequence in tokens (prompt + new tokens). Example: --max-context 4096"),
    ] = 4096,
    device: Annotated[
        Optional[str],
        typer.Option(
            help="cpu or cuda (default: cuda when a GPU is visible, else cpu; under torchrun each rank takes its "
            "local GPU). Example: --device cpu",
            show_default=False,
        ),
    ] = None,
    cuda_graphs: Annotated[
        bool,
        typer.Option(
            "--cuda-graphs/--no-cuda-graphs",
            help="On a GPU, replay decode steps as CUDA/HIP graphs. Example: --no-cuda-graphs",
        ),
    ] = True,
    kernels: Annotated[
        str,
        typer.Option(
            help="What runs the k3 ops: auto (the Triton kernels on a GPU, the torch references on the CPU), "
            "reference (the torch references everywhere) or triton (the Triton kernels everywhere: on the CPU "
            "under Triton's interpreter, slow, to test the GPU code path without a GPU). Example: --kernels triton",
        ),
    ] = "auto",
    kv_cache_dtype: Annotated[
        Optional[str],
        typer.Option(help=KV_CACHE_DTYPE_HELP + " Fixed when compiling: given here, it must be what the artifact "
                     "was compiled with (a check). Example: --kv-cache-dtype fp8", show_default=False),
    ] = None,
    inductor: InductorOption = None,
    prefill_chunk: PrefillChunkOption = None,
    rank_timeout: RankTimeoutOption = 300.0,
    verify_weights: VerifyWeightsOption = False,
    check_finite: Annotated[
        bool,
        typer.Option("--check-finite", help="Debug check: name a weight holding NaN or Inf when loading, and stop "
                     "at a step whose logits are not finite (one device sync per step). Example: --check-finite"),
    ] = False,
) -> None:
    """Load a compiled artifact with the runtime and generate tokens.

    Reads this rank's weights from the checkpoint the artifact was compiled from, prefills all prompts in one step (or in chunks of --prefill-chunk tokens), then decodes them together, one token per step. Prompts are token ids (there is no tokenizer). Prints each prompt's new tokens and the timing: load, prefill, and decode per token (the first steps include one-time warm-up).

    An artifact compiled with --tp N runs on N processes, started by torchrun: torchrun --nproc-per-node N -m k3compile run OUT (only rank 0 prints).

    --kernels triton on the CPU runs the GPU's Triton kernels under Triton's interpreter (slow; tiny models only): the GPU code path, checked without a GPU.

    Example: k3compile run ./tiny.k3c --prompt "1 2 3" --prompt "7 8" --max-new-tokens 4
    """
    import torch.distributed as dist

    from k3compile.runtime import RuntimeOptions, SamplingParams
    from k3compile.sequences import GenerationStopped

    launch = Launch.from_env()
    try:
        launch.check()
        at_least_one(max_new_tokens=max_new_tokens, max_context=max_context, prefill_chunk=prefill_chunk)
        try:
            sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        except ValueError as e:
            raise UserError(f"--{str(e).replace('_', '-')}") from None
        check_runtime_choices(device, kernels)
        check_rank_timeout(rank_timeout)
        info = read_runtime_artifact(out, launch, kv_cache_dtype, "run")
        prompts = read_prompts(prompt, prompt_file, info.config.vocab_size)
        for i, p in enumerate(prompts):
            need = len(p) + max_new_tokens - 1
            if need > max_context:
                raise UserError(
                    f"prompt {i} has {len(p)} tokens: with --max-new-tokens {max_new_tokens} it needs a context of "
                    f"{need} tokens, more than --max-context {max_context}"
                )
        options = RuntimeOptions(
            max_sequences=len(prompts), max_context=max_context, device=device,
            cuda_graphs=None if cuda_graphs else False, kernels=kernels, kv_cache_dtype=kv_cache_dtype,
            lowering=lowering_choice(inductor), check_finite=check_finite, rank_timeout_s=rank_timeout,
            verify_weights=verify_weights, prefill_chunk=prefill_chunk,
        )
        rt, load_s = load_runtime(out, options, launch)
        result = rt.generate_timed(prompts, max_new_tokens, sampling)
        # CUDA graphs that captured NCCL collectives must go before the process group: on
        # two H200s destroy_process_group hung with them alive.
        on_device, with_graphs, lowering = rt.device, rt.graphs is not None, rt.lowering
        interpreted = rt.triton_kernels and on_device.type == "cpu"
        rt.close()
    except runtime_errors() as e:
        if launch.rank == 0 and isinstance(e, GenerationStopped):
            print_tokens(prompts, e.tokens)
        launch.fail(e)
    rank = launch.rank
    if rank == 0:
        how = "greedy" if temperature == 0 else f"temperature {temperature}, top-k {top_k}, top-p {top_p}, seed {seed}"
        console.print(run_header(out, info, on_device, with_graphs, interpreted, lowering)
                      + f"; {len(prompts)} prompt(s), {max_new_tokens} new token(s) each, {how}", soft_wrap=True)
        print_tokens(prompts, result.tokens, load_s, result.prefill_s, result.decode_s)
    if dist.is_initialized():
        dist.destroy_process_group()
