"""The ``k3compile`` command line.

Commands (run ``k3compile COMMAND --help`` for the options of each):

* ``init-model``: write an HF-style model directory with seeded random weights.
* ``presets``: list the built-in model configurations and their sizes.
* ``generate``: greedy generation with the reference model on the CPU.
* ``optimize``: compile a model directory into an artifact (capture, passes, write).
* ``plan``: per-GPU memory under a parallel plan, with and without each pass that changes it.
* ``inspect``: verify an artifact and show how it was made and what each pass did.
* ``run``: load an artifact with the runtime and generate tokens (``torchrun`` for tp > 1).

The flow from a model to generated tokens::

    k3compile init-model ./tiny-model --preset tiny
    k3compile optimize ./tiny-model -o ./tiny.k3c --dtype float32
    k3compile inspect ./tiny.k3c
    k3compile run ./tiny.k3c --prompt "1 2 3"

Errors a user can fix (a bad preset name, an invalid config.json, an existing output
directory, a token id outside the vocabulary, an unknown pass, a tampered artifact...)
print one line on stderr and exit with status 2; no traceback.
"""

from __future__ import annotations

import enum
import json
import os
import re
import shutil
import tempfile
import time
import warnings
from pathlib import Path
from typing import Annotated, Any, NoReturn, Optional

import typer
from rich import box
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
        "The flow: init-model (or your own checkpoint) -> optimize -> inspect -> run.\n\n"
        "Try it on a small model with random weights:\n"
        "  k3compile presets                                 [dim]# list configurations[/]\n"
        "  k3compile init-model ./tiny-model --preset tiny   [dim]# write a model dir[/]\n"
        "  k3compile optimize ./tiny-model -o ./tiny.k3c     [dim]# compile an artifact[/]\n"
        "  k3compile inspect ./tiny.k3c                      [dim]# what each pass did[/]\n"
        "  k3compile run ./tiny.k3c --prompt \"1 2 3\"         [dim]# generate tokens[/]\n"
        "  k3compile generate ./tiny-model --prompt \"1 2 3\"  [dim]# eager reference model[/]\n\n"
        "An artifact compiled with --tp N runs on N processes: "
        "torchrun --nproc-per-node N -m k3compile run OUT\n\n"
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
    from k3compile.checkpoint.generate import GenerateOptions, GenerateStats, generate_model_dir
    from k3compile.config import with_layers

    try:
        if (preset is None) == (config is None):
            raise UserError("give exactly one of --preset NAME or --config FILE"
                            + (" (got both)" if preset is not None else ""))
        shard_bytes = parse_size(shard_size)
        if out_dir.exists():
            raise UserError(f"{out_dir} already exists; choose a new directory")
        cfg = get_preset(preset) if preset is not None else read_config_file(config)
        if layers is not None:
            if layers < 1:
                raise UserError(f"--layers must be at least 1, got {layers}")
            cfg = with_layers(cfg, layers)
        fmt = experts.value if experts is not None else cfg.expert_format
        options = GenerateOptions(experts=fmt, seed=seed, shard_bytes=shard_bytes)
        stats = GenerateStats()
        start = time.perf_counter()
        generate_model_dir(cfg, out_dir, options, stats=stats)
        elapsed = time.perf_counter() - start
    except (UserError, ConfigError, FileExistsError) as e:
        _fail(str(e))

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


#: Options shared by the commands that generate tokens (generate, run).
PromptOption = Annotated[
    Optional[list[str]],
    typer.Option(
        "--prompt",
        help="Token ids separated by spaces; repeat for several prompts, generated as one batch. "
        f"Default: \"{DEFAULT_PROMPT}\". Example: --prompt \"1 2 3\" --prompt \"4 5\"",
        show_default=False,
    ),
]
PromptFileOption = Annotated[
    Optional[Path],
    typer.Option(
        help="A text file with one prompt (token ids separated by spaces) per line. Example: --prompt-file prompts.txt",
        show_default=False,
    ),
]


class DType(str, enum.Enum):
    float32 = "float32"
    bfloat16 = "bfloat16"


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
        out, prefill_s, decode_s = result.tokens, result.prefill_s, result.decode_s
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


# ---------------------------------------------------------------------------
# Compile, inspect and run artifacts
# ---------------------------------------------------------------------------

#: Model dtypes ``optimize --dtype`` accepts (those of ``k3compile.compiler.DTYPES``).
COMPILE_DTYPES = ("bfloat16", "float32")  # keys of k3compile.compiler.DTYPES (imported lazily)


