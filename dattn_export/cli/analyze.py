"""`dattn-export analyze`: where the text's attention goes, layer by layer."""

from __future__ import annotations

from pathlib import Path

import click

from ..extras import require
from ..folders import TRAINING_OUTPUT, check_output, resolve
from ..media_options import Media, check_early
from .common import MEDIA_PATH, examples, one_prompt, output_option, prompt_option, video_options


@click.command(
    short_help="The text's attention on the media, layer by layer.",
    epilog=examples(
        "dattn-export analyze ./converted --image cat.png --prompt 'What is it?' -o out",
        "dattn-export analyze ./video-model --video clip.mp4 --raw-prompt $'USER: <image>\\nWhat happens?' -o out",
    ),
)
@click.argument("checkpoint", type=click.Path())
@click.option("--image", type=MEDIA_PATH, help="Image file.")
@video_options
@prompt_option(required=True)
@output_option("Report folder: report.json, visual_mass.png, laws.png.")
@click.option("--force", is_flag=True, help="Replace the report folder if it exists.")
def analyze(checkpoint: str, image, video, frames, audio, prompt: str, raw_prompt: str, out: Path, force: bool):
    """Per layer and text token, the attention mass on the image (a video model: on its frames and on its audio);
    MLLM-LAWS curves and attention shift; plots."""
    prompt = one_prompt(prompt, raw_prompt, required=True)
    checkpoint = resolve(checkpoint, "analyze", *TRAINING_OUTPUT)
    check_output(out, force, [checkpoint])  # before the imports: "already exists" at once
    media = Media(images=[image] if image else [], video=video, frames=frames, audio=audio)
    check_early(media, checkpoint, [prompt])
    require("matplotlib")  # the plots come last: say so before the work
    from ..stages.analyze import analyze as run_analyze
    from ..ui import out as stdout
    from ..ui import summary_table

    report = run_analyze(checkpoint, media, prompt, out, force)
    shift = (
        "n/a (needs <image> with text on both sides)"
        if report.attention_shift is None
        else f"{report.attention_shift:.4f}"
    )
    per_layer = ", ".join(f"{sum(row) / len(row):.3f}" for row in report.visual_mass)
    audio_rows = []
    if report.audio_mass is not None:
        audio_rows = [("mean audio mass per layer", ", ".join(f"{sum(r) / len(r):.3f}" for r in report.audio_mass))]
    rows = [
        ("tokens", f"{len(report.tokens)} ({report.image_after_token} before the image)"),
        ("mean visual mass per layer", per_layer),
        *audio_rows,
        ("attention shift", shift),
        ("written", f"{out}/report.json, visual_mass.png, laws.png"),
    ]
    stdout.print(summary_table("dattn-export analyze", rows))
