"""`validate`: the exported graphs against the PyTorch reference, on an image (a video model: frames and audio)
and a prompt.

Every graph's outputs are compared with the reference model's (fp32), then greedy generation runs through
the ONNX graphs with the text KV cache and is compared token by token; each decode step's logits are also
compared with the reference on the same tokens.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from ..artifacts import VALIDATION_REPORT, OnnxManifest, TrtManifest, atomic_write, from_json
from ..checkpoints.source import load_model
from ..demo_model import DEMO_VIDEO_FPS, demo_audio, demo_frames, demo_image, demo_prompt
from ..errors import InputError
from ..graphs import layer_caches
from ..media import DecodedMedia, context_tokens, decode_media, encode_media, graph_context
from ..media_options import Media
from ..modeling.marked_prompts import prompt_ids
from ..modeling.media_files import media_duration
from ..processing import load_processor, load_tokenizer
from ..prompts import Prompt, as_prompt
from ..runtime import open_graphs
from ..runtime.graph import GraphRuntime
from ..sidefiles import read_json, reading
from ..ui import quiet
from . import accuracy_gate, polygraphy_data
from .polygraphy_data import recording
from .task_gate import TaskGate
from .weight_check import WeightCheck, check_weights

# max abs error allowed on logits: fp32 as in the ecosystem's exporters; fp16 keeps ~3 significant digits
# through a whole network, so its bound is relative to the logits' scale
TOLERANCES = {"float32": 1e-4, "float16": 2e-2}


@dataclass
class Comparison:
    graph: str
    output: str
    max_abs: float
    max_rel: float  # max abs error / max |reference|
    p90: float = 0.0  # percentiles of the abs error, as polygraphy reports them
    p95: float = 0.0
    p99: float = 0.0
    within: bool | None = None  # gated outputs (logits): every element within atol + rtol * |reference|

    @classmethod
    def of(
        cls, graph: str, output: str, got: np.ndarray, expected: torch.Tensor, bounds: tuple[float, float] | None = None
    ) -> Comparison:
        """`bounds`: (atol, rtol) for an output that decides the verdict, as numpy's allclose reads them."""
        expected = expected.float().numpy()
        if not expected.size:
            return cls(graph, output, 0.0, 0.0, within=None if bounds is None else True)
        error = np.abs(got.astype(np.float32) - expected)
        p90, p95, p99 = (float(q) for q in np.percentile(error, [90, 95, 99]))
        worst = float(error.max())
        within = None if bounds is None else bool(np.all(error <= bounds[0] + bounds[1] * np.abs(expected)))
        return cls(graph, output, worst, worst / max(float(np.abs(expected).max()), 1e-12), p90, p95, p99, within)


@dataclass
class ValidationReport:
    folder: str
    reference: str
    backend: str
    dtype: str
    tolerance: float  # atol on the logits
    prompt_tokens: int
    visual_tokens: int
    comparisons: list[Comparison] = field(default_factory=list)
    reference_tokens: list[int] = field(default_factory=list)
    backend_tokens: list[int] = field(default_factory=list)
    audio_tokens: int | None = None  # None: an image model
    polygraphy_commands: list[str] = field(default_factory=list)  # with --save-polygraphy: what checks its data
    gate: accuracy_gate.GateResult | None = None  # a quantized decoder: the accuracy gate
    weights: WeightCheck | None = None  # a quantized export: its weights against the checkpoint's, run first
    rtol: float = 0.0  # on the logits, relative to the reference's magnitude
    device: str = "cpu"  # where ONNX Runtime ran the graphs or the model (TensorRT: always the GPU)
    tokens_gated: bool = True  # the free-running greedy tokens must agree (not for 16-bit or quantized weights)
    task: TaskGate | None = None  # with a benchmark: the deployment's answers against the reference's

    @property
    def bounds(self) -> tuple[float, float]:
        return self.tolerance, self.rtol

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
        if self.weights is not None and not self.weights.passed:
            return False
        if self.task is not None and not self.task.passed:
            return False
        if self.gate is not None:  # quantized weights: the gate, not the fp tolerance or exact tokens
            return self.gate.passed
        return self.logits_within and (self.reference_tokens == self.backend_tokens or not self.tokens_gated)

    @property
    def logits_within(self) -> bool:
        return all(c.within for c in self.comparisons if c.output.startswith("logits"))

    def to_json(self) -> dict:
        fields = asdict(self)
        if self.gate is not None:
            fields["gate"]["passed"] = self.gate.passed
        if self.weights is not None:
            fields["weights"]["passed"] = self.weights.passed
        if self.task is not None:
            fields["task"]["passed"] = self.task.passed
        return {**fields, "agreement": self.agreement, "passed": self.passed}

    def write(self, folder: Path) -> ValidationReport:
        """validation_report.json in `folder` (the validated artifact's), written whole or not at all."""
        atomic_write(folder / VALIDATION_REPORT, json.dumps(self.to_json(), indent=2) + "\n")
        return self

    @classmethod
    def read(cls, path: Path) -> ValidationReport:
        """A validation_report.json that `validate` wrote."""
        fields = read_json(path, VALIDATION_REPORT)
        with reading(path, VALIDATION_REPORT):
            return from_json(cls, fields)


