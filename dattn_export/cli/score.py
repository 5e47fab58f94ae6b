"""`dattn-export score`: a predictions file scored as VUE-TR's released scorer scores it, every query counted."""

from __future__ import annotations

import json
from pathlib import Path

import click

from ..extras import require
from ..folders import check_output
from .common import examples

EXISTING_FILE = click.Path(exists=True, dir_okay=False, path_type=Path)


@click.command(
    short_help="Score retrieval predictions as VUE-TR does.",
    epilog=examples(
        "dattn-export score predictions.jsonl --gt VUE-TR_ground_truth.json",
        "dattn-export score int4.jsonl --against reference.jsonl --gt bench.json --json",
    ),
)
@click.argument("predictions", type=EXISTING_FILE)
@click.option(
    "--gt", "truth", type=EXISTING_FILE, help="The ground truth: VUE-TR's (either version) or a JSONL with gt."
)
@click.option(
    "--against",
    type=EXISTING_FILE,
    help="Another predictions file whose answers are the truth (a deployment against the reference backend); --gt "
    "then only names the queries' attributes.",
)
@click.option("--json", "as_json", is_flag=True, help="Print every figure as JSON, at full precision.")
@click.option(
    "--plots",
    type=click.Path(file_okay=False, path_type=Path),
    help="Write the IoU, precision and recall curves here, overall and per attribute (the [analyze] extra).",
)
@click.option("--force", is_flag=True, help="Replace the --plots folder if it exists.")
def score(predictions: Path, truth: Path | None, against: Path | None, as_json: bool, plots: Path | None, force: bool):
    """Precision, recall and IoU (areas under their curves over 101 thresholds, overall and per attribute) computed as
    VUE-TR's released scorer computes them, and lmms-eval's R@IoU 0.3/0.5/0.7 and mIoU. Every query of the truth
    counts: one without a prediction scores as empty; the released scorer's figure, over the predictions given
    alone, is printed beside."""
    if truth is None and against is None:
        raise click.UsageError(
            "give the truth: --gt FILE (a ground truth) or --against FILE (another predictions file)"
        )
    if plots is not None:
        check_output(plots, force)
        require("matplotlib")
    from ..stages.score import score as run_score

    result = run_score(predictions, truth, against)
    if plots is not None:
        from ..artifacts import atomic_dir
        from ..stages.score import plot_curves

        with atomic_dir(plots, overwrite=force) as tmp:
            plot_curves(result, tmp)
    if as_json:
        click.echo(json.dumps(result.to_json(), indent=2))
        return
    print_score(result, plots)


def print_score(result, plots: Path | None) -> None:
    from rich.table import Table

    from ..stages.score import percent
    from ..ui import out

    table = Table(title=f"dattn-export score {result.predictions} (truth: {result.truth})", title_justify="left")
    for column in ("queries", "subset", "precision", "recall", "IoU", "R@0.3", "R@0.5", "R@0.7", "mIoU"):
        table.add_column(column, justify="left" if column == "subset" else "right")

    def row(label: str, figures, style: str = "") -> None:
        values = [figures.precision, figures.recall, figures.iou, *figures.recall_at.values(), figures.miou]
        table.add_row(str(figures.queries), label, *map(percent, values), style=style)

    row("overall", result.overall, "bold")
    for name, values in result.attributes.items():
        for value, figures in values.items():
            row(f"{name}: {value}", figures)
    out.print(table)
    released = result.submitted
    shown = lambda value: f"{100 * value:.1f}%" if value is not None else "nan%"  # as its print formats them
    out.print(
        f"The released scorer (qa_eval.py) prints, over the {released.queries} predictions given: Precision: "
        f"{shown(released.precision)}, Recall: {shown(released.recall)}, IoU: {shown(released.iou)}",
        markup=False,
    )
    if result.missing:
        shown = ", ".join(map(str, result.missing[:8])) + (", ..." if len(result.missing) > 8 else "")
        out.print(
            f"{len(result.missing)} of {result.queries} queries have no prediction (query_id {shown}): scored here "
            "as empty (IoU 0, recall 0); the released scorer leaves them out of its averages",
            markup=False,
        )
    if plots is not None:
        out.print(f"plots: {plots}", markup=False)
