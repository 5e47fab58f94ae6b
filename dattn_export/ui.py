"""Terminal output: progress on stderr, short summary tables on stdout.

In a terminal, spinners and progress bars; in a log (stdout or stderr not a terminal: CI, `| tee`, a file), nothing
is wrapped or cut and progress is plain lines: a line as each step, graph or engine is done, and for long byte work
a line every LOG_EVERY_SECONDS with the bytes, rate and time left. (Nothing before a step fails: a failure stays
the one line the CLI prints.)"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from rich.console import Console, ConsoleDimensions
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table
from rich.text import Text

LOG_WIDTH = 10_000  # a log's lines are as long as their content: no wrapping, no cut values
LOG_EVERY_SECONDS = 10.0


class LogConsole(Console):
    """Rich's console on sys.stdout or sys.stderr as they are at each print (a test's capture included): a terminal's
    width there, LOG_WIDTH and no wrapping in a log."""

    @property
    def size(self) -> ConsoleDimensions:
        size = Console.size.fget(self)
        return size if self.is_terminal else ConsoleDimensions(LOG_WIDTH, size.height)

    @size.setter
    def size(self, value: tuple[int, int]) -> None:
        Console.size.fset(self, value)

    @property
    def soft_wrap(self) -> bool:
        return not self.is_terminal

    @soft_wrap.setter
    def soft_wrap(self, value: bool) -> None:  # Console's __init__ sets it; the stream decides
        pass


out = LogConsole(highlight=False)
err = LogConsole(stderr=True, highlight=False)


# whether `stage` shows its stages: off inside `stages_unseen` (a job that shows its own progress over many)
SHOW_STAGES: ContextVar[bool] = ContextVar("dattn_show_stages", default=True)


@contextmanager
def stage(description: str, timings: dict[str, float] | None = None) -> Iterator[None]:
    """Show a spinner while a stage runs (in a log, its line when it is done) and record its wall time under
    `description` in `timings`."""
    timings = {} if timings is None else timings
    start = time.perf_counter()
    if not SHOW_STAGES.get():
        yield
        timings[description] = time.perf_counter() - start
        return
    with err.status(description):
        yield
    timings[description] = time.perf_counter() - start
    err.print(f"[green]done[/] {description} ({timings[description]:.2f} s)")


@contextmanager
def stages_unseen() -> Iterator[None]:
    """`stage` records its times but shows nothing inside: for work repeated under a progress bar of its own."""
    token = SHOW_STAGES.set(False)
    try:
        yield
    finally:
        SHOW_STAGES.reset(token)


def counted(count: int, noun: str) -> str:
    """ "1 input", "2 inputs"."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def human_bytes(count: float) -> str:
    """1234567890 -> '1.23 GB' (decimal units, as disks and the Hub count)."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(count) < 1000 or unit == "TB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.2f} {unit}"
        count /= 1000
    raise AssertionError


class LogProgress:
    """Progress as plain lines: where it stands every LOG_EVERY_SECONDS, and once at the end."""

    def __init__(self, description: str, total: int, unit: str):
        self.description, self.total, self.unit = description, total, unit
        self.done, self.start = 0, time.perf_counter()
        self.last = self.start

    def amount(self, count: float) -> str:
        return human_bytes(count) if self.unit == "B" else f"{count:,.0f} {self.unit}"

    def line(self, detail: str = "") -> str:
        elapsed = time.perf_counter() - self.start
        rate = self.done / elapsed if elapsed > 0 else 0.0
        share = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
        left = f", {(self.total - self.done) / rate:.0f} s left" if rate and self.done < self.total else ""
        where = f": {detail}" if detail else ""
        if self.unit == "B":
            counts, pace = f"{self.amount(self.done)} of {self.amount(self.total)}{share}", f"{self.amount(rate)}/s"
        else:  # items (graphs, layers): few and slow, each's time
            counts = f"{self.done:,} of {self.amount(self.total)}{share}"
            pace = f"{elapsed / self.done:.2f} s each" if self.done else "none done yet"
        return f"{self.description}: {counts}, {pace}{left}{where}"

    def advance(self, amount: int, detail: str = "") -> None:
        """Bytes: a line every LOG_EVERY_SECONDS; items (graphs, layers: few and slow): a line for each."""
        self.done += amount
        if (amount and self.unit != "B") or time.perf_counter() - self.last >= LOG_EVERY_SECONDS:
            self.last = time.perf_counter()
            err.print(self.line(detail), markup=False)


@contextmanager
def progress(description: str, total: int, unit: str = "B") -> Iterator[Callable[..., None]]:
    """Long work's progress on stderr: yields `advance(amount, detail="")`. `unit` "B" counts bytes (size, rate and
    time left as transfers show them); another unit (tensors, layers, graphs) counts items."""
    if err.is_terminal:
        amounts = [DownloadColumn(), TransferSpeedColumn()] if unit == "B" else [MofNCompleteColumn()]
        columns = [TextColumn("{task.description:<48.48}"), BarColumn(), *amounts, TimeRemainingColumn()]
        with Progress(*columns, console=err, transient=True) as bar:
            task = bar.add_task(description, total=total)
            yield lambda amount, detail="": bar.update(task, advance=amount, description=detail or description)
        return
    log = LogProgress(description, total, unit)
    yield log.advance
    if unit == "B":  # items had their line each
        err.print(log.line(), markup=False)


@contextmanager
def quiet(description: str, total: int, unit: str = "B") -> Iterator[Callable[..., None]]:
    """`progress`'s stand-in for library calls: shows nothing."""
    yield lambda amount, detail="": None


def summary_table(title: str, rows: list[tuple[str, str]]) -> Table | Text:
    """A command's closing summary: a table in a terminal; in a log, its title and a line a value (`key  value`,
    a value's further lines under it), as wide as their content and no wider."""
    if not out.is_terminal:
        width = max((len(key) for key, _ in rows), default=0)
        lines = [title]
        for key, value in rows:
            first, *more = str(value).splitlines() or [""]
            lines += [f"  {key:<{width}}  {first}".rstrip(), *(f"  {'':<{width}}  {line}" for line in more)]
        return Text("\n".join(lines))
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    for key, value in rows:
        table.add_row(key, value)
    return table
