"""The CLI tests' helpers: run a command in-process, check a refusal."""

from __future__ import annotations

from typer.testing import CliRunner

from k3compile.cli import app


def invoke(*args):
    """``k3compile ARGS`` in this process (typer's CliRunner); exceptions propagate."""
    return CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)


def assert_one_line_error(result, message: str) -> None:
    """The command refused with exit status 2 and one line on stderr holding ``message``."""
    assert result.exit_code == 2, result.output
    assert message in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "Traceback" not in result.output
