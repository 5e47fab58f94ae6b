"""Prompts about media (images, or a video model's frames and audio) answered by a folder's model, loaded once: the
PyTorch reference on a checkpoint or converted folder, or the exported graphs on their runtime; greedy decoding, the
media's context encoded once for every prompt."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np
import torch

from ..answers import answer_text
from ..artifacts import dtype_name
from ..checkpoints.names import parameter_counts
from ..checkpoints.source import build_model, folder_config, open_source, parameter_shapes
from ..errors import InputError
from ..media import DecodedMedia, context_tokens, decode_media, encode_media, graph_context
from ..media_options import Media
from ..modeling.marked_prompts import prompt_ids
from ..plugins.torch_op import model_op
from ..processing import load_processor
from ..prompts import Prompt, as_prompt, prompt_texts
from ..runtime.static_decode import static_generate
from ..sidefiles import read_json
from ..ui import stage


@dataclass
class PromptResult:
    prompt_ids: list[int]
    generated_ids: list[int]
    text: str
    visual_tokens: int
    parameters: dict[str, int]
    seconds: dict[str, float] = field(default_factory=dict)
    audio_tokens: int | None = None  # None: an image model
    time_ranges: list[str] | None = None  # a video file's answer: its "0.12-0.15" ranges as hh:mm:ss (released)


def eos_token_id(folder: Path, config) -> int | None:
    path = Path(folder) / "generation_config.json"
    eos = read_json(path, "generation config").get("eos_token_id") if path.is_file() else config.eos_token_id
    eos = eos[0] if isinstance(eos, list) and eos else eos
    if eos is not None and not (type(eos) is int and 0 <= eos < config.vocab_size):
        raise InputError(path, f"eos_token_id {eos!r} is not a token id of the {config.vocab_size}-token vocabulary")
    return eos


GRAPH_RUNTIMES = {"ort": "ONNX Runtime", "trt": "TensorRT", "genai": "onnxruntime-genai"}


def open_runtime(folder: Path, backend: str, device: str = "cpu"):
    """The runtime that decodes with `backend` (folders.BACKENDS), and the one that runs our context graphs; `device`:
    ONNX Runtime's provider for ort."""
    if backend == "genai":
        from ..runtime.genai import GenaiRuntime

        runtime = GenaiRuntime(folder)
        return runtime, runtime.graphs
    from ..runtime import open_graphs

    runtime = open_graphs(folder, backend, device=device)
    return runtime, runtime


@dataclass
class Answers:
    """Prompts answered from one context: each prompt's result (its `seconds`: its own answer), and what was done
    once for all of them (loading, the context's encoding)."""

    results: list[PromptResult]
    seconds: dict[str, float]

    def one(self) -> PromptResult:
        """The one prompt's result, its seconds the whole run's."""
        (_,) = self.results
        return self.first()

    def first(self) -> PromptResult:
        """The first prompt's result, its seconds what was done once and then its own answer's."""
        result = self.results[0]
        result.seconds = self.seconds | result.seconds
        return result


def answer_label(number: int, prompts: int, what: str) -> str:
    return f"answer {number}/{prompts}: {what}" if prompts > 1 else what


def gpu_dtype(source) -> torch.dtype:
    """The model's dtype on a GPU: the checkpoint's where it is 16-bit, else bf16 (what the released models are)."""
    stored = source.output_dtype("auto")
    return stored if stored in (torch.float16, torch.bfloat16) else torch.bfloat16


