"""The kernel-mutant check: wrong kernels that the kernel tests must catch.

Each mutant replaces one exact snippet of a kernel source (present once) and runs the tests
that should catch it; a mutant is CAUGHT when at least one of them fails (pytest exit 1),
MISSED when they all pass. Everything runs in a copy of the sources in a temporary folder
(k3compile/, passes/, runtime/, tests/ and pyproject.toml, with k3compile/runtime and
k3compile/passes as symlinks to ../runtime and ../passes, the package's setuptools
package-dir mapping), imported through PYTHONPATH: the working tree is never modified. A
sanity run first checks that the copy, not the working tree, is what Python imports, and
that every test selection passes unmutated.

    make mutants                                   # every mutant (~20 minutes on 2 cores)
    .venv/bin/python tests/kernel_mutants.py kda_gate_sign rows_rms_eps   # some of them

Exits non-zero if a mutant is missed or a run errs (not exit 0 or 1: a collection error, a
crash, a timeout). Not a pytest module (no test_ prefix): ``make test`` does not run it.
Results and the command: docs/testing.md, "Kernel mutants".
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COPIED = ("k3compile", "passes", "runtime", "tests", "pyproject.toml")
TIMEOUT_S = 1800


@dataclass(frozen=True)
class Selection:
    """Tests to run: one test file and a pytest ``-k`` expression."""

    file: str
    k: str

    def args(self) -> list[str]:
        return [self.file, "-k", self.k]


KDA = Selection("tests/test_kernel_kda_decode.py",
                "test_fused_matches_unfused_chain or test_op_kernel_prepares or (test_k3_per_rank_shapes and not amd)")
SPLIT_KV = Selection("tests/test_kernel_mla_decode.py",
                     "test_split_kv_matches or test_split_kv_tiles or test_split_kv_head_tiles or "
                     "test_split_kv_tensor_descriptor_tiles or test_split_kv_real or test_k3_split_kv")
ATTENTION = Selection("tests/test_kernel_mla_decode.py", "test_generic or test_prefill_equals or test_k3_generic")
ROWS = Selection("tests/test_kernel_rows.py", "test_rms_norm or test_splitk_kernel_matches or test_k3_tp8")
ROUTING = Selection("tests/test_kernel_moe.py", "test_route or test_routing_feeds")
EXPERTS = Selection("tests/test_kernel_moe.py", "pair_major or grouped_matches or split_k_w13 or fp32_and_fp16")
DCP = Selection("tests/test_context_parallel.py", "triton_kernel")
SPLIT_KV_FP8 = Selection("tests/test_kernel_mla_fp8.py", "split_kv_fp8")
ATTENTION_FP8 = Selection("tests/test_kernel_mla_fp8.py", "generic_and_prefill_fp8")
CACHE_WRITE_FP8 = Selection("tests/test_kernel_mla_fp8.py", "fp8_cache_write_kernel")
MLA_INPUT = Selection("tests/test_kernel_mla_input_proj.py", "row_strided_product or consecutive_weights")
MOE_INPUT = Selection("tests/test_kernel_moe_input.py", "one_product or consecutive")
KDA_PREFILL = Selection("tests/test_kernel_kda_prefill.py", "residue or continuation or stronger or slices")
MLA_EXPANDED = Selection("tests/test_kernel_mla_prefill_expanded.py", "matches_reference or residue or fp8 or windows")
PREFILL_PARTIAL = Selection("tests/test_kernel_mla_decode.py", "prefill_partial")
SHORT_CONV = Selection("tests/test_kernel_short_conv.py", "ragged")


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str  # relative to the repository root
    snippet: str  # exact source text, present exactly once
    replacement: str
    tests: Selection
    meaning: str


MUTANTS = [
    Mutant("kda_gate_sign", "runtime/kernels/kda_decode_kernel.py",
           "decay = tl.exp(lower_bound * tl.sigmoid(tl.exp(a_log) * a))",
           "decay = tl.exp(-lower_bound * tl.sigmoid(tl.exp(a_log) * a))", KDA,
           "fused KDA: the decay gate's sign flipped (the state grows by up to e^5 instead of decaying)"),
    Mutant("kda_state_not_written", "runtime/kernels/kda_decode_kernel.py",
           "tl.store(s_ptrs, tl.fma(s, decay[:, None], (beta * k)[:, None] * u[None, :]), eviction_policy=STATE_EVICT)",
           "pass  # mutant", KDA, "fused KDA: the updated state slice is never written back"),
    Mutant("kda_conv_state_not_shifted", "runtime/kernels/kda_decode_kernel.py",
           "            _shift_conv_state(q_ptr + i_b * q_stride, q_conv_state, qk_channels, cols, K)\n"
           "            _shift_conv_state(k_ptr + i_b * k_stride, k_conv_state, qk_channels, cols, K)\n",
           "            pass  # mutant\n", KDA,
           "fused KDA: with a head split over programs, the q / k conv states are not shifted"),
    Mutant("split_kv_combine_drops_a_split", "runtime/kernels/mla_split_kv.py",
           'mask=split < num_splits, other=float("-inf")) - m_max)',
           'mask=split < num_splits - 1, other=float("-inf")) - m_max)', SPLIT_KV,
           "split-KV MLA: the combine leaves out the last split"),
    Mutant("split_kv_context_off_by_one", "runtime/kernels/mla_split_kv.py",
           "valid = pos < kv_end", "valid = pos <= kv_end", SPLIT_KV,
           "split-KV MLA: the row at a split's end (the next split's first, or one past the context) counted"),
    Mutant("split_kv_block_row_in_64_token_blocks", "runtime/kernels/mla_split_kv.py",
           "row0 = block * block_size + n0 % block_size", "row0 = block * block_size + n0 % BLOCK_N", SPLIT_KV,
           "split-KV MLA: a descriptor tile's row in its cache block taken modulo the 32-row tile, not the "
           "block size (64-token blocks: every second tile re-reads the first)"),
    Mutant("split_kv_padding_rows_leak", "runtime/kernels/mla_split_kv.py",
           "head_ok = heads < num_heads", "head_ok = heads < tl.num_programs(0) * BLOCK_H", SPLIT_KV,
           "split-KV MLA: the padding rows of a head tile wider than the heads left are computed and "
           "stored (onto the next sequence's heads; past the last one's outputs)"),
    Mutant("prefill_causal_off_by_one", "runtime/kernels/mla_attention.py",
           "ctx - n_new + tok + 1", "ctx - n_new + tok", ATTENTION,
           "generic / prefill MLA: the causal limit excludes the token's own position"),
    Mutant("rows_splitk_partial_dropped", "runtime/kernels/rows.py",
           "for s in range(SPLIT_K):", "for s in range(SPLIT_K - 1):", ROWS,
           "rows GEMV: the last-arriving program sums all K splits but the last"),
    Mutant("rows_rms_eps_misplaced", "runtime/kernels/rows.py",
           "inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / width + eps)",
           "inv = 1.0 / (tl.sqrt(tl.sum(x * x, axis=0) / width) + eps)", ROWS,
           "RMSNorm: eps added to the root mean square instead of the mean square"),
    Mutant("route_not_renormalized", "runtime/kernels/routing.py",
           "sel_w = sel_w / (tl.sum(sel_w, axis=0) + 1e-20)", "sel_w = sel_w", ROUTING,
           "routing: the top-k weights not renormalised"),
    Mutant("route_bias_in_weights", "runtime/kernels/routing.py",
           "sel_w = tl.sigmoid(tl.load(logits_ptr + t * logits_stride + sel_id, mask=keep, other=0.0).to(tl.float32))",
           "sel_w = tl.sigmoid(tl.load(logits_ptr + t * logits_stride + sel_id, mask=keep, other=0.0).to(tl.float32))"
           " + tl.load(bias_ptr + sel_id, mask=keep, other=0.0).to(tl.float32)", ROUTING,
           "routing: the correction bias (selection only) added to the weights"),
    Mutant("mxfp4_nibbles_swapped", "runtime/kernels/moe.py",
           "word += lo * tl.load(x_ptrs + i).to(tl.float32)  # two statements: two fused multiply-adds\n"
           "        word += hi * tl.load(x_ptrs + i + 4).to(tl.float32)",
           "word += lo * tl.load(x_ptrs + (i ^ 1)).to(tl.float32)\n"
           "        word += hi * tl.load(x_ptrs + (i ^ 1) + 4).to(tl.float32)", EXPERTS,
           "MXFP4 experts (vector path): a byte's low E2M1 nibble taken as the odd column"),
    Mutant("mxfp4_e8m0_exponent_off_by_one", "runtime/kernels/moe.py",
           "(e << 23).to(tl.float32, bitcast=True)", "((e + 1) << 23).to(tl.float32, bitcast=True)", EXPERTS,
           "MXFP4 experts (vector path): E8M0 scale 2^(s - 126) instead of 2^(s - 127)"),
    Mutant("mxfp4_situ_betas_swapped", "runtime/kernels/moe.py",
           "v = tl.join(acc_a / beta, acc_b / linear_beta)", "v = tl.join(acc_a / linear_beta, acc_b / beta)",
           EXPERTS, "MXFP4 experts: SiTU's beta (4) and linear beta (25) swapped in the tanh arguments"),
    Mutant("split_kv_fp8_value_scale_dropped", "runtime/kernels/mla_split_kv.py",
           "p_v = p * sc_lat[:, None] if KV_FP8 else p", "p_v = p", SPLIT_KV_FP8,
           "split-KV MLA, FP8 cache: the values' per-row scales left out of the value product"),
    Mutant("split_kv_fp8_rope_scale_for_latent", "runtime/kernels/mla_split_kv.py",
           "q_pe, input_precision=DOT_PRECISION) * sc_pe[:, None]",
           "q_pe, input_precision=DOT_PRECISION) * sc_lat[:, None]", SPLIT_KV_FP8,
           "split-KV MLA, FP8 cache: the k_pe scores scaled by the latent's scale"),
    Mutant("attention_fp8_value_scale_dropped", "runtime/kernels/mla_attention.py",
           "p = p * sc_lat[None, :]  # the values' scales", "p = p", ATTENTION_FP8,
           "generic / prefill MLA, FP8 cache: the values' per-row scales left out"),
    Mutant("cache_write_fp8_one_scale", "runtime/kernels/mla_cache_write.py",
           "codes = tl.math.div_rn(x, tl.where(latent, scale_lat, scale_pe))",
           "codes = tl.math.div_rn(x, scale_lat)", CACHE_WRITE_FP8,
           "FP8 cache write: k_pe quantised with the latent's scale"),
    Mutant("dcp_merge_weights_not_normalized", "runtime/kernels/dcp_merge.py",
           "out = acc / tl.where(total > 0, total, 1.0)", "out = acc", DCP,
           "DCP merge: the members' rows weighted by exp(lse - max) without dividing by their sum"),
    Mutant("mla_input_kv_eps_from_q", "runtime/kernels/mla_input_proj.py",
           "rms_norm_row(c_ptr + row * c_stride, kv_norm_ptr, kv_row, L, kv_eps, BLOCK_L)",
           "rms_norm_row(c_ptr + row * c_stride, kv_norm_ptr, kv_row, L, q_eps, BLOCK_L)", MLA_INPUT,
           "MLA input kernel: the latent normalised with q_a_layernorm's eps"),
    Mutant("mla_input_k_pe_shifted", "runtime/kernels/mla_input_proj.py",
           "k_pe = tl.load(c_ptr + row * c_stride + L + rc", "k_pe = tl.load(c_ptr + row * c_stride + L + 1 + rc",
           MLA_INPUT, "MLA input kernel: k_pe read one column late"),
    Mutant("mla_input_gate_sign", "runtime/kernels/mla_input_proj.py",
           "sig = tl.where(g >= 0, 1.0, e) / (1.0 + e)", "sig = tl.where(g >= 0, e, 1.0) / (1.0 + e)", MLA_INPUT,
           "MLA input kernel: the gate is sigmoid(-g)"),
    Mutant("moe_input_gate_up_swapped", "runtime/kernels/moe_input.py",
           "h = _rounded(situ_glu(g, u, beta, linear_beta)", "h = _rounded(situ_glu(u, g, beta, linear_beta)",
           MOE_INPUT, "MoE input kernel: the shared expert's gate and up columns swapped"),
    Mutant("moe_input_z_unrounded", "runtime/kernels/moe_input.py",
           "zv = _rounded(tl.load(src + z_col + zc, mask=z_mask, other=0.0), z_ptr.dtype.element_ty, ROUND_BY_HAND)",
           "zv = tl.load(src + z_col + zc, mask=z_mask, other=0.0)", MOE_INPUT,
           "MoE input kernel: z stored by a plain cast (truncated under the interpreter)"),
    Mutant("kda_prefill_diagonal_in_A", "runtime/kernels/kda_prefill.py",
           "tl.store(a_s + off, tl.where(cols[None, :] < r[:, None]",
           "tl.store(a_s + off, tl.where(cols[None, :] <= r[:, None]", KDA_PREFILL,
           "KDA prefill: A takes its diagonal (a token's own key corrects its own value)"),
    Mutant("kda_prefill_block_decay_unsplit", "runtime/kernels/kda_prefill.py",
           "kt = tl.trans(k_c * tl.exp2(tl.minimum(g_ref[None, :] - g_c, MAX_EXP2)))",
           "kt = tl.trans(k_c)", KDA_PREFILL,
           "KDA prefill: A / Aq miss the decay from each key to the row block's start"),
    Mutant("kda_prefill_g_not_base2", "runtime/kernels/kda_prefill.py",
           "other=0.0), axis=0) * LOG2E)", "other=0.0), axis=0))", KDA_PREFILL,
           "KDA prefill: G stored in natural units while every decay takes it as base 2"),
    Mutant("kda_prefill_inverse_block_sign", "runtime/kernels/kda_prefill.py",
           "P = tl.dot(tl.where(same_block, M, 0.0), tl.where(same_block, 0.0, M)",
           "P = -tl.dot(tl.where(same_block, M, 0.0), tl.where(same_block, 0.0, M)", KDA_PREFILL,
           "KDA prefill: (I + A)^-1's blocks below the diagonal from (I - P)^-1 (P's sign)"),
    Mutant("kda_prefill_start_state_not_decayed", "runtime/kernels/kda_prefill_scan.py",
           "X = GL[:, None] * X + tl.dot(KEt", "X = X + tl.dot(KEt", KDA_PREFILL,
           "KDA prefill: the state carried to the next chunk skips the chunk's decay"),
    Mutant("kda_prefill_inverse_diagonal_sign", "runtime/kernels/kda_prefill.py",
           "X = eye - L", "X = eye + L", KDA_PREFILL,
           "KDA prefill: (I + L)^-1 as (I + L)(I + L^2)... (the first factor's sign)"),
    Mutant("kda_prefill_head_slice_dropped", "runtime/kernels/kda_prefill.py",
           "for d0 in range(0, D, BD):", "for d0 in range(0, BD, BD):", KDA_PREFILL,
           "KDA prefill: A / Aq sum only the first head-dim slice"),
    Mutant("chunk_table_first_token_shifted", "runtime/kernels/packed_chunks.py",
           "+ (ids - start).to(tl.int64) * CHUNK", "+ (ids - start + 1).to(tl.int64) * CHUNK", KDA_PREFILL,
           "chunk table: every chunk starts one chunk late"),
    Mutant("chunk_groups_first_chunk_shifted", "runtime/kernels/packed_chunks.py",
           "+ k * size).to(tl.int64), mask=in_grid)", "+ k * size + 1).to(tl.int64), mask=in_grid)", KDA_PREFILL,
           "chunk groups: every group starts one chunk late"),
    Mutant("kda_group_summary_starts_at_zero", "runtime/kernels/kda_prefill_scan.py",
           "X = tl.where(dk[:, None] == cols[None, :], 1.0, 0.0)", "X = tl.where(dk[:, None] == cols[None, :], 0.0, 0.0)",
           KDA_PREFILL, "KDA prefill: a chunk group's map M starts from 0, not I (start states lost)"),
    Mutant("kda_state_pass_u_uncorrected", "runtime/kernels/kda_prefill_scan.py",
           "o += tl.dot(Aq.to(dot_ty), Yw.to(dot_ty)",
           "o += tl.dot(Aq.to(dot_ty), (Y + tl.dot(W.to(dot_ty), Xw.to(dot_ty))).to(dot_ty)", KDA_PREFILL,
           "KDA prefill: the outputs take U~ instead of the values corrected by the chunk's start state"),
    Mutant("kda_state_pass_decay_of_this_chunk_again", "runtime/kernels/kda_prefill_scan.py",
           "GL_next = tl.load(gl_ptr + (base + H) * D + dk", "GL_next = tl.load(gl_ptr + base * D + dk", KDA_PREFILL,
           "KDA prefill: the decay loaded a chunk ahead is the current chunk's (each later chunk decays by its "
           "predecessor's gate)"),
    Mutant("kda_outputs_all_at_segment_start", "runtime/kernels/kda_prefill_scan.py",
           "tok = (t0 + cc * BT + rows)", "tok = (t0 + rows)", KDA_PREFILL,
           "KDA prefill: every chunk of a segment writes its outputs over the segment's first chunk"),
    Mutant("kda_outputs_miss_start_state", "runtime/kernels/kda_prefill_scan.py",
           "o = tl.dot(QG.to(dot_ty), Xw.to(dot_ty), input_precision=DOT_PRECISION)",
           "o = tl.zeros([BT, BX], dtype=tl.float32)", KDA_PREFILL,
           "KDA prefill: the outputs miss the chunk's start state (q e^G S_c)"),
    Mutant("mla_expanded_causal_off_by_one", "runtime/kernels/mla_prefill_expanded.py",
           "s = tl.where(pos[None, :] < row_end[:, None], s, float(\"-inf\"))",
           "s = tl.where(pos[None, :] <= row_end[:, None], s, float(\"-inf\"))", MLA_EXPANDED,
           "expanded MLA prefill: each token also sees the next position"),
    Mutant("mla_expanded_unmasked_too_far", "runtime/kernels/mla_prefill_expanded.py",
           "unmasked = (history + m0 + 1) // BLOCK_N * BLOCK_N", "unmasked = (history + m0 + BLOCK_N) // BLOCK_N * BLOCK_N",
           MLA_EXPANDED, "expanded MLA prefill: the tile holding the diagonal runs without the causal mask"),
    Mutant("mla_expanded_window_max_restarts", "runtime/kernels/mla_prefill_expanded.py",
           "m_i = tl.load(m_ptr + state, mask=row_ok, other=0.0)", "m_i = tl.full([BLOCK_M], 0.0, tl.float32)",
           MLA_EXPANDED, "expanded MLA prefill: a later window forgets the running max of the earlier ones"),
    Mutant("prefill_partial_global_limits", "runtime/kernels/mla_attention.py",
           "row_end = _local_length(row_end, cycle, interleave, tl.load(position_offset_ptr).to(tl.int32))",
           "row_end = row_end  # mutant", PREFILL_PARTIAL,
           "MLA prefill over a DCP member's cache: causal limits in global positions, not the member's rows"),
    Mutant("short_conv_history_off_by_one", "runtime/kernels/short_conv.py",
           "h_pos = src - start + (K - 1)", "h_pos = src - start + (K - 2)", SHORT_CONV,
           "short-conv prefill: a sequence's first tokens read the conv state one entry late"),
    Mutant("short_conv_state_keeps_history", "runtime/kernels/short_conv.py",
           "new = new + (tl.where(src >= K - 1, from_x.to(old[0].dtype), kept),)", "new = new + (old[m],)",
           SHORT_CONV, "short-conv prefill: the conv states are never updated"),
]


def make_copy(dest: Path) -> Path:
    """The sources the tests import, copied to ``dest`` (k3compile's runtime and passes
    as symlinks, the package-dir mapping of pyproject.toml)."""
    ignore = shutil.ignore_patterns("__pycache__", ".pytest_cache", "*.pyc")
    for name in COPIED:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=ignore)
        else:
            shutil.copy2(src, dest / name)
    for package in ("runtime", "passes"):
        (dest / "k3compile" / package).symlink_to(Path("..") / package, target_is_directory=True)
    return dest


def environment(copy: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(copy), "PYTHONDONTWRITEBYTECODE": "1"}


def check_imports(copy: Path) -> None:
    """The copy's modules, not the working tree's (an editable install maps k3compile there)."""
    code = "import k3compile.runtime.kernels, k3compile.passes; print(k3compile.runtime.__file__); " \
           "print(k3compile.runtime.kernels.__file__); print(k3compile.passes.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=copy, env=environment(copy), check=True,
                         capture_output=True, text=True).stdout.split()
    print("sanity: k3compile.runtime imported from", out[0])
    for path in out:
        assert Path(path).is_relative_to(copy), f"{path} is not in the copy {copy}"


@dataclass(frozen=True)
class Outcome:
    returncode: int
    first_failure: str
    seconds: float


def run_tests(copy: Path, tests: Selection, stop_at_first_failure: bool = True) -> Outcome:
    cmd = [sys.executable, "-m", "pytest", "-q", "-rf", "-p", "no:cacheprovider", *tests.args()]
    if stop_at_first_failure:
        cmd.append("-x")
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=copy, env=environment(copy), capture_output=True, text=True,
                              timeout=TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return Outcome(-1, f"timed out after {TIMEOUT_S} s", time.monotonic() - start)
    failed = re.search(r"^FAILED (.+?)(?: - .*)?$", proc.stdout, re.MULTILINE)
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    first = failed.group(1) if failed else lines[-1] if lines else ""
    return Outcome(proc.returncode, first, time.monotonic() - start)


def apply(copy: Path, mutant: Mutant) -> str:
    """Write the mutant into the copy; returns the original source."""
    path = copy / mutant.path
    source = path.read_text()
    count = source.count(mutant.snippet)
    assert count == 1, f"{mutant.name}: the snippet occurs {count} times in {mutant.path}"
    path.write_text(source.replace(mutant.snippet, mutant.replacement))
    return source


def main(names: list[str]) -> int:
    unknown = set(names) - {m.name for m in MUTANTS}
    if unknown:
        print(f"unknown mutants: {sorted(unknown)}; known: {[m.name for m in MUTANTS]}")
        return 2
    mutants = [m for m in MUTANTS if not names or m.name in names]
    with tempfile.TemporaryDirectory(prefix="k3-mutants-") as tmp:
        copy = make_copy(Path(tmp))
        check_imports(copy)
        for selection in dict.fromkeys(m.tests for m in mutants):  # each selection passes unmutated
            outcome = run_tests(copy, selection, stop_at_first_failure=False)
            print(f"sanity: {selection.file} -k '{selection.k}': exit {outcome.returncode} "
                  f"({outcome.seconds:.0f} s)", flush=True)
            if outcome.returncode != 0:
                print(f"  the unmutated sources fail: {outcome.first_failure}")
                return 1
        rows = []
        for mutant in mutants:
            original = apply(copy, mutant)
            try:
                outcome = run_tests(copy, mutant.tests)
            finally:
                (copy / mutant.path).write_text(original)
            result = {0: "MISSED", 1: "caught"}.get(outcome.returncode, f"ERROR (exit {outcome.returncode})")
            rows.append((mutant, result, outcome))
            print(f"{mutant.name}: {result} by {outcome.first_failure} ({outcome.seconds:.0f} s)", flush=True)
    print("\n| mutant | what it breaks | result | first test that failed | s |\n|---|---|---|---|--:|")
    for mutant, result, outcome in rows:
        caught_by = outcome.first_failure if result == "caught" else ""
        print(f"| `{mutant.name}` | {mutant.meaning} | {result} | `{caught_by}` | {outcome.seconds:.0f} |")
    bad = [mutant.name for mutant, result, _ in rows if result != "caught"]
    print(f"\n{len(rows) - len(bad)} of {len(rows)} mutants caught" + (f"; not caught: {bad}" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
