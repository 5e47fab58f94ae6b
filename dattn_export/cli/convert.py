"""`dattn-export convert`: training output to verified safetensors, config and manifest."""

from __future__ import annotations

from pathlib import Path

import click

from ..folders import TRAINING_OUTPUT, check_output, resolve
from .common import DTYPE, DTYPE_HELP, examples, output_option, source_options


@click.command(
    short_help="Training output to verified safetensors and a manifest.",
    epilog=examples(
        "dattn-export convert ./checkpoint-1200 -o ./converted",
        "dattn-export convert ./global_step1200 -o ./converted --dtype bf16 --max-shard-size 2GB --force",
    ),
)
@click.argument("checkpoint", type=click.Path())
@output_option("Output folder (written beside, then renamed into place).")
@click.option(
    "--dtype",
    type=DTYPE,
    default="auto",
    show_default=True,
    help=f"auto: the dtype config.json declares, else the dtype most weights are stored in. {DTYPE_HELP}",
)
@click.option(
    "--max-shard-size", default="5GB", show_default=True, help="Largest safetensors file (e.g. 2GB, 500MB, 10GiB)."
)
@click.option("--force", is_flag=True, help="Replace the output folder if it exists.")
@source_options
def convert(checkpoint: str, out: Path, dtype: str, max_shard_size: str, force: bool, base, vision_heads):
    """Convert training output (HF, Trainer, DeepSpeed ZeRO, adapter-only) to verified sharded safetensors."""
    checkpoint = resolve(checkpoint, "convert", *TRAINING_OUTPUT, base=base, base_option=True)
    check_output(out, force, [checkpoint])  # before the imports: "already exists" at once
    from ..checkpoints.names import audio_tower_role
    from ..stages.convert import convert as run_convert
    from ..ui import human_bytes, progress, summary_table
    from ..ui import out as stdout

    result = run_convert(checkpoint, out, dtype, max_shard_size, force, base, vision_heads, progress)
    shards = sorted(n for n in result.files if n.endswith(".safetensors"))
    source = result.source
    audio = (
        [("audio tower", f"{audio_tower_role(source.config)} ({source.audio_origin})")] if source.audio_origin else []
    )
    rows = [
        ("source", f"{checkpoint} ({source.reader.layout}; {'; '.join(source.reader.notes)})"),
        ("vision config", source.vision_origin),
        *audio,
        *((f"inferred: {key}", origin) for key, origin in (source.config.dattn_inferred or {}).items()),
        ("output", f"{out} ({len(shards)} shard(s), {len(result.files) + 1} files incl. manifest)"),
        (
            "tensors",
            f"{result.tensor_count:,} as {str(result.dtype).removeprefix('torch.')}"
            + (f"; stored once: {', '.join(result.dropped)}" if result.dropped else ""),
        ),
        ("bytes", f"{result.weight_bytes:,}"),
        ("copied", result.copy),
        (
            "time",
            f"{result.seconds:.2f} s in all; the tensors written in {result.writing_seconds:.2f} s "
            f"({human_bytes(result.weight_bytes / max(result.writing_seconds, 1e-9))}/s)",
        ),  # fmt: skip
    ]
    stdout.print(summary_table("dattn-export convert", rows))
