"""`validate`: the exported graphs against the PyTorch reference, on an image and a prompt.

Every graph's outputs are compared with the reference model's (fp32), then greedy generation runs through
the ONNX graphs with the text KV cache and is compared token by token; each decode step's logits are also
compared with the reference on the same tokens.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..artifacts import VALIDATION_REPORT, from_json
from ..checkpoints.source import load_model
from ..errors import InputError
from ..processing import load_image_processor, load_images, load_tokenizer
from ..runtime.ort import OrtModel
from .demo import DEMO_PROMPT, demo_image

# max abs error allowed on logits: fp32 as in the ecosystem's exporters; fp16 keeps ~3 significant digits
# through a whole network, so its bound is relative to the logits' scale
TOLERANCES = {"float32": 1e-4, "float16": 2e-2}


@dataclass
class Comparison:
    graph: str
    output: str
    max_abs: float
    max_rel: float  # max abs error / max |reference|

    @classmethod
    def of(cls, graph: str, output: str, got: np.ndarray, expected: torch.Tensor) -> Comparison:
        expected = expected.float().numpy()
        error = float(np.abs(got.astype(np.float32) - expected).max()) if expected.size else 0.0
        return cls(graph, output, error, error / max(float(np.abs(expected).max()) if expected.size else 0.0, 1e-12))


@dataclass
class ValidationReport:
    folder: str
    reference: str
    backend: str
    dtype: str
    tolerance: float
    prompt_tokens: int
    visual_tokens: int
    comparisons: list[Comparison] = field(default_factory=list)
    reference_tokens: list[int] = field(default_factory=list)
    backend_tokens: list[int] = field(default_factory=list)

    @property
    def agreement(self) -> int:
        """Greedy tokens that agree before the first difference."""
        n = 0
        for a, b in zip(self.reference_tokens, self.backend_tokens):
            if a != b:
                break
            n += 1
        return n

    @property
    def passed(self) -> bool:
        logits_ok = all(c.max_abs <= self.tolerance for c in self.comparisons if c.output.startswith("logits"))
        return logits_ok and self.reference_tokens == self.backend_tokens

    def to_json(self) -> dict:
        return {**asdict(self), "agreement": self.agreement, "passed": self.passed}

    @classmethod
    def read(cls, path: Path) -> ValidationReport:
        """A validation_report.json that `validate` wrote."""
        try:
            return from_json(cls, json.loads(Path(path).read_text()))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise InputError(path, f"is not a readable {VALIDATION_REPORT} ({type(e).__name__}: {e})") from None


def validate(
    folder: Path,
    against: Path | None = None,
    backend: str = "ort",
    steps: int = 20,
    prompt: str = DEMO_PROMPT,
    image: Path | None = None,
    threads: int | None = None,
) -> ValidationReport:
    folder = Path(folder)
    if backend == "trt":
        from ..runtime.tensorrt import TrtModel

        runtime = TrtModel(folder)
    else:
        runtime = OrtModel(folder, threads)
    manifest = runtime.manifest
    against = Path(against or manifest.source.path)
    if not against.exists():
        raise InputError(against, "does not exist: pass --against with the checkpoint the graphs were exported from")
    reference = load_model(against)
    config = reference.config
    tokenizer = load_tokenizer(folder if (folder / "tokenizer_config.json").is_file() else against, config)
    processor = load_image_processor(folder, config)
    if image is None:  # the demo's picture
        pixels = processor([demo_image()], return_tensors="pt")["pixel_values"][None]
    else:
        pixels = load_images([image], processor)
    inputs = tokenizer(prompt, return_tensors="pt")
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    dtype = manifest.dtype
    report = ValidationReport(str(folder), str(against), backend, dtype, TOLERANCES.get(dtype, 2e-2), ids.shape[1], 0)

    with torch.no_grad():
        visual_embeds, visual_mask = reference.model.embed_images(pixels), reference.model.image_mask(pixels)
        visual_kv = reference.model.encode_visual(visual_embeds, visual_mask)
        visual = dict(visual_key_values=visual_kv, visual_mask=visual_mask)
        expected = reference(ids, attention_mask=mask, **visual)
        expected_tokens = reference.generate(ids, attention_mask=mask, max_new_tokens=steps, **visual)[0]
    report.visual_tokens = visual_embeds.shape[1]
    got_embeds, got_mask = runtime.embed_images(pixels.numpy())
    report.comparisons.append(Comparison.of("vision", "visual_embeds", got_embeds, visual_embeds))
    report.comparisons.append(Comparison.of("vision", "visual_attention_mask", got_mask, visual_mask.long()))
    got_kv = runtime.encode_visual(got_embeds, got_mask)
    expected_kv = [t for layer in visual_kv for t in layer]
    for name, got, expected_part in zip(runtime.visual_names, got_kv, expected_kv, strict=True):
        report.comparisons.append(Comparison.of("visual_kv", name, got, expected_part))
    logits, past = runtime.decode(ids.numpy(), mask.numpy(), runtime.empty_kv(1), got_kv, got_mask)
    report.comparisons.append(Comparison.of("decoder", "logits (prefill)", logits, expected.logits))

    # decode steps on the reference's tokens: the logits of every step, with the cache the graphs built
    worst = None
    step_mask, expected_past = mask, expected.past_key_values
    for token in expected_tokens[:-1].tolist():
        step_mask = torch.cat([step_mask, torch.ones(1, 1, dtype=step_mask.dtype)], dim=1)
        step_ids = torch.tensor([[token]])
        with torch.no_grad():
            step = reference(step_ids, attention_mask=step_mask, past_key_values=expected_past, **visual)
        expected_past = step.past_key_values
        logits, past = runtime.decode(step_ids.numpy(), step_mask.numpy(), past, got_kv, got_mask)
        comparison = Comparison.of("decoder", "logits (decode steps)", logits, step.logits)
        worst = comparison if worst is None or comparison.max_abs > worst.max_abs else worst
    if worst is not None:
        report.comparisons.append(worst)
    report.reference_tokens = expected_tokens.tolist()
    report.backend_tokens = runtime.generate(ids.numpy(), mask.numpy(), got_kv, steps, visual_mask=got_mask)[0].tolist()
    (folder / VALIDATION_REPORT).write_text(json.dumps(report.to_json(), indent=2) + "\n")
    return report
