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
    "--max-new-tokens", type=click.IntRange(min=1), default=12, show_default=True, help="Greedy tokens to generate."
)
@click.option(
    "--force", is_flag=True, help="Write into a folder that is not empty, replacing the demo's own folders in it."
)
def demo(directory: Path, family: str, input_type: str, max_new_tokens: int, force: bool):
    """The main job end to end on a tiny random-weight D-Attn checkpoint written to DIRECTORY/checkpoint:
    reference generation, convert + verify, ONNX export + validation on ONNX Runtime."""
    check_demo_folder(directory, force)
    from ..stages.demo import run_demo
    from ..ui import err

    run = run_demo(directory, family, input_type == "video", max_new_tokens, force)
    err.print()
    print_validation(run.report, run.exported)
    verified = "; ".join(c.detail for c in run.checks) if all(c.ok for c in run.checks) else "FAILED"
    rows = [
        ("checkpoint", f"{run.checkpoint} ({family}, {input_type})"),
        ("verify", f"{run.converted}: {verified}"),
        ("onnx", f"{run.exported}: validation {'passed' if run.report.passed else 'FAILED'}"),
    ]
    print_prompt_result("dattn-export demo", run.result, rows, run.seconds, note=RANDOM_WEIGHTS)
    if not run.passed:
        raise SystemExit(1)
