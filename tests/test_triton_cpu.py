"""The k3 ops' Triton kernels on the CPU, under Triton's interpreter: what ships to GPUs, run in CI.

On the CPU the runtime runs each k3 op's torch reference unless ``RuntimeOptions.kernels``
is "triton": then it registers the GPU's kernels for CPU tensors (``register_gpu_kernels("cpu")``),
which Triton runs in its interpreter, so the dispatch a GPU runs (which shapes go to which
kernel, the launch plans, the casts) runs here too.

End to end: ``tiny-h24`` with MXFP4 experts compiled for ``h200`` at TP2 / DCP2 (every
mission pass changes the decode graph: MXFP4 experts, the deduplicated MoE tail, the fused
KDA decode step, the DCP split with its all-to-all merge, the heads padded to the split-KV
kernel's tile) runs on two gloo ranks, first with the torch references, then with the
Triton kernels (and the AttnRes mixes fused with their norms). Greedy tokens are the same, logits within ``TOLERANCE``, and every k3 op
node with a Triton kernel launched exactly its kernels (counted per kernel by
``k3compile.runtime.kernels.kernel_launches``): no op fell back to its reference. Once
with the model dtype's MLA cache and once with an FP8 one (``--kv-cache-dtype fp8``: the
FP8 cache write and the split-KV kernel's FP8 path; the ranks' interpreter rounds to
nearest as GPUs do, tests/interpreter_rounding.py).

The Triton mode registers the kernels for the whole process, for good: it runs only in the
spawned ranks, never in the pytest process, whose other tests expect the references.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter

import pytest
import torch
from torch.fx import GraphModule

from k3compile.artifact import load_artifact, read_artifact_info
from k3compile.distributed import RankPool
from k3compile.runtime import Runtime, RuntimeOptions

PROMPT = [5, 9]  # more than one token: the prefill program (one token is a decode step)
NEW_TOKENS = 2  # greedy: one from the prefill's logits, one from a decode step's
#: max |triton - reference| / max |reference| of each step's logits: the pipeline's
#: validation rtol. Measured ~1e-6: fp32 everywhere, the MXFP4 experts take fp32 z as two
#: bf16 parts (~16 significant bits), accumulation orders differ.
TOLERANCE = 1e-4

#: The Triton kernels each k3 op launches at these shapes (the ops missing here have no
#: kernel: their reference runs). MXFP4 experts: pair-major below 3,072 pairs (w13, w2, the
#: k combine); the MoE tail's GEMV + add: the split-K kernel up to 16 rows; MLA decode:
#: split-KV with a combine (the interpreter counts as 8 SMs: several KV splits).
KERNELS_OF_OP = {
    "k3.rms_norm.default": ("_rms_norm_kernel",),
    "k3.attn_res_mix.default": ("_attn_res_mix_kernel",),
    "k3.attn_res_mix_norm.default": ("_attn_res_mix_kernel",),
    "k3.sigmoid_topk_route.default": ("_route_kernel",),
    "k3.moe_experts_mxfp4.default": ("_expert_gemm_kernel", "_expert_gemm_kernel", "_combine_kernel"),
    "k3.add_rank_block_linear.default": ("_rows_gemv_add_kernel",),
    "k3.kda_decode_fused.default": ("kda_decode_kernel",),
    "k3.kda_decode_fused_proj.default": ("kda_decode_kernel",),
    "k3.situ_and_mul.default": ("_situ_and_mul_kernel",),
    "k3.situ_and_mul_proj.default": ("_situ_and_mul_kernel",),
    "k3.mla_input_proj.default": ("_mla_input_proj_kernel",),
    "k3.moe_input_proj.default": ("_route_kernel", "_moe_input_kernel"),
    "k3.mla_decode_split_kv.default": ("_mla_decode_split_kv_kernel", "_combine_splits_kernel"),
    "k3.dcp_pack.default": ("_dcp_pack_kernel",),
    "k3.dcp_merge.default": ("_dcp_merge_kernel",),
    "k3.mla_prefill_partial.default": ("_mla_attention_kernel",),
    # under DCP the prefill runs the DCP1 op over the all-gathered history; for tiny-h24's
    # two-token prompt its expanded form takes fewer FLOPs (mla_prefill_expanded.prefill_form)
    "k3.mla_prefill.default": ("_mla_expanded_kernel",),
    "k3.short_conv_prefill.default": ("_chunk_table_kernel", "_short_conv_kernel", "_conv_state_kernel"),
}
#: ... and with an FP8 cache
FP8_CACHE_WRITE = {"k3.mla_cache_write.default": ("_mla_cache_write_fp8_kernel",)}
#: kernels of both phases: the AttnRes mixes (fused with their norms), the MoE input and tail, the MLA input
BOTH_PHASES = {"_attn_res_mix_kernel", "_rms_norm_kernel", "_route_kernel", "_expert_gemm_kernel", "_combine_kernel",
               "_rows_gemv_add_kernel", "_situ_and_mul_kernel", "_mla_input_proj_kernel", "_moe_input_kernel"}
#: decode under DCP: attention over each rank's positions, merged (the prefill gathers the
#: history instead: passes/split_mla_context.py)
DECODE_ONLY = {"kda_decode_kernel", "_mla_decode_split_kv_kernel", "_combine_splits_kernel", "_dcp_pack_kernel",
               "_dcp_merge_kernel"}
#: prefill under DCP attends over the gathered history (the expanded form's kernel), the KDA
#: short convs run their prefill kernels; k3.kda_prefill
#: has kernels (runtime/kernels/kda_prefill.py) for head dims >= 16: tiny-h24's are 8, so its
#: reference runs here (tests/test_kernel_kda_prefill.py covers the kernels)
PREFILL_ONLY = {"_mla_expanded_kernel", "_chunk_table_kernel", "_short_conv_kernel", "_conv_state_kernel"}


def _k3_ops(module: GraphModule) -> dict[str, int]:
    """k3 op nodes of a program, its ``torch.cond`` branches included."""
    return dict(Counter(str(n.target) for m in module.modules() if isinstance(m, GraphModule)
                        for n in m.graph.nodes if str(n.target).startswith("k3.")))


def _expected_launches(ops: dict[str, int], fp8: bool) -> dict[str, int]:
    """The kernel launches of one run of a program with these k3 op nodes."""
    kernels_of_op = {**KERNELS_OF_OP, **FP8_CACHE_WRITE} if fp8 else KERNELS_OF_OP
    want: Counter[str] = Counter()
    for op, n in ops.items():
        for kernel in kernels_of_op.get(op, ()):
            want[kernel] += n
    return dict(want)


def _generate(rank: int, world: int, out) -> dict[str, object]:
    """On one rank: greedy generation with the references, then with the Triton kernels
    (the references first: registering is for good), each step's logits and kernel
    launches, and the k3 ops of the two programs."""
    from interpreter_rounding import rounds_like_gpus

    from k3compile.runtime.kernels import kernel_launches, reset_kernel_launches

    torch.set_num_threads(1)
    artifact = load_artifact(out, world_size=world)  # once: loading the programs is most of a rank's time
    result: dict[str, object] = {"ops": {phase: _k3_ops(p.graph_module) for phase, p in artifact.programs.items()}}
    for kernels in ("reference", "triton"):
        options = RuntimeOptions(max_sequences=1, max_context=8, kernels=kernels)
        rt = Runtime(artifact, rank, torch.device("cpu"), options)
        tokens, logits, launches = [], [], []
        for step in range(NEW_TOKENS):
            reset_kernel_launches()
            with rounds_like_gpus():
                if step == 0:
                    (seq,), step_logits = rt.prefill([PROMPT])
                else:
                    step_logits = rt.decode([seq], [tokens[-1]])
            launches.append(kernel_launches())
            logits.append(step_logits[0])
            tokens.append(int(step_logits[0].argmax()))
        result[kernels] = {"tokens": tokens, "logits": logits, "launches": launches, "triton": rt.triton_kernels}
    return result


@pytest.mark.slow
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_h200_artifact_runs_its_triton_kernels_on_cpu_ranks_like_the_references(compile_once, monkeypatch,
                                                                                  kv_cache_dtype):
    out = compile_once("tiny-h24", "mxfp4", tp=2, dcp=2, target="h200", dtype="float32",
                       kv_cache_dtype=kv_cache_dtype).out_dir
    info = read_artifact_info(out)
    fp8 = kv_cache_dtype == "fp8"
    assert info.kv_cache_dtype == (torch.float8_e4m3fn if fp8 else torch.float32)
    assert (info.target, info.tp, info.dcp, info.block_size) == ("h200", 2, 2, 64)
    changed = {p["pass"] for p in info.passes if p["phase"] == "decode" and p["changed"]}
    assert {"mxfp4_experts", "dedup_replicated_linear", "fuse_kda_decode", "split_mla_context",
            "pad_attention_heads", "fuse_attn_res_norm", "merge_mla_projections", "merge_moe_input"} <= changed

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the ranks' Triton interprets, on a GPU machine too
    with RankPool(2) as ranks:
        per_rank = ranks.run(_generate, out)
    for rank in per_rank:
        ref, tri = rank["reference"], rank["triton"]
        assert not ref["triton"] and tri["triton"]
        assert tri["tokens"] == ref["tokens"] and len(ref["tokens"]) == NEW_TOKENS
        for got, want in zip(tri["logits"], ref["logits"]):
            assert (got - want).abs().max() <= TOLERANCE * want.abs().max()
        assert ref["launches"] == [{}] * NEW_TOKENS  # the references launch no Triton kernel
        prefill, decode = tri["launches"]
        writes = {"_mla_cache_write_fp8_kernel"} if fp8 else set()
        assert prefill == _expected_launches(rank["ops"]["prefill"], fp8)
        assert set(prefill) == BOTH_PHASES | PREFILL_ONLY | writes
        assert decode == _expected_launches(rank["ops"]["decode"], fp8)
        assert set(decode) == BOTH_PHASES | DECODE_ONLY | writes
        assert decode["kda_decode_kernel"] == 3 and decode["_mla_decode_split_kv_kernel"] == 2  # KDA, MLA layers


def test_cpu_kernels_need_the_interpreter_and_kernels_take_three_choices():
    """Registering for "cpu" refuses unless Triton runs interpreted: TRITON_INTERPRET set
    after triton's first import does not count (a fresh process; registering is for good).
    A bad ``kernels`` choice is refused when the options are made, and by the CLI."""
    code = (
        "import os, torch, triton\n"
        "os.environ['TRITON_INTERPRET'] = '1'  # too late: triton is imported\n"
        "from k3compile.runtime import kernels\n"
        "try:\n"
        "    kernels.register_gpu_kernels('cpu')\n"
        "except ValueError as e:\n"
        "    print(e)\n"
        "assert not kernels.registered('cpu') and not kernels.interpreted()\n"
        "assert not torch._C._dispatch_has_kernel_for_dispatch_key('k3::rms_norm', 'CPU')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "not running under its interpreter" in done.stdout and "TRITON_INTERPRET=1" in done.stdout

    with pytest.raises(ValueError, match="unknown choice 'fast'; choose one of auto, reference, triton"):
        RuntimeOptions(kernels="fast")
    from typer.testing import CliRunner

    from k3compile.cli import app

    result = CliRunner().invoke(app, ["run", "no-such-artifact", "--prompt", "1", "--kernels", "fast"])
    assert result.exit_code == 2 and "--kernels: unknown choice 'fast'" in result.stderr, result.output
