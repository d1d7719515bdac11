"""The ``k3compile`` command line.

Commands (run ``k3compile COMMAND --help`` for the options of each):

* ``init-model``: write an HF-style model directory with seeded random weights.
* ``presets``: list the built-in model configurations and their sizes.
* ``generate``: greedy generation with the reference model on the CPU.

Errors a user can fix (a bad preset name, an invalid config.json, an existing output
directory, a token id outside the vocabulary...) print one line on stderr and exit with
status 2; no traceback.
"""

from __future__ import annotations

import enum
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Annotated, NoReturn, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

import k3compile
from k3compile.config import PRESETS, ConfigError, K3Config, get_preset, load_config

#: Exit status of every error the user can fix (the same as click's usage errors).
USAGE_ERROR = 2
DEFAULT_PROMPT = "1 2 3 4 5 6 7 8"

console = Console(highlight=False)
err_console = Console(stderr=True, highlight=False)

app = typer.Typer(
    name="k3compile",
    help=(
        "k3compile: a compiler for serving the Kimi K3 model.\n\n"
        "Try it on a small model with random weights:\n"
        "  k3compile presets                                 [dim]# list configurations[/]\n"
        "  k3compile init-model ./tiny-model --preset tiny   [dim]# write a model dir[/]\n"
        "  k3compile generate ./tiny-model --prompt \"1 2 3\"  [dim]# generate tokens[/]\n\n"
        "Run 'k3compile COMMAND --help' for the options of a command."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
    context_settings={"help_option_names": ["-h", "--help"]},
)


class UserError(Exception):
    """A problem with the command's inputs: reported as one line on stderr, exit status 2."""


def _fail(message: str) -> NoReturn:
    err_console.print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True)
    raise typer.Exit(USAGE_ERROR)


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------

_SIZE_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}