def validate(
    folder: Path,
    against: Path | None = None,
    backend: str = "ort",
    steps: int = 20,
    prompt: str | Prompt | None = None,
    media: Media | None = None,
    threads: int | None = None,
    save_polygraphy: Path | None = None,
    atol: float | None = None,
    rtol: float = 0.0,
    device: str = "cpu",
    weights_only: bool = False,
    weight_check: bool = True,
    progress=quiet,
) -> ValidationReport:
    """`media`: an image (default: the demo's picture), or a video model's frames and audio (default: the demo
    video's); `prompt` defaults to the demo's. `save_polygraphy`: a folder for every compared graph run's inputs and
    reference outputs in polygraphy's format (`polygraphy_data`). The logits pass where every element is within
    `atol + rtol * |reference|` (default atol: `TOLERANCES` of the graphs' dtype) and the greedy tokens agree.
    A quantized export's weights are checked against the checkpoint first (stages/weight_check.py, unless not
    `weight_check`); where they fail, or with `weights_only`, nothing is run. `progress`: `ui.progress` to show the
    weight check's (the CLI's), or `ui.quiet`."""
    folder = Path(folder)
    manifest = (TrtManifest if backend == "trt" else OnnxManifest).read(folder, "a folder this backend runs")
    against = Path(against or manifest.source.path)
    if not against.exists():
        raise InputError(against, "does not exist: pass --against with the checkpoint the graphs were exported from")
    if weights_only and not manifest.quantization:
        raise InputError(folder, "is not a quantized export: --weights-only checks int4 / int8 weights (use verify "
                         "for a converted folder's)")  # fmt: skip
    weights = check_weights(folder, against, progress) if manifest.quantization and weight_check else None
    if weights is not None:
        if weights_only or not weights.passed:
            report = ValidationReport(str(folder), str(against), backend, manifest.dtype, 0.0, 0, 0, weights=weights)
            return report.write(folder)
    runtime = open_graphs(folder, backend, threads, device)
    reference = load_model(against)
    config = reference.config
    media = media or Media()
    media.check(config)
    tokenizer = load_tokenizer(folder if (folder / "tokenizer_config.json").is_file() else against, config)
    processor = load_processor(folder, config, tokenizer)
    prompt = as_prompt(prompt) if prompt else demo_prompt(config.modality, tokenizer)
    length = media_duration(media.video) if media.video else None  # a retrieval query's task prompt states it
    text = prompt.text_for(tokenizer, config.family, media=True, length=length)  # the default media when none given
    ids = torch.tensor([prompt_ids(tokenizer, text)])
    mask = torch.ones_like(ids)
    inputs = {"input_ids": ids, "attention_mask": mask}
    dtype = manifest.dtype
    atol = TOLERANCES.get(dtype, 2e-2) if atol is None else atol
    report = ValidationReport(
        str(folder), str(against), backend, dtype, atol, ids.shape[1], 0, rtol=rtol, device=device
    )
    with recording(runtime) if save_polygraphy else contextlib.nullcontext() as calls:
        got_kv, got_mask, expected_tokens = compare_runs(runtime, reference, processor, media, report, inputs, steps)
    if save_polygraphy:
        report.polygraphy_commands = polygraphy_data.save(calls, reference, folder, save_polygraphy, report.bounds)
    if manifest.quantization:
        report.weights = weights
        result = gate_graphs(runtime, reference, tokenizer, manifest.quantization.scheme, text, steps, got_kv, got_mask)
        report.gate = result
    report.reference_tokens = expected_tokens.tolist()
    report.backend_tokens = runtime.generate(ids.numpy(), mask.numpy(), got_kv, steps, context_mask=got_mask)[
        0
    ].tolist()
    return report.write(folder)


