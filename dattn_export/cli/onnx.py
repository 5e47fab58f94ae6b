"""`dattn-export onnx`: the ONNX graphs with the fused attention op (optionally int4 / int8 weights)."""

from __future__ import annotations

from pathlib import Path

import click

from ..folders import TRAINING_OUTPUT, check_output, resolve
from .common import DTYPE, DTYPE_HELP, examples, output_option, source_options

QUANTIZE_OPTIONS = ("block_size", "asymmetric", "quantize_lm_head", "quantize_embedding", "accuracy_level")


def refuse_quantize_options() -> None:
    """A usage error for options that refine --quantize given without it (they would be ignored)."""
    context = click.get_current_context()
    given = [o for o in QUANTIZE_OPTIONS if context.get_parameter_source(o) != click.core.ParameterSource.DEFAULT]
    if given:
        options = ", ".join("--" + name.replace("_", "-") for name in given)
        verb = "applies" if len(given) == 1 else "apply"
        raise click.UsageError(
            f"{options} {verb} only with --quantize: add --quantize int4 or int8, or drop it", context
        )


@click.command(
    "onnx",
    short_help="Export ONNX graphs, one fused attention node a layer.",
    epilog=examples(
        "dattn-export onnx ./converted -o ./onnx",
        "dattn-export onnx ./converted -o ./onnx-int4 --quantize int4 --quantize-lm-head",
    ),
)
@click.argument("checkpoint", type=click.Path())
@output_option("Output folder for the graphs (written beside, then renamed into place).")
@click.option(
    "--attention",
    type=click.Choice(["fused", "standard"]),
    default="fused",
    show_default=True,
    help="fused: one dattn::DecomposedAttention node per attention (+ its ONNX function); "
    "standard: plain ONNX ops only.",
)
@click.option(
    "--dtype",
    type=DTYPE,
    default="fp32",
    show_default=True,
    help="The graphs' float type (auto: the checkpoint's, as convert takes it; bf16 needs --opset 22 and a GPU "
    f"backend to run). {DTYPE_HELP}",
)
@click.option(
    "--opset",
    type=click.IntRange(18, 23),
    default=18,
    show_default=True,
    help="ONNX opset (18-23; TensorRT 10/11 read 18).",
)
@click.option("--force", is_flag=True, help="Replace the output folder if it exists.")
@click.option(
    "--quantize",
    type=click.Choice(["int4", "int8"]),
    help="Weight-only quantization of the LLM's MatMuls in context_kv.onnx and decoder.onnx (ONNX Runtime's "
    "MatMulNBits); validate then applies the accuracy gate instead of the fp32 tolerance.",
)
@click.option(
    "--block-size",
    type=click.Choice(["16", "32", "64", "128", "256"]),
    default="32",
    show_default=True,
    help="--quantize: weights per scale (a power of two, as MatMulNBits takes).",
)
@click.option("--asymmetric", is_flag=True, help="--quantize: a zero point per block (default: symmetric).")
@click.option("--quantize-lm-head", is_flag=True, help="--quantize: the lm_head too (default: kept fp32).")
@click.option("--quantize-embedding", is_flag=True, help="--quantize: the embedding table too (default: kept fp32).")
@click.option(
    "--accuracy-level",
    type=click.IntRange(0, 4),
    default=4,
    show_default=True,
    help="--quantize: MatMulNBits' compute type (4: int8 activations, fast where the CPU has int8 dot products; "
    "0: fp32).",
)
@source_options
def onnx_command(
    checkpoint: str,
    out: Path,
    attention: str,
    dtype: str,
    opset: int,
    force: bool,
    quantize: str | None,
    block_size: int,
    asymmetric: bool,
    quantize_lm_head: bool,
    quantize_embedding: bool,
    accuracy_level: int,
    base,
    vision_heads,
):
    """Export vision.onnx, context_kv.onnx and decoder.onnx (+ onnx_manifest.json) from any checkpoint convert reads."""
    if quantize is None:
        refuse_quantize_options()
    checkpoint = resolve(checkpoint, "onnx", *TRAINING_OUTPUT, base=base, base_option=True)
    check_output(out, force, [checkpoint])  # before the imports: "already exists" at once
    from ..artifacts import Scheme
    from ..stages.onnx_export import export_onnx
    from ..ui import counted, progress, summary_table
    from ..ui import out as stdout

    scheme = quantize and Scheme(
        quantize, int(block_size), not asymmetric, quantize_lm_head, quantize_embedding, accuracy_level
    )
    manifest = export_onnx(
        checkpoint,
        out,
        attention=attention,
        dtype=dtype,
        opset=opset,
        force=force,
        base=base,
        vision_heads=vision_heads,
        progress=progress,
        quantize=scheme,
    )
    rows = [
        (
            name,
            f"{graph.file}: {counted(len(graph.inputs), 'input')}, {counted(len(graph.outputs), 'output')}, "
            f"{counted(graph.fused_attention_nodes, 'fused attention node')}",
        )
        for name, graph in manifest.graphs.items()
    ]
    if manifest.model.audio_tower and "audio" not in manifest.graphs:
        rows.append(("audio tower", f"no graph: {manifest.model.audio_tower}"))
    rows += [
        (
            "attention",
            f"{manifest.attention.implementation} ({manifest.model.dattn_mode}, merge {manifest.model.merge})",
        ),
        ("dtype / opset", f"{manifest.dtype} / {manifest.opset}"),
        *quantization_rows(manifest.quantization),
        *shared_weight_rows(manifest),
        ("onnxruntime-genai", manifest.genai),
        ("output", str(out)),
    ]
    stdout.print(summary_table("dattn-export onnx", rows))


def shared_weight_rows(manifest) -> list[tuple[str, str]]:
    from ..ui import human_bytes

    shared = manifest.graphs["context_kv"].weight_bytes_in_decoder_data
    return [("shared weights", f"context_kv.onnx reads {human_bytes(shared)} from decoder.onnx.data")] if shared else []


def quantization_rows(q) -> list[tuple[str, str]]:
    """The rows of an export's summary for its `artifacts.Quantization` (none when not quantized)."""
    if not q:
        return []
    detail = f"{q.scheme}, block {q.block_size}, {'symmetric' if q.symmetric else 'asymmetric'}, "
    detail += f"accuracy level {q.accuracy_level}"
    head = "lm_head quantized" if q.lm_head else "lm_head kept fp32"
    head += ", embedding quantized" if q.embedding else ", embedding kept fp32"
    graphs = ", ".join(f"{name}.onnx {count}" for name, count in q.matmuls.items())
    return [("quantization", f"MatMuls -> MatMulNBits: {graphs} ({detail}; {head}; towers kept)")]
