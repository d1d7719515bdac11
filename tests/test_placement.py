"""Placement analysis on the captured 'tiny' programs (TP1 and TP2), its error cases on
small hand-made programs, and the redundant-work report against a hand count."""

from __future__ import annotations

import importlib
import operator
import pkgutil

import torch
import torch.distributed as dist
import torch.nn.functional as F
import pytest
from torch import nn

import k3compile.ops as k3ops
from k3compile.capture import capture, tracing_process_group
from k3compile.config import PRESETS
from k3compile.distributed import TPGroup
from k3compile.placement import (
    PlacementError,
    op_rule,
    propagate_placements,
    redundant_work,
)
from k3compile.sharding import ParallelPlan, Partial, Replicate, Shard, ShardSpec

R = Replicate()
CFG = PRESETS["tiny"]
PHASES = ("decode", "prefill")
DECODE_SIZES = {"batch": 1, "logits": 1, "max_blocks": 4}
c10d = torch.ops._c10d_functional


@pytest.fixture(scope="module")
def captured():
    """{tp: CapturedModel} with placements propagated on every phase."""
    out = {}
    for tp in (1, 2):
        cm = capture(CFG, ParallelPlan(tp=tp, rank=0), torch.float32, phases=PHASES)
        for program in cm.programs.values():
            propagate_placements(program.graph_module, program, cm.specs, cm.plan)
        out[tp] = cm
    return out


def param_node(program, fqn: str):
    names = {v: k for k, v in program.graph_signature.inputs_to_parameters.items()}
    return next(n for n in program.graph.nodes if n.op == "placeholder" and n.name == names[fqn])


def linears_of(program, fqn: str):
    w = param_node(program, fqn)
    return [u for u in w.users if u.target is torch.ops.aten.linear.default]


def dispatched_linears_of(program, fqn: str):
    """The cond of a dispatched linear (model/gemm.py) and the linear in each branch."""
    w = param_node(program, fqn)
    (cond,) = [u for u in w.users if u.target is torch.ops.higher_order.cond]
    index = list(cond.args[3]).index(w)
    linears = []
    for attr in cond.args[1:3]:
        branch = getattr(program.graph_module, attr.target)
        ph = [n for n in branch.graph.nodes if n.op == "placeholder"][index]
        linears += [u for u in ph.users if u.target is torch.ops.aten.linear.default]
    return cond, linears


def only_user(node, target):
    (user,) = [u for u in node.users if u.target is target]
    return user


# --------------------------------------------------------------------------- placements


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("phase", PHASES)
def test_every_node_has_a_placement(captured, tp, phase):
    program = captured[tp].programs[phase]
    for node in program.graph.nodes:
        assert "placement" in node.meta, node.name
        val, p = node.meta.get("val"), node.meta["placement"]
        if isinstance(val, torch.Tensor):
            assert isinstance(p, (Replicate, Shard, Partial)), node.name
            if isinstance(p, Shard):
                assert 0 <= p.dim < val.dim(), node.name
        elif isinstance(val, (tuple, list)):
            assert isinstance(p, tuple) and len(p) == len(val), node.name
    out = program.graph.output_node()
    assert out.meta["placement"] == (R,)


@pytest.mark.parametrize("phase", PHASES)
def test_tp1_is_all_replicate(captured, phase):
    for node in captured[1].programs[phase].graph.nodes:
        p = node.meta["placement"]
        for q in p if isinstance(p, tuple) else (p,):
            assert q in (R, None), (node.name, q)


