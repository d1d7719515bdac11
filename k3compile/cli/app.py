"""The Typer application, its two consoles and the one-line error every command reports.

Nothing here imports torch: ``k3compile --help`` must answer at once, so each command
imports the library inside its body.
"""

from __future__ import annotations

import os
import warnings
from typing import Annotated, NoReturn

import typer
from rich.console import Console
from rich.markup import escape

import k3compile

#: Exit status of every error the user can fix (the same as click's usage errors).
USAGE_ERROR = 2

#: Width of the output when it is not a terminal (a pipe, a log file): wide enough that
#: no table column is cut or ellipsised; a table still takes only the width it needs.
PIPE_WIDTH = 1000


def make_console(stderr: bool = False) -> Console:
    """A console for stdout (or stderr). On a terminal it takes the terminal's width; piped
    or redirected it lays out at :data:`PIPE_WIDTH` columns instead of rich's 80, unless
    ``COLUMNS`` asks for a width."""
    console = Console(stderr=stderr, highlight=False)
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console.width = PIPE_WIDTH
    return console


console = make_console()
err_console = make_console(stderr=True)


class UserError(Exception):
    """A problem with the command's inputs: reported as one line on stderr, exit status 2."""


def fail(message: str) -> NoReturn:
    """Print ``error: message`` on stderr as one line and exit with :data:`USAGE_ERROR`."""
    err_console.print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True)
    raise typer.Exit(USAGE_ERROR)


def warn(message: str) -> None:
    """Print ``warning: message`` on stderr as one line."""
    err_console.print(f"[bold yellow]warning:[/] {escape(message)}", soft_wrap=True)


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


def _version(value: bool) -> None:
    if value:
        console.print(f"k3compile {k3compile.__version__}")
        raise typer.Exit()


#: Warnings torch raises about its own internals, which no user of the CLI can act on.
_TORCH_INTERNAL_WARNINGS = (
    # copy.deepcopy of an ExportedProgram (the pipeline keeps the graph before a validated
    # pass) builds LeafSpec objects, deprecated in torch 2.13's pytree.
    (FutureWarning, r"`isinstance\(treespec, LeafSpec\)` is deprecated"),
)


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit. Example: k3compile --version"),
    ] = False,
) -> None:
    """k3compile: a compiler for serving the Kimi K3 model."""
    for category, message in _TORCH_INTERNAL_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
