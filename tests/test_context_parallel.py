"""Decode context parallelism: the position layout, its ops, the ``split_mla_context``
pass and the runtime's per-rank caches.

Layout: every position has exactly one owner, local positions are dense and in order,
and the graph's ``k3::dcp_local_lengths`` agrees with the Python layout. Merge: attention
over disjoint position sets, each rescaled by ``k3::dcp_rescale`` and summed, equals
attention over their union, also when a member owns nothing. The pass: validated on gloo
ranks (TP2/DCP2), and the runtime on TP2/DCP2, TP4/DCP2 (interleave 2) and TP4/DCP4 gives
the DCP1 artifact's logits and 32 identical greedy tokens, for prompts shorter than the
DCP size too, with 1/DCP of the MLA cache per rank.
"""

from __future__ import annotations

import random

import pytest
import torch
from tolerances import DCP_MERGE, DCP_RESCALE, assert_close_scaled

import k3compile.ops  # noqa: F401  (registers torch.ops.k3)
from k3compile import runtime
from k3compile.artifact import read_artifact_info
from k3compile.batch import CacheShape
from k3compile.cli.kernels import dcp_prefill
from k3compile.compiler import CompileOptions, optimize
from k3compile.context_parallel import ContextLayout, dcp_groups, localize_step, mla_cache_indices
from k3compile.ops.mla import mla_decode_reference
from k3compile.placement import propagate_placements
from k3compile.sequences import SequenceTable
from k3compile.sharding import ParallelPlan, RankLocal, Replicate, Shard, ShardingError
from k3compile.validation import random_step_inputs

k3 = torch.ops.k3
PROMPTS = [[5, 9, 100, 7, 3, 44, 21, 8, 8, 9, 61], [17, 4], [300]]
NEW_TOKENS = 32


@pytest.mark.parametrize("dcp,interleave", [(1, 1), (2, 1), (4, 1), (2, 3), (4, 2)])
def test_layout_gives_each_position_one_owner_and_dense_local_positions(dcp, interleave):
    layouts = [ContextLayout(dcp, interleave, r) for r in range(dcp)]
    for length in range(0, 3 * dcp * interleave + 2):
        owned = [[p for p in range(length) if lay.owns(p)] for lay in layouts]
        assert sorted(p for ps in owned for p in ps) == list(range(length))
        for lay, ps in zip(layouts, owned):
            assert [lay.local_position(p) for p in ps] == list(range(len(ps)))
            assert lay.local_length(length) == len(ps)
        assert max(len(ps) for ps in owned) == layouts[0].max_local_length(length)
        lens = torch.tensor([length, 1, length + 5], dtype=torch.int32)
        for lay in layouts:
            got = k3.dcp_local_lengths(lens, torch.tensor(lay.position_offset), dcp, interleave)
            assert got.tolist() == [lay.local_length(n) for n in lens.tolist()] and got.dtype == torch.int32


def test_plan_and_groups_check_dcp():
    assert ParallelPlan(8, 5, dcp=2).dcp_rank == 1 and ParallelPlan(8, 5, dcp=8).dcp_rank == 5
    assert dcp_groups(4, 2) == [[0, 1], [2, 3]]
    with pytest.raises(ShardingError, match="dcp must be a divisor of tp=4"):
        ParallelPlan(4, 0, dcp=3)
    with pytest.raises(ShardingError, match="dcp_interleave must be >= 1"):
        ParallelPlan(4, 0, dcp=2, dcp_interleave=0)


