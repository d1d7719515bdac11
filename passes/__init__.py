"""Graph transformation passes, one per file (installed as ``k3compile.passes``).

Each pass registers itself (``k3compile.pipeline.register_pass``) with its name, config
and declarations; the pipeline selects and orders passes from those alone. The modules
are imported here in pipeline order, which is the order among passes that no
``after``/``before`` relation orders (so keep this list in that order, not sorted).
``ALL_PASSES`` is the registry itself: every registered pass by name, in that order.
"""

# isort: skip_file
from k3compile.passes.remove_noops import RemoveNoops
from k3compile.passes.mxfp4_experts import MXFP4Experts
from k3compile.passes.dedup_replicated_linear import DedupReplicatedLinear
from k3compile.passes.sink_copies import SinkCopies
from k3compile.passes.fuse_kda_decode import FuseKDADecode
from k3compile.passes.fuse_attn_res_norm import FuseAttnResNorm
from k3compile.passes.merge_glu_projections import MergeGluProjections
from k3compile.passes.merge_mla_projections import MergeMlaProjections
from k3compile.passes.merge_moe_input import MergeMoeInput
from k3compile.passes.split_mla_context import SplitMLAContext
from k3compile.passes.pad_attention_heads import PadAttentionHeads
from k3compile.pipeline.interface import PASSES as ALL_PASSES

__all__ = [
    "ALL_PASSES", "DedupReplicatedLinear", "FuseAttnResNorm", "FuseKDADecode", "MXFP4Experts", "MergeGluProjections",
    "MergeMlaProjections", "MergeMoeInput", "PadAttentionHeads", "RemoveNoops", "SinkCopies", "SplitMLAContext",
]
