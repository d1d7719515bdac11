"""Structure-only export (k3compile/export/structure.py, issue #25): a preset compiled on
the meta device, without a checkpoint, written as ONNX with its weights as graph inputs
without values. The values cannot be checked; the structure is checked against the
program that ``k3compile plan`` compiles for the same plan."""

from __future__ import annotations

import json
import re
from collections import Counter

import onnx
import pytest
import torch

from cli_runs import assert_one_line_error, invoke
from k3compile.export.collectives import COLLECTIVES_DOMAIN, register_onnx_schemas
from k3compile.export.custom_ops import K3_DOMAIN, register_onnx_schemas as register_k3_schemas
from k3compile.export.trace import STEP_INPUTS


def _planned_program():
    """The decode program that ``k3compile plan --preset tiny --tp 2 --target cpu`` compiles."""
    from k3compile.config import PRESETS
    from k3compile.memory import MemoryOptions, plan_memory

    options = MemoryOptions(tp=2, target="cpu", dtype=torch.float32, context=160, sequences=4)
    return plan_memory(PRESETS["tiny"], options).program


def test_a_tp2_rank_of_a_preset_exports_without_weights(tmp_path):
    """``k3compile export --preset tiny --tp 2 --rank 1 --keep-k3-ops``: the model passes
    the full check; its inputs are the step's, the caches', then one per weight of the
    program (shape and type, no value); its ``k3`` and ``k3.collectives`` nodes are the
    program's k3 op calls and collectives; its metadata says what was compiled."""
    out = tmp_path / "tiny_tp2_rank1.onnx"
    run = invoke("export", "--preset", "tiny", "--tp", 2, "--rank", 1, "--target", "cpu", "--dtype", "float32",
                 "--keep-k3-ops", "--max-sequences", 4, "--max-context", 160, "-o", out)
    assert run.exit_code == 0, run.output
    program = _planned_program()
    signature = program.graph_signature
    targets = {**signature.inputs_to_parameters, **signature.inputs_to_buffers,
               **signature.inputs_to_lifted_tensor_constants}
    weights = [f"step.{targets[n.name]}" for n in program.graph.nodes
               if n.op == "placeholder" and n.name in targets and n.users]  # the ones the step reads
    assert len(weights) > 100
    message = " ".join(run.stdout.split())
    assert re.search(r"wrote .*tiny_tp2_rank1\.onnx \(\d+\.\d MiB\) in \d+\.\d s: 7 step inputs and 19 "
                     rf"caches in, the logits and 19 caches out; 22 collectives \(TP2 rank 1\); structure only: "
                     rf"{len(weights)} weights in, without values", message), message

    model = onnx.load(str(out))
    register_onnx_schemas()
    register_k3_schemas({n.op_type for n in model.graph.node if n.domain == K3_DOMAIN})
    onnx.checker.check_model(model, full_check=True)
    inputs = [i.name for i in model.graph.input]
    assert inputs[:len(STEP_INPUTS)] == list(STEP_INPUTS)
    caches = inputs[len(STEP_INPUTS):len(STEP_INPUTS) + 19]
    assert all(re.fullmatch(r"cache\.\d+\.(conv_q|conv_k|conv_v|state|kv)", n) for n in caches)
    assert sorted(inputs[len(STEP_INPUTS) + 19:]) == sorted(weights)
    params = {f"step.{n}": t for n, t in {**program.state_dict, **program.constants}.items()}  # by input name
    for value in model.graph.input[len(STEP_INPUTS) + 19:]:
        assert [d.dim_value for d in value.type.tensor_type.shape.dim] == list(params[value.name].shape)
    assert {i.name for i in model.graph.initializer}.isdisjoint(weights)
    assert sum(len(i.raw_data) for i in model.graph.initializer) < 4096  # the exporter's constants only

    calls = Counter(str(n.target).split(".")[1] for n in program.graph_module.graph.nodes
                    if n.op == "call_function" and str(n.target).startswith(("k3.", "_c10d_functional.")))
    nodes = Counter(n.op_type for n in model.graph.node if n.domain in (K3_DOMAIN, COLLECTIVES_DOMAIN))
    assert nodes == calls - Counter(wait_tensor=calls["wait_tensor"]) and nodes["all_reduce"] == 21
    meta = {p.key: p.value for p in model.metadata_props}
    assert meta["k3compile.structure_only"] == "true"
    assert json.loads(meta["k3compile.structure"]) == {"num_hidden_layers": 7, "hidden_size": 64, "num_experts": 8,
                                                       "tp": 2, "dcp": 1, "dcp_interleave": 1, "target": "cpu",
                                                       "dtype": "float32"}
    assert json.loads(meta["k3compile.collectives"])["rank"] == 1


@pytest.mark.parametrize("args, message", [
    (["--format", "mlir"], "--preset: a structure-only export writes ONNX, not mlir"),
    (["--external-data"], "--external-data: a structure-only export has no weight data"),
    (["--tp", 3], "--tp 3: "),
    (["--rank", 2, "--tp", 2], "rank 2: the model structure has ranks 0..1"),
    (["--dtype", "bfloat16"], "the model structure is bfloat16, and its program's einsums"),
])
def test_what_a_structure_only_export_refuses(tmp_path, args, message):
    """Bad options of a structure-only export: one line on stderr, nothing written."""
    assert_one_line_error(invoke("export", "--preset", "tiny", *args, "-o", tmp_path / "m.onnx"), message)
    assert list(tmp_path.iterdir()) == []


def test_an_artifact_or_a_preset(tmp_path):
    """ARTIFACT and --preset exclude each other; the plan options need --preset."""
    out = tmp_path / "m.onnx"
    assert_one_line_error(invoke("export", "-o", out), "give ARTIFACT (an artifact directory) or --preset NAME")
    assert_one_line_error(invoke("export", tmp_path, "--preset", "tiny", "-o", out), "give ARTIFACT or --preset, not both")
    assert_one_line_error(invoke("export", tmp_path, "--tp", 2, "-o", out), "--tp, --dcp, --target and --dtype: with "
                          "--preset only")
    assert list(tmp_path.iterdir()) == []
