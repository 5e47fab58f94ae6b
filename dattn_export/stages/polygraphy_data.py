"""`validate --save-polygraphy DIR`: every graph run validate makes (context, prefill, each decode step), with its
inputs and the PyTorch reference's outputs on exactly those inputs, in polygraphy's own JSON format; then
`polygraphy run GRAPH --onnxrt` (or `--trt`) checks a backend against the reference with polygraphy's tolerances
and statistics, the reports users file runtime bugs with.

The reference of each graph is the module it was exported from (`graphs.graph_specs`), run on the recorded
feeds: one definition of what a graph computes."""

from __future__ import annotations

import contextlib
import shlex
from pathlib import Path

import torch
from torch.utils._pytree import tree_flatten

from ..extras import require
from ..graphs import GraphSpec, graph_specs

RUNNER = "pytorch-reference"


@contextlib.contextmanager
def recording(runtime):
    """While active, every graph run of `runtime` is recorded as (graph, feeds)."""
    calls, run = [], runtime._run

    def recorded(graph: str, feeds: dict):
        calls.append((graph, dict(feeds)))
        return run(graph, feeds)

    runtime._run = recorded
    try:
        yield calls
    finally:
        runtime._run = run


@torch.no_grad()
def reference_outputs(spec: GraphSpec, feeds: dict) -> dict:
    """The exported module's outputs on a graph run's feeds (floating inputs in fp32, as the reference runs)."""
    leaves = [torch.from_numpy(feeds[name]) for name in spec.inputs]
    leaves = [t.float() if t.is_floating_point() else t for t in leaves]
    outputs, _ = tree_flatten(spec.module(*spec.arguments(leaves)))
    return {name: t.float().numpy() for name, t in zip(spec.outputs, outputs, strict=True)}


def save(calls: list, reference, folder: Path, out: Path, bounds: tuple[float, float]) -> list[str]:
    """Writes `<graph>.inputs.json` and `<graph>.outputs.json` per graph into `out`; returns the commands that check
    them with polygraphy."""
    require("polygraphy")
    from polygraphy.comparator import RunResults
    from polygraphy.comparator.struct import IterationResult
    from polygraphy.json import save_json

    specs = graph_specs(reference, torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    commands = []
    for graph in dict.fromkeys(graph for graph, _ in calls):  # in the order first run
        feeds = [f for g, f in calls if g == graph]
        results = [IterationResult(reference_outputs(specs[graph], f), runner_name=RUNNER) for f in feeds]
        inputs, outputs = out / f"{graph}.inputs.json", out / f"{graph}.outputs.json"
        save_json(feeds, str(inputs))
        RunResults([(RUNNER, results)]).save(str(outputs))
        commands.append(
            shlex.join(
                [
                    "polygraphy",
                    "run",
                    str(folder / f"{graph}.onnx"),
                    "--onnxrt",
                    "--load-inputs",
                    str(inputs),
                    "--load-outputs",
                    str(outputs),
                    "--atol",
                    f"{bounds[0]:g}",
                    "--rtol",
                    f"{bounds[1]:g}",
                    "--check-error-stat",
                    "max",
                ]
            )  # fmt: skip
        )
    return commands