class Asker:
    """A folder's model, loaded once, asking prompts about media: the PyTorch reference (`backend` "torch", on the
    CPU in fp32 or on a GPU in 16 bits) or our graphs on a runtime (ort, trt, genai). Media are decoded before the
    model is loaded (a bad file is the first and only message), and encoded once for every prompt asked about them."""

    def __init__(self, folder: Path, backend: str = "torch", device: str = "cpu"):
        self.folder, self.backend, self.device = Path(folder), backend, device
        self.source = open_source(folder) if backend == "torch" else None
        self.config = self.source.config if self.source else folder_config(self.folder)
        self.model = self.runtime = self.graphs = None
        self.parameters: dict[str, int] = {}

    @cached_property
    def processor(self):
        return load_processor(self.folder, self.config)

    @property
    def tokenizer(self):
        return self.processor.tokenizer

    @cached_property
    def eos(self) -> int | None:
        return eos_token_id(self.folder, self.config)

    def decode(self, media: Media, prompts: list[Prompt]) -> DecodedMedia:
        """The media checked against the model for each prompt, then read and decoded."""
        for prompt in prompts:
            media.check(self.config, prompt)
        return decode_media(media, self.processor, prompts)

    def texts(self, prompts: list[Prompt], given: bool, decoded: DecodedMedia) -> list[str]:
        return prompt_texts(prompts, self.tokenizer, self.config.family, given, decoded.duration)

    def load(self, seconds: dict[str, float]) -> None:
        """The model or the graphs, once."""
        if self.model is not None or self.runtime is not None:
            return
        if self.backend != "torch":
            with stage(f"load the graphs ({GRAPH_RUNTIMES[self.backend]})", seconds):
                self.runtime, self.graphs = open_runtime(self.folder, self.backend, self.device)
            self.parameters = parameter_counts(parameter_shapes(self.config))
            return
        dtype = gpu_dtype(self.source) if self.device == "cuda" else torch.float32
        loading = "load checkpoint" if self.device == "cpu" else f"load checkpoint onto the GPU ({dtype_name(dtype)})"
        with stage(loading, seconds):
            self.model = build_model(self.source, dtype, device=self.device)
        self.parameters = parameter_counts({n: tuple(p.shape) for n, p in self.model.named_parameters()})

    def encode(self, decoded: DecodedMedia, seconds: dict[str, float]):
        """The context of `decoded` (every layer's K/V; none without media) and its keys' segment ids."""
        if self.backend == "torch":
            streams = encode_media(self.model, self.processor, decoded, seconds)
            return streams, streams.get("context_mask", torch.zeros(1, 0, dtype=torch.long))
        with stage("encode the context: K/V for every layer (our graphs)", seconds):
            context = graph_context(self.graphs, self.processor, decoded)
        return context, context[1]

    @torch.no_grad()
    def generate(self, ids: list[int], context, max_new_tokens: int) -> list[int]:
        """Greedy tokens for one prompt's ids over an encoded context, up to and with the end token."""
        if self.backend == "torch":
            ids = torch.tensor([ids], device=self.device)
            if self.device == "cuda":
                return static_generate(self.model, ids, max_new_tokens, eos_token_id=self.eos, op=model_op,
                                       cuda_graph=True, **context).tokens[0]  # fmt: skip
            return self.model.greedy(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                     eos_token_id=self.eos, **context)[0].tolist()  # fmt: skip
        ids = np.array([ids])
        if self.backend == "genai":
            generated, _ = self.runtime.generate(ids, context, max_new_tokens)
        else:
            caches, mask = context
            generated = self.runtime.generate(ids, np.ones_like(ids), caches, max_new_tokens, self.eos, mask)
            generated = generated[0].tolist()
        return generated[: generated.index(self.eos) + 1] if self.eos in generated else generated

    def ask(self, texts: list[str], decoded: DecodedMedia, max_new_tokens: int,
            seconds: dict[str, float]) -> Iterator[PromptResult]:  # fmt: skip
        """Each prompt's answer in turn, from the decoded media's context, encoded once (the model loaded first, after
        what a bad file would refuse: the generation config's end token)."""
        self.eos  # the generation config read before the model loads: a cut one is the only message
        self.load(seconds)
        context, segments = self.encode(decoded, seconds)
        visual_tokens, audio_tokens = context_tokens(self.config, segments)
        how = "(greedy)" if self.backend == "torch" else f"with {GRAPH_RUNTIMES[self.backend]}"
        for number, text in enumerate(texts, 1):
            answer: dict[str, float] = {}
            ids = prompt_ids(self.tokenizer, text)
            with stage(answer_label(number, len(texts), f"generate up to {max_new_tokens} tokens {how}"), answer):
                generated = self.generate(ids, context, max_new_tokens)
            text = answer_text(self.tokenizer, generated)
            yield PromptResult(ids, generated, text, visual_tokens, self.parameters, answer, audio_tokens,
                               decoded.time_ranges(text, self.config))  # fmt: skip


def ask_about(folder: Path, backend: str, prompts: list[str | Prompt], media: Media, max_new_tokens: int,
              device: str = "cpu") -> Answers:  # fmt: skip
    """Prompts about one set of media, answered by `backend` on `folder`: the media decoded first, then the model
    loaded, the context encoded once and each prompt answered from it."""
    seconds: dict[str, float] = {}
    asker = Asker(folder, backend, device)
    prompts = [as_prompt(prompt) for prompt in prompts]
    decoded = asker.decode(media, prompts)
    texts = asker.texts(prompts, media.given, decoded)
    return Answers(list(asker.ask(texts, decoded, max_new_tokens, seconds)), seconds)


def run_prompts(
    folder: Path, prompts: list[str | Prompt], media: Media, max_new_tokens: int, device: str = "cpu"
) -> Answers:
    """Prompts through the reference model: the media encoded once (the context's K/V for every layer), each prompt
    answered from it by greedy decoding. On a GPU (`device` "cuda"): the model in 16 bits with the Triton kernel as
    its attention, decoding from a static cache replayed from a CUDA graph (runtime/static_decode.py)."""
    return ask_about(folder, "torch", prompts, media, max_new_tokens, device)


def run_prompts_graphs(
    folder: Path, prompts: list[str | Prompt], media: Media, max_new_tokens: int, backend: str, device: str = "cpu"
) -> Answers:
    """Prompts through exported graphs: the context by our graphs (once, for every prompt), each prompt's greedy
    decoding by our decoder graph on ONNX Runtime (ort, on `device`) or TensorRT (trt), or by onnxruntime-genai."""
    return ask_about(folder, backend, prompts, media, max_new_tokens, device)


def run_prompt_graphs(
    folder: Path, prompt: str | Prompt, media: Media, max_new_tokens: int, backend: str, device: str = "cpu"
) -> PromptResult:
    return run_prompts_graphs(folder, [prompt], media, max_new_tokens, backend, device).one()


def run_prompt(
    folder: Path, prompt: str | Prompt, media: Media, max_new_tokens: int, device: str = "cpu"
) -> PromptResult:
    return run_prompts(folder, [prompt], media, max_new_tokens, device).one()
