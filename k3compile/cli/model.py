"""Commands on model directories: ``init-model``, ``presets``, ``generate``."""

from __future__ import annotations

import enum
import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape
from rich.table import Table

from k3compile.cli.app import UserError, app, console, fail
from k3compile.cli.options import PromptFileOption, PromptOption, parse_size, read_config, read_prompts
from k3compile.cli.render import human_bytes, human_count, layer_kinds_summary, print_tokens
from k3compile.config import PRESETS, ConfigError


class ExpertFormat(str, enum.Enum):
    bf16 = "bf16"
    mxfp4 = "mxfp4"


class DType(str, enum.Enum):
    float32 = "float32"
    bfloat16 = "bfloat16"


@app.command("init-model")
def init_model(
    out_dir: Annotated[
        Path,
        typer.Argument(
            help="Directory to create (it must not exist yet). Example: ./tiny-model",
            show_default=False,
        ),
    ],
    preset: Annotated[
        Optional[str],
        typer.Option(
            "--preset", "-p",
            help=f"Built-in configuration: {', '.join(PRESETS)} (see 'k3compile presets'). Example: --preset tiny",
            show_default=False,
        ),
    ] = None,
    config: Annotated[
        Optional[Path],
        typer.Option(
            "--config", "-c",
            help="A config.json (model_type kimi_k3 or kimi_linear), or a model directory holding one, "
            "to build the model from. "
            "Example: --config ./my-model/config.json",
            show_default=False,
        ),
    ] = None,
    layers: Annotated[
        Optional[int],
        typer.Option(
            "--layers",
            help="Number of decoder layers, laid out by the model's own rule (MLA every 4th layer and "
            "the last one for K3; the rest KDA). Default: the preset's or config's. Example: --layers 4",
            show_default=False,
        ),
    ] = None,
    experts: Annotated[
        Optional[ExpertFormat],
        typer.Option(
            help="Storage format of the routed-expert weights: bf16, or mxfp4 (4-bit, as the released K3 "
            "checkpoint). Default: the preset's or config's (mxfp4 for k3 and k3-tp8-rank). "
            "Either way the expert weights are the same values. Example: --experts mxfp4",
            show_default=False,
        ),
    ] = None,
    seed: Annotated[
        int,
        typer.Option(help="Random seed: the same seed gives the same weights. Example: --seed 7"),
    ] = 0,
    shard_size: Annotated[
        str,
        typer.Option(
            help="Largest safetensors shard: KB/MB/GB are powers of 1000, KiB/MiB/GiB of 1024. "
            "Example: --shard-size 500MB",
        ),
    ] = "2GB",
) -> None:
    """Write an HF-style model directory with seeded random weights.

    Writes config.json, model.safetensors.index.json and model-0000N-of-0000M.safetensors shards holding the tensor names and shapes of the real checkpoint. Give exactly one of --preset or --config.

    Example: k3compile init-model ./tiny-model --preset tiny --experts mxfp4

    One TP8 rank's real shapes, 4 layers (about 8 GB): k3compile init-model ./rank-slice --preset k3-tp8-rank --layers 4
    """
    from k3compile.checkpoint.generate import GenerateOptions, GenerateStats, NotEnoughSpace, generate_model_dir
    from k3compile.config import with_layers
    from k3compile.model import count_parameters

    try:
        cfg = read_config(preset, config, "--config", "--preset NAME or --config FILE")
        shard_bytes = parse_size(shard_size)
        if out_dir.exists():
            raise UserError(f"{out_dir} already exists; choose a new directory")
        if layers is not None:
            if layers < 1:
                raise UserError(f"--layers must be at least 1, got {layers}")
            cfg = with_layers(cfg, layers)
        fmt = experts.value if experts is not None else cfg.expert_format
        stats = GenerateStats()
        start = time.perf_counter()
        generate_model_dir(cfg, out_dir, GenerateOptions(experts=fmt, seed=seed, shard_bytes=shard_bytes), stats=stats)
        elapsed = time.perf_counter() - start
    except (UserError, ConfigError, FileExistsError, NotEnoughSpace) as e:
        fail(str(e))

    files = sorted(p for p in out_dir.iterdir() if p.is_file())
    total = sum(p.stat().st_size for p in files)
    source = f"preset {preset}" if preset is not None else f"config {config}"
    layout = "kimi_k3" if cfg.checkpoint_prefix else "kimi_linear"
    params = count_parameters(cfg)

    console.print(
        f"[bold green]Wrote[/] {escape(str(out_dir))}  ({escape(source)}, {layout} layout, experts {fmt}, seed {seed})",
        soft_wrap=True,
    )
    summary = Table(show_header=False, box=None, pad_edge=False)
    summary.add_column(style="bold")
    summary.add_column()
    summary.add_row("layers", str(cfg.num_hidden_layers))
    summary.add_row("kinds", layer_kinds_summary(cfg))
    summary.add_row("parameters", f"{params:,} ({human_count(params)})")
    shards = [p.name for p in files if p.suffix == ".safetensors"]
    others = [p.name for p in files if p.suffix != ".safetensors"]
    shard_text = shards[0] if len(shards) == 1 else f"{len(shards)} shards {shards[0]} .. {shards[-1]}"
    summary.add_row("files", f"{len(files)}: " + ", ".join(others + [shard_text]))
    summary.add_row("total bytes", f"{total:,} ({human_bytes(total)})")
    summary.add_row("time", f"{elapsed:.1f} s (drawing values {stats.draw_s:.1f} s, writing files {stats.write_s:.1f} s)")
    console.print(summary)


