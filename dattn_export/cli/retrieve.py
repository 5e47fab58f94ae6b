"""`dattn-export retrieve`: a benchmark of videos and queries answered as the released models are asked, on any
backend, into predictions VUE-TR's scorer reads."""

from __future__ import annotations

from pathlib import Path

import click

from ..extras import require, require_backend
from ..folders import BACKENDS, CONVERTED, resolve
from .common import check_device, device_option, examples, verbose_option

RETRIEVE_BACKENDS = {**BACKENDS, "vllm": (CONVERTED,)}  # what reads each backend's folder


@click.command(
    short_help="Answer a benchmark's retrieval queries about its videos.",
    epilog=examples(
        "dattn-export retrieve ./converted --benchmark VUE-TR_ground_truth.json --videos ./videos -o predictions.jsonl",
        "dattn-export retrieve ./onnx --backend ort --benchmark bench.json --videos ./videos -o int4.jsonl --resume",
    ),
)
@click.argument("model", type=click.Path(), metavar="FOLDER")
@click.option(
    "--benchmark",
    required=True,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help='VUE-TR\'s ground truth as released (either version), or a JSONL of {"video": ..., "query": ...} (a '
    '"query_id", "duration" and "gt" where known).',
)
@click.option(
    "--videos",
    "videos_folder",
    required=True,
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="The folder of the videos: each video_id is the file VIDEO_ID.* in any container (or the name given).",
)
@click.option(
    "-o",
    "--output",
    "out",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="The predictions, a .jsonl line a query as answered (the fingerprint of the run beside, PRED.run.json).",
)
@click.option(
    "--backend",
    type=click.Choice(list(RETRIEVE_BACKENDS)),
    default="torch",
    show_default=True,
    help="torch: the PyTorch reference; ort, trt, genai: an export's graphs (as generate runs them); vllm: a "
    "converted or quantized folder on vLLM's offline engine.",
)
@device_option
@click.option(
    "--max-new-tokens",
    type=click.IntRange(min=1),
    default=1024,
    show_default=True,
    help="Greedy tokens an answer may have (the released scripts' 1024: room for many ranges).",
)
@click.option("--resume", is_flag=True, help="Answer only the queries PRED lacks (a run with the same fingerprint).")
@click.option("--force", is_flag=True, help="Replace PRED if it exists.")
@click.option("--json", "json_list", is_flag=True, help="When the run ends, also write the lines as a JSON list (PRED "
              "with .json).")  # fmt: skip
@click.option(
    "-tp",
    "--tensor-parallel-size",
    "tensor_parallel",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="--backend vllm: ranks an engine spans (GPUs; on CPU, shares of the cores).",
)
@click.option(
    "--ray",
    "ray_address",
    help="--backend vllm: spread the videos over engines on the Ray cluster at this address (host:port, or auto).",
)
@click.option(
    "--replicas",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="--ray: engines on the cluster, each a Ray actor with --tensor-parallel-size ranks.",
)
@verbose_option
def retrieve(model: str, benchmark: Path, videos_folder: Path, out: Path, backend: str, device: str,
             max_new_tokens: int, resume: bool, force: bool, json_list: bool, tensor_parallel: int,
             ray_address: str | None, replicas: int, verbose: bool):  # fmt: skip
    """Temporal retrieval over a benchmark of videos, as the released models are asked (the family's task prompt,
    the chat template, greedy): each video decoded and encoded once, all its queries answered from it; a line a
    query, appended as answered, that VUE-TR's released scorer and `dattn-export score` read as they are. A video
    that cannot be used is recorded on its queries with the reason and the run goes on (exit 2 or 3 at the end when
    any failed); a stopped run is completed with --resume."""
    from ..retrieval import read_benchmark

    check_device(backend, device)
    if backend != "vllm" and (tensor_parallel > 1 or ray_address or replicas > 1):
        raise click.UsageError("--tensor-parallel-size, --ray and --replicas apply to --backend vllm")
    if replicas > 1 and not ray_address:
        raise click.UsageError("--replicas needs --ray ADDRESS (the cluster the replicas run on)")
    if out.suffix != ".jsonl":
        raise click.UsageError(
            f"-o {out}: the predictions are JSON lines: name the file *.jsonl (--json adds the list)"
        )
    read_benchmark(benchmark)  # a malformed benchmark is refused before any model loads
    if out.exists() and not (resume or force):
        from ..errors import InputError

        raise InputError(out, "already exists: pass --resume to answer what is left, or --force to start over")
    model = resolve(model, f"retrieve --backend {backend}", *RETRIEVE_BACKENDS[backend], hub=backend == "torch")
    require_backend(backend)
    if ray_address:
        require("ray")
    from ..stages.retrieve import retrieve as run_retrieve

    summary = run_retrieve(model, benchmark, videos_folder, out, backend, device, max_new_tokens, resume, force,
                           out.with_suffix(".json") if json_list else None, tensor_parallel, ray_address,
                           replicas, verbose)  # fmt: skip
    print_summary(summary, benchmark)


def print_summary(summary, benchmark: Path) -> None:
    from ..errors import ENVIRONMENT, EnvironmentFailure, InputError
    from ..retrieval import read_benchmark
    from ..ui import out, summary_table

    done = summary.answered + summary.unparsed + summary.failed
    rows = [
        ("predictions", str(summary.out)),
        ("backend", f"{summary.backend}: {summary.where}"),
        ("videos", str(summary.videos)),
        (
            "queries",
            f"{summary.queries}" + (f" ({summary.skipped} answered before, --resume)" if summary.skipped else ""),
        ),
        ("answered", str(summary.answered)),
        ("unparsed", f"{summary.unparsed} (no time range in the answer)"),
        ("failed", str(summary.failed)),
        ("time", f"{summary.seconds:.1f} s"),
        ("queries a second", f"{summary.queries_per_second:.3f}" if done else "-"),
    ]
    rows += [(f"failed: {video}", reason) for video, reason, _ in summary.failures[:10]]
    if all(query.truth is not None for query in read_benchmark(benchmark)):
        rows.append(("score", f"dattn-export score {summary.out} --gt {benchmark}"))
    out.print(summary_table("dattn-export retrieve", rows))
    if summary.failed:
        error = EnvironmentFailure if any(code == ENVIRONMENT for *_, code in summary.failures) else InputError
        raise error(summary.out, f"{summary.failed} of {summary.queries} queries failed, on "
                    f"{len(summary.failures)} video(s): each line says why (status \"error\", \"reason\")")  # fmt: skip
