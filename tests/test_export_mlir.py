"""MLIR export of an artifact's decode and prefill programs (k3compile/export, issue #25):
the torch-dialect module has the runtime's signature, and its lowering to
linalg-on-tensors, run on the CPU by torch-mlir's execution engine, computes what the
runtime computes, step after step with the caches it returns fed back in."""

from __future__ import annotations

import re

import pytest
import torch

from cli_runs import assert_one_line_error, invoke
from export_steps import (
    assert_step_equals_the_runtime,
    cpu_runtime,
    greedy_decode_steps,
    prefill_prompts,
    prefill_then_decode,
)
from k3compile.export import ExportOptions, LinalgModule, export_mlir
from k3compile.export.mlir_export import index_as_one_gather, size_mod_as_floordiv
from k3compile.export.trace import STEP_INPUTS

OPTIONS = ExportOptions(max_sequences=4, max_context=160)  # h200's blocks are 64 tokens
# (preset, experts, compile options), as tests/test_export_onnx.py: the CPU pipeline, the
# h200 pipeline's fused ops and the all-linear preset, in CI (an export and its
# compilation take 30-60 s each)
CASES = [("tiny", "mxfp4", {}), ("tiny-h24", "mxfp4", {"target": "h200"}), ("tiny-linear", "bf16", {})]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: c[0])
def linalg(request, compile_once, tmp_path_factory):
    """(artifact, the compiled LinalgModule, the command's output or None): ``tiny``
    exported through the command line, the others through the API."""
    preset, experts, options = request.param
    artifact = compile_once(preset, experts, dtype="float32", validate=False, **options).out_dir
    out = tmp_path_factory.mktemp("mlir") / f"{preset}.mlir"
    stdout = None
    if preset == "tiny":
        run = invoke("export", artifact, "-o", out, "--format", "mlir", "--dialect", "linalg", "--max-sequences",
                     OPTIONS.max_sequences, "--max-context", OPTIONS.max_context)
        assert run.exit_code == 0, run.output
        stdout = run.stdout
    else:
        export_mlir(artifact, out, OPTIONS, dialect="linalg")
    return artifact, LinalgModule(out), stdout


def test_the_linalg_module_steps_equal_the_runtime_with_caches_fed_back(linalg):
    """Three prompts prefilled by the runtime, then five greedy decode steps, the batch
    (3) not the traced one (2): each step's logits and every updated cache from the
    execution engine equal the runtime's (its program on its own caches) within 1e-5
    relative; the engine's caches come from its previous step."""
    artifact, module, _ = linalg
    rt = cpu_runtime(artifact, OPTIONS)
    ids, tokens = prefill_prompts(rt)
    assert module.inputs[:len(STEP_INPUTS)] == list(STEP_INPUTS)
    caches = {n: t.numpy().copy() for n, t in zip(module.inputs[len(STEP_INPUTS):], rt.cache_tensors, strict=True)}
    for feeds, want in greedy_decode_steps(rt, ids, tokens, 5):
        outputs = module.run({**feeds, **caches})
        assert list(outputs) == module.outputs
        assert_step_equals_the_runtime(outputs, want, rt, module.metadata["k3compile.cache_outputs"], caches)


@pytest.mark.sweep  # its export and compile take 2.5 minutes on the 2-core CPU
def test_the_prefill_module_then_the_decode_module_equal_the_runtime(linalg, tmp_path_factory):
    """The prefill program exported to linalg (traced for 16 tokens or more, the tiled
    GEMM's branch) on three new prompts (20 tokens), then on a ragged batch of 9 tokens
    in which two sequences continue and one starts (the tiled GEMM pads them to 16 rows:
    the same product), then two steps of the decode module: each step's logits and every
    updated cache equal the runtime's own steps within 1e-5 relative, the caches of each
    step fed to the next."""
    artifact, decode, _ = linalg
    out = tmp_path_factory.mktemp("mlir-prefill") / "prefill.mlir"
    export_mlir(artifact, out, ExportOptions(**{**OPTIONS.__dict__, "phase": "prefill"}), dialect="linalg")
    prefill = LinalgModule(out)
    assert prefill.inputs == decode.inputs and prefill.outputs == decode.outputs
    assert prefill.metadata["k3compile.phase"] == "prefill"
    rt = cpu_runtime(artifact, OPTIONS)
    caches = {n: t.numpy().copy() for n, t in zip(prefill.inputs[len(STEP_INPUTS):], rt.cache_tensors, strict=True)}

    def run(module: LinalgModule, feeds: dict, want: torch.Tensor) -> list[int]:
        outputs = module.run({**feeds, **caches})
        return assert_step_equals_the_runtime(outputs, want, rt, module.metadata["k3compile.cache_outputs"], caches)

    prefill_then_decode(rt, lambda feeds, want: run(prefill, feeds, want), lambda feeds, want: run(decode, feeds, want))


