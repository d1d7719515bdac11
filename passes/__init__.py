"""Graph transformation passes, one per file (installed as ``k3compile.passes``).

``ALL_PASSES`` lists every pass by name in canonical pipeline order; a target's default
pipeline (``k3compile.targets``) is a subset of these names.
"""

from k3compile.passes.dedup_replicated_linear import DedupReplicatedLinear
from k3compile.passes.fuse_kda_decode import FuseKDADecode
from k3compile.passes.mxfp4_experts import MXFP4Experts
from k3compile.passes.pad_attention_heads import PadAttentionHeads
from k3compile.passes.remove_noops import RemoveNoops
from k3compile.passes.sink_copies import SinkCopies
from k3compile.passes.split_mla_context import SplitMLAContext

ALL_PASSES = {
    p.name: p
    for p in (RemoveNoops, MXFP4Experts, DedupReplicatedLinear, SinkCopies, FuseKDADecode, SplitMLAContext, PadAttentionHeads)
}

__all__ = [
    "ALL_PASSES", "DedupReplicatedLinear", "FuseKDADecode", "MXFP4Experts", "PadAttentionHeads", "RemoveNoops",
    "SinkCopies",
    "SplitMLAContext",
]