def _dcp_merges() -> tuple[str, ...]:
    from k3compile.passes.split_mla_context import MERGES

    return MERGES


def _target_names() -> tuple[str, ...]:
    from k3compile.targets import TARGETS

    return tuple(TARGETS)


def _pass_names() -> tuple[str, ...]:
    from k3compile.passes import ALL_PASSES

    return tuple(ALL_PASSES)


def _names(values: list[str] | None) -> tuple[str, ...]:
    """Repeated options, each possibly a comma-separated list: ('a', 'b,c') -> ('a', 'b', 'c')."""
    out: list[str] = []
    for v in values or ():
        out += [n.strip() for n in v.split(",") if n.strip()]
    return tuple(dict.fromkeys(out))


def _choice(value: str, choices: tuple[str, ...], option: str, what: str) -> str:
    if value not in choices:
        raise UserError(f"{option}: unknown {what} {value!r}; choose one of {', '.join(choices)}")
    return value


def _pass_selection(enable: list[str] | None, disable: list[str] | None) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The --enable/--disable pass names, checked against the known passes."""
    enabled, disabled = _names(enable), _names(disable)
    known = _pass_names()
    for option, names in (("--enable", enabled), ("--disable", disabled)):
        for name in names:
            if name not in known:
                raise UserError(f"{option}: unknown pass {name!r}; known passes: {', '.join(known)}")
    both = [n for n in enabled if n in disabled]
    if both:
        raise UserError(f"pass {both[0]!r} is both enabled and disabled")
    return enabled, disabled


def _check_tp(cfg: K3Config, tp: int) -> None:
    from k3compile.model.k3 import check_divisible

    if tp < 1:
        raise UserError(f"--tp must be at least 1, got {tp}")
    try:
        check_divisible(cfg, tp)
    except ValueError as e:
        raise UserError(f"--tp {tp}: {e} (the model's heads and widths split evenly over the ranks)") from None


def _check_dcp(tp: int, dcp: int, interleave: int) -> None:
    if dcp < 1 or tp % dcp:
        raise UserError(f"--dcp {dcp}: must be a divisor of --tp {tp} (DCP groups are made of TP ranks)")
    if interleave < 1:
        raise UserError(f"--dcp-interleave must be at least 1, got {interleave}")


def _is_artifact_dir(path: Path) -> bool:
    from k3compile.artifact import FORMAT_NAME, MANIFEST

    try:
        return json.loads((path / MANIFEST).read_bytes()).get("format") == FORMAT_NAME
    except (OSError, ValueError, AttributeError):
        return False


def _config_name(cfg: K3Config) -> str:
    preset = next((name for name, c in PRESETS.items() if c == cfg), None)
    return f"preset {preset}" if preset else "custom config"


def _fmt_seconds(s: float) -> str:
    return f"{s * 1e3:.0f} ms" if s < 1 else f"{s:.1f} s"


def _fmt_stat(v: Any) -> str:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return str(v)
    if isinstance(v, float) and not v.is_integer():
        return f"{v:.3g}"
    return human_count(int(v)) if abs(v) >= 100_000 else str(int(v))


def _fmt_validation(v: Any, full: bool = False) -> str:
    """'1.2e-07 ok' from a summary's ``validation`` entry; '-' when not validated."""
    if not isinstance(v, dict):
        return "-"
    err, tol = v.get("max_error"), v.get("tolerance")
    err_s = f"{err:.1e}" if isinstance(err, (int, float)) else str(err)
    verdict = "ok" if v.get("ok", True) else "FAIL"
    if full:
        tol_s = f"{tol:.1e}" if isinstance(tol, (int, float)) else str(tol)
        return f"max error {err_s} (tolerance {tol_s}) {verdict}"
    return f"{err_s} {verdict}"


def _key_stats(stats: dict[str, Any], limit: int = 3) -> list[tuple[str, Any]]:
    """The nonzero stats, the standard ones first (as the notebook summary table)."""
    from k3compile.pipeline import STANDARD_STATS

    items = [(k, v) for k, v in stats.items() if v not in (0, 0.0, None, False)]
    items.sort(key=lambda kv: STANDARD_STATS.index(kv[0]) if kv[0] in STANDARD_STATS else len(STANDARD_STATS))
    return items[:limit]


