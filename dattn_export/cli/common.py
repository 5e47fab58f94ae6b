"""What every command shares: the group that turns every failure into one line, the options several commands take,
the dtype names."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from .. import __version__
from ..dtypes import TORCH_NAMES, short_name
from ..errors import InputError, one_line
from ..modeling import families  # plain Python: --help imports no torch

FAMILIES = tuple(families.FAMILIES)
DEBUG = os.environ.get("DATTN_DEBUG") == "1"  # show the traceback behind a one-line error


# what users of optimum-cli, trtexec, the `hf` CLI and vLLM type, and our command for it
OTHER_TOOLS_NAMES = {
    "export": "`dattn-export onnx` exports ONNX graphs (optimum's `export onnx`); `dattn-export trt` builds TensorRT "
    "engines from them",
    "upload": "`dattn-export push` publishes a converted folder to the Hub",
    "run": "`dattn-export generate` runs a prompt; `dattn-export serve` starts a server",
    "chat": "`dattn-export generate` runs a prompt; `dattn-export serve` starts a server",
    "inspect": "`dattn-export info` describes a checkpoint",
    "check": "`dattn-export verify` checks a converted folder; `dattn-export validate` an export",
    "build": "`dattn-export trt` builds TensorRT engines",
}


class DAttnGroup(click.Group):
    """Every failure as one line on stderr, `Error: ...`, with the exit code of `errors.one_line` (2 input,
    3 environment, 1 a bug), never a traceback (unless DATTN_DEBUG=1); Click's usage errors too (exit 2), with the
    command's --help named in the line."""

    def main(self, args=None, prog_name=None, standalone_mode=True, **extra):
        try:
            code = super().main(args, prog_name, standalone_mode=False, **extra)
        except click.exceptions.NoArgsIsHelpError as e:  # the program alone: its help page, as `--help` prints it
            click.echo(e.ctx.get_help())
            code = 0
        except click.ClickException as e:
            context = getattr(e, "ctx", None)
            hint = f" (see `{context.command_path} --help`)" if context is not None else ""
            code = report(e.exit_code, e.format_message() + hint)
        except click.Abort:
            code = report(*one_line(KeyboardInterrupt()))
        if not standalone_mode:
            return code
        sys.exit(code if isinstance(code, int) else 0)

    def resolve_command(self, ctx: click.Context, args: list[str]):
        """Other tools' command names answered with ours (Click's "Did you mean" only knows spellings)."""
        if args and args[0] in OTHER_TOOLS_NAMES and args[0] not in self.commands:
            raise click.UsageError(f"No such command {args[0]!r}: {OTHER_TOOLS_NAMES[args[0]]}", ctx)
        return super().resolve_command(ctx, args)

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise
        except Exception as e:  # noqa: BLE001  (the one place every failure becomes a line)
            if DEBUG:
                raise
            ctx.exit(report(*one_line(e)))
        except KeyboardInterrupt as e:
            ctx.exit(report(*one_line(e)))


def examples(*commands: str) -> str:
    """A command's --help epilog: worked examples, kept on their lines."""
    return "Examples:\n\n\b\n" + "\n".join(f"  {command}" for command in commands)


class DTypeChoice(click.Choice):
    """--dtype: auto or a float type, under its short name or torch's and vLLM's (bfloat16, half)."""

    def __init__(self):
        super().__init__(["auto", *TORCH_NAMES])

    def convert(self, value, param, ctx):
        return super().convert(short_name(str(value)), param, ctx)


DTYPE = DTypeChoice()


DTYPE_HELP = "Also spelled as torch and vLLM do: float32/float, float16/half, bfloat16."


def report(code: int, line: str) -> int:
    click.secho(f"Error: {' '.join(line.split())}", err=True, fg="red")
    return code


@click.group(cls=DAttnGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="dattn-export")
def main():
    """From D-Attn (decomposed attention) training output to verified, deployable artifacts."""


def output_option(help: str, name: str = "out"):
    """-o/--output: the folder a command writes."""
    return click.option(
        "-o", "--output", name, required=True, type=click.Path(file_okay=False, path_type=Path), help=help
    )


class MediaPath(click.Path):
    """A media file or folder: one that does not exist is answered at once, as a missing checkpoint is (the path's
    deepest existing part named), before anything heavy is imported."""

    def __init__(self):
        super().__init__(path_type=Path)

    def convert(self, value, param, ctx):
        from ..folders import missing

        if not os.path.lexists(value):
            raise InputError(value, missing(Path(value), param.opts[0] if param is not None else None))
        return super().convert(value, param, ctx)


MEDIA_PATH = MediaPath()


