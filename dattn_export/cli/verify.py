"""`dattn-export verify`: a converted folder checked against its manifest (and its source)."""

from __future__ import annotations

import click

from ..folders import CONVERTED, TRAINING_OUTPUT, resolve
from .common import examples, source_options


@click.command(
    short_help="Check a converted folder: hashes, tensors, model, template.",
    epilog=examples("dattn-export verify ./converted", "dattn-export verify ./converted --against ./checkpoint-1200"),
)
@click.argument("converted", type=click.Path(), metavar="CONVERTED")
@click.option("--against", type=click.Path(), help="The source checkpoint to compare every tensor with.")
@source_options
def verify(converted: str, against: str | None, base, vision_heads):
    """Check a converted folder: manifest hashes, every tensor reloads exactly, the model loads and runs."""
    converted = resolve(converted, "verify", CONVERTED)
    against = against and resolve(against, "verify --against", *TRAINING_OUTPUT, base=base, base_option=True)
    from rich.table import Table

    from ..stages.verify import verify as run_verify
    from ..ui import out as stdout
    from ..ui import progress

    checks = run_verify(converted, against, base, vision_heads, progress)
    table = Table(title=f"dattn-export verify {converted}", title_justify="left")
    for column in ("check", "result", "detail"):
        table.add_column(column)
    for check in checks:
        table.add_row(check.name, "[green]ok[/]" if check.ok else "[red]FAILED[/]", check.detail)
    stdout.print(table)
    if not all(c.ok for c in checks):
        raise SystemExit(1)
