"""`dattn-export`: one thin command per capability; the work lives in the package's modules.

Heavy imports (torch, transformers) happen inside the commands so `--help` stays fast.
"""

from __future__ import annotations

from pathlib import Path

import click

from . import __version__
from .errors import InputError


class DAttnGroup(click.Group):
    """Reports InputError as one line on stderr with exit code 2, never a traceback."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except InputError as e:
            click.secho(f"error: {e}", err=True, fg="red")
            ctx.exit(2)


@click.group(cls=DAttnGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="dattn-export")
def main():
    """From D-Attn (decomposed attention) training output to verified, deployable artifacts."""


def print_prompt_result(title: str, result, rows: list[tuple[str, str]]) -> None:
    from .ui import out, summary_table

    out.print(f"prompt ids ({len(result.prompt_ids)}): {result.prompt_ids}")
    out.print(f"generated ids ({len(result.generated_ids)}): {result.generated_ids}")
    out.print(f"generated text: {result.text!r}")
    params = ", ".join(f"{k} {v:,}" for k, v in result.parameters.items())
    timings = ", ".join(f"{k.split(':')[0]} {v:.2f} s" for k, v in result.seconds.items())
    rows = [*rows, ("parameters", params), ("visual tokens", str(result.visual_tokens)), ("time", timings)]
    out.print(summary_table(title, rows))


@main.command()
@click.argument("directory", default="dattn-demo", type=click.Path(file_okay=False, path_type=Path))
@click.option("--family", type=click.Choice(["mistral", "gemma2"]), default="mistral", show_default=True)
@click.option("--max-new-tokens", default=12, show_default=True)
def demo(directory: Path, family: str, max_new_tokens: int):
    """Write a tiny random-weight D-Attn checkpoint to DIRECTORY/checkpoint and run the main job on it."""
    from .demo import DEMO_PROMPT, write_demo_checkpoint
    from .fileio import atomic_dir
    from .generation import run_prompt

    checkpoint = directory / "checkpoint"
    with atomic_dir(checkpoint, overwrite=True) as tmp:
        write_demo_checkpoint(tmp, family)
    click.echo(f"wrote a tiny {family} D-Attn checkpoint to {checkpoint}", err=True)
    result = run_prompt(checkpoint, DEMO_PROMPT, [checkpoint / "demo.png"], max_new_tokens)
    print_prompt_result("dattn-export demo", result, [("checkpoint", str(checkpoint)), ("family", family)])


@main.command()
@click.argument("checkpoint", type=click.Path(path_type=Path))
@click.option("--prompt", required=True, help="Text prompt.")
@click.option("--image", "images", multiple=True, type=click.Path(path_type=Path), help="Image file (repeatable).")
@click.option("--max-new-tokens", default=20, show_default=True)
def generate(checkpoint: Path, prompt: str, images: tuple[Path, ...], max_new_tokens: int):
    """Greedy generation with the PyTorch reference model: a smoke test for a checkpoint folder."""
    from .generation import run_prompt

    result = run_prompt(checkpoint, prompt, list(images), max_new_tokens)
    print_prompt_result("dattn-export generate", result, [("checkpoint", str(checkpoint))])