def video_options(command):
    """--video, --frames and --audio: a video model's inputs."""
    for name, text in reversed(VIDEO_OPTIONS):
        command = click.option(f"--{name}", type=MEDIA_PATH, help=text)(command)
    return command


VIDEO_OPTIONS = [
    ("video", "Video model: a video file (1 frame/s, its audio)."),
    ("frames", "Video model: a folder of frame images, in name order."),
    ("audio", "Video model: an audio file (instead of the video's)."),
]


def prompt_option(required: bool):
    """--prompt (a question, through the chat template) and --raw-prompt (a finished prompt): one of them, as the
    prompt (`one_prompt`)."""

    def decorate(command):
        command = click.option(
            "--raw-prompt",
            help="A finished prompt, tokenized as it is (no chat template): mark the media with <image>.",
        )(command)
        default = "" if required else " (default: the demo's)"
        return click.option(
            "--prompt", help=f"A question, asked through the checkpoint's chat template, the media first{default}."
        )(command)

    return decorate


def one_prompt(question: str | None, raw: str | None, required: bool):
    """The prompt of `prompt_option`'s options, checked before anything heavy is imported; None: the default."""
    from ..prompts import Prompt

    if question is not None and raw is not None:
        raise click.UsageError("--prompt and --raw-prompt exclude each other")
    if question is None and raw is None and required:
        raise click.UsageError("give a prompt: --prompt TEXT (a question) or --raw-prompt TEXT")
    return Prompt(question) if question is not None else Prompt(raw, "raw") if raw is not None else None


def given_prompts(
    questions: tuple[str, ...], queries: tuple[str, ...], raw: tuple[str, ...], prompts_file: Path | None, video
) -> list:
    """The prompts as given (--prompt, --query, --raw-prompt, then a --prompts file), checked before anything heavy
    is imported: a question that holds a media marker (a prompt finished by hand) is refused, naming --raw-prompt."""
    from ..prompts import QUERY_WITHOUT_VIDEO, Prompt, read_prompts

    prompts = [Prompt(q) for q in questions] + [Prompt(q, "query") for q in queries] + [Prompt(r, "raw") for r in raw]
    prompts += read_prompts(prompts_file) if prompts_file else []
    if not prompts:
        raise click.UsageError("give a prompt: --prompt TEXT (repeatable), --query TEXT, --raw-prompt TEXT or "
                               "--prompts FILE")  # fmt: skip
    if video is None and any(prompt.kind == "query" for prompt in prompts):
        raise InputError("--query", QUERY_WITHOUT_VIDEO)
    return prompts


def device_option(command):
    """--device: where the model or the graphs run (--backend torch or ort)."""
    return click.option(
        "--device",
        type=click.Choice(["cpu", "cuda"]),
        default="cpu",
        show_default=True,
        help="--backend torch: the PyTorch model on the CPU (fp32), or on an NVIDIA GPU in 16 bits with the Triton "
        "kernel, decoding from a CUDA graph (the [gpu] extra); --backend ort: ONNX Runtime's CPU provider, or its CUDA "
        "provider (onnxruntime-gpu, the [gpu] extra).",
    )(command)


DEVICE_BACKENDS = ("torch", "ort")  # those that run on the CPU or a GPU (TensorRT on a GPU only, genai on the CPU)


def check_device(backend: str, device: str) -> None:
    """A --device the backend takes; for the PyTorch model on a GPU, Triton and a visible GPU (exit 3 without)."""
    if device != "cpu" and backend not in DEVICE_BACKENDS:
        raise click.UsageError(f"--device {device} applies to --backend torch or ort (TensorRT runs on the GPU anyway, "
                               "onnxruntime-genai on the CPU)")  # fmt: skip
    if device == "cuda" and backend == "torch":
        from ..extras import require
        from ..memory import require_gpu

        require("triton")
        require_gpu(0, "the model")


def source_options(command):
    """--base and --vision-heads: how to complete a checkpoint that lacks a part."""
    command = click.option(
        "--vision-heads",
        type=click.IntRange(min=1),
        help="Attention heads of the vision tower, to infer its config from tensor shapes "
        "when config.json has no vision_config and the tower is not a known one.",
    )(command)
    return click.option(
        "--base",
        type=click.Path(exists=True, path_type=Path),
        help="Base model folder for an adapter-only save (mm_projector.bin).",
    )(command)


def verbose_option(command):
    """--verbose: vLLM's info lines too (an engine this package starts logs its warnings and errors alone)."""
    return click.option(
        "--verbose", is_flag=True, help="vLLM: show its info lines too, not only its warnings and errors."
    )(command)
