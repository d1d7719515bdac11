"""The ``k3compile`` command line.

Commands (run ``k3compile COMMAND --help`` for the options of each):

* ``init-model``: write an HF-style model directory with seeded random weights.
* ``presets``: list the built-in model configurations and their sizes.
* ``generate``: greedy generation with the reference model on the CPU.
* ``optimize``: compile a model directory into an artifact (capture, passes, write).
* ``plan``: per-GPU memory under a parallel plan, with and without each pass that changes it.
* ``inspect``: verify an artifact and show how it was made and what each pass did.
* ``run``: load an artifact with the runtime and generate tokens (``torchrun`` for tp > 1).
* ``bench``: time an artifact's decode steps and prefills against the floor of their bytes.
* ``export``: one rank's decode program as an ONNX model or an MLIR module, its k3 ops decomposed.

The flow from a model to generated tokens::

    k3compile init-model ./tiny-model --preset tiny
    k3compile optimize ./tiny-model -o ./tiny.k3c --dtype float32
    k3compile inspect ./tiny.k3c
    k3compile run ./tiny.k3c --prompt "1 2 3"

Errors a user can fix (a bad preset name, an invalid config.json, an existing output
directory, a token id outside the vocabulary, an unknown pass, a tampered artifact...)
print one line on stderr and exit with status 2; no traceback.

One module per command group (:mod:`~k3compile.cli.model`, :mod:`~k3compile.cli.compile`,
:mod:`~k3compile.cli.artifact`, :mod:`~k3compile.cli.bench`, :mod:`~k3compile.cli.export`), on the app, consoles and errors of :mod:`~k3compile.cli.app`,
the option readers of :mod:`~k3compile.cli.options` and the output of
:mod:`~k3compile.cli.render`. The commands import torch and the library when they run,
never at import: ``k3compile --help`` answers at once.
"""

# Importing a command module registers its commands; --help lists them in this order.
from k3compile.cli import model  # noqa: F401,I001  (init-model, presets, generate)
from k3compile.cli import compile  # noqa: F401,I001  (optimize, plan)
from k3compile.cli import artifact  # noqa: F401,I001  (inspect, run)
from k3compile.cli import bench  # noqa: F401,I001  (bench)
from k3compile.cli import export  # noqa: F401,I001  (export)
from k3compile.cli.app import USAGE_ERROR, UserError, app
from k3compile.cli.options import parse_size

__all__ = ["USAGE_ERROR", "UserError", "app", "main", "parse_size"]


def main() -> None:
    """Console-script entry point (``k3compile``)."""
    app(prog_name="k3compile")