@pytest.mark.parametrize("phase", PHASES)
def test_column_parallel_q_proj_is_sharded_on_the_last_dim(captured, phase):
    program = captured[2].programs[phase]
    for layer in (0, 1, 3, 4):  # KDA layers
        (lin,) = linears_of(program, f"k3.model.layers.{layer}.self_attn.q_proj.weight")
        assert lin.args[0].meta["placement"] == R
        assert lin.meta["placement"] == Shard(lin.meta["val"].dim() - 1) == Shard(1)
        # The conv keeps the channel split and the view to [T, h, D] shards the heads.
        conv = next(iter(lin.users))
        assert conv.meta["placement"] == Shard(1)
        (view,) = conv.users
        assert tuple(view.meta["val"].shape[1:]) == (CFG.linear_attn.num_heads // 2, CFG.linear_attn.head_dim)
        assert view.meta["placement"] == Shard(1)
    # MLA: q_b is column-parallel too, the replicated q_a before it is R.
    (q_b,) = linears_of(program, "k3.model.layers.2.self_attn.q_b_proj.weight")
    assert q_b.meta["placement"] == Shard(1)
    (q_a,) = linears_of(program, "k3.model.layers.2.self_attn.q_a_proj.weight")
    assert q_a.meta["placement"] == R


@pytest.mark.parametrize("phase", PHASES)
def test_o_proj_is_partial_until_its_all_reduce(captured, phase):
    program = captured[2].programs[phase]
    for layer, kind in enumerate(CFG.layer_kinds):
        name = f"k3.model.layers.{layer}.self_attn.o_proj.weight"
        if kind == "kda":  # through the GEMM dispatch (model/gemm.py): a cond, placed per branch
            cond, branch_linears = dispatched_linears_of(program, name)
            assert len(branch_linears) == 2
            assert all(b.meta["placement"] == Partial() for b in branch_linears)
            assert all(b.args[0].meta["placement"] == Shard(1) for b in branch_linears)
            lin = only_user(cond, operator.getitem)
        else:
            (lin,) = linears_of(program, name)
            assert lin.args[0].meta["placement"] == Shard(1), kind
        assert lin.meta["placement"] == Partial()
        reduce = only_user(lin, c10d.all_reduce.default)
        assert reduce.meta["placement"] == R
        assert only_user(reduce, c10d.wait_tensor.default).meta["placement"] == R


@pytest.mark.parametrize("phase", PHASES)
def test_moe_placements(captured, phase):
    program = captured[2].programs[phase]
    experts = [n for n in program.graph.nodes if n.target is torch.ops.k3.moe_experts.default]
    assert len(experts) == sum(CFG.is_moe_layer(i) for i in range(CFG.num_hidden_layers))
    for node in experts:
        assert node.meta["placement"] == Partial()
        assert [a.meta["placement"] for a in node.args[:3]] == [R, R, R]  # z, weights, ids
        assert [a.meta["placement"] for a in node.args[3:6]] == [Shard(1), Shard(1), Shard(2)]
        assert only_user(node, c10d.all_reduce.default).meta["placement"] == R
    for layer in range(1, CFG.num_hidden_layers):
        # The redundancy the dedup pass removes: the whole up-projection on every rank.
        (up,) = linears_of(program, f"k3.model.layers.{layer}.mlp.routed_expert_up_proj.weight")
        assert up.meta["placement"] == R
        assert all(a.meta["placement"] == R for a in up.all_input_nodes)
        (down,) = linears_of(program, f"k3.model.layers.{layer}.mlp.shared_experts.down_proj.weight")
        assert down.meta["placement"] == Partial()


@pytest.mark.parametrize("phase", PHASES)
def test_embedding_and_lm_head(captured, phase):
    program = captured[2].programs[phase]
    emb = next(n for n in program.graph.nodes if n.target is torch.ops.aten.embedding.default)
    assert emb.meta["placement"] == Partial()  # vocab parallel
    masked = only_user(emb, torch.ops.aten.mul.Tensor)
    assert masked.meta["placement"] == Partial()
    assert only_user(masked, c10d.all_reduce.default).meta["placement"] == R

    (head,) = linears_of(program, "k3.lm_head.weight")
    assert head.meta["placement"] == Shard(1)
    gather = next(n for n in program.graph.nodes if n.target is c10d.all_gather_into_tensor.default)
    assert gather.args[0].meta["placement"] == Shard(1)  # the fp32 cast of the logits
    assert gather.meta["placement"] == R
    assert only_user(gather, c10d.wait_tensor.default).meta["placement"] == R
    (final,) = program.graph.output_node().args[0]
    assert final.meta["placement"] == R


@pytest.mark.parametrize("phase", PHASES)
def test_caches(captured, phase):
    """KDA states are split by head (rank-local state); the MLA latent cache is replicated."""
    program = captured[2].programs[phase]
    caches = [n for n in program.graph.nodes if n.op == "placeholder" and n.name.startswith("caches_")]
    assert len(caches) == 4 * CFG.layer_kinds.count("kda") + CFG.layer_kinds.count("mla")
    for node in caches:
        width = node.meta["val"].shape[-1]
        want = R if width == CFG.mla_cache_width else Shard(1)
        assert node.meta["placement"] == want, node.name


def test_k3_ops_declare_rules():
    modules = [importlib.import_module(f"k3compile.ops.{m.name}") for m in pkgutil.iter_modules(k3ops.__path__)]
    ops = [v for m in modules for v in vars(m).values() if type(v).__name__ == "CustomOpDef"]
    assert len(ops) >= 15  # every op module is found (14 model ops + add_rank_block at least)
    for op in ops:
        ns, name = op._qualname.split("::")
        assert op_rule(getattr(getattr(torch.ops, ns), name).default) is not None, op._qualname
    assert op_rule(torch.ops.k3.moe_experts.default).kind == "split"
    assert op_rule(torch.ops.k3.kda_decode.default).caches == ("state",)
    assert op_rule(torch.ops.k3.rms_norm.default).kind == "rowwise"


# --------------------------------------------------------------------------- errors


class _RowParallel(nn.Module):
    """A column- then a row-parallel linear (Partial), and a sigmoid before or after the
    all-reduce."""

    def __init__(self, sigmoid_first: bool):
        super().__init__()
        self.up = nn.Parameter(torch.empty(8, 8))
        self.down = nn.Parameter(torch.empty(4, 8))
        self.sigmoid_first = sigmoid_first
        self.tp = TPGroup(2, dist.group.WORLD)

    def forward(self, x):
        y = F.linear(F.linear(x, self.up), self.down)
        if self.sigmoid_first:
            return self.tp.all_reduce(torch.sigmoid(y))
        return torch.sigmoid(self.tp.all_reduce(y))


def _export_row_parallel(sigmoid_first: bool):
    with tracing_process_group(2):
        program = torch.export.export(_RowParallel(sigmoid_first), (torch.zeros(3, 8),), strict=False)
    specs = {
        "up": ShardSpec(names=("up",), shape=(16, 8), dtype="f32", dim=0),
        "down": ShardSpec(names=("down",), shape=(4, 16), dtype="f32", dim=1),
    }
    return program, specs


def test_nonlinear_op_on_partial_raises():
    program, specs = _export_row_parallel(sigmoid_first=True)
    with pytest.raises(PlacementError, match=r"'sigmoid'.*nonlinear op on a Partial.*self=P"):
        propagate_placements(program.graph_module, program, specs, ParallelPlan(tp=2))


def test_sigmoid_after_all_reduce_is_replicate():
    program, specs = _export_row_parallel(sigmoid_first=False)
    propagate_placements(program.graph_module, program, specs, ParallelPlan(tp=2))
    placements = {n.name: n.meta["placement"] for n in program.graph.nodes if n.op == "call_function"}
    assert placements["linear"] == Shard(1) and placements["linear_1"] == Partial()
    assert placements["all_reduce"] == placements["wait_tensor"] == placements["sigmoid"] == R


class _MergeInner(nn.Module):
    """Column-parallel output viewed [T, 2, 2], transposed, and merged with the shard inner."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.empty(4, 8))

    def forward(self, x):
        y = F.linear(x, self.w).view(-1, 2, 2)
        return y.transpose(1, 2).reshape(-1, 4)


def test_view_merging_a_sharded_inner_dim_raises():
    program = torch.export.export(_MergeInner(), (torch.zeros(3, 8),), strict=False)
    specs = {"w": ShardSpec(names=("w",), shape=(8, 8), dtype="f32", dim=0)}
    with pytest.raises(PlacementError, match=r"merges the sharded dim 2 with outer dims"):
        propagate_placements(program.graph_module, program, specs, ParallelPlan(tp=2))
    # At TP1 the same program is all Replicate.
    propagate_placements(program.graph_module, program, specs, ParallelPlan(tp=1))


@torch.library.custom_op("k3test::double", mutates_args=())
def _double(x: torch.Tensor) -> torch.Tensor:
    return 2 * x


@_double.register_fake
def _(x):
    return torch.empty_like(x)


class _NoRule(nn.Module):
    def forward(self, x):
        return torch.ops.k3test.double(x)


def test_custom_op_without_a_rule_raises():
    program = torch.export.export(_NoRule(), (torch.zeros(3),), strict=False)
    with pytest.raises(PlacementError, match=r"'double'.*k3test::double declares no placement rule.*x=R"):
        propagate_placements(program.graph_module, program, {}, ParallelPlan(tp=2))


# --------------------------------------------------------------------------- redundant work


def test_redundant_work_tp2_decode_matches_a_hand_count(captured):
    program = captured[2].programs["decode"]
    report = redundant_work(program.graph_module, program, DECODE_SIZES)
    groups = report.by_group()
    assert groups["moe"]["flops"] > 0 and groups["attn_res"]["flops"] > 0
    assert report.tp == 2

    B, H, E, L = 1, CFG.hidden_size, CFG.num_experts, CFG.routed_expert_hidden_size
    n_moe = sum(CFG.is_moe_layer(i) for i in range(CFG.num_hidden_layers))
    moe_ops = [o for o in report.ops if o.group == "moe"]
    by_module = {}
    for o in moe_ops:
        if o.op in ("aten.linear.default", "k3.router_logits.default"):
            by_module.setdefault(o.module.rsplit(".", 1)[-1], []).append(o.flops)
    # The replicated contractions: router (k3.router_logits, hidden -> experts, fp32), latent
    # down and up projections.
    assert by_module == {
        "mlp": [2 * B * H * E] * n_moe,
        "routed_expert_down_proj": [2 * B * H * L] * n_moe,
        "routed_expert_up_proj": [2 * B * L * H] * n_moe,
    }
    linears = 2 * B * H * E + 2 * B * H * L + 2 * B * L * H
    # Plus, per the cost model: post-attention norm (4/elem), routing (4 per logit), the
    # routed-expert norm (4/elem), the routed + shared add (1/elem); casts cost 0 FLOPs.
    small = 4 * B * H + 4 * B * E + 4 * B * L + B * H
    assert groups["moe"]["flops"] == n_moe * (linears + small)
    # Bytes of one up-projection: input, weight, output in fp32.
    up = next(o for o in moe_ops if o.module.endswith("routed_expert_up_proj"))
    assert up.bytes == 4 * (B * L + H * L + B * H)
    # Nothing TP-split is reported.
    ops = {o.op for o in report.ops}
    assert "k3.moe_experts.default" not in ops and "k3.situ_and_mul.default" not in ops
    assert not any("shared_experts" in o.module or o.module.endswith("o_proj") for o in report.ops)
    assert 0 < report.flops < report.total_flops

    text = report.format()
    assert "moe" in text and "routed_expert_up_proj" in text and "attn_res" in text
    d = report.to_dict()
    assert d["groups"]["moe"]["flops"] == groups["moe"]["flops"]
    assert d["replicated"]["flops"] == report.flops == sum(o["flops"] for o in d["ops"])
    assert d["sizes"] == DECODE_SIZES


def test_redundant_work_tp1_is_everything(captured):
    program = captured[1].programs["prefill"]
    report = redundant_work(program.graph_module, program, {"tokens": 32, "seqs": 2, "logits": 2, "max_blocks": 3})
    assert report.flops == report.total_flops > 0
    assert report.by_group()["moe"]["nodes"] > 0


def test_redundant_work_needs_every_size(captured):
    program = captured[2].programs["decode"]
    with pytest.raises(ValueError, match=r"no size given for .*'max_blocks'.*'logits'"):
        redundant_work(program.graph_module, program, {"batch": 1})
    with pytest.raises(ValueError, match=r"unknown dims \['bach'\]"):
        redundant_work(program.graph_module, program, {"bach": 1})
    # Symbols and input dims are accepted as names too.
    by_alias = redundant_work(program.graph_module, program, {"input_ids.0": 1, "logit_indices.0": 1, "max_blocks": 4})
    assert by_alias.flops == redundant_work(program.graph_module, program, DECODE_SIZES).flops
