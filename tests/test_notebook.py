"""The example notebook runs top to bottom in a fresh kernel, as a reader would run it, and
shows what it says: every mission pass changing the graph and passing translation
validation, and the compiled artifact reproducing the reference.

The kernel is the ``python3`` kernelspec that ipykernel installs into this interpreter's
prefix (``<venv>/share/jupyter/kernels/python3``, whose ``python`` jupyter_client
replaces by ``sys.executable``), so the notebook runs against the same installed
k3compile as the tests; the test checks that before and while running.

The notebook compiles once (tiny K3 with MXFP4 experts, TP2 / DCP2, target h200, every
pass validated on two gloo ranks) and runs the artifact on two gloo ranks: 156 s on this
2-core machine with other work running (132 s of it the compile, nearly all translation
validation; 17 s the two ranks).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[1] / "examples" / "optimize_tiny_k3.ipynb"
KERNEL = "python3"
CELL_TIMEOUT_S = 600  # the compile cell takes 2-3 minutes on 2 cores; this catches a hang
PROBE_ID = "test-probe-interpreter"

#: The passes the notebook walks through, each in a cell tagged ``pass-<name>``, with an
#: op-count delta of its decode record that shows the rewrite.
MISSION_PASSES = {
    "mxfp4_experts": "k3.moe_experts_mxfp4.default +6",
    "dedup_replicated_linear": "k3.add_rank_block_linear.default +6",
    "sink_copies": "same counts",  # the copies move into a branch
    "fuse_kda_decode": "k3.kda_decode_fused_proj.default +4",
    "split_mla_context": "k3.dcp_merge.default +3",
    "pad_attention_heads": "k3.pad_heads.default +3",
}
TOLERANCE = 1e-4


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


def test_every_mission_pass_has_its_section():
    nb = read_notebook()
    for name in MISSION_PASSES:
        assert f'record("{name}")' in tagged(nb, f"pass-{name}").source


def test_python3_kernel_is_this_interpreter():
    spec = KernelSpecManager().get_kernel_spec(KERNEL)
    bare = {"python", f"python{sys.version_info[0]}", "python{}.{}".format(*sys.version_info[:2])}
    assert spec.argv[0] in bare or Path(spec.argv[0]).resolve() == Path(sys.executable).resolve(), (
        f"the {KERNEL!r} kernelspec at {spec.resource_dir} runs {spec.argv[0]!r}, not {sys.executable}: "
        "install ipykernel into this environment"
    )


@pytest.fixture(scope="module")
def executed() -> nbformat.NotebookNode:
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
    return nb


def test_notebook_runs_in_this_interpreter(executed):
    assert stdout(executed.cells[0]).strip() == sys.prefix
    code_cells = [c for c in executed.cells if c.cell_type == "code"]
    assert all(c.execution_count is not None for c in code_cells)
    assert any(rich(c, "image/svg+xml").startswith("<svg") for c in code_cells)


def test_summary_shows_every_mission_pass_changing_the_graph(executed):
    summary = rich(tagged(executed, "pipeline-summary"), "text/html")
    rows = [re.findall(r"<td[^>]*>(.*?)</td>", r) for r in re.findall(r'<tr class="k3sum-row[^"]*">(.*?)</tr>', summary)]
    changed = {(r[0], r[1]) for r in rows if r[2] == "yes"}
    assert {(name, "decode") for name in MISSION_PASSES} <= changed
    assert ("split_mla_context", "prefill") in changed and ("mxfp4_experts", "prefill") in changed
    for name, phase, flag, _matches, _nodes, _stats, error, _s in rows:
        if flag == "yes":  # every changed record was validated, within tolerance
            assert float(error) <= TOLERANCE, (name, phase, error)


@pytest.mark.parametrize("name", MISSION_PASSES)
def test_pass_section_shows_its_diff_stats_and_validation(executed, name):
    cell = tagged(executed, f"pass-{name}")
    out = stdout(cell)
    head = re.search(r"^(\w+) \[decode\]: changed=(\w+), (\d+) rewrite\(s\)", out, re.M)
    assert head and head[1] == name and head[2] == "True" and int(head[3]) > 0, out
    assert re.search(r"^bought: +\S", out, re.M), out  # the stats in words
    assert MISSION_PASSES[name] in out
    v = re.search(r"^validation: max error (\S+) \(tolerance (\S+)\) ok$", out, re.M)
    assert v and float(v[2]) == TOLERANCE and float(v[1]) <= 1e-5, out
    page = rich(cell, "text/html")  # the record, narrowed to one layer
    assert f"<b>{name}</b>" in page and "k3rec-changed" in page and "layer=" in page
    assert "k3rec-del" in page.split("</style>")[1] or "k3rec-add" in page.split("</style>")[1]
    assert '<div class="k3rec-scroll"><table class="k3rec-diff">' in page


def test_pass_sections_show_what_each_pass_did(executed):
    def out(name: str) -> str:
        return stdout(tagged(executed, f"pass-{name}"))

    assert "weights/GPU" in out("mxfp4_experts")
    dedup = out("dedup_replicated_linear")
    assert "weights/GPU" in dedup and "FLOPs/token" in dedup and "c10d" not in dedup  # no collective added
    assert "launches if false" in out("sink_copies")
    assert "-44 launches" in out("fuse_kda_decode")  # 11 per KDA layer (7 ops and 7 projections -> 3), 4 layers
    assert "KV cache/token" in out("split_mla_context") and "+6 collectives" in out("split_mla_context")
    assert "heads 4 -&gt; 16" in rich(tagged(executed, "pass-pad_attention_heads"), "text/html")
    prefill = stdout(tagged(executed, "pass-split_mla_context-prefill"))
    assert "changed=True" in prefill and "+%dcp_history_order_default = k3.dcp_history_order" in prefill


def test_artifact_matches_the_reference_on_two_ranks(executed):
    run = stdout(tagged(executed, "compare-tokens"))
    assert "greedy tokens match the reference on both ranks" in run
    logits = stdout(tagged(executed, "run-artifact"))
    errors = re.findall(r"rank (\d) prefill logits: max \|compiled - reference\| = (\S+) \(largest logit (\S+)\)", logits)
    assert [r for r, _, _ in errors] == ["0", "1"], logits
    assert all(float(e) <= 1e-4 * float(s) for _, e, s in errors)
