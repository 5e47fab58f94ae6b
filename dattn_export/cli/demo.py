"""`dattn-export demo`: the main job end to end on the built-in tiny model."""

from __future__ import annotations

from pathlib import Path

import click

from ..folders import check_demo_folder
from ..modeling import families  # plain Python: --help imports no torch
from .answers import print_prompt_result
from .common import FAMILIES, examples
from .validate import print_validation

RANDOM_WEIGHTS = (
    "(the demo model's weights are random, so its answer is noise by design: what the demo checks is that every "
    "backend gives the reference's tokens, not what they say)"
)


def first_query(run) -> str:
    query, _ = run.answered[0]
    return f"(demo.mov's first query: {query.query!r}; all of them below)"


def answered_rows(answered, family: str) -> list[tuple[str, str]]:
    """A row a query: the seconds of the answer's ranges (the released pattern times the clip's length) and of the
    truth's."""
    from ..answers import seconds_ranges
    from ..modeling.families import FAMILIES as SPECS

    shown = lambda ranges: ", ".join(f"{start:.1f}-{end:.1f} s" for start, end in ranges) or "no range"  # noqa: E731
    rows = []
    for query, result in answered:
        found = seconds_ranges(result.text, query.duration, SPECS[family])
        rows.append((query.query, f"answer {shown(found)}; truth {shown(query.truth)}"))
    return rows


def held_out_line(held_out) -> str:
    """The held-out split's scores, VUE-TR's IoU (area under the curve) first."""
    figures = {"export (ONNX Runtime)": held_out.exported.overall, "random weights": held_out.untrained.overall}
    value = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731  (None: no query qualifies)
    shown = "; ".join(f"{name}: IoU {value(f.iou)}, recall {value(f.recall)}" for name, f in figures.items())
    return f"{held_out.exported.queries} queries of {held_out.benchmark.parent}: {shown}"


@click.command(
    short_help="The whole pipeline on a tiny built-in model.",
    epilog=examples("dattn-export demo", "dattn-export demo ./video-demo --family gemma2 --input video"),
)
@click.argument("directory", default="dattn-demo", type=click.Path(file_okay=False, path_type=Path))
@click.option(
    "--family",
    type=click.Choice(FAMILIES),
    default=families.DEFAULT_FAMILY,
    show_default=True,
    help="The LLM the tiny model is built on.",
)
@click.option(
    "--input",
    "input_type",
    type=click.Choice(["image", "video"]),
    default="image",
    show_default=True,
    help="image: a D-Attn image model and a picture; video: a video model (frames and audio, the released "
    "Vidi layout) and a short video file with a sound track.",
)
@click.option(
    "--max-new-tokens",
    type=click.IntRange(min=1),
    help="Greedy tokens to generate [default: 12; the video model's: room for the two ranges its answers hold].",
)
@click.option(
    "--force", is_flag=True, help="Write into a folder that is not empty, replacing the demo's own folders in it."
)
def demo(directory: Path, family: str, input_type: str, max_new_tokens: int, force: bool):
    """The main job end to end on a tiny D-Attn checkpoint written to DIRECTORY/checkpoint: reference generation,
    convert + verify, ONNX export + validation on ONNX Runtime. The image model has random weights; the video model
    was trained here to find the seconds a query names, and is scored on held-out clips beside a random one."""
    video = input_type == "video"
    if video and families.FAMILIES[family].released_task is None:
        raise click.BadParameter(
            f"video runs the video model trained on the released retrieval task, and the {family} family has no "
            "released retrieval task: choose --family mistral or gemma2",
            param_hint="--input",
        )
    check_demo_folder(directory, force)
    from ..demo_retrieval import ANSWER_TOKENS
    from ..stages.demo import run_demo
    from ..ui import err, out, summary_table

    run = run_demo(directory, family, video, max_new_tokens or (ANSWER_TOKENS if video else 12), force)
    err.print()
    print_validation(run.report, run.exported)
    verified = "; ".join(c.detail for c in run.checks) if all(c.ok for c in run.checks) else "FAILED"
    rows = [
        ("checkpoint", f"{run.checkpoint} ({family}, {input_type})"),
        ("verify", f"{run.converted}: {verified}"),
        ("onnx", f"{run.exported}: validation {'passed' if run.report.passed else 'FAILED'}"),
    ]
    if run.held_out is not None:
        rows.append(("held-out", held_out_line(run.held_out)))
    print_prompt_result(
        "dattn-export demo", run.result, rows, run.seconds, note=first_query(run) if video else RANDOM_WEIGHTS
    )
    if run.answered:
        out.print(
            summary_table(
                "demo.mov's queries: the reference's answer and the truth", answered_rows(run.answered, family)
            )
        )
    if not run.passed:
        raise SystemExit(1)