def pass_table(summaries: list[Any], title: str | None = None, width: int | None = None) -> Table:
    """A table of pass summaries (``PassRecord.summary()`` dicts, as stored in the manifest),
    one row per pass and phase. The stats get their own column when ``width`` (default:
    the console's) leaves room for it, else a dim line under the pass name."""
    rows: list[tuple[str, list[str], str]] = []
    for s in summaries:
        if not isinstance(s, dict):
            rows.append((str(s), ["?"] * 6, ""))
            continue
        seconds = s.get("seconds")
        stats = s.get("stats") or {}
        rows.append((
            str(s.get("pass", s.get("name", "?"))),
            [
                str(s.get("phase", "?")),
                "[yellow]yes[/]" if s.get("changed") else "no",
                str(s.get("matches", "-")),
                str(s.get("skipped", 0)),
                escape(_fmt_validation(s.get("validation"))),
                _fmt_seconds(seconds) if isinstance(seconds, (int, float)) else "-",
            ],
            ", ".join(f"{k}={_fmt_stat(v)}" for k, v in _key_stats(stats)),
        ))

    def build(stats_column: bool | None) -> Table:
        """stats_column: True a column, False under the pass name, None left out."""
        table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
        longest = max((len(name) for name, _, _ in rows), default=4)
        table.add_column("pass", no_wrap=stats_column is not False, min_width=longest)
        table.add_column("phase", no_wrap=True)
        table.add_column("changed", no_wrap=True)
        table.add_column("matches", justify="right", no_wrap=True)
        table.add_column("skipped", justify="right", no_wrap=True)
        table.add_column("max error", justify="right", no_wrap=True)
        table.add_column("time", justify="right", no_wrap=True)
        if stats_column:
            table.add_column("stats", overflow="fold")
        for name, cells, stats in rows:
            first = f"[bold]{escape(name)}[/]"
            if stats_column is False and stats:
                first += f"\n[dim]  {escape(stats)}[/]"
            table.add_row(first, *cells, *([escape(stats) or "-"] if stats_column else []))
        return table

    width = width or console.width
    fixed = console.measure(build(None), options=console.options.update_width(10_000)).maximum
    longest_stats = max((len(stats) for _, _, stats in rows), default=0)
    return build(fixed + 3 + min(max(longest_stats, 5), 32) <= width)


def _pass_totals(summaries: list[Any]) -> str:
    dicts = [s for s in summaries if isinstance(s, dict)]
    changed = sum(1 for s in dicts if s.get("changed"))
    failed = sum(1 for s in dicts if isinstance(s.get("validation"), dict) and not s["validation"].get("ok", True))
    validated = sum(1 for s in dicts if isinstance(s.get("validation"), dict))
    seconds = sum(s.get("seconds", 0) for s in dicts if isinstance(s.get("seconds", 0), (int, float)))
    text = f"{len(summaries)} pass run(s) (one per pass and phase), {changed} changed the graph"
    if validated:
        text += f", {validated} validated" + (f" ({failed} FAILED)" if failed else "")
    return text + f", {_fmt_seconds(seconds)} in passes"


_PASS_TABLE_NOTE = (
    "[dim]max error: translation validation of the pass (largest output difference / largest magnitude); "
    "'-': not validated (the pass changed nothing, or compiled without --validate)[/]"
)


def _print_passes(summaries: list[Any], title: str) -> None:
    if not summaries:
        console.print(f"{title}: none ran (the target has none, or all were disabled)", soft_wrap=True)
        return
    console.print(pass_table(summaries, title=title))
    console.print(_pass_totals(summaries), soft_wrap=True)
    console.print(_PASS_TABLE_NOTE, soft_wrap=True)


def _capture_text(stats: Any) -> str:
    seconds = getattr(stats, "seconds", {}) or {}
    nodes = getattr(stats, "nodes", {}) or {}
    parts = [f"{phase} {_fmt_seconds(seconds[phase])} ({nodes.get(phase, '?')} nodes)" for phase in seconds]
    peak = getattr(stats, "peak_rss_bytes", 0)
    return ", ".join(parts) + (f"; peak memory {human_bytes(peak)}" if peak else "")