def test_the_torch_dialect_module_has_the_runtime_signature(compile_once, tmp_path):
    """The default dialect: one function ``@decode`` whose arguments are the step's
    tensors (batch and block table width dynamic) and the caches at their runtime shapes,
    whose results are the logits and the caches; only torch-mlir's own ops (every k3 op
    decomposed, no cond); the weights embedded; the names and the cache mapping in the
    module's attributes. The runner refuses it: it runs linalg modules."""
    artifact = compile_once("tiny", "mxfp4", dtype="float32", validate=False).out_dir
    result = export_mlir(artifact, tmp_path / "tiny.mlir", OPTIONS)
    text = result.path.read_text()
    assert result.file_bytes == result.path.stat().st_size
    rt = cpu_runtime(artifact, OPTIONS)
    caches = [f"!torch.vtensor<[{','.join(map(str, c.shape))}],f32>" for c in rt.cache_tensors]
    steps = ["[?],si64", "[?],si32", "[?],si32", "[?],si64", "[?,?],si32", "[?],si64", "[?],si64"]
    arguments = [f"!torch.vtensor<{s}>" for s in steps] + caches
    vocab = rt.artifact.info.config.vocab_size
    signature = (", ".join(f"%arg{i}: {t}" for i, t in enumerate(arguments))
                 + f") -> ({', '.join([f'!torch.vtensor<[?,{vocab}],f32>', *caches])})")
    assert f"func.func @decode({signature}" in text
    assert "torch.operator" not in text and "k3." not in text and "torch.prim.If" not in text
    assert "dense_resource<" in text
    names = '", "'.join(result.inputs)
    assert f'k3compile.inputs = ["{names}"]' in text
    for output, cache in result.cache_outputs.items():
        assert f'{output} = "{cache}"' in text
    assert 'k3compile.phase = "decode"' in text and "k3compile.rank = 0 : i64" in text
    with pytest.raises(ValueError, match="a torch-dialect module; export it with --dialect linalg to run it"):
        LinalgModule(result.path)


@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_kept_k3_ops_are_torch_operators(compile_once, tmp_path, phase):
    """``k3_ops="keep"``, decode and prefill: every k3 op call of the stored program is one
    ``torch.operator`` (``torch.k3.<name>``, or ``torch.k3_functional.<name>`` for an op
    that updates a cache in place), nothing else is a ``torch.operator``, and the module
    keeps the signature's attributes and names each op's torch reference."""
    from collections import Counter

    from k3compile.artifact import load_artifact
    from k3compile.export.custom_ops import kept_signature

    artifact = compile_once("tiny", "mxfp4", dtype="float32", validate=False).out_dir
    result = export_mlir(artifact, tmp_path / "tiny.mlir",
                         ExportOptions(**{**OPTIONS.__dict__, "k3_ops": "keep", "phase": phase}))
    text = result.path.read_text()
    program = load_artifact(artifact).programs[phase].graph_module
    stored = Counter(str(n.target).split(".")[1] for n in program.graph.nodes
                     if n.op == "call_function" and str(n.target).startswith("k3."))
    operators = Counter(re.findall(r'torch\.operator "([^"]+)"', text))
    want = Counter({f"torch.{'k3_functional' if kept_signature(n).mutated else 'k3'}.{n}": c
                    for n, c in stored.items()})
    assert operators == want and any("k3_functional" in n for n in operators)
    names = '", "'.join(result.inputs)
    assert f'k3compile.inputs = ["{names}"]' in text and 'k3compile.k3_ops = "keep"' in text
    assert 'rms_norm = "k3compile.ops.norm.rms_norm"' in text


