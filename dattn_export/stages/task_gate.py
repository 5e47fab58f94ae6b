"""`validate --benchmark`: the task gate. A deployment (an ONNX or TensorRT export, a quantized folder on vLLM) and its
PyTorch reference answer a retrieval benchmark as `retrieve` answers it; the deployment's answers are scored against
the reference's (`score --against`: VUE-TR's IoU, the reference's answers as the truth) and held to the least
agreement its weights allow, beside both scores against the benchmark's own truth where it has one. A deployment is
good when it still finds the seconds its reference finds."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ..retrieval import read_benchmark, read_predictions

# The least IoU of a deployment's answers against its reference's (`score --against`; answers all alike score 0.995,
# VUE-TR counting an IoU strictly above each threshold), by its weights. Measured by bench/retrieval_task.py on the
# demo's trained video model, both families, the held-out split (131 queries): fp32 graphs on ORT, onnxruntime-genai
# and vLLM gave the reference's every answer; fp16 >= 0.993; int8 and w8a8 >= 0.964; int4 and w4a16 >= 0.854 (>= 0.812
# on tests/test_task_gate.py's 15 queries: a small benchmark moves more); broken deployments <= 0.571 (w4a16 with
# every matrix's scales a row off; 0.408-0.554 on the 15) and 0.000-0.003 (int4 scales a row off, two layers
# exchanged). 4 bits sits between the two. docs/benchmarks.md "The task on every deployment".
TASK_GATES = {"exact": 0.98, "16-bit": 0.95, "int8": 0.9, "w8a8": 0.9, "fp8": 0.9, "int4": 0.7, "w4a16": 0.7}


def gates_text() -> str:
    """TASK_GATES as the CLI's help says them: "exact 0.98; 16-bit 0.95; int8, w8a8, fp8 0.9; ..."."""
    by_threshold: dict[float, list[str]] = {}
    for weights, threshold in TASK_GATES.items():
        by_threshold.setdefault(threshold, []).append(weights)
    return "; ".join(f"{', '.join(names)} {threshold}" for threshold, names in by_threshold.items())


@dataclass
class TaskGate:
    """A deployment's answers to a benchmark against its reference's."""

    benchmark: str
    weights: str  # "exact", or the quantization scheme that sets the threshold
    threshold: float
    agreement: float  # VUE-TR's IoU of the deployment's answers against the reference's
    queries: int
    identical: int  # answers whose text is the reference's
    reference_iou: float | None  # each against the benchmark's truth, where it gives one
    deployment_iou: float | None
    differences: list[dict] = field(default_factory=list)  # the first few queries answered otherwise

    @property
    def passed(self) -> bool:
        return self.agreement >= self.threshold


def task_gate(deployment: Path, backend: str, reference: Path, benchmark: Path, videos: Path, weights: str,
              max_new_tokens: int, device: str = "cpu", show=None) -> TaskGate:  # fmt: skip
    """`deployment` on `backend` (on `device`) and `reference` on torch (fp32 on the CPU) answer `benchmark`'s queries
    about the files in `videos`; the deployment judged by `weights`' row of TASK_GATES. `show`: `ui.progress` for the
    CLI (default `ui.quiet`)."""
    # here, not above: validate reads TaskGate whether or not a benchmark is given, and the CLI's help reads
    # TASK_GATES at start-up, before rich or torch is needed
    from ..ui import quiet
    from .retrieve.job import retrieve
    from .score import score

    show = show or quiet

    with tempfile.TemporaryDirectory(prefix="dattn-task-") as scratch:
        answers = {}
        runs = (("reference", reference, "torch", "cpu"), ("deployment", deployment, backend, device))
        for name, folder, on, where in runs:  # the reference in fp32 on the CPU, wherever the deployment runs
            out = Path(scratch) / f"{name}.jsonl"
            retrieve(folder, benchmark, videos, out, on, where, max_new_tokens, show=labelled(show, name))
            answers[name] = out
        against = score(answers["deployment"], benchmark, against=answers["reference"])
        has_truth = all(query.truth is not None for query in read_benchmark(benchmark))
        truth = {name: score(path, benchmark).overall.iou if has_truth else None for name, path in answers.items()}
        texts = {name: {r["query_id"]: r.get("text") for r in read_predictions(path).records}
                 for name, path in answers.items()}  # fmt: skip
    differ = [query_id for query_id, text in texts["reference"].items() if texts["deployment"].get(query_id) != text]
    return TaskGate(
        benchmark=str(benchmark),
        weights=weights,
        threshold=TASK_GATES[weights],
        agreement=against.overall.iou,
        queries=against.queries,
        identical=against.queries - len(differ),
        reference_iou=truth["reference"],
        deployment_iou=truth["deployment"],
        differences=[
            {"query_id": q, "reference": texts["reference"][q], "deployment": texts["deployment"].get(q)}
            for q in differ[:5]
        ],
    )


def labelled(show, name: str):
    """`show` (ui.progress or ui.quiet) with each description headed by `name`: which run is answering."""
    return lambda description, *args, **kwargs: show(f"{name}: {description}", *args, **kwargs)
