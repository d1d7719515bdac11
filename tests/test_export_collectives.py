"""Export of a TP > 1 rank's decode program with its collectives kept
(k3compile/export/collectives.py, issue #25): each collective is one node over the rank's
group, and each rank's ONNX model, run in its own process of a gloo group by ONNX's
reference evaluator with the collectives run by torch.distributed, computes what the
runtime's ranks compute, step after step with the caches it returns fed back in."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest

from cli_runs import assert_one_line_error, invoke
from export_steps import cpu_runtime, greedy_decode_steps, prefill_prompts, relative_error
from k3compile.export import ExportOptions, export_onnx
from k3compile.export.collectives import COLLECTIVES_DOMAIN, register_onnx_schemas
from k3compile.export.trace import STEP_INPUTS

OPTIONS = ExportOptions(max_sequences=4, max_context=160)
STEPS = 5


def _export_and_step(rank: int, world: int, artifact: Path, out: Path, steps: int) -> list[tuple[str, float]]:
    """On one gloo rank: export the rank's ONNX model to ``out``, then prefill the prompts
    with the runtime, and for each greedy decode step run the model on ONNX's reference
    evaluator (its collectives on this group) with the caches of its previous step; the
    relative error of its logits and of every cache against the runtime's, by name."""
    from k3compile.export.collectives import reference_evaluator

    path = out / f"rank{rank}.onnx"
    export_onnx(artifact, path, ExportOptions(**{**OPTIONS.__dict__, "rank": rank}))
    rt = cpu_runtime(artifact, OPTIONS, rank)
    ids, tokens = prefill_prompts(rt)
    evaluator = reference_evaluator(str(path))
    model = evaluator.proto_
    inputs, outputs = [i.name for i in model.graph.input], [o.name for o in model.graph.output]
    cache_outputs = json.loads({p.key: p.value for p in model.metadata_props}["k3compile.cache_outputs"])
    caches = {n: t.numpy().copy() for n, t in zip(inputs[len(STEP_INPUTS):], rt.cache_tensors, strict=True)}
    errors = []
    for feeds, want in greedy_decode_steps(rt, ids, tokens, steps):
        got = evaluator.run(None, {**feeds, **caches})
        errors.append(("logits", relative_error(got[0], want)))
        for name, value, cache in zip(outputs[1:], got[1:], rt.cache_tensors, strict=True):
            exact = np.abs(value - cache.numpy()).max() == 0
            errors.append((name, 0.0 if exact else relative_error(value, cache)))
            caches[cache_outputs[name]] = value
    return errors


@pytest.fixture(scope="module")
def tp2(compile_once, rank_pools, tmp_path_factory):
    """(artifact, each rank's ONNX model, each rank's errors of :func:`_export_and_step`):
    the ranks export their models at once, each in its own process."""
    artifact = compile_once("tiny", "mxfp4", tp=2, dtype="float32").out_dir
    out = tmp_path_factory.mktemp("onnx-tp2")
    errors = rank_pools.get(2).run(_export_and_step, artifact, out, STEPS)
    return artifact, [out / f"rank{r}.onnx" for r in range(2)], errors


def _stored_collectives(artifact: Path) -> Counter:
    from k3compile.artifact import load_artifact

    program = load_artifact(artifact).programs["decode"].graph_module
    return Counter(str(n.target).split(".")[1] for n in program.graph.nodes
                   if n.op == "call_function" and str(n.target).startswith("_c10d_functional."))


def test_each_ranks_model_on_its_gloo_rank_equals_the_runtime(tp2):
    """Three prompts prefilled by the TP2 runtime on two gloo ranks, then five greedy
    decode steps: on each rank, the logits and every updated cache of the rank's ONNX model
    (reference evaluator, collectives on the same gloo group) equal the runtime's within
    1e-5 relative, its caches fed back from its previous step."""
    _, _, per_rank = tp2
    for rank, errors in enumerate(per_rank):
        assert len(errors) == STEPS * (1 + 19) and errors[0][0] == "logits"
        bad = [(name, e) for name, e in errors if not e < 1e-5]
        assert not bad, f"rank {rank}: {bad[:5]}"


