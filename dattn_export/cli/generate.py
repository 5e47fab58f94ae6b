"""`dattn-export generate`: prompts answered from one encoded context, on the reference or a graph backend."""

from __future__ import annotations

from pathlib import Path

import click

from ..extras import require_backend
from ..folders import BACKENDS, resolve
from ..media_options import Media, check_early
from .answers import answers_json, print_answers, print_prompt_result
from .common import MEDIA_PATH, check_device, device_option, examples, given_prompts, video_options


@click.command(
    short_help="Answer questions about media, on any backend.",
    epilog=examples(
        "dattn-export generate ./converted --image cat.png --prompt 'What is shown?'",
        "dattn-export generate ./video-model --video clip.mp4 --query 'a man opens the door' --query 'a dog barks'",
    ),
)
@click.argument("checkpoint", type=click.Path(), metavar="FOLDER")
@click.option(
    "--prompt",
    "questions",
    multiple=True,
    help="A question, asked as the released models were trained: the media's marker first, through the "
    "checkpoint's chat template (repeatable: the media is encoded once and every prompt answered from it).",
)
@click.option(
    "--query",
    "queries",
    multiple=True,
    help="A retrieval query about --video (repeatable): the family's released task prompt around it, asked as --prompt "
    "is; the answer's time ranges printed as the released script prints them.",
)
@click.option(
    "--raw-prompt",
    "raw_prompts",
    multiple=True,
    help="A finished prompt, tokenized as it is (no chat template): mark the media's place with <image>.",
)
@click.option(
    "--prompts",
    "prompts_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help='A file of questions, after the options above: one a line, or JSON lines (.jsonl: a string or {"prompt": '
    '...}; {"query": ...} or {"raw_prompt": ...} for the other kinds).',
)
@click.option("--image", "images", multiple=True, type=MEDIA_PATH, help="Image file (repeatable).")
@video_options
@click.option(
    "--max-new-tokens", type=click.IntRange(min=1), default=20, show_default=True, help="Greedy tokens to generate."
)
@click.option(
    "--backend",
    type=click.Choice(list(BACKENDS)),
    default="torch",
    show_default=True,
    help="torch: the PyTorch reference on a checkpoint or converted folder; ort: an `onnx` folder on ONNX Runtime "
    "CPU; trt: a `trt` engines folder on a GPU; genai: onnxruntime-genai decoding an `onnx` folder (the context by "
    "our graphs on ONNX Runtime, once).",
)
@device_option
@click.option("--json", "as_json", is_flag=True, help="Print the answers, token counts and timings as JSON.")
def generate(
    checkpoint: str,
    questions: tuple[str, ...],
    queries: tuple[str, ...],
    raw_prompts: tuple[str, ...],
    prompts_file: Path | None,
    images: tuple[Path, ...],
    video: Path | None,
    frames: Path | None,
    audio: Path | None,
    max_new_tokens: int,
    backend: str,
    device: str,
    as_json: bool,
):
    """Greedy generation from FOLDER: a checkpoint or converted folder with the PyTorch reference model, or the
    exported graphs with the backend that runs them."""
    check_device(backend, device)
    prompts = given_prompts(questions, queries, raw_prompts, prompts_file, video)
    checkpoint = resolve(checkpoint, f"generate --backend {backend}", *BACKENDS[backend], hub=backend == "torch")
    media = Media(images=list(images), video=video, frames=frames, audio=audio)
    check_early(media, checkpoint, prompts)
    require_backend(backend)
    from ..stages.generate import run_prompts, run_prompts_graphs

    if backend == "torch":
        answers = run_prompts(checkpoint, prompts, media, max_new_tokens, device)
    else:
        answers = run_prompts_graphs(checkpoint, prompts, media, max_new_tokens, backend, device)
    if as_json:
        import json

        click.echo(json.dumps(answers_json(answers, prompts, checkpoint, backend), indent=2))
        return
    folder = [("checkpoint" if backend == "torch" else "graphs", str(checkpoint))]
    if len(prompts) == 1:
        print_prompt_result("dattn-export generate", answers.one(), folder)
    else:
        print_answers("dattn-export generate", answers, folder)
