"""`dattn-export quantize`: a converted folder's decoder layers in compressed-tensors' int8, 4-bit or FP8 format."""

from __future__ import annotations

from pathlib import Path

import click

from ..folders import CONVERTED, check_output, resolve
from .common import examples, output_option


@click.command(
    short_help="Quantize a converted folder for vLLM and transformers.",
    epilog=examples(
        "dattn-export quantize ./converted -o ./converted-w8a8 --scheme w8a8",
        "dattn-export quantize ./converted -o ./converted-w4a16 --scheme w4a16 --group-size 64",
    ),
)
@click.argument("converted", type=click.Path(), metavar="CONVERTED")
@output_option("Output folder (written beside, then renamed into place).")
@click.option(
    "--scheme",
    type=click.Choice(["w8a8", "w4a16", "fp8"]),
    required=True,
    help="w8a8: int8 weights (a scale per channel) and int8 activations per token; w4a16: 4-bit weights in groups, "
    "16-bit activations; fp8: float8 weights and activations (GPUs with FP8). vLLM serves each, on CPUs w8a8 and "
    "w4a16 (in bf16); transformers loads each.",
)
@click.option(
    "--group-size", type=click.IntRange(min=2), help="w4a16: input features per scale (default 128, the preset's)."
)
@click.option("--force", is_flag=True, help="Replace the output folder if it exists.")
def quantize(converted: str, out: Path, scheme: str, group_size: int | None, force: bool):
    """Quantize a converted folder's decoder layers (attention and MLP projections) in compressed-tensors' format,
    which vLLM serves and transformers loads; the towers, adapters, embeddings and head stay in 16 bits. `verify`
    holds every quantized matrix to its source within the scheme's rounding."""
    converted = resolve(converted, "quantize", CONVERTED)
    check_output(out, force, [converted])
    from ..stages.quantize import quantize as run_quantize
    from ..ui import human_bytes, progress, summary_table
    from ..ui import out as stdout

    result = run_quantize(converted, out, scheme, group_size, force, progress)
    rows = [
        ("source", str(converted)),
        ("output", str(out)),
        ("scheme", f"{scheme} (compressed-tensors {result.format}" + (f", groups of {result.group_size})" if
                                                                      result.group_size else ", a scale per channel)")),
        ("quantized", f"{result.matrices} matrices (the decoder layers' attention and MLP projections)"),
        ("kept", f"{result.kept} tensors as they are (towers, adapters, embeddings, head, norms)"),
        ("bytes", f"{human_bytes(result.source_bytes)} -> {human_bytes(result.written_bytes)} "
                  f"({result.written_bytes / result.source_bytes:.2f}x)"),
        ("time", f"{result.seconds:.1f} s"),
        ("next", f"dattn-export verify {out}; dattn-export serve {out}"),
    ]  # fmt: skip
    stdout.print(summary_table("dattn-export quantize", rows))