@torch.no_grad()
def gate_graphs(runtime, reference, tokenizer, scheme: str, prompt: str, steps: int, got_kv, got_mask):
    """The quantized decoder against the reference over the prompt and the gate's own (`accuracy_gate.gate_texts`),
    with the same context: next-token distributions at every position of the reference's greedy continuation
    (teacher-forced)."""
    layers = [tuple(torch.from_numpy(t) for t in layer) for layer in layer_caches(got_kv, reference.config)]
    visual = dict(context_key_values=layers, context_mask=torch.from_numpy(got_mask))  # both sides: the same context
    expected, got = [], []
    for text in accuracy_gate.gate_texts(prompt, tokenizer, reference.config.family):
        ids = torch.tensor([prompt_ids(tokenizer, text)])
        continuation = reference.greedy(ids, max_new_tokens=steps, **visual)
        full = torch.cat([ids, continuation], dim=1)[:, :-1]
        start = ids.shape[1] - 1
        expected.append(reference(full, **visual).logits[0, start:].numpy())
        ones = np.ones(full.shape, np.int64)
        logits, _ = runtime.decode(full.numpy(), ones, runtime.empty_kv(1), got_kv, got_mask)
        got.append(logits[0, start:])
    return accuracy_gate.gate(scheme, expected, got)


def compare_runs(runtime: GraphRuntime, reference, processor, media: Media, report: ValidationReport, inputs, steps):
    """The context graphs (on `media`, else `default_media`), the prefill and every decode step on the reference's
    tokens, compared with the reference: (the graphs' context K/V and mask, the reference's greedy tokens)."""
    config, ids, mask = reference.config, inputs["input_ids"], inputs["attention_mask"]
    decoded = decode_media(media, processor) if media.given else default_media(config)
    context_check = config.streams[0].part_on(sys.modules[__name__], "context_check")  # a video's checks its audio
    visual, got_kv, got_mask = context_check(runtime, reference, processor, decoded, report)

    with torch.no_grad():
        expected = reference(ids, attention_mask=mask, **visual)
        expected_tokens = reference.greedy(ids, attention_mask=mask, max_new_tokens=steps, **visual)[0]
    logits, past = runtime.decode(ids.numpy(), mask.numpy(), runtime.empty_kv(1), got_kv, got_mask)
    report.comparisons.append(Comparison.of("decoder", "logits (prefill)", logits, expected.logits, report.bounds))

    # decode steps on the reference's tokens: the logits of every step, with the cache the graphs built
    worst, all_within = None, True
    step_mask, expected_past = mask, expected.past_key_values
    for token in expected_tokens[:-1].tolist():
        step_mask = torch.cat([step_mask, torch.ones(1, 1, dtype=step_mask.dtype)], dim=1)
        step_ids = torch.tensor([[token]])
        with torch.no_grad():
            step = reference(step_ids, attention_mask=step_mask, past_key_values=expected_past, **visual)
        expected_past = step.past_key_values
        logits, past = runtime.decode(step_ids.numpy(), step_mask.numpy(), past, got_kv, got_mask)
        comparison = Comparison.of("decoder", "logits (decode steps)", logits, step.logits, report.bounds)
        worst = comparison if worst is None or comparison.max_abs > worst.max_abs else worst
        all_within = all_within and comparison.within
    if worst is not None:  # the largest error shown; the verdict over every step
        report.comparisons.append(dataclasses.replace(worst, within=all_within))
    return got_kv, got_mask, expected_tokens


