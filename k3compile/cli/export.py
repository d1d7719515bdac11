"""``export``: one rank's optimized program in another toolchain's format
(:mod:`k3compile.export`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from k3compile.cli.app import UserError, app, console, fail
from k3compile.cli.options import check_dtype, check_plan, check_target, choice, read_config
from k3compile.config import ConfigError

if TYPE_CHECKING:
    from k3compile.export import ModelStructure

#: the formats ``export`` writes
FORMATS = ("onnx", "mlir")


@app.command("export")
def export_command(
    output: Annotated[Path, typer.Option("-o", "--output", help="The file to write. Example: -o tiny_decode.onnx",
                                         show_default=False)],
    out: Annotated[Optional[Path], typer.Argument(
        metavar="ARTIFACT", help="An artifact directory written by 'k3compile optimize' (or --preset instead). "
                                 "Example: ./tiny.k3c", show_default=False)] = None,
    format: Annotated[str, typer.Option("--format", help="onnx or mlir. Example: --format mlir")] = "onnx",
    phase: Annotated[str, typer.Option(help="The program to export: decode (one token a sequence) or prefill (packed prompts, continuations included). Example: --phase prefill")]
    = "decode",
    rank: Annotated[int, typer.Option(help="Whose program and weights: 0 to TP-1 (a TP1 artifact has rank 0). "
                                           "Example: --rank 1")]
    = 0,
    max_sequences: Annotated[int, typer.Option(help="Sequences the exported cache inputs hold (MLIR decode: at most 15). "
                                                    "Example: --max-sequences 8")]
    = 4,
    max_context: Annotated[int, typer.Option(help="Tokens a sequence the cache inputs hold. Example: --max-context 1024")]
    = 256,
    external_data: Annotated[bool, typer.Option("--external-data/--embedded-weights",
                                                help="ONNX: weights in a FILE.data beside the model (ONNX external "
                                                     "data), or inside it (at most 2 GB).")] = False,
    dialect: Annotated[str, typer.Option(help="MLIR: torch (torch-mlir's torch dialect) or linalg (lowered to "
                                              "linalg-on-tensors, which k3compile.export.LinalgModule runs). "
                                              "Example: --dialect linalg")] = "torch",
    preset: Annotated[Optional[str], typer.Option(
        "--preset", "-p", help="Structure only: a built-in configuration compiled now on the meta device (as "
                               "'k3compile plan'), instead of ARTIFACT; no checkpoint, and the weights are graph "
                               "inputs without values (ONNX only). Example: --preset k3", show_default=False)] = None,
    tp: Annotated[Optional[int], typer.Option(help="With --preset: tensor-parallel degree (default 1). Example: --tp 8",
                                              show_default=False)] = None,
    dcp: Annotated[Optional[int], typer.Option(help="With --preset: decode context parallelism, a divisor of --tp "
                                                    "(default 1). Example: --dcp 8", show_default=False)] = None,
    target: Annotated[Optional[str], typer.Option(help="With --preset: the hardware whose passes compile it: cpu, "
                                                       "h200, mi355x or mi300x (default mi355x). Example: --target h200",
                                                  show_default=False)] = None,
    dtype: Annotated[Optional[str], typer.Option(help="With --preset: float32 (the default) or bfloat16 (which "
                                                      "ONNX refuses: its Einsum has no bfloat16). Example: --dtype "
                                                      "float32", show_default=False)] = None,
    keep_k3_ops: Annotated[bool, typer.Option("--keep-k3-ops/--decompose-k3-ops",
                                              help="Keep every k3 op call as one custom op (ONNX: a node of the "
                                                   "domain k3 with a registered schema; MLIR, torch dialect only: "
                                                   "torch.operator \"torch.k3.NAME\") instead of decomposing it "
                                                   "into standard operators. No runtime has kernels for them: "
                                                   "ONNX Runtime cannot run such a model. Example: --keep-k3-ops")]
    = False,
) -> None:
    """Export one rank's decode or prefill program of an artifact (or a preset's decode program, structure only), its k3 ops decomposed into standard operators (or kept: --keep-k3-ops).

    The inputs are the runtime's step tensors and every cache; the outputs the logits and every cache after the step (named CACHE.next), so a caller feeds them back in. The batch and the block table's width are dynamic. docs/export.md has worked examples.

    --phase prefill: the step for several new tokens a sequence (new prompts, and continuations of sequences with cached tokens), packed; the token count is dynamic too, up to --max-sequences x --max-context. Its caches are the decode program's, so a prefill's outputs feed the decode program. A new sequence's KDA state slot must be zero before its first prefill (the runtime zeroes it). A DCP > 1 prefill is refused.

    A TP > 1 artifact exports one rank's program (--rank) with its collectives kept, each one op over the rank's group: ONNX, a node of the domain k3.collectives (attributes: the group's size, ranks and name, the reduce op; metadata k3compile.collectives); MLIR, torch.operator "torch._c10d_functional.NAME" (torch dialect only: linalg has no collectives and is refused). Run each rank's file in its own process of a process group.

    ONNX: the metadata key k3compile.cache_outputs maps each cache output to its input; checked with onnx.checker (full check) before it is written.

    MLIR (needs torch-mlir: the mlir extra): one function named after the phase, weights embedded as dense resources; the module's attributes k3compile.inputs, k3compile.outputs and k3compile.cache_outputs name its arguments and results. Verified before it is written.

    Example: k3compile export ./tiny.k3c --format onnx -o tiny_decode.onnx

    Example: k3compile export ./tiny.k3c --format mlir --dialect linalg -o tiny_decode.mlir

    Example: k3compile export ./tiny.k3c --phase prefill -o tiny_prefill.onnx

    With --keep-k3-ops every k3 op call stays one custom op, whose semantics are its torch reference in k3compile/ops (the metadata k3compile.k3_op_references names it): a file to read (Netron) or for a runtime that implements the k3 ops itself; ONNX Runtime and LinalgModule cannot run it.

    Example: k3compile export ./tiny.k3c --keep-k3-ops -o tiny_decode_k3.onnx

    Example: k3compile export ./tiny-tp2.k3c --rank 1 -o tiny_tp2_rank1.onnx

    Structure only (--preset instead of ARTIFACT): the configuration is compiled for --tp, --dcp and --target on the meta device, without a checkpoint, and the rank's decode program written as ONNX with its weights as graph inputs that have shapes and types but no values: a graph to read (Netron) or to analyse, not to run.

    The full K3 exports with --keep-k3-ops (decomposed, its 40,721-node graph does not get through the ONNX exporter's optimizer in 30 minutes: docs/export.md).

    Example: k3compile export --preset k3 --tp 8 --rank 0 --target mi355x --keep-k3-ops -o k3_tp8_rank0.onnx
    """
    from k3compile.artifact import ArtifactError
    from k3compile.export import ExportOptions, export_mlir, export_onnx
    from k3compile.export.mlir_export import DIALECTS

    try:
        choice(format, FORMATS, "--format", "format")
        source = out if preset is None else _structure(out, preset, tp, dcp, target, dtype, format, external_data)
        if preset is None and (tp, dcp, target, dtype) != (None,) * 4:
            raise UserError("--tp, --dcp, --target and --dtype: with --preset only (an artifact has its own)")
        if source is None:
            raise UserError("give ARTIFACT (an artifact directory) or --preset NAME (structure only)")
        choice(dialect, DIALECTS, "--dialect", "dialect")
        if max_sequences < 2 or max_context < 2:
            raise UserError(f"--max-sequences and --max-context: at least 2, got {max_sequences} and {max_context}")
        if format == "mlir" and external_data:
            raise UserError("--external-data: ONNX only (an MLIR module embeds its weights)")
        if format == "onnx" and dialect != "torch":
            raise UserError(f"--dialect {dialect}: MLIR only (add --format mlir)")
        options = ExportOptions(phase=choice(phase, ("decode", "prefill"), "--phase", "phase"), rank=rank,
                                max_sequences=max_sequences, max_context=max_context, external_data=external_data,
                                k3_ops="keep" if keep_k3_ops else "decompose")
        with console.status(f"exporting the {phase} program of rank {rank}"):
            if format == "onnx":
                result = export_onnx(source, output, options)
            else:
                result = export_mlir(source, output, options, dialect)
    except (UserError, ArtifactError, ConfigError, ValueError) as e:
        fail(str(e))
    caches = len(result.cache_outputs)
    size = f"{result.file_bytes / 2**20:.1f} MiB" + (" with its data" if format == "onnx" and not result.weights else "")
    collectives = result.collectives
    console.print(f"wrote {result.path} ({size}) in {result.seconds:.1f} s: "
                  f"{len(result.inputs) - caches} step inputs and {caches} caches in, the logits and {caches} caches "
                  "out" + (f"; {sum(collectives['calls'].values())} collectives (TP{collectives['tp']} rank "
                           f"{collectives['rank']})" if collectives else "")
                  + (f"; structure only: {len(result.weights)} weights in, without values" if result.weights else ""),
                  soft_wrap=True)


def _structure(artifact: Path | None, preset: str, tp: int | None, dcp: int | None, target: str | None,
               dtype: str | None, format: str, external_data: bool) -> ModelStructure:
    """The ``ModelStructure`` of ``--preset`` and its plan options, checked."""
    from k3compile.compiler import DTYPES
    from k3compile.export import ModelStructure

    if artifact is not None:
        raise UserError(f"give ARTIFACT or --preset, not both (got {artifact} and --preset {preset})")
    if format != "onnx":
        raise UserError(f"--preset: a structure-only export writes ONNX, not {format} (an MLIR module embeds its "
                        "weights)")
    if external_data:
        raise UserError("--external-data: a structure-only export has no weight data")
    cfg = read_config(preset, None, "MODEL", "--preset NAME")
    tp, dcp = tp or 1, dcp or 1
    check_plan(tp, dcp, 1, cfg)
    return ModelStructure(cfg, tp, dcp, target=check_target(target or "mi355x"),
                          dtype=DTYPES[check_dtype(dtype or "float32")])
