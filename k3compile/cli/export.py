"""``export``: one rank's optimized program in another toolchain's format
(:mod:`k3compile.export`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from k3compile.cli.app import UserError, app, console, fail
from k3compile.cli.artifact import ArtifactArgument
from k3compile.cli.options import choice

#: the formats ``export`` writes
FORMATS = ("onnx", "mlir")


@app.command("export")
def export_command(
    out: ArtifactArgument,
    output: Annotated[Path, typer.Option("-o", "--output", help="The file to write. Example: -o tiny_decode.onnx",
                                         show_default=False)],
    format: Annotated[str, typer.Option("--format", help="onnx or mlir. Example: --format mlir")] = "onnx",
    phase: Annotated[str, typer.Option(help="The program to export: decode (prefill: not yet). Example: --phase decode")]
    = "decode",
    rank: Annotated[int, typer.Option(help="Whose program and weights (a TP1 artifact has rank 0). Example: --rank 0")]
    = 0,
    max_sequences: Annotated[int, typer.Option(help="Sequences the exported cache inputs hold (MLIR: at most 15). "
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
    keep_k3_ops: Annotated[bool, typer.Option("--keep-k3-ops/--decompose-k3-ops",
                                              help="Keep every k3 op call as one custom op (ONNX: a node of the "
                                                   "domain k3 with a registered schema; MLIR, torch dialect only: "
                                                   "torch.operator \"torch.k3.NAME\") instead of decomposing it "
                                                   "into standard operators. No runtime has kernels for them: "
                                                   "ONNX Runtime cannot run such a model. Example: --keep-k3-ops")]
    = False,
) -> None:
    """Export an artifact's decode program, its k3 ops decomposed into standard operators (or kept: --keep-k3-ops).

    The inputs are the runtime's decode-step tensors and every cache; the outputs the logits and every cache after the step (named CACHE.next), so a caller feeds them back in. The batch and the block table's width are dynamic. Collectives have no ONNX or MLIR form: TP > 1 artifacts are refused. docs/export.md has worked examples.

    ONNX: the metadata key k3compile.cache_outputs maps each cache output to its input; checked with onnx.checker (full check) before it is written.

    MLIR (needs torch-mlir: the mlir extra): one function named after the phase, weights embedded as dense resources; the module's attributes k3compile.inputs, k3compile.outputs and k3compile.cache_outputs name its arguments and results. Verified before it is written.

    Example: k3compile export ./tiny.k3c --format onnx -o tiny_decode.onnx

    Example: k3compile export ./tiny.k3c --format mlir --dialect linalg -o tiny_decode.mlir

    With --keep-k3-ops every k3 op call stays one custom op, whose semantics are its torch reference in k3compile/ops (the metadata k3compile.k3_op_references names it): a file to read (Netron) or for a runtime that implements the k3 ops itself; ONNX Runtime and LinalgModule cannot run it.

    Example: k3compile export ./tiny.k3c --keep-k3-ops -o tiny_decode_k3.onnx
    """
    from k3compile.artifact import ArtifactError
    from k3compile.export import ExportOptions, export_mlir, export_onnx
    from k3compile.export.mlir_export import DIALECTS

    try:
        choice(format, FORMATS, "--format", "format")
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
                result = export_onnx(out, output, options)
            else:
                result = export_mlir(out, output, options, dialect)
    except (UserError, ArtifactError, ValueError) as e:
        fail(str(e))
    caches = len(result.cache_outputs)
    size = f"{result.file_bytes / 2**20:.1f} MiB" + (" with its data" if format == "onnx" else "")
    console.print(f"wrote {result.path} ({size}) in {result.seconds:.1f} s: "
                  f"{len(result.inputs) - caches} step inputs and {caches} caches in, the logits and {caches} caches "
                  "out", soft_wrap=True)
