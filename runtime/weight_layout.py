"""Parameters laid out as consecutive rows of one buffer, so that one GEMM reads them all.

Some k3 ops take several weights that multiply the same input (``k3::kda_decode_fused_proj``:
a KDA layer's q, k, v, g and b projections; ``k3::situ_and_mul_proj``: an MLP's gate and
up; ``k3::mla_input_proj``: an MLA layer's q_a, kv_a and g projections;
``k3::moe_input_proj``: a MoE layer's router, latent down, shared gate and up). Their kernels run
ONE GEMM over all those rows
when the weights are consecutive row blocks of one tensor (:func:`consecutive_rows`), and one
GEMM per weight otherwise: the same values either way, up to the GEMM's accumulation order.
At load the runtime allocates each such group as one buffer and makes its parameters views
of it (:func:`grouped_parameters`), and every program that reads the parameters (prefill's
separate linears too) reads the same views. The buffer's rows are padded with zeros to a
multiple of :data:`ROW_ALIGN`, and the GEMM runs over the padding too (its columns are
dropped, :func:`column_blocks`): cuBLAS ran a KDA layer's 6,156 rows (not a multiple of 8)
as a legacy GEMV at batch 1 and with 2-element-aligned tiles at 16 and 64.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torch.export import ExportedProgram

from k3compile.ops import activations, kda_fused, mla_proj, moe_input

#: a group's buffer holds a multiple of this many rows (zeros after the last weight)
ROW_ALIGN = 64

#: op -> its weight arguments to lay out as consecutive rows, in this order
ROW_GROUPS: dict[object, tuple[str, ...]] = {
    torch.ops.k3.kda_decode_fused_proj.default: kda_fused.PROJECTION_WEIGHTS,
    torch.ops.k3.situ_and_mul_proj.default: activations.PROJECTION_WEIGHTS,
    torch.ops.k3.mla_input_proj.default: mla_proj.PROJECTION_WEIGHTS,
    torch.ops.k3.moe_input_proj.default: moe_input.PROJECTION_WEIGHTS,
}


def consecutive_rows(weights: Sequence[Tensor]) -> Tensor | None:
    """The [rows, K] tensor whose consecutive row blocks the 2-D ``weights`` are, in order
    (one storage, each block right after the previous), or None. ``rows`` is their sum, or
    that rounded up to :data:`ROW_ALIGN` when the storage ends there (a
    :func:`grouped_parameters` buffer: zero rows); :func:`column_blocks` splits a product."""
    first = weights[0]
    if first.dim() != 2:
        return None
    K, offset, rows = first.shape[1], first.storage_offset(), 0
    for w in weights:
        if (w.dim() != 2 or w.shape[1] != K or w.stride() != (K, 1) or w.dtype != first.dtype
                or w.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                or w.storage_offset() != offset + rows * K):
            return None
        rows += w.shape[0]
    padded = padded_rows(rows)
    if first.untyped_storage().nbytes() == (offset + padded * K) * first.element_size():
        rows = padded
    return first.as_strided((rows, K), (K, 1), offset)


def column_blocks(product: Tensor, weights: Sequence[Tensor]) -> tuple[Tensor, ...]:
    """Each weight's columns of ``product`` (x times :func:`consecutive_rows` of
    ``weights``, transposed; padding columns dropped), as views."""
    sizes = [w.shape[0] for w in weights]
    return product.narrow(-1, 0, sum(sizes)).split(sizes, dim=-1)


def padded_rows(rows: int) -> int:
    """``rows`` rounded up to :data:`ROW_ALIGN`."""
    return -(-rows // ROW_ALIGN) * ROW_ALIGN


def padding_bytes(program: ExportedProgram) -> int:
    """Bytes the padding rows of the program's groups add to its parameters."""
    total = 0
    for group in row_groups(program):
        metas = [program.state_dict[name] for name in group]
        rows = sum(m.shape[0] for m in metas)
        total += (padded_rows(rows) - rows) * metas[0].shape[1] * metas[0].element_size()
    return total


def row_groups(program: ExportedProgram) -> list[tuple[str, ...]]:
    """The parameter names of each op call of :data:`ROW_GROUPS` in ``program``, in layout
    order; a group whose weights differ in width or dtype, or share a parameter with an
    earlier group, is left out (its op then runs one GEMM per weight)."""
    params = program.graph_signature.inputs_to_parameters
    groups: list[tuple[str, ...]] = []
    taken: set[str] = set()
    for node in program.graph.nodes:
        names = ROW_GROUPS.get(node.target)
        if names is None:
            continue
        schema = [a.name for a in node.target._schema.arguments]
        args = [node.kwargs[n] if n in node.kwargs else node.args[schema.index(n)] for n in names]
        group = tuple(params.get(getattr(a, "name", None)) for a in args)
        if None in group or taken & set(group) or len(set(group)) != len(group):
            continue
        metas = [program.state_dict[name] for name in group]
        if any(m.dim() != 2 or m.shape[1] != metas[0].shape[1] or m.dtype != metas[0].dtype for m in metas):
            continue
        groups.append(group)
        taken |= set(group)
    return groups


def grouped_parameters(program: ExportedProgram, device: torch.device) -> dict[str, Tensor]:
    """For every :func:`row_groups` group, one new buffer and its parameters as views of it
    (uninitialised: the loader fills them; the padding rows zero), by parameter name."""
    views: dict[str, Tensor] = {}
    for group in row_groups(program):
        metas = [program.state_dict[name] for name in group]
        rows = sum(m.shape[0] for m in metas)
        buffer = torch.empty(padded_rows(rows), metas[0].shape[1], dtype=metas[0].dtype, device=device)
        buffer[rows:].zero_()
        for name, block in zip(group, buffer[:rows].split([m.shape[0] for m in metas]), strict=True):
            views[name] = block
    return views
