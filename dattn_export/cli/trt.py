"""`dattn-export trt`: TensorRT engines with the D-Attn plugin."""

from __future__ import annotations

from pathlib import Path

import click

from ..extras import require
from ..folders import ONNX, check_output, resolve
from .common import examples, output_option


class AxisSizes(click.ParamType):
    """AXIS=N[,AXIS=N]: sizes of named dynamic axes (trt's --min/--opt/--max)."""

    name = "AXIS=N"

    def convert(self, value, param, ctx):
        if isinstance(value, dict):
            return value
        sizes = {}
        for item in filter(None, value.split(",")):
            axis, _, size = item.partition("=")
            if not (axis.strip() and size.strip().isdigit()):
                self.fail(f"{item!r} is not AXIS=N (e.g. batch=4,sequence=256)", param, ctx)
            sizes[axis.strip()] = int(size)
        return sizes


AXIS_SIZES = AxisSizes()


def merged(dicts) -> dict[str, int]:
    return {key: value for d in dicts for key, value in d.items()}


@click.command(
    short_help="Build TensorRT engines with the D-Attn plugin.",
    epilog=examples(
        "dattn-export trt ./onnx-fp16 -o ./engines --fp16",
        "dattn-export trt ./onnx -o ./engines --max-batch 4 --opt sequence=64 --max context_sequence=4608,images=2",
    ),
)
@click.argument("onnx_folder", type=click.Path(), metavar="ONNX")
@output_option("Folder for the engines and trt_manifest.json.", name="engines")
@click.option(
    "--fp16",
    "precision",
    flag_value="fp16",
    help="Check that the engines are fp16: they take the graphs' own types (strongly typed, as TensorRT 11 builds), "
    "so ONNX must be an fp16 export (onnx --dtype fp16); another is refused with the command that makes one.",
)
@click.option("--bf16", "precision", flag_value="bf16", help="As --fp16, for bf16 (onnx --dtype bf16 --opset 22).")
@click.option(
    "--max-batch",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Most prompts an engine runs at once (shorthand for --max batch=N).",
)
@click.option(
    "--max-context-tokens",
    "--max-visual-tokens",  # its name before audio joined the context
    "max_context_tokens",
    type=click.IntRange(min=1),
    default=2304,
    show_default=True,
    help="Most context tokens a prompt carries (every image's, or a video's frames and audio; shorthand for "
    "--max context_sequence=N).",
)
@click.option(
    "--max-text-tokens",
    type=click.IntRange(min=1),
    default=512,
    show_default=True,
    help="Most text tokens: the prompt plus what is generated (sets sequence, past_sequence and total_sequence).",
)
@click.option(
    "--min",
    "min_axes",
    type=AXIS_SIZES,
    multiple=True,
    help="Profile minimum per axis, AXIS=N[,AXIS=N] (repeatable; the axes are the dynamic ones onnx_manifest.json "
    "names: batch, sequence, context_sequence, ...).",
)
@click.option("--opt", "opt_axes", type=AXIS_SIZES, multiple=True, help="Profile optimum per axis (as --min).")
@click.option(
    "--max",
    "max_axes",
    type=AXIS_SIZES,
    multiple=True,
    help="Profile maximum per axis (as --min; over the shorthands).",
)
@click.option("--timing-cache", type=click.Path(dir_okay=False, path_type=Path), help="Read and update this cache.")
@click.option("--no-plugin", is_flag=True, help="Build fused nodes from their ONNX function instead of the plugin.")
@click.option("--force", is_flag=True, help="Replace ENGINES if it exists.")
def trt(
    onnx_folder: str,
    engines: Path,
    precision,
    max_batch,
    max_context_tokens,
    max_text_tokens,
    min_axes,
    opt_axes,
    max_axes,
    timing_cache,
    no_plugin,
    force,
):
    """Build TensorRT engines (with the DecomposedAttention plugin) for the graphs `onnx` exported to ONNX."""
    onnx_folder = resolve(onnx_folder, "trt", ONNX, hub=False)
    from ..stages.trt_build import Limits, build_engines, check_buildable  # light: torch comes with the build
    from ..ui import out as stdout
    from ..ui import progress, summary_table

    # the user's own mistakes first, then what the machine lacks, then the heavy work
    check_output(engines, force, [onnx_folder])
    check_buildable(onnx_folder, engines, precision)
    limits = Limits(
        max_batch=max_batch,
        max_text_tokens=max_text_tokens,
        max_context_tokens=max_context_tokens,
        min=merged(min_axes),
        opt=merged(opt_axes),
        max=merged(max_axes),
    )
    require("tensorrt")
    if not no_plugin:
        require("triton", unless="--no-plugin")
    manifest = build_engines(
        onnx_folder, engines, precision, limits, timing_cache, force, use_plugin=not no_plugin, progress=progress
    )
    rows = [(name, f"{file} ({(engines / file).stat().st_size:,} bytes)") for name, file in manifest.engines.items()]
    rows += [
        ("attention", "DecomposedAttention plugin" if manifest.plugin else "ONNX function (TensorRT layers)"),
        ("precision", manifest.precision),
        ("profile", ", ".join(f"{axis} {'/'.join(map(str, b))}" for axis, b in manifest.profile.items())),
        ("TensorRT", manifest.tensorrt),
    ]
    stdout.print(summary_table("dattn-export trt", rows))
