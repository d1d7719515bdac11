"""Decode context parallelism (DCP): which rank stores which positions of the MLA history.

Under TP every rank computes its own heads but caches the latent of every token (q_a and
kv_a are replicated), so the MLA history is stored ``tp`` times. DCP splits it by
position instead, within groups of ``dcp`` consecutive TP ranks (TP rank ``g*dcp + r``
is member ``r`` of group ``g``): position ``p`` of a sequence is stored only by member

    owner(p) = (p // interleave) % dcp

so the positions come in cycles of ``dcp * interleave``, each member owning a run of
``interleave`` of them per cycle. A member stores its positions densely in its own paged
cache, in position order: global position p is local position

    local(p) = (p // (dcp * interleave)) * interleave + p % interleave

and of a sequence of length L it stores

    local_length(L) = (L // cycle) * interleave + clamp(L % cycle - r * interleave, 0, interleave)

positions. Member 0 owns position 0, so every non-empty sequence has history on member
0; a member may own nothing yet (L <= r * interleave): its attention is empty and the
merge gives it weight zero.

What changes for a program in this layout (the ``split_mla_context`` pass produces it):
the step inputs ``block_table`` and ``slot_mapping`` are this rank's: its own cache
blocks for its own positions, and for each new token its local slot if it owns the
token, else the scratch slot (block 0 offset 0, which the runtime reserves); ``seq_lens``
stays the global context length (the graph derives local lengths from it). The MLA
cache tensors hold local positions only. KDA state is unaffected (split by heads).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.fx import GraphModule

from k3compile.sharding import ParallelPlan

#: The process-group name the DCP collectives in a graph use. Programs are shared by all
#: ranks (SPMD) while each rank's DCP group differs, so each rank registers its own group
#: under this one name (:func:`k3compile.distributed.init_context_parallel`).
DCP_GROUP_NAME = "k3_dcp"

#: ``GraphModule.meta`` key the pass sets on a program in the context-parallel layout.
LAYOUT_META_KEY = "context_parallel"

#: Where a rank's non-owned new tokens are written: block 0, offset 0 (reserved).
SCRATCH_SLOT = 0


@dataclass(frozen=True)
class ContextLayout:
    """One DCP group member's share of every sequence's positions."""

    dcp: int = 1
    interleave: int = 1
    rank: int = 0  # member index in the DCP group

    def __post_init__(self) -> None:
        if self.dcp < 1 or self.interleave < 1 or not 0 <= self.rank < self.dcp:
            raise ValueError(f"invalid context layout {self}")

    @classmethod
    def of(cls, plan: ParallelPlan) -> ContextLayout:
        return cls(plan.dcp, plan.dcp_interleave, plan.dcp_rank)

    @property
    def cycle(self) -> int:
        return self.dcp * self.interleave

    @property
    def position_offset(self) -> int:
        """This member's first position in each cycle."""
        return self.rank * self.interleave

    def owner(self, position: int) -> int:
        return (position // self.interleave) % self.dcp

    def owns(self, position: int) -> bool:
        return self.owner(position) == self.rank

    def local_position(self, position: int) -> int:
        """Where an owned position lives in this member's cache."""
        return (position // self.cycle) * self.interleave + position % self.interleave

    def local_length(self, length: int) -> int:
        """How many of a sequence's first ``length`` positions this member stores."""
        rest = length % self.cycle - self.position_offset
        return (length // self.cycle) * self.interleave + min(max(rest, 0), self.interleave)

    def max_local_length(self, length: int) -> int:
        """The most any member stores of ``length`` positions (member 0's share)."""
        return ContextLayout(self.dcp, self.interleave, 0).local_length(length)


def local_lengths(seq_lens: Tensor, position_offset: Tensor, dcp: int, interleave: int) -> Tensor:
    """:meth:`ContextLayout.local_length` of every entry of ``seq_lens`` (int32), for the
    member whose first position in a cycle is ``position_offset`` (a 0-d tensor)."""
    cycle = dcp * interleave
    lens = seq_lens.long()
    rest = (lens % cycle - position_offset.to(lens.device)).clamp(0, interleave)
    return ((lens // cycle) * interleave + rest).to(torch.int32)


def dcp_groups(tp: int, dcp: int) -> list[list[int]]:
    """The DCP groups: consecutive TP ranks, ``dcp`` per group."""
    return [list(range(g * dcp, (g + 1) * dcp)) for g in range(tp // dcp)]


def program_layout(gm: GraphModule) -> tuple[int, int] | None:
    """(dcp, interleave) if ``gm`` is in the context-parallel layout, else None."""
    return gm.meta.get(LAYOUT_META_KEY)


@dataclass
class LocalStep:
    """A step's inputs as one DCP member sees them, and where its positions live."""

    inputs: list  # StepModule user inputs in this member's layout
    global_slots: Tensor  # [n] flat cache slots of the member's positions in the global cache
    local_slots: Tensor  # [n] the same positions' flat slots in the member's cache


def mla_cache_indices(layer_kinds: tuple[str, ...] | list[str]) -> list[int]:
    """Indices of the MLA caches in the flat cache list (k3compile.batch.flatten_caches)."""
    out, i = [], 0
    for kind in layer_kinds:
        if kind == "kda":
            i += 4
        else:
            out.append(i)
            i += 1
    return out


def localize_step(layer_kinds: tuple[str, ...] | list[str], inputs: list, layout: ContextLayout) -> LocalStep:
    """One step's user inputs (StepModule order, global layout: every position cached)
    turned into what member ``layout.rank`` gets: its own paged MLA caches holding its
    positions of each sequence's history (blocks allocated in order after the scratch
    block 0), its block table, and its slot mapping (scratch slot for tokens it does not
    own). ``seq_lens`` and everything else stay as they are. Used by translation
    validation and tests to run a context-parallel program on the same step."""
    ids, cu, seq_lens, state_slots, table, slot_mapping, logit_indices, caches = inputs
    mla = mla_cache_indices(layer_kinds)
    block_size = caches[mla[0]].shape[1] if mla else 1
    lengths = seq_lens.tolist()
    new = (cu[1:] - cu[:-1]).tolist()
    local_blocks = [-(-layout.local_length(n) // block_size) for n in lengths]
    # as wide on every member (the runtime's SequenceTable.make_batch): the prefill's history all-gather
    width = max([1, *(-(-layout.max_local_length(n) // block_size) for n in lengths)])
    local_table = torch.zeros(len(lengths), width, dtype=table.dtype)
    global_slots, local_slots, history, local_mapping = [], [], [], []
    next_block = 1  # block 0 is scratch
    for i, (length, n_new, nb) in enumerate(zip(lengths, new, local_blocks)):
        blocks = list(range(next_block, next_block + nb))
        next_block += nb
        local_table[i, :nb] = torch.tensor(blocks, dtype=table.dtype)
        for p in range(length):
            if not layout.owns(p):
                if p >= length - n_new:
                    local_mapping.append(SCRATCH_SLOT)
                continue
            lp = layout.local_position(p)
            local_slot = blocks[lp // block_size] * block_size + lp % block_size
            global_slots.append(int(table[i, p // block_size]) * block_size + p % block_size)
            local_slots.append(local_slot)
            history.append(p < length - n_new)
            if p >= length - n_new:
                local_mapping.append(local_slot)
    g = torch.tensor(global_slots, dtype=torch.int64)
    loc = torch.tensor(local_slots, dtype=torch.int64)
    kept = torch.tensor(history, dtype=torch.bool)
    local_caches = list(caches)
    for index in mla:
        kv = caches[index]
        local = kv.new_zeros(next_block, block_size, kv.shape[-1])
        local.view(-1, kv.shape[-1])[loc[kept]] = kv.view(-1, kv.shape[-1])[g[kept]]
        local_caches[index] = local
    local_inputs = [ids, cu, seq_lens, state_slots, local_table,
                    torch.tensor(local_mapping, dtype=slot_mapping.dtype), logit_indices, local_caches]
    return LocalStep(local_inputs, g, loc)
