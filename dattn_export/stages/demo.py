"""`dattn-export demo`: the main job end to end on the built-in tiny model (`demo_model.py`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..artifacts import atomic_dir
from ..demo_corpus import write_benchmark
from ..demo_model import DEMO_QUESTIONS, write_demo_checkpoint
from ..demo_retrieval import (
    ANSWER_TOKENS,
    HELD_OUT_CLIPS,
    DemoQuery,
    demo_queries,
    trained_weights,
    write_retrieval_checkpoint,
)
from ..folders import check_demo_folder
from ..media_options import Media
from ..modeling.families import DEFAULT_FAMILY
from ..prompts import Prompt
from ..ui import quiet, stage
from .convert import convert
from .generate import PromptResult, run_prompts
from .onnx_export import export_onnx
from .retrieve import retrieve
from .score import Score, score
from .validate import ValidationReport, validate
from .verify import Check, verify


@dataclass
class HeldOut:
    """The video demo's score: the export on ONNX Runtime and a random model of the same kind answer every query of
    the held-out split (`retrieve`), scored as VUE-TR scores (`score`)."""

    benchmark: Path
    exported: Score
    untrained: Score


@dataclass
class DemoRun:
    """What `demo` did: the folders it wrote and each step's result."""

    checkpoint: Path
    converted: Path
    exported: Path
    result: PromptResult  # the reference's (first) answer
    checks: list[Check]
    report: ValidationReport
    seconds: dict[str, float]
    answered: list[tuple[DemoQuery, PromptResult]] = field(default_factory=list)  # the video's queries, answered
    held_out: HeldOut | None = None

    @property
    def passed(self) -> bool:
        return self.report.passed and all(c.ok for c in self.checks)


def run_demo(
    directory: Path, family: str = DEFAULT_FAMILY, video: bool = False, max_new_tokens: int = 12, force: bool = False
) -> DemoRun:
    """The main job end to end on a tiny checkpoint written to `directory/checkpoint`: reference generation,
    convert + verify, ONNX export + validation on ONNX Runtime; a video model (the one trained to retrieve,
    demo_retrieval.py) is asked every query of a held-out clip, and the export and a random model answer the
    held-out split and are scored. A folder that holds anything is refused unless `force`; then only the demo's own
    folders in it are replaced."""
    check_demo_folder(directory, force)
    checkpoint, converted, exported = directory / "checkpoint", directory / "converted", directory / "onnx"
    seconds: dict[str, float] = {}
    kind = "video checkpoint trained to retrieve" if video else "image checkpoint"
    with stage(f"write a tiny {family} D-Attn {kind}", seconds):
        with atomic_dir(checkpoint, overwrite=True) as tmp:
            if video:
                write_retrieval_checkpoint(tmp, family, trained_weights(family))
            else:
                write_demo_checkpoint(tmp, family)
    asked = demo_queries() if video else []
    media = Media(video=checkpoint / "demo.mov") if video else Media(images=[checkpoint / "demo.png"])
    prompts = [Prompt(q.query, "query") for q in asked] if video else [Prompt(DEMO_QUESTIONS["image"])]
    answers = run_prompts(checkpoint, prompts, media, max_new_tokens)
    result, prompt = answers.first(), prompts[0]
    seconds |= result.seconds  # the stages' times in the order they ran
    with stage("convert to safetensors + manifest, verify against the source", seconds):
        convert(checkpoint, converted, force=True)
        checks = verify(converted, against=checkpoint)
    graphs = "vision / audio / context_kv / decoder" if video else "vision / context_kv / decoder"
    with stage(f"export {graphs} ONNX graphs (fused attention)", seconds):
        export_onnx(converted, exported, force=True)
    with stage("validate the graphs on ONNX Runtime against PyTorch", seconds):
        report = validate(exported, against=checkpoint, steps=max_new_tokens, prompt=prompt, media=media)
    held_out = score_held_out(directory, family, exported, seconds) if video else None
    answered = list(zip(asked, answers.results))
    return DemoRun(checkpoint, converted, exported, result, checks, report, seconds, answered, held_out)


def score_held_out(directory: Path, family: str, exported: Path, seconds: dict[str, float]) -> HeldOut:
    """The held-out split written to `directory/held-out`; the export (ONNX Runtime) and the same model untrained
    (`directory/untrained`, PyTorch) answer it, each into its predictions file there, and are scored."""
    folder, untrained = directory / "held-out", directory / "untrained"
    with stage(f"write the held-out split ({HELD_OUT_CLIPS} clips) and the model untrained", seconds):
        with atomic_dir(folder, overwrite=True) as tmp:
            write_benchmark(tmp, "held-out", HELD_OUT_CLIPS)
        with atomic_dir(untrained, overwrite=True) as tmp:
            write_retrieval_checkpoint(tmp, family)
    benchmark, videos = folder / "held-out.json", folder / "videos"
    scores = {}
    runs = (
        ("onnx", exported, "ort", "the export (ONNX Runtime)"),
        ("untrained", untrained, "torch", "the model untrained"),
    )
    for name, model, backend, what in runs:
        with stage(f"answer the held-out split with {what}", seconds):
            predictions = folder / f"{name}.jsonl"
            retrieve(model, benchmark, videos, predictions, backend, max_new_tokens=ANSWER_TOKENS, force=True,
                     show=quiet)  # fmt: skip
            scores[name] = score(predictions, benchmark)
    return HeldOut(benchmark, scores["onnx"], scores["untrained"])
