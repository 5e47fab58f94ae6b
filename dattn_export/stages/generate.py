"""Run a prompt (and images, or a video model's frames and audio) through a checkpoint with the reference model:
greedy decoding."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..answers import answer_text
from ..artifacts import dtype_name
from ..checkpoints.names import parameter_counts
from ..checkpoints.source import build_model, folder_config, open_source, parameter_shapes
from ..errors import InputError
from ..media import context_tokens, decode_media, encode_media, graph_context
from ..media_options import Media
from ..modeling.marked_prompts import prompt_ids
from ..plugins.torch_op import model_op
from ..processing import load_tokenizer
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
        (result,) = self.results
        result.seconds = self.seconds | result.seconds
        return result


def answer_label(number: int, prompts: int, what: str) -> str:
    return f"answer {number}/{prompts}: {what}" if prompts > 1 else what


def run_prompts_graphs(
    folder: Path, prompts: list[str | Prompt], media: Media, max_new_tokens: int, backend: str, device: str = "cpu"
) -> Answers:
    """Prompts through exported graphs: the context by our graphs (once, for every prompt), each prompt's greedy
    decoding by our decoder graph on ONNX Runtime (ort, on `device`) or TensorRT (trt), or by onnxruntime-genai."""
    seconds: dict[str, float] = {}
    folder = Path(folder)
    config = folder_config(folder)
    prompts = [as_prompt(prompt) for prompt in prompts]
    for prompt in prompts:
        media.check(config, prompt)
    decoded = decode_media(media, folder, config, prompts)
    tokenizer, eos = load_tokenizer(folder, config), eos_token_id(folder, config)
    texts = prompt_texts(prompts, tokenizer, config.family, media.given, decoded.duration)
    name = GRAPH_RUNTIMES[backend]
    with stage(f"load the graphs ({name})", seconds):
        runtime, graphs = open_runtime(folder, backend, device)
    with stage("encode the context: K/V for every layer (our graphs)", seconds):
        context = graph_context(graphs, folder, config, decoded)
    caches, mask = context
    visual_tokens, audio_tokens = context_tokens(config, mask)
    results = []
    for number, text in enumerate(texts, 1):
        answer: dict[str, float] = {}
        ids = np.array([prompt_ids(tokenizer, text)])
        with stage(answer_label(number, len(prompts), f"generate up to {max_new_tokens} tokens with {name}"), answer):
            if backend == "genai":
                generated, _ = runtime.generate(ids, context, max_new_tokens)
            else:
                attention = np.ones_like(ids)
                generated = runtime.generate(ids, attention, caches, max_new_tokens, eos, mask)[0].tolist()
        generated = generated[: generated.index(eos) + 1] if eos in generated else generated
        results.append(
            PromptResult(
                prompt_ids=ids[0].tolist(),
                generated_ids=generated,
                text=(text := answer_text(tokenizer, generated)),
                visual_tokens=visual_tokens,
                parameters=parameter_counts(parameter_shapes(config)),
                seconds=answer,
                audio_tokens=audio_tokens,
                time_ranges=decoded.time_ranges(text, config),
            )
        )
    return Answers(results, seconds)


def run_prompt_graphs(
    folder: Path, prompt: str | Prompt, media: Media, max_new_tokens: int, backend: str, device: str = "cpu"
) -> PromptResult:
    return run_prompts_graphs(folder, [prompt], media, max_new_tokens, backend, device).one()


def gpu_dtype(source) -> torch.dtype:
    """The model's dtype on a GPU: the checkpoint's where it is 16-bit, else bf16 (what the released models are)."""
    stored = source.output_dtype("auto")
    return stored if stored in (torch.float16, torch.bfloat16) else torch.bfloat16


@torch.no_grad()
def run_prompts(
    folder: Path, prompts: list[str | Prompt], media: Media, max_new_tokens: int, device: str = "cpu"
) -> Answers:
    """Prompts through the reference model: the media encoded once (the context's K/V for every layer), each prompt
    answered from it by greedy decoding. On a GPU (`device` "cuda"): the model in 16 bits with the Triton kernel as
    its attention, decoding from a static cache replayed from a CUDA graph (runtime/static_decode.py)."""
    seconds: dict[str, float] = {}
    source = open_source(folder)
    prompts = [as_prompt(prompt) for prompt in prompts]
    for prompt in prompts:
        media.check(source.config, prompt)
    decoded = decode_media(media, folder, source.config, prompts)
    tokenizer, eos = load_tokenizer(folder, source.config), eos_token_id(folder, source.config)
    texts = prompt_texts(prompts, tokenizer, source.config.family, media.given, decoded.duration)
    dtype = gpu_dtype(source) if device == "cuda" else torch.float32
    with stage(
        "load checkpoint" if device == "cpu" else f"load checkpoint onto the GPU ({dtype_name(dtype)})", seconds
    ):
        model = build_model(source, dtype, device=device)
    streams = encode_media(model, folder, decoded, seconds)
    parameters = parameter_counts({n: tuple(p.shape) for n, p in model.named_parameters()})
    segments = streams.get("context_mask", torch.zeros(1, 0, dtype=torch.long))
    visual_tokens, audio_tokens = context_tokens(model.config, segments)
    results = []
    for number, text in enumerate(texts, 1):
        answer: dict[str, float] = {}
        ids = torch.tensor([prompt_ids(tokenizer, text)], device=device)
        with stage(answer_label(number, len(prompts), f"generate up to {max_new_tokens} tokens (greedy)"), answer):
            if device == "cuda":
                decoded_ids = static_generate(model, ids, max_new_tokens, eos_token_id=eos, op=model_op,
                                              cuda_graph=True, **streams)  # fmt: skip
                generated = decoded_ids.tokens[0]
            else:
                generated = model.greedy(
                    ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, eos_token_id=eos, **streams
                )[0].tolist()
        results.append(
            PromptResult(
                prompt_ids=ids[0].tolist(),
                generated_ids=generated,
                text=(text := answer_text(tokenizer, generated)),
                visual_tokens=visual_tokens,
                parameters=parameters,
                seconds=answer,
                audio_tokens=audio_tokens,
                time_ranges=decoded.time_ranges(text, model.config),
            )
        )
    return Answers(results, seconds)


def run_prompt(
    folder: Path, prompt: str | Prompt, media: Media, max_new_tokens: int, device: str = "cpu"
) -> PromptResult:
    return run_prompts(folder, [prompt], media, max_new_tokens, device).one()