@pytest.mark.parametrize("dcp,interleave", [(2, 1), (4, 2)])
def test_lse_merge_of_disjoint_positions_equals_full_attention(dcp, interleave):
    """Each member attends to its own positions of the same cache (as a zero-length
    context when it owns none); rescaled terms summed over members = full attention, and
    so does each member's merge of its own heads from every member's packed rows (the
    all-to-all merge)."""
    gen = torch.Generator().manual_seed(0)
    B, H, W, V, bs = 4, 4, 20, 16, 4
    lens = torch.tensor([1, 2, 9, 13], dtype=torch.int32)  # 1 and 2: members without a position
    q = torch.randn(B, H, W, generator=gen)
    cache = torch.randn(16, bs, W, generator=gen)
    table = torch.randperm(16, generator=gen)[: B * 4].view(B, 4).int()
    full_o, full_lse = mla_decode_reference(q, cache, table, lens, 0.3, V)
    inputs = [torch.zeros(B, dtype=torch.long), torch.arange(B + 1, dtype=torch.int32), lens, torch.arange(B),
              table, (table[:, 0].long() * bs), torch.arange(B), [cache]]
    parts = []
    for r in range(dcp):
        layout = ContextLayout(dcp, interleave, r)
        local = localize_step(["mla"], inputs, layout)
        local_lens = k3.dcp_local_lengths(lens, torch.tensor(layout.position_offset), dcp, interleave)
        # the step's token is already in the global cache: copy it to the member's cache too
        local.inputs[-1][0].view(-1, W)[local.local_slots] = cache.view(-1, W)[local.global_slots]
        parts.append(mla_decode_reference(q, local.inputs[-1][0], local.inputs[4], local_lens, 0.3, V))
    lse_all = torch.cat([lse for _, lse in parts])  # [dcp*B, H], member order (the all-gather)
    merged = sum(k3.dcp_rescale(o, lse, lse_all, dcp) for o, lse in parts)  # the reduce-scatter's sum
    assert any(torch.isinf(lse).any() for _, lse in parts)  # some member owned nothing of a sequence
    torch.testing.assert_close(merged.permute(1, 0, 2), full_o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.logsumexp(lse_all.view(dcp, B, H), 0), full_lse)
    packs = [k3.dcp_pack(o, lse, dcp) for o, lse in parts]
    h = H // dcp
    for m in range(dcp):
        received = torch.stack([pack[m] for pack in packs])  # the all-to-all's output on member m
        mine = k3.dcp_merge(received, torch.bfloat16)
        assert mine.dtype == torch.bfloat16 and mine.shape == (B, h, V)
        torch.testing.assert_close(mine, full_o[:, m * h : (m + 1) * h].bfloat16())


def test_sequence_table_stores_only_owned_positions():
    layout = ContextLayout(dcp=2, interleave=2, rank=1)
    table = SequenceTable(1000, CacheShape(num_slots=4, num_blocks=9, block_size=2), 1, 1, layout)
    s = table.new_sequence()
    table.reserve([s], [7])  # positions 0..6: rank 1 owns 2, 3, 6
    batch = table.make_batch([s], [7], decode=False)
    blocks = table.sequences[s].blocks
    assert len(blocks) == 2  # 3 local positions in blocks of 2
    expected = [0, 0, blocks[0] * 2, blocks[0] * 2 + 1, 0, 0, blocks[1] * 2]  # scratch slot 0 elsewhere
    assert batch.slot_mapping.tolist() == expected and batch.seq_lens.tolist() == [7]
    table.advance([s], [7])
    table.reserve([s], [1])  # position 7 is owned: local position 3, still block 1
    assert len(table.sequences[s].blocks) == 2
    assert table.make_batch([s], [1], decode=True).slot_mapping.tolist() == [blocks[1] * 2 + 1]
    with pytest.raises(ValueError, match="reserve it"):
        SequenceTable(1000, CacheShape(4, 9, 2), 1, 0, layout)


@pytest.mark.parametrize("dcp,interleave,rank", [(1, 1, 0), (2, 1, 1), (4, 3, 2), (8, 1, 7)])
def test_step_slot_mapping_is_each_positions_cache_slot(dcp, interleave, rank):
    """make_batch's slot mapping (by tensors) is cache_slot of each position, after history."""
    layout = ContextLayout(dcp, interleave, rank)
    table = SequenceTable(1000, CacheShape(num_slots=3, num_blocks=40, block_size=4), 0, 1, layout)
    a, b = table.new_sequence(), table.new_sequence()
    table.reserve([a, b], [5, 1])
    table.advance([a, b], [5, 1])
    table.reserve([a, b], [37, 3])
    batch = table.make_batch([a, b], [37, 3], decode=False)
    seq_a, seq_b = table.sequences[a], table.sequences[b]
    expected = [table.cache_slot(seq_a, p) for p in range(5, 42)] + [table.cache_slot(seq_b, p) for p in range(1, 4)]
    assert batch.slot_mapping.tolist() == expected and batch.slot_mapping.dtype == torch.int64
    assert len(set(expected) - {0}) == sum(layout.owns(p) for p in range(5, 42)) + sum(layout.owns(p) for p in range(1, 4))