def test_what_cannot_be_exported_is_refused_before_any_work(compile_once, tmp_path):
    """The ONNX export's refusals (FP8 MLA caches, a rank out of range), the
    collectives of a TP2 program in the linalg dialect, a batch range in which the GEMM
    dispatch would branch at run time, and options that are not MLIR's: each a clear
    error, no file written."""
    tp1 = compile_once("tiny", "mxfp4", dtype="float32", validate=False).out_dir
    tp2 = compile_once("tiny", "mxfp4", tp=2, dtype="float32").out_dir
    fp8 = compile_once("tiny", "mxfp4", dtype="float32", kv_cache_dtype="fp8").out_dir
    out = tmp_path / "m.mlir"
    with pytest.raises(ValueError, match=r"collectives \(.*all_reduce.*\), which MLIR's linalg dialect cannot express: "
                                         r"export a TP1 artifact \(this one is TP2, DCP1\), or to a format that keeps"):
        export_mlir(tp2, out, OPTIONS, dialect="linalg")
    with pytest.raises(ValueError, match=r"MLA caches are float8_e4m3fn, .* to MLIR yet: compile with "
                                         r"--kv-cache-dtype auto"):
        export_mlir(fp8, out, OPTIONS)
    with pytest.raises(ValueError, match=r"rank 1: the artifact has ranks 0..0"):
        export_mlir(tp1, out, ExportOptions(rank=1))
    with pytest.raises(ValueError, match=r"max_sequences 16: the decode program picks its GEMM by the batch .* "
                                         r"at most 15 sequences for MLIR"):
        export_mlir(tp1, out, ExportOptions(max_sequences=16))
    with pytest.raises(ValueError, match=r"must end in \.mlir"):
        export_mlir(tp1, tmp_path / "m.onnx", OPTIONS)
    with pytest.raises(ValueError, match="dialect: one of torch, linalg, got 'tosa'"):
        export_mlir(tp1, out, OPTIONS, dialect="tosa")
    with pytest.raises(ValueError, match="external_data is for ONNX"):
        export_mlir(tp1, out, ExportOptions(external_data=True))
    with pytest.raises(ValueError, match="kept k3 ops export to the torch dialect only"):
        export_mlir(tp1, out, ExportOptions(k3_ops="keep"), dialect="linalg")
    assert list(tmp_path.iterdir()) == []


def test_the_command_says_what_it_wrote_and_refuses_bad_options(linalg, tmp_path):
    """``k3compile export --format mlir`` (the ``tiny`` case) says what it wrote; a bad
    option is one line on stderr and nothing written. The cases exported through the API
    have the signature the command reports: the step inputs and every cache in, the
    logits and every cache out."""
    artifact, module, stdout = linalg
    if stdout is None:
        caches = len(module.inputs) - len(STEP_INPUTS)
        assert caches > 0 and module.outputs[0] == "logits" and len(module.outputs) == 1 + caches
        return
    assert re.search(r"wrote .*tiny\.mlir \(\d+\.\d MiB\) in \d+\.\d s: 7 step inputs and 19 caches in, the logits "
                     r"and 19 caches out", " ".join(stdout.split()))
    assert_one_line_error(invoke("export", artifact, "-o", tmp_path / "m.mlir", "--format", "mlir", "--dialect",
                                 "tosa"), "--dialect: unknown dialect 'tosa'; choose one of torch, linalg")
    assert_one_line_error(invoke("export", artifact, "-o", tmp_path / "m.mlir", "--format", "mlir",
                                 "--external-data"), "--external-data: ONNX only")
    assert_one_line_error(invoke("export", artifact, "-o", tmp_path / "m.onnx", "--dialect", "linalg"),
                          "--dialect linalg: MLIR only")
    assert list(tmp_path.iterdir()) == []


def test_size_remainders_become_floor_divisions():
    """The form that replaces ``a % b`` of sizes for torch-mlir's importer: Python's
    remainder (of a negative ``a`` too) at every traced size."""

    class Pad(torch.nn.Module):
        def forward(self, x):
            return x.new_zeros(x.shape[0] + (-x.shape[0]) % 16)

    program = torch.export.export(Pad(), (torch.zeros(5),), dynamic_shapes=({0: torch.export.Dim("n", max=64)},))
    assert size_mod_as_floordiv(program.graph_module) == 1
    assert "mod" not in program.graph_module.code
    for n in (1, 5, 16, 17, 33):
        assert program.module()(torch.zeros(n)).shape == (n + (-n) % 16,)


def test_two_index_tensors_become_one_gather():
    """The form that replaces ``x[i, j]`` for torch-mlir's linalg lowering: equal to the
    indexing, negative indices included; other indexing is left alone."""
    x = torch.randn(5, 4, 3)
    i, j = torch.tensor([[0, 4], [-1, 2]]), torch.tensor([[3, -4], [1, 0]])
    assert torch.equal(index_as_one_gather(x, [i, j]), x[i, j])
    assert torch.equal(index_as_one_gather(x, [i, j, torch.tensor(2)]), x[i, j, 2])
    assert index_as_one_gather(x, [i]) is NotImplemented
    assert index_as_one_gather(x, [None, j]) is NotImplemented
    assert index_as_one_gather(x, [x[:, 0, 0] > 0, j[0]]) is NotImplemented
