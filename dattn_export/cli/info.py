"""`dattn-export info`: what a checkpoint is, without reading tensor data."""

from __future__ import annotations

from pathlib import Path

import click

from ..folders import TRAINING_OUTPUT, resolve
from .common import examples, source_options


@click.command(
    short_help="A checkpoint's layout, architecture and size.",
    epilog=examples("dattn-export info ./global_step1200 --json", "dattn-export info bytedance/Vidi1.5-9B@main"),
)
@click.argument("checkpoint", type=click.Path())
@source_options
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def info(checkpoint: str, base: Path | None, vision_heads: int | None, as_json: bool):
    """Detect a checkpoint's layout and show its architecture, parameters, dtypes, size and problems."""
    import dataclasses
    import json

    checkpoint = resolve(checkpoint, "info", *TRAINING_OUTPUT, base=base, base_option=True)
    from ..stages.info import describe
    from ..ui import out, summary_table

    report = describe(checkpoint, base, vision_heads)
    if as_json:
        click.echo(json.dumps(dataclasses.asdict(report), indent=2))
        return
    architecture = dict(report.architecture or {})
    inferred = architecture.pop("inferred", {})
    rows = [
        ("layout", f"{report.layout} ({'; '.join(report.notes)})"),
        *((key.replace("_", " "), str(value)) for key, value in architecture.items()),
        *((f"inferred: {key}", origin) for key, origin in inferred.items()),
        ("parameters", ", ".join(f"{k} {v:,}" for k, v in report.parameters.items())),
        ("tensors", f"{report.tensors:,} ({', '.join(f'{k} {v}' for k, v in report.dtypes.items())})"),
        ("bytes", f"{report.bytes:,}"),
        ("problems", "\n".join(report.problems) or "none"),
    ]
    out.print(summary_table(f"dattn-export info {checkpoint}", rows))