@pytest.mark.parametrize("dcp,interleave", [(2, 1), (2, 2), (4, 1), (4, 2), (2, 3), (2, 8)])
def test_history_order_puts_every_members_positions_in_order(dcp, interleave):
    """k3.dcp_local_blocks on each member's cache (laid out by its SequenceTable), stacked
    member-major as the all-gather does, then k3.dcp_history_order: every sequence's
    positions in order, each row the one its owner wrote for that position (also with an
    interleave that does not divide the blocks, or exceeds a block)."""
    lengths, bs, W = [9, 7, 1, 3], 4, 3  # the longest, 9, at DCP2: 5 and 4 positions, 2 and 1 blocks
    caches, tables = [], []
    for rank in range(dcp):
        table = SequenceTable(1000, CacheShape(num_slots=5, num_blocks=16, block_size=bs), 0, 1,
                              ContextLayout(dcp, interleave, rank))
        ids = [table.new_sequence() for _ in lengths]
        table.reserve(ids, lengths)
        cache = torch.full((16, bs, W), -1.0)
        for n, (seq, length) in enumerate(zip(ids, lengths)):
            for pos in range(length):
                if table.layout.owns(pos):
                    cache.view(-1, W)[table.cache_slot(table.sequences[seq], pos)] = torch.tensor([n, pos, rank])
        caches.append(cache)
        tables.append(table.make_batch(ids, lengths, decode=False).block_table)
    width = tables[0].shape[1]
    assert all(t.shape[1] == width for t in tables)  # one width on every member: the all-gather's
    gathered = torch.cat([k3.dcp_local_blocks(c, t) for c, t in zip(caches, tables)])
    assert gathered.dtype == torch.uint8  # bytes on the wire
    cache, table = k3.dcp_history_order(gathered, dcp, interleave, torch.float32)
    assert table.dtype == torch.int32 and table.shape == (len(lengths), dcp * width)
    for n, length in enumerate(lengths):
        rows = cache[table[n].long()].reshape(-1, W)[:length]
        owners = [(pos // interleave) % dcp for pos in range(length)]
        assert rows.tolist() == [[n, pos, owner] for pos, owner in zip(range(length), owners)]


def test_localize_step_moves_owned_history_and_maps_new_tokens():
    from k3compile.config import get_preset

    cfg = get_preset("tiny")
    inputs = random_step_inputs(cfg, ParallelPlan(2, 0), "decode", torch.float32, 16, seed=3, num_seqs=4)
    kinds = cfg.layer_kinds
    layout = ContextLayout(2, 1, 1)
    local = localize_step(kinds, inputs, layout)
    k = mla_cache_indices(kinds)[0]
    W = inputs[-1][k].shape[-1]
    lens, lt = inputs[2].tolist(), local.inputs[4]
    assert local.global_slots.numel() == sum(layout.local_length(n) for n in lens)
    new_slots = set()
    for i, n in enumerate(lens):  # the new token of an owner maps to its local slot, else scratch
        lp = layout.local_position(n - 1)
        want = int(lt[i, lp // 16]) * 16 + lp % 16 if layout.owns(n - 1) else 0
        assert local.inputs[5][i].item() == want
        new_slots |= {want} if layout.owns(n - 1) else set()
    history = torch.tensor([s not in new_slots for s in local.local_slots.tolist()])
    assert 0 < history.sum() < history.numel()
    g = inputs[-1][k].view(-1, W)[local.global_slots]
    loc = local.inputs[-1][k].view(-1, W)[local.local_slots]
    assert torch.equal(loc[history], g[history])  # history copied; new tokens are written by the step
    assert local.inputs[-1][0] is inputs[-1][0]  # KDA state unchanged


@pytest.mark.parametrize("block_size", [1, 2])
def test_localized_block_tables_are_as_wide_on_every_member(block_size):
    """The gathered prefill all-gathers each member's blocks: translation validation's
    localized steps, like the runtime's, give every member a table of the same width."""
    from k3compile.config import get_preset

    cfg = get_preset("tiny")
    inputs = random_step_inputs(cfg, ParallelPlan(2, 0), "prefill", torch.float32, block_size, seed=1,
                                fresh_prefill=True)
    widths = {localize_step(cfg.layer_kinds, inputs, ContextLayout(2, 1, r)).inputs[4].shape[1] for r in range(2)}
    assert len(widths) == 1, widths


# ----------------------------------------------------------------------------- the pass


def _compile(compile_once, tp: int, dcp: int, interleave: int = 1, validate: bool = False,
              merge: str = "all-to-all", prefill: str = "gathered"):
    """tiny's float32 artifact, compiled once per session; when validating, only the DCP
    pass runs (the others are validated by their own tests)."""
    others = ("remove_noops", "mxfp4_experts", "dedup_replicated_linear", "sink_copies") if validate else ()
    return compile_once("tiny", tp=tp, dcp=dcp, dcp_interleave=interleave, dtype="float32", validate=validate,
                        disable=others, pass_configs={"split_mla_context": {"merge": merge, "prefill": prefill}})


def _rank_run(rank: int, world: int, out):
    """Prefill logits (prompts in chunks of 4 tokens), one decode step's logits, the logits
    of a continuation (several new tokens for sequences with history: 2, 5 and 1 tokens
    after the decode step, then 3 more for the first), greedy tokens and this rank's MLA
    cache bytes."""
    torch.set_num_threads(1)
    options = runtime.RuntimeOptions(max_sequences=3, max_context=64, prefill_chunk=4)  # the 11-token prompt: 3 chunks
    rt = runtime.load(out, rank=rank, world_size=world, options=options)
    ids, prefill = rt.prefill(PROMPTS)
    decode = rt.decode(ids, [11, 12, 13])
    more = [rt.step(ids, [[1, 2], [3, 4, 5, 6, 7], [8]]), rt.step(ids[:1], [[9, 10, 11]])]
    for seq in ids:
        rt.release(seq)
    tokens = rt.generate(PROMPTS, NEW_TOKENS)
    # MLA cache bytes without the scratch block 0
    kv = sum(c.kv[1:].numel() * c.kv.element_size() for c in rt.caches if hasattr(c, "kv"))
    return prefill, decode, more, tokens, kv


def _check_like_dcp1(base: list, split: list, dcp: int) -> None:
    for (p1, d1, m1, t1, kv1), (p2, d2, m2, t2, kv2) in zip(base, split):
        torch.testing.assert_close(p2, p1, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(d2, d1, atol=1e-5, rtol=1e-5)
        for a, b in zip(m2, m1, strict=True):  # continuations under DCP
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        assert t2 == t1 and all(len(t) == NEW_TOKENS for t in t2)
        assert kv2 * dcp == kv1 > 0  # 64 tokens per sequence split evenly: exactly 1/dcp per rank


@pytest.fixture(scope="module")
def dcp1_runs(compile_once, rank_pools) -> list:
    """``_rank_run`` on each TP2 rank with the DCP1 artifact: what both merges must match."""
    return rank_pools.get(2).run(_rank_run, _compile(compile_once, tp=2, dcp=1).out_dir)


@pytest.mark.slow
def test_tp2_dcp2_validated_on_gloo_ranks_and_runs_like_dcp1(compile_once, rank_pools, dcp1_runs):
    """merge="reduce-scatter" and prefill="partial" (the absorbed form over each member's
    positions, merged like decode): validated on gloo ranks, placements, runs like DCP1."""
    result = _compile(compile_once, tp=2, dcp=2, validate=True, merge="reduce-scatter", prefill="partial")
    cfg = result.captured.config
    n_mla = sum(kind == "mla" for kind in cfg.layer_kinds)
    records = {r.phase: r for r in result.pipeline.records if r.pass_name == "split_mla_context"}
    decode, prefill = records["decode"], records["prefill"]
    assert decode.result.matches == prefill.result.matches == n_mla
    assert decode.result.stats["collectives_added"] == 3 * n_mla
    assert decode.report.ok and decode.report.max_error < 1e-5
    assert prefill.report.ok and prefill.report.max_error < 1e-5  # the absorbed form: other rounding
    assert prefill.result.stats["collectives_added"] == 3 * n_mla
    assert dcp_prefill(read_artifact_info(result.out_dir).passes) == "partial"  # what inspect --kernels reports

    program = result.captured.programs["decode"]
    gm = program.graph_module
    propagate_placements(gm, program, result.captured.specs, ParallelPlan(2, 0, dcp=2))
    attention = [n for n in gm.graph.nodes if n.target is k3.mla_decode.default]
    gathered = cfg.num_attention_heads // 2 * 2  # this rank's heads and its DCP peer's
    assert [n.args[0].meta["val"].shape[1] for n in attention] == [gathered] * n_mla
    assert all(n.meta["placement"] == (RankLocal(), RankLocal()) for n in attention)
    assert all(n.args[1].meta["placement"] == RankLocal() for n in attention)  # the cache: this rank's positions
    merged = [n for n in gm.graph.nodes if n.target is torch.ops.aten._to_copy.default
              and n.args[0].target is torch.ops.aten.permute.default]
    assert len(merged) == n_mla and all(n.meta["placement"] == Shard(1) for n in merged)
    assert all(n.meta["placement"] == Replicate() for n in gm.graph.nodes if n.name == "seq_lens")

    _check_like_dcp1(dcp1_runs, rank_pools.get(2).run(_rank_run, result.out_dir), dcp=2)


@pytest.mark.slow
def test_all_to_all_merge_validated_on_gloo_ranks_and_runs_like_dcp1(compile_once, rank_pools, dcp1_runs):
    """merge="all-to-all" and prefill="gathered" (the defaults): one collective less per
    MLA layer in decode, one in all for prefill (the history's all-gather, then the DCP1
    prefill on this rank's heads); TP2/DCP2 validated on gloo ranks and run like DCP1
    (TP4/DCP4 with them: the next test)."""
    result = _compile(compile_once, tp=2, dcp=2, validate=True, merge="all-to-all")
    n_mla = sum(kind == "mla" for kind in result.captured.config.layer_kinds)
    records = {r.phase: r for r in result.pipeline.records if r.pass_name == "split_mla_context"}
    decode, prefill = records["decode"], records["prefill"]
    assert decode.result.stats["collectives_added"] == 2 * n_mla
    assert all("LSE merge by all-to-all" in r.detail for r in decode.result.rewrites)
    assert decode.report.ok and decode.report.max_error < 1e-5
    assert prefill.result.stats["collectives_added"] == n_mla and prefill.report.ok
    assert prefill.report.max_error < 1e-6  # the DCP1 op over the same history: the same arithmetic

    program = result.captured.programs["prefill"]
    gm = program.graph_module
    propagate_placements(gm, program, result.captured.specs, ParallelPlan(2, 0, dcp=2))
    ordered = [n for n in gm.graph.nodes if n.target is k3.dcp_history_order.default]
    attention = [n for n in gm.graph.nodes if n.target is k3.mla_prefill.default]
    assert len(ordered) == len(attention) == n_mla
    assert all(n.args[0].meta["placement"] == RankLocal() and n.meta["placement"] == (Replicate(), Replicate())
               for n in ordered)  # the group's gathered blocks in, the whole history out
    assert all(n.meta["placement"] == Shard(1) for n in attention)  # this rank's own heads, as without DCP
    assert not any(n.target is k3.mla_prefill_partial.default for n in gm.graph.nodes)
    assert dcp_prefill(read_artifact_info(result.out_dir).passes) == "gathered"

    program = result.captured.programs["decode"]
    gm = program.graph_module
    propagate_placements(gm, program, result.captured.specs, ParallelPlan(2, 0, dcp=2))
    exchanges = [n for n in gm.graph.nodes if n.target is torch.ops._c10d_functional.all_to_all_single.default]
    merged = [n for n in gm.graph.nodes if n.target is k3.dcp_merge.default]
    assert len(exchanges) == len(merged) == n_mla
    assert all(n.args[0].meta["placement"] == RankLocal() and n.meta["placement"] == Shard(2) for n in exchanges)
    assert all(n.meta["placement"] == Shard(1) for n in merged)  # this rank's own heads, as without DCP
    assert not any(n.target is torch.ops._c10d_functional.reduce_scatter_tensor.default for n in gm.graph.nodes)

    _check_like_dcp1(dcp1_runs, rank_pools.get(2).run(_rank_run, result.out_dir), dcp=2)


def test_inspect_kernels_reports_the_dcp_prefill_the_artifact_runs(compile_once):
    """inspect --kernels on TP2 / DCP2 artifacts: the split-KV kernel takes the group's
    gathered heads; the prefill is the DCP1 kernel on the rank's own heads (gathered) or
    the absorbed kernel over its share (partial), as the pass rewrote it."""
    from cli_runs import invoke

    for prefill, kernel in (("gathered", "mla prefill (expanded)"), ("partial", "mla prefill (absorbed, DCP share)")):
        out = _compile(compile_once, tp=2, dcp=2, merge="reduce-scatter" if prefill == "partial" else "all-to-all",
                       prefill=prefill).out_dir
        result = invoke("inspect", out, "--kernels", "--batch", "2", "--context", "512", "--target", "mi355x")
        assert result.exit_code == 0, result.output
        text = result.stdout
        assert "one rank of TP2 / DCP2" in text
        decode_part, prefill_part = text.split("Prefill: ")
        assert "mla decode split-KV" in decode_part and kernel in prefill_part, (prefill, text)


@pytest.mark.sweep
def test_tp4_dcp2_interleaved_and_dcp4_run_like_dcp1(compile_once, rank_pools):
    """DCP4 with either merge (prompts of 1 and 2 tokens: members that own nothing)."""
    ranks = rank_pools.get(4)
    base = ranks.run(_rank_run, _compile(compile_once, tp=4, dcp=1).out_dir)
    dcp2 = _compile(compile_once, tp=4, dcp=2, interleave=2).out_dir
    _check_like_dcp1(base, ranks.run(_rank_run, dcp2), dcp=2)
    for merge, prefill in (("reduce-scatter", "partial"), ("all-to-all", "gathered")):
        dcp4 = _compile(compile_once, tp=4, dcp=4, merge=merge, prefill=prefill).out_dir
        _check_like_dcp1(base, ranks.run(_rank_run, dcp4), dcp=4)


def test_pass_is_required_by_dcp_and_skips_at_dcp1(model_dirs, tmp_path, optimize_shared):
    with pytest.raises(ValueError, match="dcp=2 needs pass split_mla_context"):
        optimize(model_dirs("tiny"), tmp_path / "x", CompileOptions(tp=2, dcp=2, disable=("split_mla_context",)))
    assert not (tmp_path / "x").exists()
    result = optimize_shared(model_dirs("tiny"), tmp_path / "y", CompileOptions(tp=1, enable=("split_mla_context",)))
    (decode, prefill) = [r for r in result.pipeline.records if r.pass_name == "split_mla_context"]
    assert not decode.result.changed and {s.reason for s in decode.result.skipped} == {
        "dcp=1: every rank keeps the whole MLA history"}


def test_prefill_partial_merged_over_members_equals_the_whole_context():
    """k3::mla_prefill_partial on each member's cache, merged by LSE, equals it on one cache
    holding every position (dcp=1): ragged new tokens after history, interleave 1 and 2,
    a member that holds none of a short sequence's positions."""
    from k3compile.ops.mla import mla_prefill_partial_reference

    gen = torch.Generator().manual_seed(4)
    H, W, L, bs = 3, 12, 8, 4
    lengths, new = [9, 2, 14], [4, 2, 1]  # context lengths (history + new), new tokens
    cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(new), H, W, generator=gen)
    rows = [torch.randn(n, W, generator=gen) for n in lengths]  # every position's cached row

    def cache_of(layout):
        """This member's paged cache and block table, its positions in order."""
        mine = [[r for p, r in enumerate(seq) if layout.owns(p)] for seq in rows]
        nblocks = [-(-len(m) // bs) for m in mine]
        cache = torch.zeros(1 + sum(nblocks), bs, W)
        table = torch.zeros(len(rows), max(nblocks + [1]), dtype=torch.int32)
        nxt = 1
        for i, m in enumerate(mine):
            for j, r in enumerate(m):
                cache[nxt + j // bs, j % bs] = r
            table[i, :nblocks[i]] = torch.arange(nxt, nxt + nblocks[i])
            nxt += nblocks[i]
        return cache, table

    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    whole, table = cache_of(ContextLayout(1, 1, 0))
    want, _ = mla_prefill_partial_reference(q, whole, table, cu, seq_lens, torch.tensor(0), 1, 1, 0.3, L)
    for dcp, interleave in ((2, 1), (2, 2), (4, 1)):
        parts = []
        for r in range(dcp):
            layout = ContextLayout(dcp, interleave, r)
            cache, table = cache_of(layout)
            parts.append(mla_prefill_partial_reference(q, cache, table, cu, seq_lens,
                                                       torch.tensor(layout.position_offset), dcp, interleave, 0.3, L))
        lse = torch.stack([p[1] for p in parts])
        weights = torch.exp(lse - torch.logsumexp(lse, dim=0)).nan_to_num(0.0)
        merged = sum(w.unsqueeze(-1) * p[0] for w, p in zip(weights, parts))
        torch.testing.assert_close(merged, want, atol=1e-5, rtol=1e-5)


def test_fresh_prefill_op_rejects_earlier_context():
    q = torch.randn(3, 2, 12)
    kv = torch.randn(3, 10)
    w = torch.randn(2 * (4 + 4), 8)
    with pytest.raises(ValueError, match="sequence 1 has 4 earlier tokens"):
        k3.mla_prefill_new_tokens(q, kv, w, torch.tensor([0, 2, 3], dtype=torch.int32),
                                  torch.tensor([2, 5], dtype=torch.int32), 0.5, torch.float32)


def test_localize_and_layout_random_roundtrip():
    """Random lengths: local slots are distinct and every owned position appears once."""
    rng = random.Random(0)
    for _ in range(20):
        dcp, interleave = rng.choice([2, 4]), rng.choice([1, 2, 3])
        length = rng.randint(1, 40)
        for r in range(dcp):
            lay = ContextLayout(dcp, interleave, r)
            local = [lay.local_position(p) for p in range(length) if lay.owns(p)]
            assert local == sorted(set(local)) and len(local) == lay.local_length(length)


#: The DCP kernels' tests run on the GPU where there is one, else under the interpreter
#: (tests/conftest.py), which truncates fp32 -> bf16.
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_dcp_rescale_triton_kernel_matches_the_reference():
    """The GPU kernel of k3::dcp_rescale (under TRITON_INTERPRET without a GPU) against the
    op's torch reference, with members that own nothing (lse -inf) and a row no member has."""
    from k3compile.runtime.kernels.dcp_merge import dcp_rescale

    gen = torch.Generator().manual_seed(0)
    for dcp, B, H, D in ((2, 3, 4, 20), (4, 3, 3, 16)):
        o = torch.randn(B, H, D, generator=gen).bfloat16()
        lse_all = torch.randn(dcp * B, H, generator=gen)
        lse_all[1::B] = float("-inf")  # sequence 1: member 0 only has positions
        lse_all[1] = torch.randn(H, generator=gen)
        lse_all[2::B, 0] = float("-inf")  # sequence 2, head 0: no member has a position
        for member in range(dcp):
            lse = lse_all[member * B : (member + 1) * B].clone()
            want = k3.dcp_rescale(o, lse, lse_all, dcp)  # the torch reference on CPU tensors
            got = dcp_rescale(*(t.to(KERNEL_DEVICE) for t in (o, lse, lse_all)), dcp).cpu()
            assert got.shape == (H, B, D) and got.dtype == torch.float32
            assert_close_scaled(got, want, torch.float32, roundings=DCP_RESCALE, dims=-1, what="rescaled rows")


def test_dcp_pack_and_merge_triton_kernels_match_the_references():
    """The GPU kernels of k3::dcp_pack and k3::dcp_merge (under TRITON_INTERPRET without a GPU)
    against the ops' torch references: members that own nothing (lse -inf), a row that
    no member has (merged to 0), a value width that is not a power of two. The merge in
    bf16 against the reference's fp32 merge: one rounding (tests/tolerances.py: DCP_MERGE)."""
    from k3compile.runtime.kernels.dcp_merge import dcp_merge, dcp_pack

    gen = torch.Generator().manual_seed(1)
    for dcp, B, h, D in ((2, 3, 2, 20), (4, 2, 3, 16)):
        o = torch.randn(B, dcp * h, D, generator=gen).bfloat16()
        lse = torch.randn(B, dcp * h, generator=gen)
        lse[1, :h] = float("-inf")
        packed = dcp_pack(o.to(KERNEL_DEVICE), lse.to(KERNEL_DEVICE), dcp).cpu()
        assert packed.shape == (dcp, B, h, D + 1) and packed.dtype == torch.float32
        assert torch.equal(packed, k3.dcp_pack(o, lse, dcp))  # a copy: exact
        received = torch.randn(dcp, B, h, D + 1, generator=gen)
        received[0, 0, :, D] = float("-inf")  # sequence 0: member 0 owns nothing
        received[:, 1, 0, D] = float("-inf")  # sequence 1, head 0: no member owns anything
        got = dcp_merge(received.to(KERNEL_DEVICE), torch.bfloat16).cpu()
        want = k3.dcp_merge(received, torch.float32)
        assert got.dtype == torch.bfloat16 and torch.equal(got[1, 0], torch.zeros(D).bfloat16())
        assert_close_scaled(got, want, torch.bfloat16, roundings=DCP_MERGE(torch.bfloat16), dims=-1,
                            truncates=KERNEL_DEVICE == "cpu", what="merged rows")


def aot_requests() -> dict[tuple[str, str], object]:
    """k3::dcp_rescale, dcp_pack and dcp_merge at K3 DCP8 shapes (bf16 o, 512 values) for
    every GPU target; compiled in the session's one batch (conftest's aot_reports)."""
    from k3compile.runtime.kernels.dcp_merge import aot_launches

    return {(name, t): launch.request(t) for t in ("gfx950", "gfx942", "sm_90")
            for name, launch in aot_launches(8).items()}


def test_dcp_merge_kernels_compile_for_every_gpu_target(aot_reports):
    """Every kernel of aot_requests: within LDS, no spills, at least one program per CU."""
    assert len(aot_reports) == 9
    for report in aot_reports.values():
        assert report.fits and report.occupancy >= 1, report
        assert report.spills in (0, None), report


def test_pad_heads_runs_after_dcp_on_the_gathered_heads(compile_once):
    """tiny-h24 at TP2 (12 heads per rank, as K3 at TP8) for h200 with DCP2: the DCP pass
    gathers 24 heads, then pad_attention_heads pads those 24 to 32 (not 12 to 16)."""
    result = compile_once("tiny-h24", "mxfp4", tp=2, dcp=2, target="h200", dtype="float32")
    names = [r.pass_name for r in result.pipeline.records if r.phase == "decode"]
    assert names.index("split_mla_context") < names.index("pad_attention_heads")
    pad = next(r for r in result.pipeline.records if r.pass_name == "pad_attention_heads" and r.phase == "decode")
    n_mla = sum(kind == "mla" for kind in result.captured.config.layer_kinds)
    assert pad.result.matches == n_mla and all("heads 24 -> 32" in r.detail for r in pad.result.rewrites)
    graph = result.captured.programs["decode"].graph
    split_kv = [n for n in graph.nodes if n.target is k3.mla_decode_split_kv.default]
    assert [n.args[0].meta["val"].shape[1] for n in split_kv] == [32] * n_mla
    assert all(n.args[3].target is k3.dcp_local_lengths.default for n in split_kv)  # local lengths reach the kernel