def parse_size(text: str) -> int:
    """``"2GB"`` -> 2_000_000_000, ``"512MiB"`` -> 536_870_912, ``"1000"`` -> 1000 bytes.

    Decimal units (KB, MB, GB, TB) are powers of 1000 as in ``transformers``'
    ``max_shard_size``; binary units (KiB, MiB, GiB, TiB, or K, M, G, T) powers of 1024.
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else None
    if not m or unit not in _SIZE_UNITS:
        raise UserError(f"--shard-size: cannot read {text!r} as a size; write e.g. 2GB, 500MB, 1GiB or 1000000")
    value = int(float(m.group(1)) * _SIZE_UNITS[unit])
    if value < 1:
        raise UserError(f"--shard-size must be at least 1 byte, got {text!r}")
    return value


def human_count(n: int) -> str:
    """1_160_256 -> '1.16M', 2_779_484_476_000 -> '2.78T'."""
    for div, suffix in ((10**12, "T"), (10**9, "B"), (10**6, "M"), (10**3, "K")):
        if n >= div:
            return f"{n / div:.3g}{suffix}" if n / div < 1000 else f"{n / div:.0f}{suffix}"
    return str(n)


def human_bytes(n: int) -> str:
    for div, suffix in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if n >= div:
            return f"{n / div:.1f} {suffix}"
    return f"{n} B"


def count_parameters(cfg: K3Config) -> int:
    """Parameters of the full (TP1) model, counted on the ``meta`` device: no memory used."""
    import torch

    from k3compile.model import K3ForCausalLM

    with torch.device("meta"):
        model = K3ForCausalLM(cfg)
    return sum(p.numel() for p in model.parameters())


def layer_kinds_summary(cfg: K3Config) -> str:
    """'5 KDA + 2 MLA (K K M K K M M)' with the pattern elided for deep models."""
    kinds = cfg.layer_kinds
    n_kda, n_mla = kinds.count("kda"), kinds.count("mla")
    pattern = "".join("M" if k == "mla" else "K" for k in kinds)
    if len(pattern) > 24:
        pattern = pattern[:12] + "..." + pattern[-4:]
    return f"{n_kda} KDA + {n_mla} MLA  (K=KDA, M=MLA: {pattern})"


def read_config_file(path: Path) -> K3Config:
    """Read a config.json (``kimi_k3`` or ``kimi_linear``) exactly as :func:`load_config` does.

    ``load_config`` reads ``DIR/config.json``, so the file is copied into a temporary
    directory and read from there; the temporary path in any error is replaced by ``path``.
    A model directory is accepted as well.
    """
    if path.is_dir():
        return load_config(path)
    if not path.is_file():
        raise UserError(f"--config: {path} does not exist")
    with tempfile.TemporaryDirectory(prefix="k3compile-config-") as tmp:
        copy = Path(tmp) / "config.json"
        shutil.copyfile(path, copy)
        try:
            return load_config(tmp)
        except ConfigError as e:
            raise ConfigError(str(e).replace(str(copy), str(path)).replace(tmp, str(path.parent))) from None


def parse_prompt(text: str, where: str, vocab_size: int) -> list[int]:
    """``"1 2 3"`` -> [1, 2, 3]; every id must be an integer in [0, vocab_size)."""
    words = text.split()
    if not words:
        raise UserError(f"{where} is empty; write token ids separated by spaces, e.g. \"1 2 3\"")
    ids = []
    for w in words:
        try:
            tok = int(w)
        except ValueError:
            raise UserError(f"{where}: {w!r} is not a token id (an integer in [0, {vocab_size}))") from None
        if not 0 <= tok < vocab_size:
            raise UserError(f"{where}: token id {tok} is outside the vocabulary [0, {vocab_size})")
        ids.append(tok)
    return ids


def read_prompts(prompts: list[str] | None, prompt_file: Path | None, vocab_size: int) -> list[list[int]]:
    if prompts and prompt_file is not None:
        raise UserError("give prompts with --prompt or with --prompt-file, not both")
    if prompt_file is not None:
        if not prompt_file.is_file():
            raise UserError(f"--prompt-file: {prompt_file} does not exist")
        lines = prompt_file.read_text().splitlines()
        while lines and not lines[-1].strip():  # trailing blank lines end the file
            lines.pop()
        if not lines:
            raise UserError(f"--prompt-file: {prompt_file} holds no prompts (one prompt per line)")
        return [parse_prompt(line, f"{prompt_file} line {i + 1}", vocab_size) for i, line in enumerate(lines)]
    if not prompts:
        prompts = [DEFAULT_PROMPT]
    return [parse_prompt(p, f"--prompt #{i + 1}", vocab_size) for i, p in enumerate(prompts)]


# ---------------------------------------------------------------------------
# Commands
# ---------------------------------------------------------------------------


def _version(value: bool) -> None:
    if value:
        console.print(f"k3compile {k3compile.__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit. Example: k3compile --version"),
    ] = False,
) -> None:
    """k3compile: a compiler for serving the Kimi K3 model."""


class ExpertFormat(str, enum.Enum):
    bf16 = "bf16"
    mxfp4 = "mxfp4"


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
    experts: Annotated[
        ExpertFormat,
        typer.Option(
            help="Storage format of the routed-expert weights: bf16, or mxfp4 (4-bit, as the released K3 "
            "checkpoint). Example: --experts mxfp4",
        ),
    ] = ExpertFormat.bf16,
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
    """
    from k3compile.checkpoint.generate import GenerateOptions, generate_model_dir

    try:
        if (preset is None) == (config is None):
            raise UserError("give exactly one of --preset NAME or --config FILE"
                            + (" (got both)" if preset is not None else ""))
        shard_bytes = parse_size(shard_size)
        if out_dir.exists():
            raise UserError(f"{out_dir} already exists; choose a new directory")
        cfg = get_preset(preset) if preset is not None else read_config_file(config)
        options = GenerateOptions(experts=experts.value, seed=seed, shard_bytes=shard_bytes)
        start = time.perf_counter()
        generate_model_dir(cfg, out_dir, options)
        elapsed = time.perf_counter() - start
    except (UserError, ConfigError, FileExistsError) as e:
        _fail(str(e))

    files = sorted(p for p in out_dir.iterdir() if p.is_file())
    total = sum(p.stat().st_size for p in files)
    source = f"preset {preset}" if preset is not None else f"config {config}"
    layout = "kimi_k3" if cfg.checkpoint_prefix else "kimi_linear"
    params = count_parameters(cfg)

    console.print(
        f"[bold green]Wrote[/] {escape(str(out_dir))}  ({escape(source)}, {layout} layout, experts {experts.value}, seed {seed})",
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
    summary.add_row("time", f"{elapsed:.1f} s")
    console.print(summary)


@app.command("presets")
def presets() -> None:
    """List the built-in model configurations (for init-model --preset).

    Parameter counts are of the full model, computed on the meta device (no memory is allocated).

    Example: k3compile presets
    """
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


class DType(str, enum.Enum):
    float32 = "float32"
    bfloat16 = "bfloat16"


@app.command("generate")
def generate(
    model_dir: Annotated[
        Path,
        typer.Argument(help="A model directory (config.json + safetensors). Example: ./tiny-model", show_default=False),
    ],
    prompt: Annotated[
        Optional[list[str]],
        typer.Option(
            "--prompt",
            help="Token ids separated by spaces; repeat for several prompts, generated as one batch. "
            f"Default: \"{DEFAULT_PROMPT}\". Example: --prompt \"1 2 3\" --prompt \"4 5\"",
            show_default=False,
        ),
    ] = None,
    prompt_file: Annotated[
        Optional[Path],
        typer.Option(
            help="A text file with one prompt (token ids separated by spaces) per line. Example: --prompt-file prompts.txt",
            show_default=False,
        ),
    ] = None,
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
    from k3compile.checkpoint.loader import CheckpointError
    from k3compile.reference import ReferenceEngine, RequestError, load_reference

    try:
        if not model_dir.is_dir():
            raise UserError(f"{model_dir} is not a directory (create one with 'k3compile init-model')")
        cfg = load_config(model_dir)
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

        # The loop of ReferenceEngine.generate, timed step by step.
        start = time.perf_counter()
        ids, logits = engine.prefill(prompts)
        prefill_s = time.perf_counter() - start
        out: list[list[int]] = [[] for _ in prompts]
        start = time.perf_counter()
        for step in range(max_new_tokens):
            next_tokens = logits.argmax(-1).tolist()
            for o, t in zip(out, next_tokens):
                o.append(t)
            if step + 1 < max_new_tokens:
                logits = engine.decode(ids, next_tokens)
        decode_s = time.perf_counter() - start
        for s in ids:
            engine.release(s)
    except (UserError, ConfigError, CheckpointError, RequestError) as e:
        _fail(str(e))

    console.print(
        f"[bold]{escape(str(model_dir))}[/]: {cfg.num_hidden_layers} layers, vocab {cfg.vocab_size}, {dtype.value}, "
        f"{len(prompts)} prompt(s), {max_new_tokens} new token(s) each",
        soft_wrap=True,
    )
    for i, (p, new) in enumerate(zip(prompts, out)):
        console.print(f"prompt {i} ({len(p)} tokens): {' '.join(map(str, p))}", soft_wrap=True)
        console.print(f"  new tokens: {' '.join(map(str, new))}", soft_wrap=True)
    decode_steps = max_new_tokens - 1
    total_prompt = sum(map(len, prompts))
    timing = f"timing: load {load_s * 1e3:.0f} ms, prefill {prefill_s * 1e3:.1f} ms ({total_prompt} tokens)"
    if decode_steps:
        timing += f", decode {decode_s * 1e3 / decode_steps:.1f} ms/token ({decode_steps} steps, batch {len(prompts)})"
    console.print(timing, soft_wrap=True)


def main() -> None:
    """Console-script entry point (``k3compile``)."""
    app(prog_name="k3compile")


if __name__ == "__main__":
    main()
