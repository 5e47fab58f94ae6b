"""`dattn-export`: one thin command per capability; the work lives in the package's modules.

Heavy imports (torch, transformers) happen inside the commands so `--help` stays fast.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from . import __version__
from .dtypes import TORCH_NAMES, short_name
from .errors import one_line
from .extras import require, require_backend
from .folders import BACKENDS, CONVERTED, ONNX, TRAINING_OUTPUT, check_demo_folder, check_output, resolve
from .modeling import families  # plain Python: --help imports no torch

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


QUANTIZE_OPTIONS = ("block_size", "asymmetric", "quantize_lm_head", "quantize_embedding", "accuracy_level")


def refuse_quantize_options() -> None:
    """A usage error for options that refine --quantize given without it (they would be ignored)."""
    context = click.get_current_context()
    given = [o for o in QUANTIZE_OPTIONS if context.get_parameter_source(o) != click.core.ParameterSource.DEFAULT]
    if given:
        options = ", ".join("--" + name.replace("_", "-") for name in given)
        verb = "applies" if len(given) == 1 else "apply"
        raise click.UsageError(
            f"{options} {verb} only with --quantize: add --quantize int4 or int8, or drop it", context
        )


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


def print_prompt_result(
    title: str, result, rows: list[tuple[str, str]], seconds: dict[str, float] | None = None
) -> None:
    from .ui import out, summary_table

    print_answer(result)
    out.print(summary_table(title, [*rows, *context_rows(result), ("time", timings(seconds or result.seconds))]))


def print_answers(title: str, answers, rows: list[tuple[str, str]]) -> None:
    """Each prompt's answer, then one table: the context (encoded once) and each answer's time."""
    from .ui import out, summary_table

    for number, result in enumerate(answers.results, 1):
        print_answer(result, f"answer {number}: ")
    once = timings(answers.seconds)
    each = "\n".join(f"answer {n}: {sum(r.seconds.values()):.2f} s" for n, r in enumerate(answers.results, 1))
    rows = [*rows, ("prompts", str(len(answers.results))), *context_rows(answers.results[0])]
    out.print(summary_table(title, [*rows, ("time, once", once), ("time, each prompt", each)]))


def answers_json(answers, prompts: list[str], checkpoint: Path, backend: str) -> dict:
    import dataclasses

    first = answers.results[0]
    return {
        "checkpoint": str(checkpoint),
        "backend": backend,
        "visual_tokens": first.visual_tokens,
        "audio_tokens": first.audio_tokens,
        "seconds": answers.seconds,
        "answers": [
            {"prompt": prompt, **{k: v for k, v in dataclasses.asdict(result).items() if k not in ANSWER_SHARED}}
            for prompt, result in zip(prompts, answers.results)
        ],
    }


ANSWER_SHARED = ("visual_tokens", "audio_tokens", "parameters")  # a PromptResult's fields that every answer shares


def print_answer(result, label: str = "") -> None:
    from .ui import out

    out.print(f"{label}prompt ids ({len(result.prompt_ids)}): {result.prompt_ids}")
    out.print(f"{label}generated ids ({len(result.generated_ids)}): {result.generated_ids}")
    out.print(f"{label}generated text: {result.text!r}")
    if result.time_ranges is not None:  # a video file's answer, as the released inference script prints it
        out.print(f"{label}time ranges: {', '.join(result.time_ranges) or '(none in the answer)'}")


def context_rows(result) -> list[tuple[str, str]]:
    from .checkpoints.names import AUDIO_TOWER_NOT_RUN

    rows = [("parameters", ", ".join(f"{k} {v:,}" for k, v in result.parameters.items()))]
    rows.append(("visual tokens", str(result.visual_tokens)))
    if result.audio_tokens is not None:
        rows.append(("audio tokens", str(result.audio_tokens)))
    elif "audio tower" in result.parameters:
        rows.append(("audio tower", AUDIO_TOWER_NOT_RUN))
    return rows


def timings(seconds: dict[str, float]) -> str:
    return "\n".join(f"{k.split(':')[0]}: {v:.2f} s" for k, v in seconds.items())


@main.command(
    epilog=examples("dattn-export demo", f"dattn-export demo ./video-demo --family {FAMILIES[-1]} --input video")
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
    from .stages.demo import run_demo
    from .ui import err

    run = run_demo(directory, family, input_type == "video", max_new_tokens, force)
    err.print()
    print_validation(run.report, run.exported)
    verified = "; ".join(c.detail for c in run.checks) if all(c.ok for c in run.checks) else "FAILED"
    rows = [
        ("checkpoint", f"{run.checkpoint} ({family}, {input_type})"),
        ("verify", f"{run.converted}: {verified}"),
        ("onnx", f"{run.exported}: validation {'passed' if run.report.passed else 'FAILED'}"),
    ]
    print_prompt_result("dattn-export demo", run.result, rows, run.seconds)
    if not run.passed:
        raise SystemExit(1)


class AxisSizes(click.ParamType):
    """AXIS=N[,AXIS=N]: sizes of named dynamic axes (trt's --min/--opt/--max)."""

    name = "AXIS=N"

    def convert(self, value, param, ctx):
        if isinstance(value, dict):
            return value
        sizes = {}
        for item in filter(None, value.split(",")):
            axis, _, size = item.partition("=")
            if not (axis.strip() and size.strip().isdigit()):
                self.fail(f"{item!r} is not AXIS=N (e.g. batch=4,sequence=256)", param, ctx)
            sizes[axis.strip()] = int(size)
        return sizes


AXIS_SIZES = AxisSizes()


def merged(dicts) -> dict[str, int]:
    return {key: value for d in dicts for key, value in d.items()}


def output_option(help: str, name: str = "out"):
    """-o/--output: the folder a command writes."""
    return click.option(
        "-o", "--output", name, required=True, type=click.Path(file_okay=False, path_type=Path), help=help
    )


def video_options(command):
    """--video, --frames and --audio: a video model's inputs."""
    for name, text in reversed(VIDEO_OPTIONS):
        command = click.option(f"--{name}", type=click.Path(path_type=Path), help=text)(command)
    return command


def device_option(command):
    """--device: where ONNX Runtime runs the graphs (--backend ort)."""
    return click.option(
        "--device",
        type=click.Choice(["cpu", "cuda"]),
        default="cpu",
        show_default=True,
        help="--backend ort: ONNX Runtime's CPU provider, or its CUDA provider on an NVIDIA GPU (onnxruntime-gpu, "
        "the [gpu] extra).",
    )(command)


def check_device(backend: str, device: str) -> None:
    if device != "cpu" and backend != "ort":
        raise click.UsageError(f"--device {device} applies to --backend ort (TensorRT engines run on the GPU anyway)")


VIDEO_OPTIONS = [
    ("video", "Video model: a video file (1 frame/s, its audio)."),
    ("frames", "Video model: a folder of frame images, in name order."),
    ("audio", "Video model: an audio file (instead of the video's)."),
]


@main.command(
    epilog=examples(
        "dattn-export generate ./converted --prompt $'USER: <image>\\nWhat is shown?\\nASSISTANT:' --image cat.png",
        "dattn-export generate ./onnx --backend genai --image cat.png --prompts questions.jsonl --max-new-tokens 64",
    )
)
@click.argument("checkpoint", type=click.Path(), metavar="FOLDER")
@click.option(
    "--prompt",
    "prompts",
    multiple=True,
    help="Text prompt (repeatable: the media is encoded once and every prompt answered from it).",
)
@click.option(
    "--prompts",
    "prompts_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help='A file of prompts, after any --prompt: one a line, or JSON lines (.jsonl: a string or {"prompt": ...} '
    "a line, for prompts with line breaks).",
)
@click.option("--image", "images", multiple=True, type=click.Path(path_type=Path), help="Image file (repeatable).")
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
    prompts: tuple[str, ...],
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
    if not prompts and prompts_file is None:
        raise click.UsageError("give a prompt: --prompt TEXT (repeatable) or --prompts FILE")
    checkpoint = resolve(checkpoint, f"generate --backend {backend}", *BACKENDS[backend], hub=backend == "torch")
    require_backend(backend)
    from .media import Media
    from .stages.generate import read_prompts, run_prompts, run_prompts_graphs

    prompts = [*prompts, *(read_prompts(prompts_file) if prompts_file else [])]
    media = Media(images=list(images), video=video, frames=frames, audio=audio)
    if backend == "torch":
        answers = run_prompts(checkpoint, prompts, media, max_new_tokens)
    else:
        answers = run_prompts_graphs(checkpoint, prompts, media, max_new_tokens, backend, device)
    if as_json:
        import json

        click.echo(json.dumps(answers_json(answers, prompts, checkpoint, backend), indent=2))
    elif len(prompts) == 1:
        print_prompt_result("dattn-export generate", answers.one(), [("checkpoint", str(checkpoint))])
    else:
        print_answers("dattn-export generate", answers, [("checkpoint", str(checkpoint))])


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


@main.command(
    epilog=examples("dattn-export info ./global_step1200 --json", "dattn-export info bytedance/Vidi1.5-9B@main")
)
@click.argument("checkpoint", type=click.Path())
@source_options
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def info(checkpoint: str, base: Path | None, vision_heads: int | None, as_json: bool):
    """Detect a checkpoint's layout and show its architecture, parameters, dtypes, size and problems."""
    import dataclasses
    import json

    checkpoint = resolve(checkpoint, "info", *TRAINING_OUTPUT)
    from .stages.info import describe
    from .ui import out, summary_table

    report = describe(checkpoint, base, vision_heads)
    if as_json:
        click.echo(json.dumps(dataclasses.asdict(report), indent=2))
        return
    architecture = dict(report.architecture or {})
    inferred = architecture.pop("inferred", {})
    rows = [
        ("layout", f"{report.layout} ({'; '.join(report.notes)})"),
        *((key.replace("_", " "), str(value)) for key, value in architecture.items()),
        *((f"inferred: {key}", origin) for key, origin in inferred.items()),
        ("parameters", ", ".join(f"{k} {v:,}" for k, v in report.parameters.items())),
        ("tensors", f"{report.tensors:,} ({', '.join(f'{k} {v}' for k, v in report.dtypes.items())})"),
        ("bytes", f"{report.bytes:,}"),
        ("problems", "\n".join(report.problems) or "none"),
    ]
    out.print(summary_table(f"dattn-export info {checkpoint}", rows))


@main.command(
    epilog=examples(
        "dattn-export convert ./checkpoint-1200 -o ./converted",
        "dattn-export convert ./global_step1200 -o ./converted --dtype bf16 --max-shard-size 2GB --force",
    )
)
@click.argument("checkpoint", type=click.Path())
@output_option("Output folder (written beside, then renamed into place).")
@click.option(
    "--dtype",
    type=DTYPE,
    default="auto",
    show_default=True,
    help=f"auto: the dtype config.json declares, else the dtype most weights are stored in. {DTYPE_HELP}",
)
@click.option(
    "--max-shard-size", default="5GB", show_default=True, help="Largest safetensors file (e.g. 2GB, 500MB, 10GiB)."
)
@click.option("--force", is_flag=True, help="Replace the output folder if it exists.")
@source_options
def convert(checkpoint: str, out: Path, dtype: str, max_shard_size: str, force: bool, base, vision_heads):
    """Convert training output (HF, Trainer, DeepSpeed ZeRO, adapter-only) to verified sharded safetensors."""
    checkpoint = resolve(checkpoint, "convert", *TRAINING_OUTPUT)
    from .checkpoints.names import audio_tower_role
    from .stages.convert import convert as run_convert
    from .ui import out as stdout
    from .ui import progress, summary_table

    result = run_convert(checkpoint, out, dtype, max_shard_size, force, base, vision_heads, progress)
    shards = sorted(n for n in result.files if n.endswith(".safetensors"))
    source = result.source
    audio = (
        [("audio tower", f"{audio_tower_role(source.config)} ({source.audio_origin})")] if source.audio_origin else []
    )
    rows = [
        ("source", f"{checkpoint} ({source.reader.layout}; {'; '.join(source.reader.notes)})"),
        ("vision config", source.vision_origin),
        *audio,
        *((f"inferred: {key}", origin) for key, origin in (source.config.dattn_inferred or {}).items()),
        ("output", f"{out} ({len(shards)} shard(s), {len(result.files) + 1} files incl. manifest)"),
        (
            "tensors",
            f"{result.tensor_count:,} as {str(result.dtype).removeprefix('torch.')}"
            + (f"; stored once: {', '.join(result.dropped)}" if result.dropped else ""),
        ),
        ("bytes", f"{result.weight_bytes:,}"),
        ("copied", result.copy),
        ("time", f"{result.seconds:.2f} s ({result.weight_bytes / max(result.seconds, 1e-9) / 1e6:.0f} MB/s)"),
    ]
    stdout.print(summary_table("dattn-export convert", rows))


@main.command(
    epilog=examples("dattn-export verify ./converted", "dattn-export verify ./converted --against ./checkpoint-1200")
)
@click.argument("out", type=click.Path(), metavar="CONVERTED")
@click.option("--against", type=click.Path(), help="The source checkpoint to compare every tensor with.")
@source_options
def verify(out: str, against: str | None, base, vision_heads):
    """Check a converted folder: manifest hashes, every tensor reloads exactly, the model loads and runs."""
    out = resolve(out, "verify", CONVERTED)
    against = against and resolve(against, "verify --against", *TRAINING_OUTPUT)
    from rich.table import Table

    from .stages.verify import verify as run_verify
    from .ui import out as stdout
    from .ui import progress

    checks = run_verify(out, against, base, vision_heads, progress)
    table = Table(title=f"dattn-export verify {out}", title_justify="left")
    for column in ("check", "result", "detail"):
        table.add_column(column)
    for check in checks:
        table.add_row(check.name, "[green]ok[/]" if check.ok else "[red]FAILED[/]", check.detail)
    stdout.print(table)
    if not all(c.ok for c in checks):
        raise SystemExit(1)


@main.command(
    "onnx",
    epilog=examples(
        "dattn-export onnx ./converted -o ./onnx",
        "dattn-export onnx ./converted -o ./onnx-int4 --quantize int4 --quantize-lm-head",
    ),
)
@click.argument("checkpoint", type=click.Path())
@output_option("Output folder for the graphs (written beside, then renamed into place).")
@click.option(
    "--attention",
    type=click.Choice(["fused", "standard"]),
    default="fused",
    show_default=True,
    help="fused: one dattn::DecomposedAttention node per attention (+ its ONNX function); "
    "standard: plain ONNX ops only.",
)
@click.option(
    "--dtype",
    type=DTYPE,
    default="fp32",
    show_default=True,
    help="The graphs' float type (auto: the checkpoint's, as convert takes it; bf16 needs --opset 22 and a GPU "
    f"backend to run). {DTYPE_HELP}",
)
@click.option(
    "--opset",
    type=click.IntRange(18, 23),
    default=18,
    show_default=True,
    help="ONNX opset (18-23; TensorRT 10/11 read 18).",
)
@click.option("--force", is_flag=True, help="Replace the output folder if it exists.")
@click.option(
    "--quantize",
    type=click.Choice(["int4", "int8"]),
    help="Weight-only quantization of the LLM's MatMuls in context_kv.onnx and decoder.onnx (ONNX Runtime's "
    "MatMulNBits); validate then applies the accuracy gate instead of the fp32 tolerance.",
)
@click.option(
    "--block-size",
    type=click.Choice(["16", "32", "64", "128", "256"]),
    default="32",
    show_default=True,
    help="--quantize: weights per scale (a power of two, as MatMulNBits takes).",
)
@click.option("--asymmetric", is_flag=True, help="--quantize: a zero point per block (default: symmetric).")
@click.option("--quantize-lm-head", is_flag=True, help="--quantize: the lm_head too (default: kept fp32).")
@click.option("--quantize-embedding", is_flag=True, help="--quantize: the embedding table too (default: kept fp32).")
@click.option(
    "--accuracy-level",
    type=click.IntRange(0, 4),
    default=4,
    show_default=True,
    help="--quantize: MatMulNBits' compute type (4: int8 activations, fast where the CPU has int8 dot products; "
    "0: fp32).",
)
@source_options
def onnx_command(
    checkpoint: str,
    out: Path,
    attention: str,
    dtype: str,
    opset: int,
    force: bool,
    quantize: str | None,
    block_size: int,
    asymmetric: bool,
    quantize_lm_head: bool,
    quantize_embedding: bool,
    accuracy_level: int,
    base,
    vision_heads,
):
    """Export vision.onnx, context_kv.onnx and decoder.onnx (+ onnx_manifest.json) from any checkpoint convert reads."""
    if quantize is None:
        refuse_quantize_options()
    checkpoint = resolve(checkpoint, "onnx", *TRAINING_OUTPUT)
    from .artifacts import Scheme
    from .stages.onnx_export import export_onnx
    from .ui import out as stdout
    from .ui import progress, summary_table

    scheme = quantize and Scheme(
        quantize, int(block_size), not asymmetric, quantize_lm_head, quantize_embedding, accuracy_level
    )
    manifest = export_onnx(
        checkpoint,
        out,
        attention=attention,
        dtype=dtype,
        opset=opset,
        force=force,
        base=base,
        vision_heads=vision_heads,
        progress=progress,
        quantize=scheme,
    )
    rows = [
        (
            name,
            f"{graph.file}: {len(graph.inputs)} inputs, {len(graph.outputs)} outputs, "
            f"{graph.fused_attention_nodes} fused attention nodes",
        )
        for name, graph in manifest.graphs.items()
    ]
    if manifest.model.audio_tower and "audio" not in manifest.graphs:
        rows.append(("audio tower", f"no graph: {manifest.model.audio_tower}"))
    rows += [
        (
            "attention",
            f"{manifest.attention.implementation} ({manifest.model.dattn_mode}, merge {manifest.model.merge})",
        ),
        ("dtype / opset", f"{manifest.dtype} / {manifest.opset}"),
        *quantization_rows(manifest.quantization),
        *shared_weight_rows(manifest),
        ("onnxruntime-genai", manifest.genai),
        ("output", str(out)),
    ]
    stdout.print(summary_table("dattn-export onnx", rows))


@main.command(
    epilog=examples(
        "dattn-export validate ./onnx",
        "dattn-export validate ./engines --backend trt --image cat.png --prompt $'USER: <image>\\nWhat is it?'",
    )
)
@click.argument("out", type=click.Path(), metavar="FOLDER")
@click.option("--against", type=click.Path(), help="Reference checkpoint (default: the export's source).")
@click.option(
    "--backend",
    type=click.Choice(["ort", "trt"]),  # those of BACKENDS that run the graphs the reference is compared with
    default="ort",
    show_default=True,
    help="ort: an `onnx` folder on ONNX Runtime CPU; trt: a `trt` engines folder on a GPU.",
)
@click.option(
    "--max-new-tokens",
    "--steps",
    "steps",
    type=click.IntRange(min=1),
    default=20,
    show_default=True,
    help="Greedy tokens to generate and compare (--steps: its earlier name).",
)
@click.option(
    "--atol",
    type=click.FloatRange(min=0),
    help="Absolute tolerance on the logits [default: the graphs' dtype's, printed in the report's title]. A "
    "quantized export is held to its accuracy gate instead.",
)
@click.option(
    "--rtol",
    type=click.FloatRange(min=0),
    default=0.0,
    show_default=True,
    help="Relative tolerance on the logits: each passes within atol + rtol * |reference| (numpy's allclose).",
)
@click.option("--prompt", default=None, help="Prompt (default: the demo's).")
@click.option("--image", type=click.Path(exists=True, path_type=Path), help="Image (default: the demo's picture).")
@video_options
@click.option(
    "--save-polygraphy",
    type=click.Path(file_okay=False, path_type=Path),
    help="Write every compared graph run's inputs and the reference's outputs here in polygraphy's JSON format, "
    "and print the `polygraphy run` commands that check them.",
)
@device_option
def validate(
    out: str,
    against: str | None,
    backend: str,
    steps: int,
    atol: float | None,
    rtol: float,
    prompt: str | None,
    image,
    video,
    frames,
    audio,
    save_polygraphy: Path | None,
    device: str,
):
    """Run the graphs in FOLDER (an `onnx` export, or with --backend trt a `trt` engines folder) and compare them
    with the PyTorch reference; exit 1 beyond tolerance. A video model takes --video, --frames or --audio (default:
    the demo video's frames and sound)."""
    check_device(backend, device)
    out = resolve(out, f"validate --backend {backend}", *BACKENDS[backend], hub=False)
    against = against and resolve(against, "validate --against", *TRAINING_OUTPUT)
    require_backend(backend)
    if save_polygraphy:
        require("polygraphy")
    from .media import Media
    from .stages.validate import validate as run_validate
    from .ui import out as stdout

    media = Media(images=[image] if image else [], video=video, frames=frames, audio=audio)
    report = run_validate(
        out,
        against,
        backend,
        steps,
        prompt,
        media,
        save_polygraphy=save_polygraphy,
        atol=atol,
        rtol=rtol,
        device=device,
    )
    print_validation(report, out)
    if report.polygraphy_commands:
        stdout.print(f"polygraphy data in {save_polygraphy}; check it (--trt instead of --onnxrt for TensorRT):")
        for command in report.polygraphy_commands:
            stdout.print(command, markup=False, soft_wrap=True)
    if not report.passed:
        raise SystemExit(1)


def shared_weight_rows(manifest) -> list[tuple[str, str]]:
    from .ui import human_bytes

    shared = manifest.graphs["context_kv"].weight_bytes_in_decoder_data
    return [("shared weights", f"context_kv.onnx reads {human_bytes(shared)} from decoder.onnx.data")] if shared else []


def quantization_rows(q) -> list[tuple[str, str]]:
    """The rows of an export's summary for its `artifacts.Quantization` (none when not quantized)."""
    if not q:
        return []
    detail = f"{q.scheme}, block {q.block_size}, {'symmetric' if q.symmetric else 'asymmetric'}, "
    detail += f"accuracy level {q.accuracy_level}"
    head = "lm_head quantized" if q.lm_head else "lm_head kept fp32"
    head += ", embedding quantized" if q.embedding else ", embedding kept fp32"
    graphs = ", ".join(f"{name}.onnx {count}" for name, count in q.matmuls.items())
    return [("quantization", f"MatMuls -> MatMulNBits: {graphs} ({detail}; {head}; towers kept)")]


def print_validation(report, folder: Path) -> None:
    from rich.table import Table

    from .artifacts import VALIDATION_REPORT
    from .ui import out

    rule = f"logits within atol {report.tolerance:g}" + (f" + rtol {report.rtol:g}" if report.rtol else "")
    if report.gate:  # quantized weights: the gate decides, the fp tolerance does not apply
        rule = f"{report.gate.scheme} weights: held to the accuracy gate, not to a logits tolerance"
    where = "gpu" if report.backend == "trt" else report.device
    table = Table(
        title=f"dattn-export validate {folder} ({report.backend} on {where}, {report.dtype}; {rule})",
        title_justify="left",
    )
    for column in ("graph", "output", "max abs error", "max rel error", "p90 / p95 / p99 abs"):
        table.add_column(column)
    for c in report.comparisons:
        table.add_row(
            c.graph, c.output, f"{c.max_abs:.2e}", f"{c.max_rel:.2e}", f"{c.p90:.1e} / {c.p95:.1e} / {c.p99:.1e}"
        )
    out.print(table)
    if g := report.gate:
        t = g.thresholds
        out.print(
            f"accuracy gate ({g.scheme} weights; {g.prompts} prompts, {g.positions} positions): greedy mass "
            f"{g.greedy_mass:.3f} (>= {t.greedy_mass}), top-5 mass {g.top5_mass:.4f} (>= {t.top5_mass}), "
            f"mean KL {g.mean_kl:.4f} (<= {t.mean_kl}); greedy agreement {g.agreement:.3f}, max KL {g.max_kl:.4f}"
        )
    verdict = "[green]PASSED[/]" if report.passed else "[red]FAILED[/]"
    tokens = f"greedy tokens: {report.agreement}/{len(report.reference_tokens)} agree with the reference"
    if report.gate:  # free-running tokens part at the first near tie and never meet again: reported, not gated
        decided = f"by the accuracy gate above; {tokens} (reported, not gated: quantized weights may part at a tie)"
    else:
        decided = f"logits {'within' if report.logits_within else 'beyond'} tolerance; {tokens} (all must)"
    out.print(f"{verdict}: {decided} (report: {folder / VALIDATION_REPORT})")


@main.command(
    epilog=examples(
        "dattn-export push ./converted --repo-id me/my-dattn --dry-run",
        "dattn-export push ./converted --repo-id me/my-dattn --private --validation-report onnx/validation_report.json",
    )
)
@click.argument("out", type=click.Path(), metavar="CONVERTED")
@click.option("--repo-id", required=True, help="namespace/name on the Hub.")
@click.option("--private", is_flag=True, help="Create the repo private (an existing repo keeps its visibility).")
@click.option("--revision", help="Branch to commit to (created from main when missing).")
@click.option("--create-pr", is_flag=True, help="Open a pull request instead of committing to the branch.")
@click.option("--commit-message", help="Commit message (default: says what was uploaded).")
@click.option(
    "--token",
    help="Hub token; default: HF_TOKEN or the stored login. Never printed or uploaded "
    "(prefer HF_TOKEN: command-line arguments are visible to other users of the machine).",
)
@click.option(
    "--dry-run", is_flag=True, help="List every file, size and hash and print the model card; contact nothing."
)
@click.option("--skip-verify", is_flag=True, help="Publish even if the folder does not verify.")
@click.option("--license", "license_", default="other", show_default=True, help="License for the model card.")
@click.option("--base-model", help="The base model for the model card (e.g. the LLM the model started from).")
@click.option(
    "--validation-report",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="validation_report.json of an ONNX export of this model: its table goes into the model card.",
)
def push(
    out: str,
    repo_id: str,
    private: bool,
    revision,
    create_pr: bool,
    commit_message,
    token,
    dry_run: bool,
    skip_verify: bool,
    license_: str,
    base_model,
    validation_report,
):
    """Publish a converted folder to the Hugging Face Hub in one commit, with a model card and the model code."""
    out = resolve(out, "push", CONVERTED, hub=False)
    from .stages.push import push as run_push
    from .ui import out as stdout
    from .ui import stage, summary_table

    with stage("verifying and publishing" if not dry_run else "verifying"):
        result = run_push(
            out,
            repo_id,
            token=token,
            private=private,
            revision=revision,
            create_pr=create_pr,
            commit_message=commit_message,
            dry_run=dry_run,
            skip_verify=skip_verify,
            license=license_,
            base_model=base_model,
            validation_report=validation_report,
        )
    total = sum(f.size for f in result.files)
    if dry_run:  # sha256sum's format, with sizes: compare with `sha256sum` or the Hub's LFS pointers
        click.echo(
            f"dry run: {len(result.files)} files, {total:,} bytes would be committed to {repo_id}; nothing contacted"
        )
        for f in result.files:
            click.echo(f"{f.sha256}  {f.size:>14,}  {f.path_in_repo}")
        if rewritten := [f.path_in_repo for f in result.files if f.rewritten]:
            click.echo(f"{', '.join(rewritten)}: published without this machine's paths (towers as Hub ids or null)")
        click.echo("\nmodel card (README.md):\n" + result.card)
        return
    rows = [
        ("repo", result.repo_url),
        ("commit", result.commit_url or "-"),
        ("pull request", result.pr_url or "-"),
        ("files", f"{len(result.files)} ({total:,} bytes)"),
        ("verified", "skipped" if result.checks is None else "; ".join(c.detail for c in result.checks)),
    ]
    stdout.print(summary_table("dattn-export push", rows))


@main.command(
    epilog=examples(
        "dattn-export trt ./onnx-fp16 -o ./engines --fp16",
        "dattn-export trt ./onnx -o ./engines --max-batch 4 --opt sequence=64 --max context_sequence=4608,images=2",
    )
)
@click.argument("out", type=click.Path(), metavar="ONNX")
@output_option("Folder for the engines and trt_manifest.json.", name="engines")
@click.option(
    "--fp16",
    "precision",
    flag_value="fp16",
    help="Check that the engines are fp16: they take the graphs' own types (strongly typed, as TensorRT 11 builds), "
    "so ONNX must be an fp16 export (onnx --dtype fp16); another is refused with the command that makes one.",
)
@click.option("--bf16", "precision", flag_value="bf16", help="As --fp16, for bf16 (onnx --dtype bf16 --opset 22).")
@click.option(
    "--max-batch",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Most prompts an engine runs at once (shorthand for --max batch=N).",
)
@click.option(
    "--max-context-tokens",
    "--max-visual-tokens",  # its name before audio joined the context
    "max_context_tokens",
    type=click.IntRange(min=1),
    default=2304,
    show_default=True,
    help="Most context tokens a prompt carries (every image's, or a video's frames and audio; shorthand for "
    "--max context_sequence=N).",
)
@click.option(
    "--max-text-tokens",
    type=click.IntRange(min=1),
    default=512,
    show_default=True,
    help="Most text tokens: the prompt plus what is generated (sets sequence, past_sequence and total_sequence).",
)
@click.option(
    "--min",
    "min_axes",
    type=AXIS_SIZES,
    multiple=True,
    help="Profile minimum per axis, AXIS=N[,AXIS=N] (repeatable; the axes are the dynamic ones onnx_manifest.json "
    "names: batch, sequence, context_sequence, ...).",
)
@click.option("--opt", "opt_axes", type=AXIS_SIZES, multiple=True, help="Profile optimum per axis (as --min).")
@click.option(
    "--max",
    "max_axes",
    type=AXIS_SIZES,
    multiple=True,
    help="Profile maximum per axis (as --min; over the shorthands).",
)
@click.option("--timing-cache", type=click.Path(dir_okay=False, path_type=Path), help="Read and update this cache.")
@click.option("--no-plugin", is_flag=True, help="Build fused nodes from their ONNX function instead of the plugin.")
@click.option("--force", is_flag=True, help="Replace ENGINES if it exists.")
def trt(
    out: str,
    engines: Path,
    precision,
    max_batch,
    max_context_tokens,
    max_text_tokens,
    min_axes,
    opt_axes,
    max_axes,
    timing_cache,
    no_plugin,
    force,
):
    """Build TensorRT engines (with the DecomposedAttention plugin) for the graphs `onnx` exported to ONNX."""
    out = resolve(out, "trt", ONNX, hub=False)
    from .stages.trt_build import Limits, build_engines, check_buildable  # light: torch comes with the build
    from .ui import out as stdout
    from .ui import progress, summary_table

    # the user's own mistakes first, then what the machine lacks, then the heavy work
    check_output(engines, force, [out])
    check_buildable(out, engines, precision)
    limits = Limits(
        max_batch=max_batch,
        max_text_tokens=max_text_tokens,
        max_context_tokens=max_context_tokens,
        min=merged(min_axes),
        opt=merged(opt_axes),
        max=merged(max_axes),
    )
    require("tensorrt")
    if not no_plugin:
        require("triton", unless="--no-plugin")
    manifest = build_engines(
        out, engines, precision, limits, timing_cache, force, use_plugin=not no_plugin, progress=progress
    )
    rows = [(name, f"{file} ({(engines / file).stat().st_size:,} bytes)") for name, file in manifest.engines.items()]
    rows += [
        ("attention", "DecomposedAttention plugin" if manifest.plugin else "ONNX function (TensorRT layers)"),
        ("precision", manifest.precision),
        ("profile", ", ".join(f"{axis} {'/'.join(map(str, b))}" for axis, b in manifest.profile.items())),
        ("TensorRT", manifest.tensorrt),
    ]
    stdout.print(summary_table("dattn-export trt", rows))


@main.command(
    epilog=examples(
        "dattn-export analyze ./converted --image cat.png --prompt $'USER: <image>\\nWhat is it?\\nASSISTANT:' -o out",
        "dattn-export analyze ./video-model --video clip.mp4 --prompt $'USER: What happens?\\nASSISTANT:' -o out",
    )
)
@click.argument("checkpoint", type=click.Path())
@click.option("--image", type=click.Path(path_type=Path), help="Image file.")
@video_options
@click.option("--prompt", required=True, help="Prompt; mark where the image sits with <image> for the LAWS curves.")
@output_option("Report folder: report.json, visual_mass.png, laws.png.")
@click.option("--force", is_flag=True, help="Replace the report folder if it exists.")
def analyze(checkpoint: str, image, video, frames, audio, prompt: str, out: Path, force: bool):
    """Per layer and text token, the attention mass on the image (a video model: on its frames and on its audio);
    MLLM-LAWS curves and attention shift; plots."""
    checkpoint = resolve(checkpoint, "analyze", *TRAINING_OUTPUT)
    require("matplotlib")  # the plots come last: say so before the work
    from .media import Media
    from .stages.analyze import analyze as run_analyze
    from .ui import out as stdout
    from .ui import summary_table

    media = Media(images=[image] if image else [], video=video, frames=frames, audio=audio)
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


@main.command(
    context_settings={"ignore_unknown_options": True},
    epilog=examples(
        "dattn-export serve ./converted", "dattn-export serve ./converted -tp 2 --port 8001 --max-model-len 8192"
    ),
)
@click.argument("out", type=click.Path(file_okay=False), metavar="CONVERTED")
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
@click.argument("vllm_args", nargs=-1, type=click.UNPROCESSED)
def serve(out: str, tensor_parallel_size: int, host: str, port: int, vllm_args: tuple[str, ...]):
    """Serve a converted folder with vLLM (an OpenAI-compatible server): `vllm serve CONVERTED` with our plugin, a chat
    template when the tokenizer has none and, on CPU, the environment vLLM needs. Arguments after CONVERTED that are not
    ours go to `vllm serve`."""
    import shlex

    out = resolve(out, "serve", CONVERTED)
    from .stages.serve import vllm_serve_command

    command, env = vllm_serve_command(out, tensor_parallel_size, host, port, vllm_args)
    shown = [f"{k}={shlex.quote(v)}" for k, v in env.items()]
    click.echo(f"running: {' '.join([*shown, shlex.join(command)])}", err=True)  # exactly what runs
    sys.stdout.flush()
    os.execvpe(command[0], command, {**os.environ, **env})
