"""Terminal output: progress on stderr, short summary tables on stdout."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.table import Table

out = Console(highlight=False)
err = Console(stderr=True, highlight=False)


@contextmanager
def stage(description: str, timings: dict[str, float]) -> Iterator[None]:
    """Show a spinner while a stage runs and record its wall time under `description`."""
    start = time.perf_counter()
    with err.status(description):
        yield
    timings[description] = time.perf_counter() - start
    err.print(f"[green]done[/] {description} ({timings[description]:.2f} s)")


def summary_table(title: str, rows: list[tuple[str, str]]) -> Table:
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    for key, value in rows:
        table.add_row(key, value)
    return table
