"""Reading the command line: sizes, prompts, pass and target names, the parallel plan.

Each check turns a library's verdict into a :class:`~k3compile.cli.app.UserError` that
names the option; the rules themselves (which plans are valid, which passes exist) live
in the library and are imported when a command runs.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from k3compile.cli.app import UserError

if TYPE_CHECKING:
    from k3compile.config import K3Config

DEFAULT_PROMPT = "1 2 3 4 5 6 7 8"

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


def at_least_one(**values: int | None) -> None:
    """Every given option (``context=0`` names ``--context``) is None or at least 1."""
    for name, value in values.items():
        if value is not None and value < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1, got {value}")


# ----- prompts (generate, run) ---------------------------------------------------

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
    """The prompts of ``--prompt`` (repeated) or ``--prompt-file`` (one per line), or the default one."""
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
    return [parse_prompt(p, f"--prompt #{i + 1}", vocab_size) for i, p in enumerate(prompts or [DEFAULT_PROMPT])]


# ----- configs, targets, passes, parallel plans (optimize, plan) -------------------


def read_config(preset: str | None, path: Path | None, path_option: str, either: str) -> K3Config:
    """The configuration of ``--preset NAME`` or of ``path`` (a config.json or a model
    directory holding one, given as ``path_option``); ``either`` names the two choices
    in the error when not exactly one is given."""
    from k3compile.config import get_preset, load_config

    if (preset is None) == (path is None):
        raise UserError(f"give exactly one of {either}" + (" (got both)" if preset is not None else ""))
    if preset is not None:
        return get_preset(preset)
    if not path.exists():
        raise UserError(f"{path_option}: {path} does not exist")
    return load_config(path)


def choice(value: str, choices: tuple[str, ...] | list[str], option: str, what: str) -> str:
    """``value`` if it is one of ``choices``, else a UserError listing them."""
    if value not in choices:
        raise UserError(f"{option}: unknown {what} {value!r}; choose one of {', '.join(choices)}")
    return value


def check_target(target: str) -> str:
    """``--target``: one of the targets the compiler knows."""
    from k3compile.targets import TARGETS

    return choice(target, tuple(TARGETS), "--target", "target")


#: ``--kv-cache-dtype``'s help, shared by optimize, plan and run
KV_CACHE_DTYPE_HELP = (
    "The MLA latent cache's dtype: auto (the model dtype), bf16, or fp8 (E4M3 with a per-token scale for the "
    "latent and one for k_pe: 592 bytes per token and layer in K3 instead of 1152; fnuz E4M3 on mi300x)."
)


InductorOption = Annotated[
    Optional[bool],
    typer.Option(
        "--inductor/--no-inductor",
        help="Run the decode program compiled by Inductor (torch.compile at load: the ops around the k3 kernels fuse) "
        "or op by op, today's path, for comparison and debugging. Default: when compiling, the target's (GPU "
        "targets: Inductor; cpu: op by op); when running, what the artifact records (on the CPU: op by op). "
        "Example: --no-inductor",
        show_default=False,
    ),
]


RankTimeoutOption = Annotated[
    float,
    typer.Option(
        "--rank-timeout",
        help="Seconds a rank waits for the others: to join at start-up, and in every collective. A rank that "
        "stopped then ends the others with an error naming it. Example: --rank-timeout 60",
    ),
]


VerifyWeightsOption = Annotated[
    bool,
    typer.Option("--verify-weights", help="Before loading, hash every byte of the checkpoint against the full "
                 "hashes the artifact records (compiled with --hash-weights); ranks share the work. "
                 "Example: --verify-weights"),
]


PrefillChunkOption = Annotated[
    Optional[int],
    typer.Option(help="Prefill a prompt in chunks of this many tokens, each against the cache the earlier chunks "
                 "wrote: prefill memory stays bounded (default: a whole prompt in one step). Example: "
                 "--prefill-chunk 4096", show_default=False),
]


def check_rank_timeout(seconds: float) -> None:
    """``--rank-timeout``: a positive, finite number of seconds."""
    if not 0 < seconds < float("inf"):
        raise UserError(f"--rank-timeout: a positive number of seconds needed, got {seconds}")


def lowering_choice(inductor: bool | None) -> str | None:
    """--inductor/--no-inductor as a lowering (targets.LOWERINGS); None when not given."""
    return None if inductor is None else "inductor" if inductor else "eager"


def check_kv_cache_choice(value: str) -> str:
    """``--kv-cache-dtype``: one of the cache dtype choices."""
    from k3compile.batch import KV_CACHE_DTYPE_CHOICES

    return choice(value, KV_CACHE_DTYPE_CHOICES, "--kv-cache-dtype", "choice")


def check_dtype(dtype: str) -> str:
    """``--dtype``: one of the model dtypes the compiler accepts."""
    from k3compile.compiler import DTYPES

    return choice(dtype, tuple(DTYPES), "--dtype", "dtype")


def _names(values: list[str] | None) -> tuple[str, ...]:
    """Repeated options, each possibly a comma-separated list: ('a', 'b,c') -> ('a', 'b', 'c')."""
    out: list[str] = []
    for v in values or ():
        out += [n.strip() for n in v.split(",") if n.strip()]
    return tuple(dict.fromkeys(out))


def pass_selection(enable: list[str] | None, disable: list[str] | None) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The --enable/--disable pass names, checked against the registered passes."""
    from k3compile.passes import ALL_PASSES

    enabled, disabled = _names(enable), _names(disable)
    for option, names in (("--enable", enabled), ("--disable", disabled)):
        for name in names:
            if name not in ALL_PASSES:
                raise UserError(f"{option}: unknown pass {name!r}; known passes: {', '.join(ALL_PASSES)}")
    both = [n for n in enabled if n in disabled]
    if both:
        raise UserError(f"pass {both[0]!r} is both enabled and disabled")
    return enabled, disabled


def check_plan(tp: int, dcp: int = 1, dcp_interleave: int = 1, cfg: K3Config | None = None) -> None:
    """``--tp``/``--dcp``/``--dcp-interleave`` make a valid :class:`~k3compile.sharding.ParallelPlan`
    and, given the model's ``cfg``, its heads and widths split evenly over ``tp`` ranks."""
    from k3compile.sharding import ParallelPlan, ShardingError

    try:
        ParallelPlan(tp=tp, dcp=dcp, dcp_interleave=dcp_interleave)
    except ShardingError as e:
        raise UserError(f"--tp {tp} --dcp {dcp} --dcp-interleave {dcp_interleave}: {e}") from None
    if cfg is not None:
        from k3compile.model.k3 import check_divisible

        try:
            check_divisible(cfg, tp)
        except ValueError as e:
            raise UserError(f"--tp {tp}: {e} (the model's heads and widths split evenly over the ranks)") from None
