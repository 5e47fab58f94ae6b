"""The benches' pictures for docs/benchmarks.md (`--plot PNG`): grouped bars, a colour a series, each bar's value
printed on it, and the machine and date in the corner so that a picture says where its figures come from."""

from __future__ import annotations

import datetime
import platform
from pathlib import Path


def machine() -> str:
    """This machine in a few words: its CPU model and cores (the figures' first dependency on a CPU-only run)."""
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor() or platform.machine())  # fmt: skip
    import os

    return f"{model}, {os.cpu_count()} cores"


def bar_label(value: float) -> str:
    """Three significant figures, whole numbers from 100 up (1,234 rather than 1.23e+03)."""
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def grouped_bars(path: Path, title: str, groups: list[str], series: dict[str, list[float]], unit: str,
                 log: bool = False) -> None:  # fmt: skip
    """One group of bars per entry of `groups`, one bar per series in each; values in `unit`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(9, 4.5), dpi=100)
    width = 0.8 / len(series)
    for number, (name, values) in enumerate(series.items()):
        places = [g + (number - (len(series) - 1) / 2) * width for g in range(len(groups))]
        bars = axes.bar(places, values, width, label=name)
        axes.bar_label(bars, labels=[bar_label(v) for v in values], fontsize=8, padding=2)
    axes.set_xticks(range(len(groups)), groups, fontsize=9)
    axes.set_ylabel(unit)
    if log:
        axes.set_yscale("log")
    axes.set_title(title, fontsize=11)
    axes.legend(fontsize=8, ncols=2, loc="upper left")  # two columns: short enough to clear the bars under it
    axes.margins(y=0.3)
    figure.text(0.99, 0.01, f"{machine()}; {datetime.date.today()}", ha="right", va="bottom", fontsize=7, alpha=0.7)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    print(f"wrote {path}")
