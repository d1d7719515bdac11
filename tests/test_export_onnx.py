"""ONNX export of an artifact's decode and prefill programs (k3compile/export, issue #25):
the models pass onnx's full check, and ONNX Runtime on the CPU computes what the runtime
computes, step after step with the caches it returns fed back in."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from cli_runs import assert_one_line_error, invoke
from export_steps import (
    assert_step_equals_the_runtime,
    cpu_runtime,
    greedy_decode_steps,
    prefill_prompts,
    prefill_then_decode,
    relative_error,
)
from k3compile.export import ExportOptions, ExportResult, export_onnx, prefill_decompositions
from k3compile.export.custom_ops import K3_DOMAIN, K3_OPS_MODES, kept_signature
from k3compile.export.decompositions import decode_mxfp4, k3_op_definitions, sigmoid_topk_route
from k3compile.export.onnx_export import STEP_INPUTS
from k3compile.export.trace import check_program
from k3compile.ops.kda import kda_prefill_reference, short_conv_prefill_reference
from k3compile.ops.mla import mla_prefill_reference

OPTIONS = ExportOptions(max_sequences=4, max_context=160)  # h200's blocks are 64 tokens
PREFILL = ExportOptions(**{**OPTIONS.__dict__, "phase": "prefill"})
# (preset, experts, compile options): the CPU pipeline, and the h200 pipeline whose fused
# ops (KDA decode with its projections, MLA input projection, padded heads, AttnRes mix
# and norm) the CPU runs as their references, in CI; the all-linear preset in the sweep
CASES = [("tiny", "mxfp4", {}), ("tiny-h24", "mxfp4", {"target": "h200"}),
         pytest.param(("tiny-linear", "bf16", {}), marks=pytest.mark.sweep, id="tiny-linear")]
# with the sweeps (conftest): CI runs the prefill export on ``tiny`` (50 s a preset)
SWEEP_ONLY = ("test_onnx_runtime_prefill_then_decode_equal_the_runtime[tiny-h24]",)


@pytest.fixture(scope="module", params=CASES, ids=lambda c: c[0])
def exported(request, compile_once, tmp_path_factory):
    """(artifact, ExportResult, the command's output or None): ``tiny`` through the command
    line with its weights as external data, the others through the API, weights embedded."""
    preset, experts, options = request.param
    artifact = compile_once(preset, experts, dtype="float32", validate=False, **options).out_dir
    out = tmp_path_factory.mktemp("onnx") / f"{preset}.onnx"
    if preset != "tiny":
        return artifact, export_onnx(artifact, out, OPTIONS), None
    run = invoke("export", artifact, "-o", out, "--external-data", "--max-sequences", OPTIONS.max_sequences,
                 "--max-context", OPTIONS.max_context)
    assert run.exit_code == 0, run.output
    return artifact, written(out), run.stdout


def written(out: Path) -> ExportResult:
    """The ExportResult of the model the command wrote at ``out``: its inputs, outputs and
    cache mapping read back, the bytes of its directory."""
    model = onnx.load(str(out), load_external_data=False)
    cache_outputs = json.loads({p.key: p.value for p in model.metadata_props}["k3compile.cache_outputs"])
    files = sum(f.stat().st_size for f in out.parent.iterdir())
    return ExportResult(out, 0.0, files, tuple(i.name for i in model.graph.input),
                        tuple(o.name for o in model.graph.output), cache_outputs)


@pytest.fixture(scope="module")
def prefill(exported, tmp_path_factory):
    """The same artifact's prefill program (``--phase prefill``): ``tiny`` through the
    command line, the others through the API."""
    artifact, result, stdout = exported
    out = tmp_path_factory.mktemp("onnx-prefill") / result.path.name
    if stdout is None:
        return export_onnx(artifact, out, PREFILL)
    run = invoke("export", artifact, "-o", out, "--phase", "prefill", "--max-sequences", PREFILL.max_sequences,
                 "--max-context", PREFILL.max_context)
    assert run.exit_code == 0, run.output
    return written(out)


@pytest.fixture(scope="module")
def kept(exported, tmp_path_factory):
    """The same artifact exported with its k3 ops kept (``--keep-k3-ops``): ``tiny``
    through the command line, the others through the API."""
    artifact, result, stdout = exported
    out = tmp_path_factory.mktemp("onnx-kept") / result.path.name
    if stdout is None:
        export_onnx(artifact, out, ExportOptions(**{**OPTIONS.__dict__, "k3_ops": "keep"}))
    else:
        run = invoke("export", artifact, "-o", out, "--keep-k3-ops", "--max-sequences", OPTIONS.max_sequences,
                     "--max-context", OPTIONS.max_context)
        assert run.exit_code == 0, run.output
    return onnx.load(str(out))


def test_the_model_passes_the_full_check_and_names_its_cache_outputs(exported):
    _, result, _ = exported
    model = onnx.load(str(result.path))
    onnx.checker.check_model(model, full_check=True)
    assert [i.name for i in model.graph.input][:len(STEP_INPUTS)] == list(STEP_INPUTS)
    meta = {p.key: p.value for p in model.metadata_props}
    assert json.loads(meta["k3compile.cache_outputs"]) == result.cache_outputs
    caches = [n for n in result.inputs if n.startswith("cache.")]
    assert [o.name for o in model.graph.output] == ["logits", *(f"{n}.next" for n in caches)]
    assert result.file_bytes >= result.path.stat().st_size > 0


def test_onnx_runtime_steps_equal_the_runtime_with_caches_fed_back(exported):
    """Three prompts prefilled by the runtime, then five greedy decode steps: each step's
    logits and every updated cache from ONNX Runtime equal the runtime's (its program on
    its own caches) within 1e-5 relative; ONNX Runtime's caches come from its previous
    step, so the round trip of every cache is exercised."""
    artifact, result, _ = exported
    rt = cpu_runtime(artifact, OPTIONS)
    ids, tokens = prefill_prompts(rt)
    session = ort.InferenceSession(str(result.path), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    caches = {n: t.numpy().copy() for n, t in zip(names[len(STEP_INPUTS):], rt.cache_tensors, strict=True)}
    for feeds, want in greedy_decode_steps(rt, ids, tokens, 5):
        outputs = dict(zip(result.outputs, session.run(None, {**feeds, **caches}), strict=True))
        assert_step_equals_the_runtime(outputs, want, rt, result.cache_outputs, caches)


def test_onnx_runtime_prefill_then_decode_equal_the_runtime(exported, prefill):
    """The prefill model (full check; the token count dynamic, the GEMM dispatch an If) on
    three new prompts (20 tokens: the If takes the tiled GEMM), then on a ragged batch of
    9 tokens (the GEMV) in which two sequences continue after their cached tokens and one
    starts, then two decode steps of the decode model: each step's logits and every
    updated cache from ONNX Runtime equal the runtime's own steps (its prefill and decode
    programs on its own caches) within 1e-5 relative, the caches of each ONNX Runtime step
    fed to the next."""
    artifact, decode, _ = exported
    onnx.checker.check_model(str(prefill.path), full_check=True)
    model = onnx.load(str(prefill.path), load_external_data=False)
    assert {p.key: p.value for p in model.metadata_props}["k3compile.phase"] == "prefill"
    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    assert dims["input_ids"] == dims["slot_mapping"] != dims["seq_lens"] and isinstance(dims["input_ids"][0], str)
    assert any(n.op_type == "If" for n in model.graph.node)  # the GEMM dispatch, taken at run time
    rt = cpu_runtime(artifact, OPTIONS)
    sessions = {r.path: ort.InferenceSession(str(r.path), providers=["CPUExecutionProvider"])
                for r in (prefill, decode)}
    assert prefill.inputs == decode.inputs and prefill.outputs == decode.outputs
    caches = {n: t.numpy().copy() for n, t in zip(prefill.inputs[len(STEP_INPUTS):], rt.cache_tensors, strict=True)}

    def run(result: ExportResult, feeds: dict, want: torch.Tensor) -> list[int]:
        outputs = dict(zip(result.outputs, sessions[result.path].run(None, {**feeds, **caches}), strict=True))
        return assert_step_equals_the_runtime(outputs, want, rt, result.cache_outputs, caches)

    prefill_then_decode(rt, lambda feeds, want: run(prefill, feeds, want), lambda feeds, want: run(decode, feeds, want))


@pytest.mark.parametrize("lengths", [[5, 0, 1, 17], [1], [0, 40, 2]], ids=str)
def test_prefill_decompositions_equal_the_references(lengths):
    """The standard-operator forms of the prefill ops against their references on packed
    sequences of ``lengths`` new tokens (0 and 1 among them) in scattered state slots, each
    continuing from a random state (KDA, short conv) or after cached positions (MLA): the
    outputs and every updated state within 1e-5 relative."""
    torch.manual_seed(len(lengths))
    T, N, H, D, C = sum(lengths), len(lengths), 4, 16, 24
    cu = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32)
    slots = torch.randperm(N + 3)[:N]

    def both(reference, form, args: tuple, mutated: int) -> None:
        copies = [a.clone() if i == mutated else a for i, a in enumerate(args)]
        want, got = reference(*args), form(*copies)
        assert relative_error(got.numpy(), want) < 1e-5
        assert relative_error(copies[mutated].numpy(), args[mutated]) < 1e-5

    x, weight, conv_state = torch.randn(T, C), torch.randn(C, 4), torch.randn(N + 3, C, 3)
    both(short_conv_prefill_reference, prefill_decompositions.short_conv_prefill, (x, weight, conv_state, cu, slots),
         2)
    q, k, v = torch.randn(T, H, D), torch.randn(T, H, D), torch.randn(T, H, D)
    g, beta = -5 * torch.sigmoid(torch.randn(T, H, D)), torch.sigmoid(torch.randn(T, H))
    both(kda_prefill_reference, prefill_decompositions.kda_prefill,
         (q, k, v, g, beta, torch.randn(N + 3, H, D, D), cu, slots, 0.25), 5)
    block_size, width, latent, rope = 16, 5, 32, 8
    kv_cache = torch.randn(N * width + 1, block_size, latent + rope)
    block_table = torch.randperm(N * width).add(1).view(N, width).int()
    seq_lens = torch.tensor(lengths, dtype=torch.int32) + torch.tensor([9, 30, 0, 3][:N], dtype=torch.int32)
    args = (torch.randn(T, H, D + rope), kv_cache, torch.randn(H * 2 * D, latent), cu, block_table, seq_lens, 0.2)
    want = mla_prefill_reference(*args)
    assert relative_error(prefill_decompositions.mla_prefill(*args).numpy(), want) < 1e-5


def test_decompositions_equal_the_references(tmp_path):
    """The forms that replace non-traceable references: routing as ONNX Runtime runs it
    (ONNX TopK breaks ties by the lower index, as the reference's stable sort; torch's CPU
    topk does not promise that) and MXFP4 decoding (every code and a spread of scales)."""
    from k3compile.checkpoint.mxfp4 import unpack_mxfp4

    class Route(torch.nn.Module):
        def forward(self, logits, bias):
            return sigmoid_topk_route(logits, bias, 4, True, 2.5)

    logits = torch.randn(6, 32)
    logits[:, 5] = logits[:, 9] = 3.0  # a tie: the reference puts id 5 first
    bias = torch.zeros(32)
    want = k3_op_definitions()["sigmoid_topk_route"]._init_fn(logits, bias, 4, True, 2.5)
    path = tmp_path / "route.onnx"
    torch.onnx.export(Route(), (logits, bias), dynamo=True, verbose=False).save(path)
    weights, ids = ort.InferenceSession(str(path)).run(None, {"logits": logits.numpy(), "bias": bias.numpy()})
    assert np.array_equal(ids, want[1].numpy()) and np.allclose(weights, want[0].numpy(), rtol=1e-6)
    packed = torch.arange(256, dtype=torch.uint8).repeat(2, 1)  # every pair of codes
    scale = torch.tensor([[120, 127, 130, 0, 254, 1, 127, 127] * 2] * 2, dtype=torch.uint8)
    assert torch.equal(decode_mxfp4(packed, scale, torch.float32), unpack_mxfp4(packed, scale, torch.float32))


def test_what_cannot_be_exported_is_refused_before_any_work(compile_once, tmp_path):
    """FP8 MLA caches, a rank out of range (of a TP1 and a TP2 artifact), a wrong file name
    and a context-parallel prefill (ops without decompositions): each a clear error, no
    file written."""
    tp1 = compile_once("tiny", "mxfp4", dtype="float32", validate=False).out_dir
    tp2 = compile_once("tiny", "mxfp4", tp=2, dtype="float32").out_dir
    out = tmp_path / "m.onnx"
    with pytest.raises(ValueError, match=r"rank 2: the artifact has ranks 0..1"):
        export_onnx(tp2, out, ExportOptions(rank=2))
    fp8 = compile_once("tiny", "mxfp4", dtype="float32", kv_cache_dtype="fp8").out_dir
    with pytest.raises(ValueError, match=r"MLA caches are float8_e4m3fn, .* compile with --kv-cache-dtype auto"):
        export_onnx(fp8, out, OPTIONS)
    with pytest.raises(ValueError, match=r"rank 1: the artifact has ranks 0..0"):
        export_onnx(tp1, out, ExportOptions(rank=1))
    with pytest.raises(ValueError, match=r"must end in \.onnx"):
        export_onnx(tp1, tmp_path / "m.txt", OPTIONS)
    with pytest.raises(ValueError, match="phase: one of decode, prefill"):
        ExportOptions(phase="train")
    with pytest.raises(ValueError, match="k3_ops: one of decompose, keep, got 'inline'"):
        ExportOptions(k3_ops="inline")
    graph = torch.fx.Graph()  # a DCP2 prefill's op, decomposed or kept
    graph.call_function(torch.ops.k3.dcp_history_order.default, ())
    graph.output(None)
    for k3_ops in K3_OPS_MODES:
        with pytest.raises(ValueError, match=r"the prefill program's k3 ops dcp_history_order \(context parallelism, "
                                             r"DCP2\) do not export yet, decomposed or kept"):
            check_program(torch.fx.GraphModule({}, graph), ExportOptions(phase="prefill", k3_ops=k3_ops), "ONNX",
                          True, 2, 2)
    assert list(tmp_path.iterdir()) == []


def test_weights_embedded_or_external(exported, tmp_path):
    """The API embeds the weights; ``k3compile export --external-data`` (the ``tiny`` case)
    writes them to FILE.data beside the model and says what it wrote; a bad option is
    one line on stderr and nothing written."""
    artifact, result, stdout = exported
    data = result.path.with_name(result.path.name + ".data")
    if stdout is None:
        assert not data.exists() and result.file_bytes == result.path.stat().st_size
        return
    assert re.search(r"wrote .*tiny\.onnx \(\d+\.\d MiB with its data\) in \d+\.\d s: 7 step inputs and "
                     r"19 caches in, the logits and 19 caches out", " ".join(stdout.split()))
    assert data.stat().st_size > result.path.stat().st_size  # the weights live there
    assert_one_line_error(invoke("export", artifact, "-o", tmp_path / "m.onnx", "--format", "tflite"),
                          "--format: unknown format 'tflite'; choose one of onnx, mlir")
    assert list(tmp_path.iterdir()) == []


def test_kept_k3_ops_are_one_k3_node_a_call(exported, kept):
    """``--keep-k3-ops``: the ``k3`` nodes are the stored program's k3 op calls (as a
    multiset), with their registered schemas the full check passes, the decompositions'
    forms (routing's TopK, the cache writes' ScatterND) are gone, the metadata names each
    op's torch reference, and the inputs, outputs and cache mapping are the decomposed
    model's. ONNX Runtime has no kernels for the domain."""
    artifact, result, _ = exported
    def tensors(args) -> int:
        return sum(len(a) if isinstance(a, (list, tuple)) else 1 for a in args
                   if isinstance(a, (torch.fx.Node, list, tuple)))

    calls = stored_k3_calls(artifact, "decode")
    stored = Counter(str(n.target).split(".")[1] for n in calls)
    nodes = [n for n in kept.graph.node if n.domain == K3_DOMAIN]
    assert Counter(n.op_type for n in nodes) == stored
    assert Counter((n.op_type, len(n.input)) for n in nodes) == \
           Counter((str(n.target).split(".")[1], tensors(n.args)) for n in calls)  # a tensor input each
    assert {n.domain for n in kept.graph.node} == {"", K3_DOMAIN}
    assert {"TopK", "ScatterND"}.isdisjoint(n.op_type for n in kept.graph.node)
    onnx.checker.check_model(kept, full_check=True)
    for node in kept.graph.node:
        if node.domain == K3_DOMAIN:
            signature = kept_signature(node.op_type)
            assert len(node.output) == len(signature.outputs)
            assert {a.name for a in node.attribute} == {a for a, _ in signature.attributes}
    assert {o.domain: o.version for o in kept.opset_import}[K3_DOMAIN] == 1
    decomposed = onnx.load(str(result.path), load_external_data=False)
    for field in ("input", "output"):
        assert [(v.name, v.type) for v in getattr(kept.graph, field)] == \
               [(v.name, v.type) for v in getattr(decomposed.graph, field)]
    meta = {p.key: p.value for p in kept.metadata_props}
    assert json.loads(meta["k3compile.cache_outputs"]) == result.cache_outputs and meta["k3compile.k3_ops"] == "keep"
    references = json.loads(meta["k3compile.k3_op_references"])
    assert references.keys() == stored.keys()
    assert all(r.startswith("k3compile.ops.") and r.endswith(f".{n}") for n, r in references.items())
    with pytest.raises(Exception, match=r"k3:\w+\(-1\) is not a registered function/op"):
        ort.InferenceSession(kept.SerializeToString(), providers=["CPUExecutionProvider"])


