"""Commands that compile: ``optimize`` (a model directory into an artifact) and ``plan``
(per-GPU memory under a parallel plan, pass by pass, from a config alone)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from k3compile.cli.app import UserError, app, console, fail
from k3compile.cli.options import (
    KV_CACHE_DTYPE_HELP,
    InductorOption,
    at_least_one,
    check_dtype,
    check_kv_cache_choice,
    check_plan,
    check_target,
    choice,
    lowering_choice,
    pass_selection,
    read_config,
)
from k3compile.cli.render import Steps, capture_text, config_label, dtype_name, human_bytes, plan_table, print_passes
from k3compile.config import PRESETS, ConfigError

# registry: the --dcp-merge and --dcp-prefill options' pass config (choices from the pass
# registry, not from importing the pass).
_DCP_PASS = "split_mla_context"


def _dcp_choices(option: str) -> tuple[str, ...]:
    from k3compile.pipeline import config_choices

    return config_choices(_DCP_PASS, option)


def _dcp_config(merge: str, prefill: str) -> dict[str, dict[str, str]]:
    """``CompileOptions.pass_configs`` for ``--dcp-merge merge --dcp-prefill prefill``."""
    return {_DCP_PASS: {"merge": merge, "prefill": prefill}}


@app.command("optimize")
def optimize_command(
    model_dir: Annotated[
        Path,
        typer.Argument(
            help="A model directory (config.json + safetensors), e.g. written by init-model. Example: ./tiny-model",
            show_default=False,
        ),
    ],
    out: Annotated[
        Path,
        typer.Option(
            "--out", "-o",
            help="Artifact directory to write (must not exist, unless --overwrite). Example: -o ./tiny.k3c",
            show_default=False,
        ),
    ],
    tp: Annotated[
        int,
        typer.Option(help="Tensor-parallel degree: the artifact runs on this many processes (GPUs). Example: --tp 8"),
    ] = 1,
    dcp: Annotated[
        int,
        typer.Option(
            help="Decode context parallelism: split the MLA history by position over groups of this many "
            "TP ranks (a divisor of --tp); runs pass split_mla_context. Example: --dcp 8",
        ),
    ] = 1,
    dcp_interleave: Annotated[
        int, typer.Option(help="Consecutive positions each DCP rank owns in turn. Example: --dcp-interleave 1")
    ] = 1,
    dcp_merge: Annotated[
        str,
        typer.Option(
            help="How DCP ranks merge their partial attentions: all-to-all (one collective) or reduce-scatter "
            "(all-gather of LSEs, then a reduce-scatter of rescaled outputs). Example: --dcp-merge all-to-all",
        ),
    ] = "all-to-all",
    dcp_prefill: Annotated[
        str,
        typer.Option(
            help="How a DCP prefill attends: gathered (the group's history all-gathered, then attention on the "
            "rank's own heads as without DCP) or partial (each rank over its own positions, merged like "
            "decode). Example: --dcp-prefill gathered",
        ),
    ] = "gathered",
    target: Annotated[
        str,
        typer.Option(
            help="Hardware to compile for: cpu, h200, mi355x or mi300x (picks the default passes). Example: --target h200",
        ),
    ] = "cpu",
    dtype: Annotated[
        str,
        typer.Option(
            help="Weight and activation dtype: bfloat16 or float32 (KDA states stay fp32). Example: --dtype float32",
        ),
    ] = "bfloat16",
    kv_cache_dtype: Annotated[
        str, typer.Option(help=KV_CACHE_DTYPE_HELP + " Example: --kv-cache-dtype fp8")
    ] = "auto",
    inductor: InductorOption = None,
    block_size: Annotated[
        Optional[int],
        typer.Option(
            help="Tokens per MLA cache block (fixed per artifact); default: the target's (h200: 64, so that "
            "the fast MLA decode kernel loads its KV tiles by TMA; others: 16). Example: --block-size 16",
            show_default=False,
        ),
    ] = None,
    enable: Annotated[
        Optional[list[str]],
        typer.Option(
            help="Run a pass the target does not run by default; repeat, or separate names with commas. "
            "Example: --enable remove_noops",
            show_default=False,
        ),
    ] = None,
    disable: Annotated[
        Optional[list[str]],
        typer.Option(
            help="Skip a pass of the target's default list; repeat, or separate names with commas. "
            "Example: --disable remove_noops",
            show_default=False,
        ),
    ] = None,
    validate: Annotated[
        bool,
        typer.Option(
            "--validate",
            help="After every pass that changes a graph, run the graph before and after on the same random "
            "inputs and fail if the outputs differ (at --tp N on N local gloo processes; meant for tiny models). Example: --validate",
        ),
    ] = False,
    overwrite: Annotated[
        bool,
        typer.Option("--overwrite", help="Replace OUT if it is an existing artifact. Example: --overwrite"),
    ] = False,
    hash_weights: Annotated[
        bool,
        typer.Option("--hash-weights", help="Also record each checkpoint shard's full sha256 (reads the whole "
                     "checkpoint once), so that 'run --verify-weights' can check every byte. Without it the artifact "
                     "records each shard's size, header hash and a hash of sampled content, checked at every load. "
                     "Example: --hash-weights"),
    ] = False,
) -> None:
    """Compile a model directory into an artifact that 'k3compile run' loads.

    Steps: capture the model as one graph per phase (decode, prefill) on the meta device (no weights are loaded), check the checkpoint's tensor names and shapes, run the target's passes over each graph, and write OUT (graphs, sharding plan per rank, manifest). The weights stay in MODEL_DIR: the artifact refers to it, so keep it in place. Nothing is written if anything fails.

    Passes: the target's default list, changed with --enable/--disable (a wrong name lists the known ones); 'k3compile inspect OUT' shows what each pass did.

    Example: k3compile optimize ./tiny-model -o ./tiny.k3c --dtype float32 --validate
    """
    from k3compile.artifact import ArtifactError
    from k3compile.artifact_writer import check_output_dir
    from k3compile.checkpoint.loader import CheckpointError, load_checkpoint_config
    from k3compile.compiler import CompileOptions, optimize
    from k3compile.pipeline import PassError
    from k3compile.sharding import ShardingError

    step: list[str] = []
    try:
        check_plan(tp, dcp, dcp_interleave)
        at_least_one(block_size=block_size)
        choice(dcp_merge, _dcp_choices("merge"), "--dcp-merge", "merge")
        choice(dcp_prefill, _dcp_choices("prefill"), "--dcp-prefill", "prefill")
        check_dtype(dtype)
        check_kv_cache_choice(kv_cache_dtype)
        check_target(target)
        enabled, disabled = pass_selection(enable, disable)
        if not model_dir.is_dir():
            raise UserError(f"{model_dir} is not a directory (create one with 'k3compile init-model')")
        if (out.exists() or out.is_symlink()) and not overwrite:
            raise UserError(f"{out} already exists; pass --overwrite to replace it, or choose a new directory")
        check_output_dir(out, overwrite)
        cfg = load_checkpoint_config(model_dir)
        check_plan(tp, cfg=cfg)
        try:
            options = CompileOptions(
                tp=tp, dcp=dcp, dcp_interleave=dcp_interleave, target=target, dtype=dtype,
                kv_cache_dtype=kv_cache_dtype, pass_configs=_dcp_config(dcp_merge, dcp_prefill),
                block_size=block_size, enable=enabled, disable=disabled, validate=validate,
                lowering=lowering_choice(inductor) or "auto", hash_weights=hash_weights,
            )
        except ValueError as e:
            raise UserError(str(e)) from None

        console.print(
            f"[bold]Compiling[/] {escape(str(model_dir))} ({config_label(cfg)}, {cfg.num_hidden_layers} layers) "
            f"for target {target}: tp {tp}{f', dcp {dcp}' if dcp > 1 else ''}, {dtype}, "
            f"{dtype_name(options.mla_cache_dtype)} MLA cache, block size {options.block_size}"
            + (", validating every pass" if validate else ""),
            soft_wrap=True,
        )
        start = time.perf_counter()

        def on_step(label: str) -> None:
            step[:] = [label]
            steps(label)

        with Steps() as steps:
            result = optimize(model_dir, out, options, overwrite=overwrite, on_step=on_step)
        elapsed = time.perf_counter() - start
    except UserError as e:
        fail(str(e))
    except (ConfigError, CheckpointError, ArtifactError, ShardingError, PassError) as e:
        fail(f"{step[0]}: {e}" if step else str(e))

    from k3compile.records.text import fmt_seconds

    console.print()
    print_passes([r.summary() for r in result.pipeline.records], "Passes")
    console.print()
    files = [p for p in result.out_dir.rglob("*") if p.is_file()]
    size = sum(p.stat().st_size for p in files)
    console.print(f"[bold]capture[/]   {capture_text(result.captured.stats)}", soft_wrap=True)
    console.print(
        f"[bold]artifact[/]  {escape(str(result.out_dir))}  ({len(files)} files, {human_bytes(size)}; "
        f"weights stay in {escape(str(model_dir.resolve()))})",
        soft_wrap=True,
    )
    console.print(f"[bold]total[/]     {fmt_seconds(elapsed)}", soft_wrap=True)
    run_cmd = f"torchrun --nproc-per-node {tp} -m k3compile run {out}" if tp > 1 else f"k3compile run {out}"
    console.print(f"Next: k3compile inspect {escape(str(out))}   |   {escape(run_cmd)} --prompt \"1 2 3\"", soft_wrap=True)


@app.command("plan")
def plan_command(
    model: Annotated[
        Optional[Path],
        typer.Argument(
            help="A model directory or its config.json (weights are not needed). Example: ./k3-config",
            show_default=False,
        ),
    ] = None,
    preset: Annotated[
        Optional[str],
        typer.Option(
            "--preset", "-p",
            help=f"A built-in configuration instead of MODEL: {', '.join(PRESETS)}. Example: --preset k3",
            show_default=False,
        ),
    ] = None,
    tp: Annotated[int, typer.Option(help="Tensor-parallel degree (GPUs). Example: --tp 8")] = 8,
    dcp: Annotated[
        int,
        typer.Option(help="Decode context parallelism: the MLA history split by position over this many ranks (a divisor of --tp). Example: --dcp 8"),
    ] = 1,
    dcp_interleave: Annotated[
        int, typer.Option(help="Consecutive positions each DCP rank owns in turn. Example: --dcp-interleave 1")
    ] = 1,
    context: Annotated[
        int, typer.Option(help="Tokens per sequence the caches hold. Example: --context 131072")
    ] = 131072,
    sequences: Annotated[
        int, typer.Option(help="Sequences resident at once (cache slots). Example: --sequences 16")
    ] = 1,
    target: Annotated[
        str,
        typer.Option(help="Hardware: cpu, h200, mi355x or mi300x (picks the passes and the memory per GPU). Example: --target h200"),
    ] = "mi355x",
    dtype: Annotated[
        str, typer.Option(help="Weight and activation dtype: bfloat16 or float32. Example: --dtype bfloat16")
    ] = "bfloat16",
    kv_cache_dtype: Annotated[
        str, typer.Option(help=KV_CACHE_DTYPE_HELP + " Example: --kv-cache-dtype fp8")
    ] = "auto",
    block_size: Annotated[
        Optional[int],
        typer.Option(help="Tokens per MLA cache block; default: the target's (h200: 64, others: 16). "
                     "Example: --block-size 64", show_default=False),
    ] = None,
    enable: Annotated[
        Optional[list[str]],
        typer.Option(help="Add a pass to the target's list. Example: --enable remove_noops", show_default=False),
    ] = None,
    disable: Annotated[
        Optional[list[str]],
        typer.Option(help="Drop a pass of the target's list. Example: --disable dedup_replicated_linear", show_default=False),
    ] = None,
) -> None:
    """Per-GPU memory of a model under a parallel plan, with and without each pass that changes it.

    Captures the decode graph on the meta device (no weights are read: a config is enough; the full K3 takes about half a minute), runs the target's passes one at a time and reports, per GPU, the weights by kind as the runtime holds them (mxfp4 experts dequantised to the model dtype), the MLA latent KV cache and the KDA state for SEQUENCES x CONTEXT tokens, before the passes and after each pass that changed memory.

    Example: k3compile plan --preset k3 --tp 8 --context 131072 --target mi355x
    """
    from k3compile.batch import resolve_kv_cache_dtype
    from k3compile.compiler import DTYPES
    from k3compile.memory import MemoryOptions, plan_memory
    from k3compile.targets import get_target
    from k3compile.pipeline import PassError

    try:
        cfg = read_config(preset, model, "MODEL", "MODEL (a model directory or config.json) or --preset NAME")
        check_plan(tp, dcp, dcp_interleave, cfg)
        at_least_one(context=context, sequences=sequences, block_size=block_size)
        check_dtype(dtype)
        check_kv_cache_choice(kv_cache_dtype)
        check_target(target)
        enabled, disabled = pass_selection(enable, disable)
        try:
            kv_dtype = resolve_kv_cache_dtype(kv_cache_dtype, DTYPES[dtype], get_target(target))
        except ValueError as e:
            raise UserError(str(e)) from None
        options = MemoryOptions(
            tp=tp, dcp=dcp, dcp_interleave=dcp_interleave, target=target, dtype=DTYPES[dtype], context=context,
            sequences=sequences, block_size=block_size, enable=enabled, disable=disabled, kv_cache_dtype=kv_dtype,
        )
        with Steps() as steps:
            result = plan_memory(cfg, options, on_step=steps)
    except (UserError, ConfigError, PassError) as e:
        fail(str(e))
    console.print(plan_table(result))
    final, hbm = result.final.total, result.hbm_bytes
    experts = result.routed_expert_format()
    if experts:
        console.print(f"routed experts held as {experts}", soft_wrap=True)
    if hbm:
        verdict = (f"fits, leaving {human_bytes(hbm - final)} for more context or sequences" if final <= hbm
                   else "does not fit")
        console.print(f"total {human_bytes(final)} per GPU {verdict} in the {target}'s {human_bytes(hbm)}", soft_wrap=True)
    if result.unchanged:
        console.print(f"passes that ran without changing memory: {', '.join(result.unchanged)}", soft_wrap=True)