@torch.no_grad()
def context_check_image(runtime: GraphRuntime, reference, processor, media: DecodedMedia, report: ValidationReport):
    """The pictures (the demo's by default) through vision and context_kv, compared: (the reference's streams, the
    graphs' K/V and mask)."""
    pixels = processor.pictures([media.images or [demo_image()]])["pixel_values"]
    context_embeds, context_mask = reference.model.embed_images(pixels), reference.model.image_mask(pixels)
    context_kv = reference.model.encode_context(context_embeds, context_mask)
    report.visual_tokens = context_embeds.shape[1]
    got_embeds, got_mask = runtime.embed_images(pixels.numpy())
    report.comparisons.append(Comparison.of("vision", "context_embeds", got_embeds, context_embeds))
    report.comparisons.append(Comparison.of("vision", "context_attention_mask", got_mask, context_mask.long()))
    got_kv = runtime.encode_context(got_embeds, got_mask)
    expected_kv = [t for layer in context_kv for t in layer]
    for name, got, expected_part in zip(runtime.context_names, got_kv, expected_kv, strict=True):
        report.comparisons.append(Comparison.of("context_kv", name, got, expected_part))
    return dict(context_key_values=context_kv, context_mask=context_mask), got_kv, got_mask


def default_media(config) -> DecodedMedia:
    """What a model is validated on when no media is given: the demo's picture, or the demo video's frames (one a
    second) and sound."""
    if config.modality != "video":
        return DecodedMedia([demo_image()], None, None)
    frames = demo_frames()[::DEMO_VIDEO_FPS]
    return DecodedMedia([], [Image.fromarray(f) for f in frames], demo_audio(len(frames)) / 32768)


@torch.no_grad()
def context_check_frames(runtime: GraphRuntime, reference, processor, media: DecodedMedia, report: ValidationReport):
    """A video model's frames and audio through vision, audio and context_kv, each stream's K/V compared with the
    reference's (worst of every layer's): (the reference's streams, the graphs' context K/V and mask)."""
    streams = encode_media(reference, processor, media, {})
    got_kv, got_mask = graph_context(runtime, processor, media)
    report.visual_tokens, report.audio_tokens = context_tokens(reference.config, got_mask)
    expected_segments = streams["context_mask"][0]
    for stream in reference.config.streams:
        if len(keys := (expected_segments == stream.segment).nonzero()[:, 0]):  # a stream's keys lie together
            within = slice(int(keys[0]), int(keys[-1]) + 1)
            output = f"{stream.name} K/V"
            compare_stream(
                report, f"{stream.graph} + context_kv", output, got_kv, streams["context_key_values"], within
            )
    return streams, got_kv, got_mask


@torch.no_grad()
def context_check_tiles(runtime: GraphRuntime, reference, processor, media: DecodedMedia, report: ValidationReport):
    """An anyres image's thumbnail and tiles (the demo's picture by default) through vision and context_kv, its K/V
    compared with the reference's (worst of every layer's)."""
    image = media.images[0] if media.images else demo_image()
    tiles, (columns, rows) = processor.anyres(image)
    context_kv, context_mask = reference.model.encode_anyres([tiles], [image.size])
    got_kv, got_mask = runtime.encode_anyres(tiles.numpy(), columns, rows)
    report.visual_tokens = got_mask.shape[1]
    output = f"visual K/V ({columns} x {rows} tiles)"
    compare_stream(report, "vision + context_kv", output, got_kv, context_kv, slice(None))
    return dict(context_key_values=context_kv, context_mask=context_mask), got_kv, got_mask


def compare_stream(report: ValidationReport, graph: str, output: str, got_kv: list, expected: list, keys: slice):
    """Adds the worst over every layer's K/V of one context stream, the `keys` of the graphs' context and of the
    reference's (`expected`, per layer)."""
    expected = [t for layer in expected for t in layer]
    comparisons = [
        Comparison.of(graph, output, got[:, :, keys], part[:, :, keys])
        for got, part in zip(got_kv, expected, strict=True)
    ]
    report.comparisons.append(max(comparisons, key=lambda c: c.max_abs))