class _Steps:
    """The steps of ``optimize`` as they happen: a spinner on the current step (on a
    terminal) and a line with its duration for every finished one."""

    def __init__(self, console: Console):
        self.console = console
        self.status = console.status("starting", spinner="dots")
        self.current: str | None = None
        self.started = 0.0

    def __enter__(self) -> _Steps:
        self.status.start()
        return self

    def __call__(self, label: str) -> None:
        self._finish()
        self.current, self.started = label, time.perf_counter()
        self.status.update(f"[bold]{escape(label)}[/] ...")

    def _finish(self) -> None:
        if self.current is not None:
            seconds = time.perf_counter() - self.started
            self.console.print(f"  [green]✓[/] {escape(self.current)}  [dim]{_fmt_seconds(seconds)}[/]", soft_wrap=True)
            self.current = None

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is None:
            self._finish()
        self.status.stop()


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
) -> None:
    """Compile a model directory into an artifact that 'k3compile run' loads.

    Steps: capture the model as one graph per phase (decode, prefill) on the meta device (no weights are loaded), check the checkpoint's tensor names and shapes, run the target's passes over each graph, and write OUT (graphs, sharding plan per rank, manifest). The weights stay in MODEL_DIR: the artifact refers to it, so keep it in place. Nothing is written if anything fails.

    Passes: the target's default list, changed with --enable/--disable (a wrong name lists the known ones); 'k3compile inspect OUT' shows what each pass did.

    Example: k3compile optimize ./tiny-model -o ./tiny.k3c --dtype float32 --validate
    """
    from k3compile.artifact import ArtifactError
    from k3compile.checkpoint.loader import CheckpointError
    from k3compile.pipeline import PassError
    from k3compile.sharding import ShardingError

    step: list[str] = []
    try:
        if tp < 1:
            raise UserError(f"--tp must be at least 1, got {tp}")
        _check_dcp(tp, dcp, dcp_interleave)
        if block_size is not None and block_size < 1:
            raise UserError(f"--block-size must be at least 1, got {block_size}")
        _choice(dcp_merge, _dcp_merges(), "--dcp-merge", "merge")
        _choice(dtype, COMPILE_DTYPES, "--dtype", "dtype")
        _choice(target, _target_names(), "--target", "target")
        enabled, disabled = _pass_selection(enable, disable)
        if not model_dir.is_dir():
            raise UserError(f"{model_dir} is not a directory (create one with 'k3compile init-model')")
        if out.exists() or out.is_symlink():
            if not overwrite:
                raise UserError(f"{out} already exists; pass --overwrite to replace it, or choose a new directory")
            if not out.is_dir() or out.is_symlink() or not (_is_artifact_dir(out) or not any(out.iterdir())):
                raise UserError(f"refusing to overwrite {out}: it is not a k3compile artifact")
        from k3compile.checkpoint.loader import load_checkpoint_config

        cfg = load_checkpoint_config(model_dir)
        _check_tp(cfg, tp)

        from k3compile.compiler import CompileOptions, optimize

        try:
            options = CompileOptions(
                tp=tp, dcp=dcp, dcp_interleave=dcp_interleave, dcp_merge=dcp_merge, target=target, dtype=dtype,
                block_size=block_size, enable=enabled, disable=disabled, validate=validate,
            )
        except ValueError as e:
            raise UserError(str(e)) from None

        console.print(
            f"[bold]Compiling[/] {escape(str(model_dir))} ({_config_name(cfg)}, {cfg.num_hidden_layers} layers) "
            f"for target {target}: tp {tp}{f', dcp {dcp}' if dcp > 1 else ''}, {dtype}, block size {options.block_size}"
            + (", validating every pass" if validate else ""),
            soft_wrap=True,
        )
        start = time.perf_counter()

        def on_step(label: str) -> None:
            step[:] = [label]
            steps(label)

        with _Steps(console) as steps:
            result = optimize(model_dir, out, options, overwrite=overwrite, on_step=on_step)
        elapsed = time.perf_counter() - start
    except UserError as e:
        _fail(str(e))
    except (ConfigError, CheckpointError, ArtifactError, ShardingError, PassError) as e:
        _fail(f"{step[0]}: {e}" if step else str(e))

    summaries = [r.summary() for r in result.pipeline.records]
    console.print()
    _print_passes(summaries, "Passes")
    console.print()
    files = [p for p in result.out_dir.rglob("*") if p.is_file()]
    size = sum(p.stat().st_size for p in files)
    console.print(f"[bold]capture[/]   {_capture_text(result.captured.stats)}", soft_wrap=True)
    console.print(
        f"[bold]artifact[/]  {escape(str(result.out_dir))}  ({len(files)} files, {human_bytes(size)}; "
        f"weights stay in {escape(str(model_dir.resolve()))})",
        soft_wrap=True,
    )
    console.print(f"[bold]total[/]     {_fmt_seconds(elapsed)}", soft_wrap=True)
    run_cmd = (
        f"torchrun --nproc-per-node {tp} -m k3compile run {out}" if tp > 1 else f"k3compile run {out}"
    )
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

    Captures the decode graph on the meta device (no weights are read: a config is enough, the full K3 takes about a minute), runs the target's passes one at a time and reports, per GPU, the weights by kind as the runtime holds them (mxfp4 experts dequantised to the model dtype), the MLA latent KV cache and the KDA state for SEQUENCES x CONTEXT tokens, before the passes and after each pass that changed memory.

    Example: k3compile plan --preset k3 --tp 8 --context 131072 --target mi355x
    """
    from k3compile.memory import MemoryOptions, plan_memory
    from k3compile.pipeline import PassError

    try:
        if (model is None) == (preset is None):
            raise UserError("give exactly one of MODEL (a model directory or config.json) or --preset NAME")
        cfg = get_preset(preset) if preset is not None else read_config_file(model)
        _check_tp(cfg, tp)
        _check_dcp(tp, dcp, dcp_interleave)
        for option, value in (("--context", context), ("--sequences", sequences), ("--block-size", block_size)):
            if value is not None and value < 1:
                raise UserError(f"{option} must be at least 1, got {value}")
        _choice(dtype, COMPILE_DTYPES, "--dtype", "dtype")
        _choice(target, _target_names(), "--target", "target")
        enabled, disabled = _pass_selection(enable, disable)
        from k3compile.compiler import DTYPES

        options = MemoryOptions(
            tp=tp, dcp=dcp, dcp_interleave=dcp_interleave, target=target, dtype=DTYPES[dtype], context=context,
            sequences=sequences, block_size=block_size, enable=enabled, disable=disabled,
        )
        with _Steps(console) as steps:
            result = plan_memory(cfg, options, on_step=steps)
    except UserError as e:
        _fail(str(e))
    except (ConfigError, PassError) as e:
        _fail(str(e))
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


def plan_table(result: Any) -> Table:
    """Rows: weight kinds, weight total, MLA KV, KDA state, total; columns: the stages."""
    cfg, o = result.config, result.options
    title = (
        f"Memory per GPU: {_config_name(cfg)}, tp {o.tp}{f', dcp {o.dcp}' if o.dcp > 1 else ''}, target {o.target}, {str(o.dtype).removeprefix('torch.')}, "
        f"{o.sequences} sequence(s) x {o.context} tokens (block {o.block_size})"
    )
    table = Table(title=title, box=box.SIMPLE_HEAD, title_justify="left")
    table.add_column("")
    stages = result.stages
    for i, (name, _) in enumerate(stages):
        table.add_column(name if i == 0 else f"+ {name}", justify="right")
    if len(stages) > 1:
        table.add_column("saved", justify="right")
    kinds = {k: [e.weights[k] for _, e in stages] for k in stages[0][1].weights if any(e.weights[k] for _, e in stages)}
    n_mla = sum(1 for k in cfg.layer_kinds if k == "mla")
    rows = [(k, v) for k, v in kinds.items()]
    rows += [
        ("weights", [e.weight_total for _, e in stages]),
        (f"MLA latent KV ({n_mla} layers)", [e.mla_kv for _, e in stages]),
        (f"KDA state ({cfg.num_hidden_layers - n_mla} layers)", [e.kda_state for _, e in stages]),
        ("total", [e.total for _, e in stages]),
    ]
    last_kind = list(kinds)[-1]
    for label, values in rows:
        cells = [human_bytes(v) for v in values]
        if len(stages) > 1:
            cells.append(human_bytes(values[0] - values[-1]) if values[0] != values[-1] else "")
        bold = label in ("weights", "total")
        table.add_row(f"[bold]{label}[/]" if bold else label, *cells, end_section=label in (last_kind, "weights"))
    return table


def _read_info(out: Path, check_checkpoint: Any = "warn", world_size: int | None = None):
    """Verify an artifact; checkpoint warnings go to stderr as one line each."""
    from k3compile.artifact import read_artifact_info

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        info = read_artifact_info(out, world_size=world_size, check_checkpoint=check_checkpoint)
    for w in caught:
        err_console.print(f"[bold yellow]warning:[/] {escape(str(w.message))}", soft_wrap=True)
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
        warnings.simplefilter("ignore")  # already reported by _read_info
        artifact = load_artifact(out, check_checkpoint=False)
    return {
        phase: snapshot(artifact.programs[phase].graph_module, artifact.programs[phase]).filter(layer=layer)
        for phase in phases
    }


def _print_pass_details(s: dict[str, Any], layer_names: set[str] | None) -> None:
    console.print(
        f"[bold]{escape(str(s.get('pass')))}[/] {escape('[' + str(s.get('phase')) + ']')}: "
        f"{'changed' if s.get('changed') else 'unchanged'}, {s.get('matches', 0)} match(es), "
        f"nodes {s.get('nodes_before', '?')} -> {s.get('nodes_after', '?')}, "
        f"{_fmt_seconds(s['seconds']) if isinstance(s.get('seconds'), (int, float)) else '?'}",
        soft_wrap=True,
    )
    stats = s.get("stats") or {}
    if stats:
        console.print("  stats:      " + escape(", ".join(f"{k}={_fmt_stat(v)}" for k, v in stats.items())), soft_wrap=True)
    delta = s.get("op_count_delta") or {}
    if delta:
        console.print("  ops:        " + escape(", ".join(f"{k} {d:+d}" for k, d in delta.items())), soft_wrap=True)
    if s.get("validation") is not None:
        console.print("  validation: " + escape(_fmt_validation(s.get("validation"), full=True)), soft_wrap=True)
    reasons = [r for r in s.get("skipped_reasons") or [] if isinstance(r, dict)]
    skipped = s.get("skipped", len(reasons))
    if skipped:
        shown = reasons
        note = ""
        if layer_names is not None:
            shown = [r for r in reasons if r.get("node") in layer_names]
            note = f", {len(shown)} of the {len(reasons)} stored in the manifest are in this layer"
        elif len(reasons) < skipped:
            note = f", the first {len(reasons)} stored in the manifest"
        console.print(f"  skipped {skipped} candidate(s){note}:", soft_wrap=True)
        for r in shown:
            console.print(f"    {escape(str(r.get('node')))}: {escape(str(r.get('reason')))}", soft_wrap=True)
    if isinstance(s.get("diff"), str) and s["diff"]:
        console.print(escape(s["diff"]), soft_wrap=True, markup=False)


@app.command("inspect")
def inspect_command(
    out: Annotated[
        Path,
        typer.Argument(help="An artifact directory written by 'k3compile optimize'. Example: ./tiny.k3c", show_default=False),
    ],
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
) -> None:
    """Verify an artifact and show how it was compiled and what each pass did.

    Checks every file's size and sha256 against the manifest (a modified artifact is refused), then prints the versions, model, parallelism, target, dtype, capture statistics and a table of the passes (one row per pass and phase). A changed or missing source checkpoint is a warning here (and an error for 'k3compile run').

    Example: k3compile inspect ./tiny.k3c --pass remove_noops --phase decode --diff
    """
    from k3compile.artifact import ArtifactError
    from k3compile.targets import TARGETS

    try:
        info = _read_info(out)
        phases = list(info.phases)
        if phase is not None:
            if phase not in info.phases:
                raise UserError(f"--phase: unknown phase {phase!r}; this artifact has {', '.join(info.phases)}")
            phases = [phase]
        summaries = list(info.passes)
        if pass_name is not None:
            ran = list(dict.fromkeys(str(s.get("pass")) for s in summaries if isinstance(s, dict)))
            if pass_name not in ran:
                where = ", ".join(ran) if ran else "none"
                raise UserError(f"--pass: pass {pass_name!r} did not run for this artifact; passes that ran: {where}")
        if layer is not None and not 0 <= layer < info.config.num_hidden_layers:
            raise UserError(f"--layer: {layer} is outside [0, {info.config.num_hidden_layers}) (the model's layers)")
        selected = [s for s in summaries if _summary_matches(s, pass_name, phase)]
        layer_snaps = _layer_nodes(out, phases, layer) if layer is not None else None
    except UserError as e:
        _fail(str(e))
    except ArtifactError as e:
        _fail(str(e))

    cfg = info.config
    dtype = str(info.dtype).removeprefix("torch.")
    target = TARGETS.get(info.target)
    stats = info.capture_stats
    params = count_parameters(cfg)
    console.print(f"[bold green]Artifact[/] {escape(str(out))}  (verified: every file matches the manifest)", soft_wrap=True)
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold", no_wrap=True)
    table.add_column(overflow="fold")
    table.add_row("format", f"{escape(info.format)} version {info.format_version}")
    table.add_row("written by", f"k3compile {escape(info.k3compile_version)}, torch {escape(info.torch_version)}")
    table.add_row(
        "model",
        f"{_config_name(cfg)}: {human_count(params)} parameters, {cfg.num_hidden_layers} layers, "
        f"hidden {cfg.hidden_size}, vocab {cfg.vocab_size}",
    )
    table.add_row("layers", layer_kinds_summary(cfg))
    table.add_row("checkpoint", f"{escape(info.model_dir)} (weights are read from here at load)")
    run_with = f"torchrun --nproc-per-node {info.tp} -m k3compile run {escape(str(out))}"
    table.add_row("tp", f"{info.tp}" + (f" (run with: {run_with})" if info.tp > 1 else ""))
    if info.dcp > 1:
        table.add_row("dcp", f"{info.dcp} (MLA history split by position, interleave {info.dcp_interleave})")
    table.add_row(
        "target",
        escape(info.target)
        + (
            " (unknown to this k3compile)" if target is None
            else "" if target.name == target.device == target.arch
            else f" ({target.device}, {target.arch})"
        ),
    )
    table.add_row("dtype", dtype)
    table.add_row("block size", f"{info.block_size} tokens per MLA cache block")
    table.add_row("phases", ", ".join(info.phases))
    table.add_row("capture", escape(_capture_text(stats)))
    console.print(table)
    console.print()

    scope = " ".join(p for p in (f"pass {pass_name}" if pass_name else "", f"phase {phase}" if phase else "") if p)
    _print_passes(selected, "Passes" + (f" ({scope})" if scope else ""))

    if layer_snaps is not None:
        kind = cfg.layer_kinds[layer].upper()
        console.print()
        console.print(
            f"[bold]Layer {layer}[/] ({kind}) in the compiled graphs "
            "[dim](the pass numbers above are for whole graphs: the manifest does not split them by layer)[/]",
            soft_wrap=True,
        )
        for ph, snap in layer_snaps.items():
            ops = ", ".join(f"{op.removesuffix('.default')} x{n}" for op, n in snap.op_counts.items())
            console.print(f"  {ph}: {len(snap)} nodes; {escape(ops) or 'no ops'}", soft_wrap=True)

    if diff or pass_name is not None:
        layer_names = None
        if layer_snaps is not None:
            layer_names = {line.name for snap in layer_snaps.values() for line in snap}
        console.print()
        for s in selected:
            if isinstance(s, dict):
                _print_pass_details(s, layer_names)
    if diff and not any(isinstance(s, dict) and s.get("diff") for s in selected):
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
            f"dcp={info.dcp}, dcp_interleave={info.dcp_interleave}, target={info.target!r}, dtype={dtype!r}, block_size={info.block_size}), overwrite=True)\n"
            f"  rec = next(r for r in result.pipeline.records if r.pass_name == {example_pass!r} "
            f"and r.phase == {example_phase!r})\n"
            f"  print(rec{filt}.to_text())   # or display(rec{filt}) in Jupyter",
            markup=False,
            soft_wrap=True,
            highlight=False,
        )


def _resolve_device(device: str | None, distributed: bool) -> str | None:
    if device is None:
        return None
    if not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        raise UserError(f"--device: unknown device {device!r}; choose cpu or cuda (or cuda:N)")
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise UserError(f"--device {device}: torch sees no CUDA/ROCm GPU here; use --device cpu")
        if device == "cuda" and distributed:
            return f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    return device


@app.command("run")
def run_command(
    out: Annotated[
        Path,
        typer.Argument(help="An artifact directory written by 'k3compile optimize'. Example: ./tiny.k3c", show_default=False),
    ],
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
) -> None:
    """Load a compiled artifact with the runtime and generate tokens.

    Reads this rank's weights from the checkpoint the artifact was compiled from, prefills all prompts in one step, then decodes them together, one token per step. Prompts are token ids (there is no tokenizer). Prints each prompt's new tokens and the timing: load, prefill, and decode per token (the first steps include one-time warm-up).

    An artifact compiled with --tp N runs on N processes, started by torchrun: torchrun --nproc-per-node N -m k3compile run OUT (only rank 0 prints).

    Example: k3compile run ./tiny.k3c --prompt "1 2 3" --prompt "7 8" --max-new-tokens 4
    """
    import torch
    import torch.distributed as dist

    from k3compile.artifact import ArtifactError
    from k3compile.checkpoint.loader import CheckpointError
    from k3compile.runtime import RequestError, RuntimeOptions, SamplingParams, load

    distributed = os.environ.get("WORLD_SIZE") is not None
    rank = int(os.environ.get("RANK", "0")) if distributed else 0
    try:
        try:
            world = int(os.environ["WORLD_SIZE"]) if distributed else 1
        except ValueError:
            raise UserError(f"WORLD_SIZE={os.environ['WORLD_SIZE']!r} is not an integer") from None
        if max_new_tokens < 1:
            raise UserError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
        if max_context < 1:
            raise UserError(f"--max-context must be at least 1, got {max_context}")
        try:
            sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        except ValueError as e:
            raise UserError(f"--{str(e).replace('_', '-')}") from None
        info = _read_info(out, check_checkpoint=False)
        if not distributed and info.tp > 1:
            raise UserError(
                f"{out} was compiled for tp={info.tp}: start it on {info.tp} processes with "
                f"'torchrun --nproc-per-node {info.tp} -m k3compile run {out}'"
            )
        if distributed and world != info.tp:
            raise UserError(
                f"{out} was compiled for tp={info.tp} but torchrun started {world} process(es); "
                f"use 'torchrun --nproc-per-node {info.tp} -m k3compile run {out}'"
            )
        prompts = read_prompts(prompt, prompt_file, info.config.vocab_size)
        for i, p in enumerate(prompts):
            need = len(p) + max_new_tokens - 1
            if need > max_context:
                raise UserError(
                    f"prompt {i} has {len(p)} tokens: with --max-new-tokens {max_new_tokens} it needs a context of "
                    f"{need} tokens, more than --max-context {max_context}"
                )
        options = RuntimeOptions(
            max_sequences=len(prompts),
            max_context=max_context,
            device=_resolve_device(device, distributed),
            cuda_graphs=None if cuda_graphs else False,
        )

        start = time.perf_counter()
        import torch._dynamo  # noqa: F401  (torch's custom ops import it on first call: count it as load time)

        from rich.progress import Progress

        with Progress(console=err_console, transient=True, disable=not err_console.is_terminal) as bar:
            task = bar.add_task("loading weights", total=None)
            progress = lambda done, total: bar.update(task, completed=done, total=total)  # noqa: E731
            if distributed:  # rank and world size from torchrun's environment
                rt = load(out, options=options, on_progress=progress)
            else:
                rt = load(out, rank=0, world_size=1, options=options, on_progress=progress)
        load_s = time.perf_counter() - start

        result = rt.generate_timed(prompts, max_new_tokens, sampling)
        new, prefill_s, decode_s = result.tokens, result.prefill_s, result.decode_s
        # CUDA graphs that captured NCCL collectives must go before the process group: on
        # two H200s destroy_process_group hung with them alive.
        device, with_graphs = rt.device, rt.graphs is not None
        rt.close()
    except (UserError, ArtifactError, CheckpointError, ConfigError, RequestError) as e:
        if dist.is_initialized():
            dist.destroy_process_group()
        if rank == 0:
            _fail(str(e))
        raise typer.Exit(USAGE_ERROR)
    how = "greedy" if temperature == 0 else f"temperature {temperature}, top-k {top_k}, top-p {top_p}, seed {seed}"
    if rank == 0:
        _print_generation(out, info, device, with_graphs, prompts, new, max_new_tokens, how, load_s, prefill_s,
                          decode_s)
    if dist.is_initialized():
        dist.destroy_process_group()


def _print_generation(out, info, device, with_graphs: bool, prompts, new, max_new_tokens: int, how: str,
                      load_s: float, prefill_s: float, decode_s: float) -> None:
    """What ``k3compile run`` prints (rank 0), before the process group is torn down."""
    cfg = info.config
    console.print(
        f"[bold]{escape(str(out))}[/]: {_config_name(cfg)}, tp {info.tp}{f', dcp {info.dcp}' if info.dcp > 1 else ''}, {str(info.dtype).removeprefix('torch.')}, "
        f"target {escape(info.target)}, on {device}"
        + (" with CUDA graphs" if with_graphs else "")
        + f"; {len(prompts)} prompt(s), {max_new_tokens} new token(s) each, {how}",
        soft_wrap=True,
    )
    for i, (p, toks) in enumerate(zip(prompts, new)):
        console.print(f"prompt {i} ({len(p)} tokens): {' '.join(map(str, p))}", soft_wrap=True)
        console.print(f"  new tokens: {' '.join(map(str, toks))}", soft_wrap=True)
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