def test_each_collective_is_one_node_over_the_ranks_group(tp2):
    """The ``k3.collectives`` nodes are the stored program's collectives (as a multiset;
    ``wait_tensor`` dropped), each with its group's size, ranks and name and its reduce op;
    with their registered schemas the full check passes; the metadata describes the group
    and the rank; the inputs and outputs are those of a TP1 export."""
    artifact, models, _ = tp2
    stored = _stored_collectives(artifact)
    assert stored["wait_tensor"] == stored["all_reduce"] + stored["all_gather_into_tensor"] > 0
    register_onnx_schemas()
    for rank, path in enumerate(models):
        model = onnx.load(str(path))
        onnx.checker.check_model(model, full_check=True)
        nodes = [n for n in model.graph.node if n.domain == COLLECTIVES_DOMAIN]
        assert Counter(n.op_type for n in nodes) == stored - Counter(wait_tensor=stored["wait_tensor"])
        for node in nodes:
            attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            assert attributes.pop("reduce_op", b"sum") == b"sum"
            assert attributes == {"group_size": 2, "group_ranks": [0, 1], "group_name": b"0"}
            assert len(node.input) == len(node.output) == 1
        assert {o.domain: o.version for o in model.opset_import}[COLLECTIVES_DOMAIN] == 1
        meta = {p.key: p.value for p in model.metadata_props}
        calls = dict(stored - Counter(wait_tensor=stored["wait_tensor"]))
        assert json.loads(meta["k3compile.collectives"]) == {"domain": COLLECTIVES_DOMAIN, "version": 1, "tp": 2,
                                                             "dcp": 1, "rank": rank, "groups": {"0": [0, 1]},
                                                             "calls": calls}
        assert meta["k3compile.rank"] == str(rank)
        inputs = [i.name for i in model.graph.input]
        assert inputs[:len(STEP_INPUTS)] == list(STEP_INPUTS) and len(inputs) == len(STEP_INPUTS) + 19
        assert [o.name for o in model.graph.output] == ["logits", *(f"{n}.next" for n in inputs[len(STEP_INPUTS):])]


@pytest.mark.sweep  # an MLIR export of its own: 25 s more
def test_mlir_keeps_the_collectives_in_the_torch_dialect(compile_once, tmp_path):
    """``k3compile export --format mlir --rank 1`` of a TP2 artifact: every collective and
    wait of the stored program is one ``torch.operator "torch._c10d_functional.<name>"``,
    and the module's attributes describe the group."""
    artifact = compile_once("tiny", "mxfp4", tp=2, dtype="float32").out_dir
    out = tmp_path / "rank1.mlir"
    run = invoke("export", artifact, "--rank", 1, "--format", "mlir", "-o", out, "--max-sequences",
                 OPTIONS.max_sequences, "--max-context", OPTIONS.max_context)
    assert run.exit_code == 0, run.output
    assert re.search(r"wrote .*rank1\.mlir \(\d+\.\d MiB\) in \d+\.\d s: 7 step inputs and 19 caches in, the logits "
                     r"and 19 caches out; 22 collectives \(TP2 rank 1\)", " ".join(run.stdout.split()))
    text = out.read_text()
    operators = Counter(re.findall(r'torch\.operator "([^"]+)"', text))
    assert operators == Counter({f"torch._c10d_functional.{n}": c for n, c in _stored_collectives(artifact).items()})
    assert ('k3compile.collectives = {calls = {all_gather_into_tensor = 1 : i64, all_reduce = 21 : i64}, '
            'dcp = 1 : i64, groups = {"0" = [0, 1]}, rank = 1 : i64, tp = 2 : i64}') in text
    assert "k3compile.rank = 1 : i64" in text


def test_linalg_refuses_collectives_before_any_work(compile_once, tmp_path):
    """MLIR's linalg dialect has no collectives: ``--dialect linalg`` of a TP2 artifact is
    one line on stderr, nothing written."""
    artifact = compile_once("tiny", "mxfp4", tp=2, dtype="float32").out_dir
    out = tmp_path / "rank0.mlir"
    assert_one_line_error(invoke("export", artifact, "--format", "mlir", "--dialect", "linalg", "-o", out),
                          "the decode program holds collectives (all_gather_into_tensor, all_reduce), which MLIR's "
                          "linalg dialect cannot express: export a TP1 artifact (this one is TP2, DCP1), or to a "
                          "format that keeps collectives (ONNX, MLIR's torch dialect)")
    assert list(tmp_path.iterdir()) == []
