"""`validate --backend vllm`: a folder `quantize` wrote, served by vLLM offline (`vllm.LLM`, the engine `serve`
runs), held to its 16-bit folder served alike.

The same accuracy gate as a quantized ONNX export's (`accuracy_gate.GATES`, the scheme's row), over the prompt and
`GATE_QUESTIONS` with the same media: each engine's full next-token distribution at every position of the 16-bit
model's greedy continuation, teacher-forced (one request per position, the continuation so far in its prompt, since
the engine decodes only its own tokens). The free-running greedy tokens are reported, not gated: quantized weights
may part from the 16-bit model's at a near tie and never meet again. Both engines run in the same dtype (bfloat16 on
a CPU, whose 4-bit kernel takes 16-bit activations), so the gate sees the quantization alone. The quantized
matrices are checked against the 16-bit ones first (`weight_check.check_compressed`), as `validate` checks an ONNX
export's."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np
import torch

from .. import memory
from ..artifacts import ConvertManifest
from ..checkpoints.source import folder_config, open_source
from ..demo_model import demo_prompt
from ..errors import InputError
from ..media import DecodedMedia, decode_media
from ..media_options import Media
from ..modeling.marked_prompts import prompt_ids
from ..modeling.processing_dattn import DAttnProcessor
from ..processing import load_processor
from ..prompts import Prompt, as_prompt
from ..ui import quiet
from ..vllm_plugin import unsupported
from ..vllm_plugin.logs import QUIET_ENVIRONMENT
from . import accuracy_gate
from .quantize import COMPRESSED_SCHEMES
from .serve import check_cpu_attention, cpu_environment
from .validate import ValidationReport, default_media
from .verify import quantized_from
from .weight_check import check_compressed


def validate_vllm(
    folder: Path,
    against: Path | None = None,
    steps: int = 20,
    prompt: str | Prompt | None = None,
    media: Media | None = None,
    weight_check: bool = True,
    weights_only: bool = False,
    progress=quiet,
    verbose: bool = False,
) -> ValidationReport:
    """`against`: the 16-bit folder (default: the one the manifest names); `media`: default the demo's picture or
    video; `prompt`: default the demo's. Writes validation_report.json in `folder`."""
    folder = Path(folder)
    manifest = ConvertManifest.read(folder, "a folder written by dattn-export convert")
    if manifest.quantization is None:
        raise InputError(folder, "is not quantized: --backend vllm holds a folder `dattn-export quantize` wrote "
                         "to its unquantized one (whose numbers: validate --backend torch)")  # fmt: skip
    scheme = manifest.quantization.scheme
    against = Path(quantized_from(folder, manifest, against))
    config = folder_config(folder)
    if reason := unsupported(config):
        raise InputError(folder / "config.json", f"vLLM cannot serve this model: {reason}")
    source = open_source(against)
    source.raise_first_problem()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    report = ValidationReport(str(folder), str(against), "vllm", engine_dtype(config), 0.0, 0, 0, device=device,
                              tokens_gated=False)  # fmt: skip
    if weight_check or weights_only:
        report.weights = check_compressed(folder, manifest, source, progress)
        if weights_only or not report.weights.passed:
            return report.write(folder)
    if not torch.cuda.is_available():  # vLLM's CPU engine holds the weights and its KV cache in memory
        needed = source.nbytes + int(float(cpu_environment(1)["VLLM_CPU_KVCACHE_SPACE"]) * (1 << 30))
        memory.require(needed + ENGINE_OVERHEAD, f"serving {against} with vLLM",
                       "validate on a GPU machine, or check the weights alone with --weights-only")  # fmt: skip
        check_cpu_attention(folder, config)  # imports vLLM: after what needs no engine
    media = media or Media()
    media.check(config)
    processor = load_processor(folder, config)
    tokenizer = processor.tokenizer
    prompt = as_prompt(prompt) if prompt else demo_prompt(config.modality, tokenizer)
    decoded = decode_media(media, processor, [prompt]) if media.given else default_media(config)
    text = prompt.text_for(tokenizer, config.family, media=True, length=decoded.duration)
    prompts = [prompt_ids(tokenizer, t) for t in accuracy_gate.gate_texts(text, tokenizer, config.family)]
    report.prompt_tokens = len(prompts[0])
    with progress("serving both folders with vLLM", 4, "runs") as advance:
        with Engine(against, processor, decoded, prompts, steps, report.dtype, verbose) as engine:
            continuations = engine.greedy(prompts, steps)
            advance(1, "vLLM: the unquantized folder, teacher-forced")
            expected = engine.distributions(prompts, continuations)
        advance(1, f"vLLM: the {scheme} folder's greedy tokens")
        with Engine(folder, processor, decoded, prompts, steps, report.dtype, verbose) as engine:
            report.backend_tokens = engine.greedy(prompts[:1], steps)[0]
            advance(1, f"vLLM: the {scheme} folder, teacher-forced")
            got = engine.distributions(prompts, continuations)
        advance(1)
    report.reference_tokens = continuations[0]
    report.gate = dataclasses.replace(accuracy_gate.gate(COMPRESSED_SCHEMES[scheme].gate, expected, got), scheme=scheme)
    return report.write(folder)


