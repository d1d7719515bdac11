"""The example notebook runs top to bottom in a fresh kernel, as a reader would run it.

The kernel is the ``python3`` kernelspec that ipykernel installs into this interpreter's
prefix (``<venv>/share/jupyter/kernels/python3``, whose ``python`` jupyter_client
replaces by ``sys.executable``), so the notebook runs against the same installed
k3compile as the tests; the test checks that before and while running.
"""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat
from jupyter_client.kernelspec import KernelSpecManager
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[1] / "examples" / "optimize_tiny_k3.ipynb"
KERNEL = "python3"
CELL_TIMEOUT_S = 300
PROBE_ID = "test-probe-interpreter"


def read_notebook() -> nbformat.NotebookNode:
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    return nb


def tagged(nb: nbformat.NotebookNode, tag: str) -> nbformat.NotebookNode:
    (cell,) = [c for c in nb.cells if tag in c.get("metadata", {}).get("tags", [])]
    return cell


def stdout(cell: nbformat.NotebookNode) -> str:
    return "".join(o.text for o in cell.outputs if o.output_type == "stream" and o.name == "stdout")


def rich(cell: nbformat.NotebookNode, mime: str) -> str:
    return "".join(o.data[mime] for o in cell.outputs if "data" in o and mime in o.data)


def test_committed_notebook_has_no_outputs():
    for cell in read_notebook().cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, (
                f"cell {cell.id!r} has outputs: clear them before committing"
            )


def test_python3_kernel_is_this_interpreter():
    spec = KernelSpecManager().get_kernel_spec(KERNEL)
    bare = {"python", f"python{sys.version_info[0]}", "python{}.{}".format(*sys.version_info[:2])}
    assert spec.argv[0] in bare or Path(spec.argv[0]).resolve() == Path(sys.executable).resolve(), (
        f"the {KERNEL!r} kernelspec at {spec.resource_dir} runs {spec.argv[0]!r}, not {sys.executable}: "
        "install ipykernel into this environment"
    )


def test_notebook_runs_and_matches_the_reference():
    nb = read_notebook()
    # Where the kernel's interpreter lives (added in memory only, first).
    nb.cells.insert(0, nbformat.v4.new_code_cell("import sys\nprint(sys.prefix)", id=PROBE_ID))
    client = NotebookClient(
        nb,
        timeout=CELL_TIMEOUT_S,
        kernel_name=KERNEL,
        resources={"metadata": {"path": str(NOTEBOOK.parent)}},
    )
    client.execute()  # raises CellExecutionError on the first failing cell

    assert stdout(nb.cells[0]).strip() == sys.prefix

    summary = rich(tagged(nb, "pipeline-summary"), "text/html")
    assert "remove_noops" in summary and "k3sum" in summary

    compare = tagged(nb, "compare-tokens")
    assert compare.execution_count is not None
    assert "greedy tokens match the reference" in stdout(compare)

    code_cells = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count is not None for c in code_cells)
    assert any(rich(c, "image/svg+xml").startswith("<svg") for c in code_cells)