def stored_k3_calls(artifact: Path, phase: str) -> list[torch.fx.Node]:
    """The k3 op calls of the artifact's stored ``phase`` program."""
    from k3compile.artifact import load_artifact

    program = load_artifact(artifact).programs[phase].graph_module
    return [n for n in program.graph.nodes if n.op == "call_function" and str(n.target).startswith("k3.")]


def test_kept_prefill_k3_ops_are_one_k3_node_a_call(compile_once, tmp_path):
    """``--keep-k3-ops --phase prefill`` (``tiny``): the ``k3`` nodes are the stored prefill
    program's k3 op calls (as a multiset), the ones that update a cache (the prefill's
    short conv and KDA, the MLA cache write) with an ``<argument>_out`` output more, and
    the full check passes with their schemas."""
    artifact = compile_once("tiny", "mxfp4", dtype="float32", validate=False).out_dir
    result = export_onnx(artifact, tmp_path / "k3.onnx", ExportOptions(**{**PREFILL.__dict__, "k3_ops": "keep"}))
    model = onnx.load(str(result.path))
    nodes = [n for n in model.graph.node if n.domain == K3_DOMAIN]
    assert Counter(n.op_type for n in nodes) == Counter(str(n.target).split(".")[1]
                                                        for n in stored_k3_calls(artifact, "prefill"))
    outputs = {n.op_type: len(n.output) for n in nodes}
    assert outputs["kda_prefill"] == outputs["short_conv_prefill"] == 2 and outputs["mla_prefill"] == 1
    assert json.loads({p.key: p.value for p in model.metadata_props}["k3compile.k3_op_references"])[
        "kda_prefill"] == "k3compile.ops.kda.kda_prefill"
    onnx.checker.check_model(model, full_check=True)


def test_kept_signatures_follow_the_torch_schemas():
    """Tensor arguments in order with a Tensor[] last (ONNX's variadic input), scalars as
    attributes, and one ``<argument>_out`` output per argument the op updates in place."""
    mix = kept_signature("attn_res_mix")
    assert (mix.inputs, mix.tensor_list, mix.attributes) == (("partial", "proj", "norm"), "blocks", (("eps", "FLOAT"),))
    conv = kept_signature("short_conv_decode")
    assert conv.mutated == ("conv_state",) and conv.outputs == ("output", "conv_state_out")
    assert kept_signature("mla_cache_write").outputs == ("kv_cache_out",)
    assert kept_signature("sigmoid_topk_route").attributes == (("top_k", "INT"), ("renormalize", "INT"),
                                                               ("scaling", "FLOAT"))