# vLLM's CPU engine beyond its weights and KV cache (measured at Vidi-7B's shape, 16 layers: 13.8 GiB for 9.3 GiB of
# weights and 2 GiB of KV cache), besides memory.HEADROOM
ENGINE_OVERHEAD = 1 << 30


def engine_dtype(config) -> str:
    """Both engines' dtype: the folder's on a GPU; on a CPU bfloat16 (the CPU's 4-bit kernel takes 16-bit
    activations, and its int8 kernel 16-bit outputs), whatever the folder's."""
    return str(config.dtype).removeprefix("torch.") if torch.cuda.is_available() else "bfloat16"


class Engine:
    """`vllm.LLM` on one folder for the gate's requests, in this process (its engine shut down on leaving, so that
    the next folder's starts on a free machine)."""

    def __init__(self, folder: Path, processor: DAttnProcessor, media: DecodedMedia, prompts: list[list[int]],
                 steps: int, dtype: str, verbose: bool = False):  # fmt: skip
        self.folder, self.processor, self.media, self.dtype, self.verbose = folder, processor, media, dtype, verbose
        self.config = processor.model_config
        self.length = max(map(len, prompts)) + steps + 1
        if media.frames:  # as vLLM takes them, once for every request
            frames = np.stack([np.asarray(f.convert("RGB")) for f in media.frames])
            self.data = {"video": (frames, {"audio": media.samples})}
        else:
            self.data = {"image": media.images[0].convert("RGB")}

    def __enter__(self) -> Engine:
        in_this_process = {**({} if self.verbose else QUIET_ENVIRONMENT), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        for name, value in {**cpu_environment(1), **in_this_process}.items():
            os.environ.setdefault(name, value)
        from vllm import LLM

        options = {}
        if self.media.frames:  # a video's encoder tokens are taken in one step: the budget holds them
            from ..vllm_plugin.video import encoder_token_budget

            hop = self.processor.feature_extractor.hop_length
            budget = encoder_token_budget(self.config, len(self.media.frames), hop)
            options = {"limit_mm_per_prompt": {"video": {"count": 1, "num_frames": len(self.media.frames)}},
                       "max_num_batched_tokens": max(budget, self.length)}  # fmt: skip
        self.llm = LLM(str(self.folder), dtype=self.dtype, max_model_len=self.length, max_logprobs=-1,
                       enforce_eager=not torch.cuda.is_available(), distributed_executor_backend="uni",
                       use_tqdm_on_load=False, **options)  # fmt: skip
        return self

    def __exit__(self, *exc) -> None:
        self.llm.llm_engine.engine_core.shutdown()
        del self.llm

    def run(self, prompts: list[list[int]], tokens: int, logprobs: int | None):
        from vllm import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, logprobs=logprobs,
                                flat_logprobs=True, detokenize=False)  # fmt: skip
        return [
            out.outputs[0]
            for out in self.llm.generate(
                [{"prompt_token_ids": p, "multi_modal_data": self.data} for p in prompts], params, use_tqdm=False
            )
        ]

    def greedy(self, prompts: list[list[int]], steps: int) -> list[list[int]]:
        return [list(out.token_ids) for out in self.run(prompts, steps, None)]

    def distributions(self, prompts: list[list[int]], continuations: list[list[int]]) -> list[np.ndarray]:
        """Each prompt's next-token log-probabilities (positions, vocab) at every position of its continuation: one
        request per position, the continuation's tokens before it appended to the prompt."""
        requests = [p + c[:i] for p, c in zip(prompts, continuations) for i in range(len(c))]
        rows = [full_row(out.logprobs, self.config.vocab_size) for out in self.run(requests, 1, -1)]
        splits = np.cumsum([len(c) for c in continuations])[:-1]
        return np.split(np.stack(rows), splits)


def full_row(logprobs, vocab: int) -> np.ndarray:
    """The first position's log-probabilities over the vocabulary from vLLM's flat logprobs (every token's)."""
    row = np.full(vocab, -np.inf)
    first, last = logprobs.start_indices[0], logprobs.end_indices[0]
    row[logprobs.token_ids[first:last]] = logprobs.logprobs[first:last]
    return row
