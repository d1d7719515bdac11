"""The KDA prefill kernels (runtime/kernels/kda_prefill.py) against ``k3::kda_prefill``'s
torch reference, under the Triton interpreter without a GPU (conftest sets
TRITON_INTERPRET; on a GPU machine on the GPU).

Packed ragged batches whose sequences end at every residue of the chunk, states updated
in place in the given slots and nowhere else, a sequence continued from a state a first
call left, shapes the kernels do not take (the reference runs) and bad inputs (a clear
error before any work); and against fla-core's naive chunked form, the peer. Tolerance:
fp32 throughout, the chunked math of the reference in another order (products and sums
over up to 64 tokens): 2e-5 of the largest value in fp32; for bf16 inputs 2^-8 for the
outputs (one bf16 rounding of the output and of the bf16 workspaces the state pass
multiplies, ``kda_prefill.work_dtype``, and on CUDA GPUs the tf32 products of the
preparation: ``kda_prefill.dot_precision``) and 2^-7 for the states (the normalised keys
are rounded to bf16 as well, as fla-core's l2norm writes them, and the state sums them
over every token).
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import math
import pathlib

import pytest
import torch

import k3compile.ops  # noqa: F401  (registers torch.ops.k3)
from k3compile.ops.kda import L2NORM_EPS, kda_gate, kda_prefill_reference
from k3compile.runtime.kernels import aot, kda_prefill, kernel_launches, packed_chunks, reset_kernel_launches

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make(lens: list[int], H: int = 2, D: int = 16, DV: int = 32, dtype: torch.dtype = torch.float32,
         slots: list[int] | None = None, states: int = 6, seed: int = 0) -> dict[str, object]:
    """Packed inputs of sequences of ``lens`` tokens, K3's gate (lower bound -5, some tokens
    at the bound), random starting states."""
    gen = torch.Generator().manual_seed(seed)
    T = sum(lens)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    g = kda_gate(r(T, H, D) * 3, r(H) + 1.0, r(H * D), -5.0)
    x = {"q": r(T, H, D).to(dtype), "k": r(T, H, D).to(dtype), "v": r(T, H, DV).to(dtype), "g": g,
         "beta": torch.rand(T, H, generator=gen), "state": r(states, H, D, DV),
         "cu_seqlens": torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32),
         "slots": torch.tensor(slots if slots is not None else list(range(len(lens))))}
    return {n: t.to(DEVICE) for n, t in x.items()}


def run_both(x: dict[str, object], chunk: int, scale: float = 0.25, group_chunks: int | None = None):
    """(o, state) of the kernels and of the reference, each from its own copy of the states."""
    args = lambda state: (x["q"], x["k"], x["v"], x["g"], x["beta"], state, x["cu_seqlens"], x["slots"])  # noqa: E731
    s_kernel, s_ref = x["state"].clone(), x["state"].cpu().clone()
    o = kda_prefill.kda_prefill(*args(s_kernel), scale, chunk=chunk, group_chunks=group_chunks)
    o_ref = kda_prefill_reference(*(t.cpu() for t in args(s_ref)[:5]), s_ref, x["cu_seqlens"].cpu(),
                                  x["slots"].cpu(), scale)
    return o.cpu(), s_kernel.cpu(), o_ref, s_ref


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str, bf16_tol: float = 2.0**-8) -> None:
    scale = want.float().abs().max().clamp(min=1.0)
    tol = 2e-5 if dtype == torch.float32 else bf16_tol
    err = float((got.float() - want.float()).abs().max() / scale)
    assert err <= tol, f"{what}: max error {err:.3g} of the largest value, tolerance {tol:.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ragged_batch_at_every_chunk_residue(dtype):
    """Sequences of 1, 15, 16, 17, 31, 33 and 48 tokens with chunks of 16: each ends at a
    different residue (and one token); slots out of order, states 1 and 5 untouched."""
    lens = [1, 15, 16, 17, 31, 33, 48]
    slots = [3, 0, 6, 2, 7, 4, 8]
    x = make(lens, dtype=dtype, slots=slots, states=9)
    reset_kernel_launches()
    o, state, o_ref, state_ref = run_both(x, chunk=16, group_chunks=0)
    assert kernel_launches() == {"_chunk_table_kernel": 1, "_kda_chunk_prep_kernel": 1, "_kda_state_pass_kernel": 1}
    assert o.dtype == dtype and o.shape == o_ref.shape
    close(o, o_ref, dtype, "o")
    # a bf16 model's products run at the backend's fp32-operand precision (tf32 on CUDA GPUs)
    close(state, state_ref, dtype, "state", bf16_tol=2.0**-7)
    assert torch.equal(state[[1, 5]], x["state"].cpu()[[1, 5]])  # slots no sequence owns


@pytest.mark.parametrize("group_chunks", [1, 2, 3])
def test_chunk_groups_at_every_group_residue(group_chunks):
    """The state pass by chunk groups (group summaries, their scan, then the groups from
    their start states): sequences of 1 to 7 chunks of 16 cut into groups of 1, 2 and 3,
    so that every sequence ends at each residue of the group, one sequence in a single
    partial group; the same outputs and states as the reference."""
    lens = [1, 20, 33, 48, 64, 80, 100, 112]
    x = make(lens, slots=[3, 0, 6, 2, 7, 4, 8, 9], states=10, seed=4)
    reset_kernel_launches()
    o, state, o_ref, state_ref = run_both(x, chunk=16, group_chunks=group_chunks)
    assert kernel_launches() == {"_chunk_table_kernel": 1, "_chunk_groups_kernel": 1, "_kda_chunk_prep_kernel": 1,
                                 "_kda_state_pass_kernel": 2, "_kda_group_scan_kernel": 1}
    close(o, o_ref, torch.float32, "o")
    close(state, state_ref, torch.float32, "state")
    assert torch.equal(state[[1, 5]], x["state"].cpu()[[1, 5]])


@pytest.mark.filterwarnings("ignore:(overflow|invalid value) encountered:RuntimeWarning")
def test_several_head_dim_slices(monkeypatch):
    """The preparation's A / Aq accumulated over several head-dim slices (K3's D = 128 takes
    four of kda_prefill.HEAD_SLICE on sm_90, two on AMD; the small shapes here one unless
    narrowed): the same results, with K3's gate and with one strong enough to take the
    column-at-a-time path."""
    for target in kda_prefill.HEAD_SLICE:
        monkeypatch.setitem(kda_prefill.HEAD_SLICE, target, 16)
    for strong in (False, True):
        x = make([1, 17, 40], D=32, DV=32, seed=4)
        if strong:  # as test_gates_stronger_than_k3s
            x["g"] = -8.0 - 4.0 * torch.rand(x["g"].shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
        o, state, o_ref, state_ref = run_both(x, chunk=16)
        close(o, o_ref, torch.float32, "o")
        close(state, state_ref, torch.float32, "state")


def test_w_blocks_narrower_than_the_head_dims(monkeypatch):
    """W / U~ and the state factors by column blocks narrower than D and DV (K3's D = 128
    takes two blocks of kda_prefill.W_BLOCK; the small shapes here one unless narrowed),
    with D != DV."""
    monkeypatch.setattr(kda_prefill, "W_BLOCK", 16)
    x = make([1, 17, 40], D=32, DV=64, seed=5)
    o, state, o_ref, state_ref = run_both(x, chunk=16)
    close(o, o_ref, torch.float32, "o")
    close(state, state_ref, torch.float32, "state")


@pytest.mark.filterwarnings("ignore:(overflow|invalid value) encountered:RuntimeWarning")
def test_gates_stronger_than_k3s():
    """Gates of -8 to -12 a token (K3's are above -5): a sub-chunk decays past 2^MAX_EXP2, so
    the preparation's diagonal blocks take the column-at-a-time path (whose rows above the
    column overflow and are masked: the interpreter warns); still the reference's outputs
    and states (which then barely depend on earlier tokens)."""
    x = make([40, 33], D=16, DV=16, seed=6)
    x["g"] = -8.0 - 4.0 * torch.rand(x["g"].shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    span = 15 * 8.0  # the least decay over a sub-chunk of 16
    assert span * math.log2(math.e) > kda_prefill.MAX_EXP2.value
    o, state, o_ref, state_ref = run_both(x, chunk=16)
    close(o, o_ref, torch.float32, "o")
    close(state, state_ref, torch.float32, "state")


@pytest.mark.parametrize("cu_dtype", [torch.int32, torch.int64])
def test_chunk_table(cu_dtype):
    """The chunk table of one launch against its definition: chunks numbered sequence after
    sequence, each chunk's sequence ``searchsorted(ends, id, right=True)`` and first token;
    empty sequences, ragged ones, and 300 sequences (several of the kernel's blocks)."""
    gen = torch.Generator().manual_seed(1)
    for lens, chunk in (([0, 5, 0], 16), ([1, 15, 16, 17, 31, 33, 48], 16), ([64], 64),
                        (torch.randint(0, 300, (300,), generator=gen).tolist(), 64)):
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=cu_dtype, device=DEVICE)
        table = packed_chunks.chunk_table(cu, sum(lens), chunk)
        chunks = torch.tensor([-(-n // chunk) for n in lens])
        ends = chunks.cumsum(0)
        count = int(ends[-1])
        seq = torch.searchsorted(ends, torch.arange(count), right=True)
        first = cu.cpu().long()[seq] + (torch.arange(count) - (ends - chunks)[seq]) * chunk
        assert table.seq.numel() == -(-sum(lens) // chunk) + len(lens)
        assert int(table.count) == count and int(table.sequences) == len(lens)
        assert torch.equal(table.cu.cpu(), cu.cpu().long())
        assert torch.equal(table.seq_first.cpu(), ends - chunks) and torch.equal(table.seq_chunks.cpu(), chunks)
        assert torch.equal(table.seq[:count].cpu(), seq) and torch.equal(table.first[:count].cpu(), first)


@pytest.mark.parametrize("cu_dtype", [torch.int32, torch.int64])
def test_chunk_groups(cu_dtype):
    """The chunk groups of one launch against their definition: each sequence's chunks cut
    into groups of ``size`` (the last may be shorter), numbered sequence after sequence,
    each with its first chunk (chunks numbered as the chunk table numbers them) and chunk
    count, 0 past the real groups; empty sequences, ragged ones, groups of one chunk, and
    300 sequences (several of the kernel's blocks)."""
    gen = torch.Generator().manual_seed(2)
    for lens, chunk, size in (([0, 5, 0], 16, 1), ([1, 15, 16, 17, 31, 33, 48, 100], 16, 3), ([64], 64, 2),
                              ([1000, 1, 4000], 64, 7),
                              (torch.randint(0, 3000, (300,), generator=gen).tolist(), 64, 5)):
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=cu_dtype, device=DEVICE)
        groups = packed_chunks.chunk_groups(cu, sum(lens), chunk, size)
        chunk0, chunks, seq_first, seq_groups = [], [], [], []
        first_chunk = 0
        for n in (-(-t // chunk) for t in lens):
            seq_first.append(len(chunk0))
            seq_groups.append(-(-n // size))
            for k in range(seq_groups[-1]):
                chunk0.append(first_chunk + k * size)
                chunks.append(min(size, n - k * size))
            first_chunk += n
        worst = -(-packed_chunks.worst_chunks(sum(lens), len(lens), chunk) // size) + len(lens)
        count = len(chunk0)
        assert groups.size == size and groups.segments.chunk0.numel() == worst and int(groups.segments.count) == count
        assert groups.segments.chunk0[:count].tolist() == chunk0
        assert groups.segments.chunks.tolist() == chunks + [0] * (worst - count)
        assert groups.seq_first.tolist() == seq_first and groups.seq_groups.tolist() == seq_groups
        assert groups.start_rows.tolist() == list(range(worst)) and groups.end_rows.tolist() == [-1] * worst


def test_group_size_only_where_the_gpu_would_idle():
    """Groups when sequences x heads x value tiles leave compute units idle and the
    sequences are long enough to cut; as few groups as keep the summary pass at about two
    programs a unit, at least four a sequence."""
    from k3compile.runtime.kernels.kda_prefill_scan import MIN_GROUP, group_size

    assert group_size(1, 12, 2, 513, units=132) == 103  # 32K tokens at batch 1: 5 groups, 240 summary programs
    assert group_size(1, 12, 2, 2049, units=132) == 410  # 128K tokens
    assert group_size(1, 12, 2, 65, units=132) == 13  # 4K tokens
    assert group_size(1, 12, 2, 17, units=132) == MIN_GROUP
    assert group_size(2, 12, 2, 1026, units=132) == 129  # at least four groups a sequence
    assert group_size(8, 12, 2, 4104, units=132) is None  # 192 programs fill 132 SMs
    assert group_size(1, 12, 2, 15, units=132) is None  # too short to cut
    assert group_size(1, 12, 2, 513, units=1) is None  # the interpreter: only where asked


def test_k3_chunk_of_64_and_a_continuation():
    """Chunks of 64 (the default) over 130 and 64 tokens; then a second call continues both
    sequences from the states the first left (chunked prefill of a long prompt)."""
    x = make([130, 64], D=32, DV=32, seed=1)
    o, state, o_ref, state_ref = run_both(x, chunk=64)
    close(o, o_ref, torch.float32, "o")
    close(state, state_ref, torch.float32, "state")
    y = make([70, 3], D=32, DV=32, seed=2)
    y["state"] = state.to(DEVICE)
    o2, state2, o2_ref, state2_ref = run_both(y, chunk=64)
    close(o2, o2_ref, torch.float32, "o of the continuation")
    close(state2, state2_ref, torch.float32, "state of the continuation")


def test_matches_fla_naive_chunk_kda():
    """fla-core, the peer, as a cross-check of the kernels themselves (its naive chunked
    form, fp32): two sequences of 128 tokens as fla's batch of 2, from random states.
    Moderate decays: fla's naive form exponentiates unmasked gate differences, which
    overflow over K3's whole range."""
    naive_chunk_kda = pytest.importorskip("fla.ops.kda.naive").naive_chunk_kda

    gen = torch.Generator().manual_seed(3)
    B, T, H, D, DV = 2, 128, 2, 32, 32
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q, k, v = r(B, T, H, D), r(B, T, H, D), r(B, T, H, DV)
    g, beta, s0 = -0.2 * torch.rand(B, T, H, D, generator=gen), torch.rand(B, T, H, generator=gen), r(B, H, D, DV)
    norm = lambda x: x / (x.square().sum(-1, keepdim=True) + L2NORM_EPS).sqrt()  # noqa: E731
    o_fla, s_fla = naive_chunk_kda(norm(q), norm(k), v, g, beta, scale=D**-0.5, initial_state=s0,
                                   output_final_state=True)
    state = s0.clone().to(DEVICE)
    packed = [t.flatten(0, 1).to(DEVICE) for t in (q, k, v, g, beta)]
    cu = torch.tensor([0, T, 2 * T], dtype=torch.int32, device=DEVICE)
    o = kda_prefill.kda_prefill(*packed, state, cu, torch.arange(B, device=DEVICE), D**-0.5)
    close(o.cpu(), o_fla.flatten(0, 1), torch.float32, "o against fla")
    close(state.cpu(), s_fla, torch.float32, "state against fla")


@pytest.mark.parametrize("D, chunk", [(8, 16), (16, 128)])
def test_shapes_the_kernels_do_not_take_run_the_reference(D, chunk):
    """Head dims of 8 (not >= 16) or chunks of 128 (more row blocks than the preparation's
    four): the reference, no kernel launch, same result."""
    x = make([5, 9], D=D, DV=D)
    reset_kernel_launches()
    o, state, o_ref, state_ref = run_both(x, chunk=chunk)
    assert kernel_launches() == {}
    assert torch.equal(o, o_ref) and torch.equal(state, state_ref)


def test_bad_inputs_are_refused_before_any_work():
    x = make([4, 4])
    state = x["state"].clone()
    with pytest.raises(ValueError, match=r"cu_seqlens \[N\+1\] and slots \[N\] expected"):
        kda_prefill.kda_prefill(x["q"], x["k"], x["v"], x["g"], x["beta"], state, x["cu_seqlens"],
                                x["slots"][:1], 0.25)
    with pytest.raises(ValueError, match=r"state must be \[S, 2, 16, 32\]"):
        kda_prefill.kda_prefill(x["q"], x["k"], x["v"], x["g"], x["beta"], state[..., :16], x["cu_seqlens"],
                                x["slots"], 0.25)
    assert torch.equal(state, x["state"])


def aot_requests() -> dict[tuple[str, str], aot.CompileRequest]:
    return {(t, launch.name): launch.request(t) for t in aot.TARGETS
            for launch in kda_prefill.aot_requests(t)}


def test_kernels_compile_for_every_target(aot_reports):
    """At K3's per-rank shapes (12 heads, D = DV = 128, chunks of 64, bf16), compiled as
    the runtime launches them (on AMD with ROCm's buffer loads): every kernel (chunk
    table, chunk groups, preparation, state pass with the outputs, group summaries, group scan) compiles
    and fits its targets' shared memory / LDS without spills on AMD; on sm_90 at most 16 words a
    thread (the preparation under its register cap, kda_prefill.PREP_MAX_REGISTERS, spills
    6 at three pipeline stages: decision 79)."""
    assert len(aot_reports) == 6 * len(aot.TARGETS)
    for (target, name), res in aot_reports.items():
        allowed = 0 if target.startswith("gfx") else 16
        assert res.fits, (target, name, res)
        assert res.spills is not None and res.spills <= allowed, (target, name, res)


def test_preparation_holds_three_programs_per_h200_sm(aot_reports):
    """The preparation's register cap on sm_90 is what lets a third program reside."""
    prep = aot_reports[("sm_90", "kda_prefill prep")]
    assert prep.registers <= kda_prefill.PREP_MAX_REGISTERS["sm_90"], prep
    assert prep.programs_per_unit >= 3, prep


def test_preparation_holds_two_workgroups_per_gfx950_cu(aot_reports):
    """Issue #23: two preparation workgroups per MI355X CU, so that the chunk groups of two
    sequences, or of one, run side by side (with ROCm's buffer loads: A / Aq by 64-wide
    head-dim slices there, kda_prefill.HEAD_SLICE); and per MI300X CU since W / U~ take
    bf16 operands (decision 79)."""
    for target in ("gfx950", "gfx942"):
        prep = aot_reports[(target, "kda_prefill prep")]
        assert prep.programs_per_unit >= 2, prep


def test_the_benchmarks_source_edits_still_match_the_kernel(monkeypatch):
    """benchmarks/kda_prefill.py times the preparation stopped after each phase (--phases) and
    with each part replaced by a stand-in (--part-costs) by editing this module's source:
    every edit must still find its text once and leave Python that parses, so that a kernel
    change cannot silently break the tools its figures come from."""
    bench_dir = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
    monkeypatch.syspath_prepend(str(bench_dir))
    spec = importlib.util.spec_from_file_location("kda_prefill_benchmark", bench_dir / "kda_prefill.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    src = inspect.getsource(kda_prefill)
    edits = {f"stop before {marker.strip()}": [(marker, "    return\n" + marker)] for marker in bench.PHASES}
    edits.update(bench.part_stand_ins(src))
    assert len(edits) == 3 + 6
    for name, change in edits.items():
        edited = bench.edited(src, change)
        assert edited != src, name
        ast.parse(edited)