@app.command("presets")
def presets() -> None:
    """List the built-in model configurations (for init-model --preset).

    Parameter counts are of the full model, computed on the meta device (no memory is allocated).

    Example: k3compile presets
    """
    from k3compile.model import count_parameters

    table = Table(title="k3compile presets")
    table.add_column("name", style="bold", no_wrap=True)
    table.add_column("layers\n(KDA+MLA)", justify="right", no_wrap=True)
    table.add_column("hidden", justify="right", no_wrap=True)
    table.add_column("MLA\nheads", justify="right", no_wrap=True)
    table.add_column("KDA\nheads", justify="right", no_wrap=True)
    table.add_column("experts\n(active)", justify="right", no_wrap=True)
    table.add_column("parameters", justify="right", no_wrap=True)
    for name, cfg in PRESETS.items():
        kinds = cfg.layer_kinds
        table.add_row(
            name,
            f"{cfg.num_hidden_layers} ({kinds.count('kda')}+{kinds.count('mla')})",
            str(cfg.hidden_size),
            str(cfg.num_attention_heads),
            str(cfg.linear_attn.num_heads),
            f"{cfg.num_experts} ({cfg.num_experts_per_token})",
            human_count(count_parameters(cfg)),
        )
    console.print(table)
    console.print("Use one: k3compile init-model ./tiny-model --preset tiny", soft_wrap=True)


@app.command("generate")
def generate(
    model_dir: Annotated[
        Path,
        typer.Argument(help="A model directory (config.json + safetensors). Example: ./tiny-model", show_default=False),
    ],
    prompt: PromptOption = None,
    prompt_file: PromptFileOption = None,
    max_new_tokens: Annotated[
        int,
        typer.Option(min=1, help="Tokens to generate for every prompt. Example: --max-new-tokens 4"),
    ] = 16,
    dtype: Annotated[
        DType,
        typer.Option(help="Weight and activation dtype (KDA states stay fp32). Example: --dtype bfloat16"),
    ] = DType.float32,
    threads: Annotated[
        Optional[int],
        typer.Option(
            min=1,
            help="CPU threads for torch (default: torch's choice). Example: --threads 4",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Generate tokens greedily with the reference model on the CPU.

    Prompts are token ids (there is no tokenizer): "1 2 3" is three tokens. All prompts are prefilled in one packed step, then decoded together, one token per step. Prints the new token ids of each prompt and the timing (the first step includes one-time warm-up).

    Example: k3compile generate ./tiny-model --prompt "1 2 3" --prompt "7 8" --max-new-tokens 4
    """
    import torch

    from k3compile.batch import CacheShape
    from k3compile.checkpoint.loader import CheckpointError, load_checkpoint_config
    from k3compile.reference import ReferenceEngine, RequestError, load_reference
    from k3compile.sequences import generate_tokens

    try:
        if not model_dir.is_dir():
            raise UserError(f"{model_dir} is not a directory (create one with 'k3compile init-model')")
        cfg = load_checkpoint_config(model_dir)
        prompts = read_prompts(prompt, prompt_file, cfg.vocab_size)
        if threads is not None:
            torch.set_num_threads(threads)
        block_size = 16
        num_blocks = sum(-(-(len(p) + max_new_tokens) // block_size) for p in prompts)

        start = time.perf_counter()
        import torch._dynamo  # noqa: F401  (torch's custom ops import it on first call: count it as load time)

        model = load_reference(model_dir, dtype=getattr(torch, dtype.value))
        engine = ReferenceEngine(model, CacheShape(num_slots=len(prompts), num_blocks=num_blocks, block_size=block_size))
        load_s = time.perf_counter() - start

        result = generate_tokens(engine, prompts, max_new_tokens, lambda logits: logits.argmax(-1).tolist())
    except (UserError, ConfigError, CheckpointError, RequestError) as e:
        fail(str(e))

    console.print(
        f"[bold]{escape(str(model_dir))}[/]: {cfg.num_hidden_layers} layers, vocab {cfg.vocab_size}, {dtype.value}, "
        f"{len(prompts)} prompt(s), {max_new_tokens} new token(s) each",
        soft_wrap=True,
    )
    print_tokens(prompts, result.tokens, load_s, result.prefill_s, result.decode_s)
