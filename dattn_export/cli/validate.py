"""`dattn-export validate`: an export's numbers against the PyTorch reference, and the report's rendering."""

from __future__ import annotations

from pathlib import Path

import click

from ..extras import require, require_backend
from ..folders import BACKENDS, CONVERTED, TRAINING_OUTPUT, resolve
from ..media_options import Media, check_early
from ..stages.task_gate import gates_text
from .common import (
    MEDIA_PATH,
    check_device,
    device_option,
    examples,
    one_prompt,
    prompt_option,
    verbose_option,
    video_options,
)

SERVED = {"vllm": (CONVERTED,)}  # the engines that serve a converted folder, which FOLDER and --against are


@click.command(
    short_help="An export's numbers against the PyTorch reference.",
    epilog=examples(
        "dattn-export validate ./engines --backend trt --image cat.png --prompt 'What is it?'",
        "dattn-export validate ./converted-w4a16 --backend vllm --video clip.mp4",
    ),
)
@click.argument("folder", type=click.Path(), metavar="FOLDER")
@click.option("--against", type=click.Path(), help="Reference checkpoint (default: the export's source).")
@click.option(
    "--backend",
    type=click.Choice(["ort", "trt", "torch", "vllm"]),
    default="ort",
    show_default=True,
    help="ort: an `onnx` folder on ONNX Runtime CPU; trt: a `trt` engines folder on a GPU; torch: a checkpoint or "
    "converted folder, the PyTorch model as it runs deployed (16 bits, static-cache decoding; on --device cuda the "
    "Triton kernel and CUDA graphs) against its fp32 reference on the same device; vllm: a folder `quantize` wrote, "
    "served by vLLM offline (on the GPU where there is one) and held to its unquantized folder served alike by the "
    "accuracy gate.",
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
@prompt_option(required=False)
@click.option("--image", type=MEDIA_PATH, help="Image (default: the demo's picture).")
@video_options
@click.option(
    "--save-polygraphy",
    type=click.Path(file_okay=False, path_type=Path),
    help="Write every compared graph run's inputs and the reference's outputs here in polygraphy's JSON format, "
    "and print the `polygraphy run` commands that check them.",
)
@click.option(
    "--weights-only",
    is_flag=True,
    help="A quantized export: check only its weights against the checkpoint (every element within its scheme's "
    "rounding), without running the graphs. `validate` checks them first unless --no-weight-check.",
)
@click.option(
    "--no-weight-check",
    is_flag=True,
    help="A quantized export: skip the weight check and hold the graphs to the accuracy gate alone (weights that "
    "another tool quantized other than to the nearest point of each block's grid, as GPTQ does).",
)
@click.option(
    "--benchmark",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="The task gate: a retrieval benchmark (as `retrieve` takes it) answered by FOLDER and by its PyTorch "
    "reference; FOLDER passes when its answers, scored against the reference's as VUE-TR scores (IoU), reach its "
    f"weights' least agreement ({gates_text()}). Needs --videos.",
)
@click.option(
    "--videos",
    "videos_folder",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="--benchmark's videos: each video_id the file VIDEO_ID.* in this folder.",
)
@click.option(
    "--answer-tokens",
    type=click.IntRange(min=1),
    default=1024,
    show_default=True,
    help="--benchmark: the new tokens an answer may have (the released scripts'; an answer ends at its EOS).",
)
@device_option
@verbose_option
def validate(
    folder: str,
    against: str | None,
    backend: str,
    steps: int,
    atol: float | None,
    rtol: float,
    prompt: str | None,
    raw_prompt: str | None,
    image,
    video,
    frames,
    audio,
    save_polygraphy: Path | None,
    weights_only: bool,
    no_weight_check: bool,
    benchmark: Path | None,
    videos_folder: Path | None,
    answer_tokens: int,
    device: str,
    verbose: bool,
):
    """Run the graphs in FOLDER (an `onnx` export, or with --backend trt a `trt` engines folder) and compare them
    with the PyTorch reference; exit 1 beyond tolerance. With --backend vllm, FOLDER is one `quantize` wrote, served
    by vLLM and held to its unquantized folder served alike. A video model takes --video, --frames or --audio (default:
    the demo video's frames and sound)."""
    check_device(backend, device)
    prompt = one_prompt(prompt, raw_prompt, required=False)
    if weights_only and no_weight_check:
        raise click.UsageError("--weights-only and --no-weight-check exclude each other")
    if backend == "torch" and (against or save_polygraphy or weights_only or atol is not None):
        raise click.UsageError("--backend torch checks a checkpoint against itself in fp32: it takes no --against, "
                               "--atol, --save-polygraphy or --weights-only")  # fmt: skip
    if (benchmark is None) != (videos_folder is None):
        raise click.UsageError("--benchmark and --videos go together: the task gate asks the benchmark's queries "
                               "about the videos in the folder")  # fmt: skip
    if benchmark and (backend == "torch" or weights_only):
        raise click.UsageError("--benchmark judges an export or a quantized folder against its PyTorch reference: "
                               "not with --backend torch or --weights-only")  # fmt: skip
    if backend == "vllm" and (save_polygraphy or atol is not None):
        raise click.UsageError("--backend vllm holds a quantized folder to the accuracy gate: it takes no --atol or "
                               "--save-polygraphy")  # fmt: skip
    folder = resolve(folder, f"validate --backend {backend}", *SERVED.get(backend) or BACKENDS[backend], hub=False)
    against = against and resolve(against, "validate --against", *SERVED.get(backend) or TRAINING_OUTPUT)
    media = Media(images=[image] if image else [], video=video, frames=frames, audio=audio)
    check_early(media, folder, [])  # a prompt that names media without them is asked about the default media
    require_backend(backend)
    if save_polygraphy:
        require("polygraphy")
    from ..stages.validate import validate as run_validate
    from ..ui import out as stdout
    from ..ui import progress

    if backend == "vllm":
        from ..stages.validate_vllm import validate_vllm

        report = validate_vllm(folder, against, steps, prompt, media, not no_weight_check, weights_only, progress,
                               verbose)  # fmt: skip
    elif backend == "torch":
        from ..stages.validate_model import validate_model

        report = validate_model(folder, device, steps, prompt, media)
        print_validation(report, folder, written=False)
        raise SystemExit(0 if report.passed else 1)
    else:
        report = run_validate(
            folder,
            against,
            backend,
            steps,
            prompt,
            media,
            save_polygraphy=save_polygraphy,
            atol=atol,
            rtol=rtol,
            device=device,
            weights_only=weights_only,
            weight_check=not no_weight_check,
            progress=progress,
        )
    if benchmark and (report.weights is None or report.weights.passed):
        from ..stages.task_gate import task_gate

        weights = report.gate.scheme if report.gate else "exact" if report.dtype in ("fp32", "float32") else "16-bit"
        report.task = task_gate(folder, backend, Path(report.reference), benchmark, videos_folder, weights,
                                answer_tokens, device, progress)  # fmt: skip
        report.write(folder)
    if report.weights is not None:
        print_weights(report.weights, report.reference)
    if report.weights is not None and (weights_only or not report.weights.passed):
        verdict = "[green]PASSED[/]" if report.passed else f"[red]FAILED[/]: {report.weights.first_failure()}"
        stdout.print(f"{verdict} (report: {folder / 'validation_report.json'})")
        raise SystemExit(0 if report.passed else 1)
    print_validation(report, folder)
    if report.polygraphy_commands:
        stdout.print(f"polygraphy data in {save_polygraphy}; check it (--trt instead of --onnxrt for TensorRT):")
        for command in report.polygraphy_commands:
            stdout.print(command, markup=False, soft_wrap=True)
    if not report.passed:
        raise SystemExit(1)


def print_validation(report, folder: Path, written: bool = True) -> None:
    """The report's table and verdict; `written`: validation_report.json was written in `folder`."""
    from rich.table import Table

    from ..artifacts import VALIDATION_REPORT
    from ..ui import out

    rule = f"logits within atol {report.tolerance:g}" + (f" + rtol {report.rtol:g}" if report.rtol else "")
    if report.backend == "torch":
        rule = f"against fp32: logits within {report.tolerance:.3g}, a share of the largest fp32 logit"
    if report.gate:  # quantized weights: the gate decides, the fp tolerance does not apply
        rule = f"{report.gate.scheme} weights: held to the accuracy gate, not to a logits tolerance"
    where = "gpu" if report.backend == "trt" else report.device
    title = f"{folder} against the PyTorch reference ({report.backend} on {where}, {report.dtype}; {rule})"
    if report.backend == "vllm":  # no tensors compared: the gate's distributions only
        title = f"{folder} against {report.reference}, both served by vLLM in {report.dtype}; {rule}"
    table = Table(title=title, title_justify="left")
    for column in ("graph", "output", "max abs error", "max rel error", "p90 / p95 / p99 abs"):
        table.add_column(column)
    for c in report.comparisons:
        table.add_row(
            c.graph, c.output, f"{c.max_abs:.2e}", f"{c.max_rel:.2e}", f"{c.p90:.1e} / {c.p95:.1e} / {c.p99:.1e}"
        )
    out.print(table if report.comparisons else table.title)
    if g := report.gate:
        t = g.thresholds
        out.print(
            f"accuracy gate ({g.scheme} weights; {g.prompts} prompts, {g.positions} positions): greedy mass "
            f"{g.greedy_mass:.3f} (>= {t.greedy_mass}), top-5 mass {g.top5_mass:.4f} (>= {t.top5_mass}), "
            f"mean KL {g.mean_kl:.4f} (<= {t.mean_kl}); greedy agreement {g.agreement:.3f}, max KL {g.max_kl:.4f}"
        )
    if report.task:
        print_task(report.task, folder)
    verdict = "[green]PASSED[/]" if report.passed else "[red]FAILED[/]"
    tokens = f"greedy tokens: {report.agreement}/{len(report.reference_tokens)} agree with the reference"
    if report.gate:  # free-running tokens part at the first near tie and never meet again: reported, not gated
        weights = "not checked (--no-weight-check)"
        if report.weights:
            weights = f"within {report.gate.scheme}'s rounding ({len(report.weights.matrices)} matrices)"
        tied = "reported, not gated: quantized weights may part at a tie"
        decided = f"by the accuracy gate above; {tokens} ({tied}); weights {weights}"
    else:
        gated = "all must" if report.tokens_gated else "reported, not gated: 16-bit logits may part at a tie"
        decided = f"logits {'within' if report.logits_within else 'beyond'} tolerance; {tokens} ({gated})"
    if report.task:
        decided += f"; the task gate {'passed' if report.task.passed else 'FAILED'}"
    out.print(f"{verdict}: {decided}" + (f" (report: {folder / VALIDATION_REPORT})" if written else ""))


def print_task(task, folder: Path) -> None:
    """The task gate's line, and the first queries answered otherwise than the reference answered them."""
    from ..ui import out

    truth = ""
    if task.reference_iou is not None:
        truth = f"; against the truth: the reference {task.reference_iou:.3f}, {folder.name} {task.deployment_iou:.3f}"
    out.print(
        f"task gate: {task.queries} queries of {Path(task.benchmark).name} answered by {folder.name} and by the "
        f"reference: IoU against the reference's answers {task.agreement:.3f} (>= {task.threshold} for {task.weights} "
        f"weights); {task.identical}/{task.queries} answers identical{truth}",
        markup=False,
    )
    for d in task.differences:
        out.print(f"  query {d['query_id']}: reference {d['reference']!r}, {folder.name} {d['deployment']!r}",
                  markup=False)  # fmt: skip


def print_weights(check, checkpoint: str) -> None:
    from rich.table import Table

    from ..ui import out

    units = " or ".join(dict.fromkeys(f"{m.scale_unit}'s" if m.scale_unit != "channel" else "row's"
                                      for m in check.matrices)) or "block's"  # fmt: skip
    table = Table(
        title=f"quantized weights ({check.scheme}) against {checkpoint}: each element within its {units} rounding "
        "bound (ratio <= 1)",
        title_justify="left",
    )
    for column in ("file", "matrices", "worst ratio", "at"):
        table.add_column(column)
    for location in dict.fromkeys(m.location for m in check.matrices):
        matrices = [m for m in check.matrices if m.location == location]
        worst = max(matrices, key=lambda m: m.worst_ratio)
        style = "" if worst.passed else "[red]"
        ratio = f"{worst.worst_ratio:.5f}" if worst.passed else f"{worst.worst_ratio:.3g}"
        table.add_row(location, str(len(matrices)), f"{style}{ratio}", f"{worst.matrix()}, {worst.position()}")
    out.print(table)
