"""`dattn-export demo`: the main job end to end on the built-in tiny model (`demo_model.py`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..artifacts import atomic_dir
from ..demo_model import DEMO_QUESTIONS, write_demo_checkpoint
from ..folders import check_demo_folder
from ..media_options import Media
from ..modeling.families import DEFAULT_FAMILY
from ..prompts import Prompt
from ..ui import stage
from .convert import convert
from .generate import PromptResult, run_prompt
from .onnx_export import export_onnx
from .validate import ValidationReport, validate
from .verify import Check, verify


@dataclass
class DemoRun:
    """What `demo` did: the folders it wrote and each step's result."""

    checkpoint: Path
    converted: Path
    exported: Path
    result: PromptResult  # the reference's answer
    checks: list[Check]
    report: ValidationReport
    seconds: dict[str, float]

    @property
    def passed(self) -> bool:
        return self.report.passed and all(c.ok for c in self.checks)


def run_demo(
    directory: Path, family: str = DEFAULT_FAMILY, video: bool = False, max_new_tokens: int = 12, force: bool = False
) -> DemoRun:
    """The main job end to end on a tiny checkpoint written to `directory/checkpoint`: reference generation,
    convert + verify, ONNX export + validation on ONNX Runtime. A folder that holds anything is refused unless
    `force`; then only the demo's own folders in it are replaced."""
    check_demo_folder(directory, force)
    checkpoint, converted, exported = directory / "checkpoint", directory / "converted", directory / "onnx"
    seconds: dict[str, float] = {}
    with stage(f"write a tiny {family} D-Attn {'video' if video else 'image'} checkpoint", seconds):
        with atomic_dir(checkpoint, overwrite=True) as tmp:
            write_demo_checkpoint(tmp, family, video=video)
    media = Media(video=checkpoint / "demo.mov") if video else Media(images=[checkpoint / "demo.png"])
    prompt = Prompt(DEMO_QUESTIONS["video" if video else "image"])
    result = run_prompt(checkpoint, prompt, media, max_new_tokens)
    seconds |= result.seconds  # the stages' times in the order they ran
    with stage("convert to safetensors + manifest, verify against the source", seconds):
        convert(checkpoint, converted, force=True)
        checks = verify(converted, against=checkpoint)
    graphs = "vision / audio / context_kv / decoder" if video else "vision / context_kv / decoder"
    with stage(f"export {graphs} ONNX graphs (fused attention)", seconds):
        export_onnx(converted, exported, force=True)
    with stage("validate the graphs on ONNX Runtime against PyTorch", seconds):
        report = validate(exported, against=checkpoint, steps=max_new_tokens, prompt=prompt, media=media)
    return DemoRun(checkpoint, converted, exported, result, checks, report, seconds)
