"""`dattn-export serve`: vLLM's OpenAI-compatible server with our plugin."""

from __future__ import annotations

import os
import sys

import click

from ..folders import CONVERTED, resolve
from .common import examples, verbose_option


@click.command(
    short_help="Serve a converted folder with vLLM (OpenAI API).",
    context_settings={"ignore_unknown_options": True},
    epilog=examples(
        "dattn-export serve ./converted", "dattn-export serve ./converted -tp 2 --port 8001 --max-model-len 8192"
    ),
)
@click.argument("converted", type=click.Path(file_okay=False), metavar="CONVERTED")
@click.option(
    "--tensor-parallel-size",
    "-tp",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Ranks (GPUs, or CPU core groups).",
)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address the server listens on.")
@click.option(
    "--port", type=click.IntRange(1, 65535), default=8000, show_default=True, help="Port the server listens on."
)
@click.option(
    "--context-cache-gib",
    type=click.FloatRange(min=0),
    help="Memory per rank for the contexts (K/V of every layer) of images and videos seen before, so that a "
    "later question on one skips its towers and context stream [plugin default: 4; 0: off].",
)
@verbose_option
@click.argument("vllm_args", nargs=-1, type=click.UNPROCESSED)
def serve(
    converted: str,
    tensor_parallel_size: int,
    host: str,
    port: int,
    context_cache_gib: float | None,
    verbose: bool,
    vllm_args: tuple[str, ...],
):
    """Serve a converted folder with vLLM (an OpenAI-compatible server): `vllm serve CONVERTED` with our plugin, a chat
    template when the tokenizer has none and, on CPU, the environment vLLM needs. Arguments after CONVERTED that are not
    ours go to `vllm serve`."""
    import shlex

    converted = resolve(converted, "serve", CONVERTED)
    from ..stages.serve import vllm_serve_command

    command, env = vllm_serve_command(converted, tensor_parallel_size, host, port, vllm_args, context_cache_gib,
                                      verbose)  # fmt: skip
    shown = [f"{k}={shlex.quote(v)}" for k, v in env.items()]
    click.echo(f"running: {' '.join([*shown, shlex.join(command)])}", err=True)  # exactly what runs
    sys.stdout.flush()
    os.execvpe(command[0], command, {**os.environ, **env})
