"""onnxruntime-genai drives our decoder.onnx: its input and output names are genai's defaults (`input_ids`,
`position_ids`, `attention_mask`, `past_key_values.%d.key`, `present.%d.key`, ...). `genai_config` writes what genai
reads; `GenaiRuntime` computes a context once with our graphs (an image's or a video's K/V: vision, audio and
context_kv on ONNX Runtime) and binds it as the decoder's extra inputs, then genai generates.

genai's tokenizer drops the BOS token our prompts start with, so prompts go in as ids from the model's own
tokenizer. genai counts positions over the text tokens: our positions when text attends to the context debiased
(decoupled); otherwise the text follows the visual tokens and genai cannot say so."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from ..artifacts import OnnxManifest
from ..errors import InputError
from ..extras import require
from ..sidefiles import read_json, reading
from .ort import OrtModel

GENAI_CONFIG = "genai_config.json"


def unsupported(manifest: OnnxManifest) -> str | None:
    """Why genai cannot drive these graphs, or None."""
    if manifest.model.wings:
        return "WINGS learners add cache parts (wings_key/value) that genai does not carry"
    if not manifest.model.debias:
        return "text positions follow the visual tokens (no debiasing); genai counts text tokens only"
    if manifest.dtype == "bfloat16":
        return "bfloat16 graphs: ONNX Runtime's CPU provider has no bf16 kernels"
    return None


def genai_config(manifest: OnnxManifest, config, generation: dict) -> dict:
    """genai_config.json for an export: the decoder's names and shapes, the special tokens, the search settings of
    generation_config.json (greedy unless it samples), the context length."""
    context = getattr(config, "max_position_embeddings", 4096)
    return {
        "model": {
            "type": config.family.genai_type,
            "bos_token_id": config.bos_token_id,
            "eos_token_id": generation.get("eos_token_id", config.eos_token_id),
            "pad_token_id": generation.get("pad_token_id", config.pad_token_id),
            "vocab_size": config.vocab_size,
            "context_length": context,
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "filename": manifest.graphs["decoder"].file,
                "head_size": config.head_dim,
                "hidden_size": config.hidden_size,
                "num_attention_heads": config.num_attention_heads,
                "num_key_value_heads": config.num_key_value_heads,
                "num_hidden_layers": config.num_hidden_layers,
                "inputs": {
                    "input_ids": "input_ids",
                    "attention_mask": "attention_mask",
                    "position_ids": "position_ids",
                    "past_key_names": "past_key_values.%d.key",
                    "past_value_names": "past_key_values.%d.value",
                },
                "outputs": {
                    "logits": "logits",
                    "present_key_names": "present.%d.key",
                    "present_value_names": "present.%d.value",
                },
            },
        },
        "search": {
            "do_sample": bool(generation.get("do_sample", False)),
            "max_length": context,
            "min_length": 0,
            "num_beams": 1,
            "num_return_sequences": 1,
            "past_present_share_buffer": False,  # our decoder returns the whole cache (past + new)
            "repetition_penalty": generation.get("repetition_penalty", 1.0),
            "temperature": generation.get("temperature", 1.0),
            "top_k": generation.get("top_k", 1) if generation.get("do_sample") else 1,
            "top_p": generation.get("top_p", 1.0),
        },
    }


class GenaiRuntime:
    """Greedy generation by onnxruntime-genai on an export folder, the context bound once per prompt."""

    def __init__(self, folder: Path, threads: int | None = None):
        """`threads`: the decoder session's intra-op threads (default: the cores this process may use). genai's own
        default runs a decode step on one thread."""
        require("onnxruntime_genai")
        import onnxruntime_genai as og

        self.folder, self.og = Path(folder), og
        self.graphs = OrtModel(folder, threads)  # the context graphs (and the manifest)
        reason = unsupported(self.graphs.manifest)
        if reason or not (self.folder / GENAI_CONFIG).is_file():
            raise InputError(self.folder, f"genai cannot drive it: {reason or f'no {GENAI_CONFIG}'}")
        read_json(self.folder / GENAI_CONFIG, GENAI_CONFIG)
        with reading(self.folder / GENAI_CONFIG, GENAI_CONFIG):
            config = og.Config(str(self.folder))
        threads = threads or len(os.sched_getaffinity(0))
        config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}))
        self.model = og.Model(config)

    def start(self, input_ids: np.ndarray, context: tuple[list[np.ndarray], np.ndarray], max_new_tokens: int):
        """A greedy generator given the context and the prompt, and the arrays it reads: genai reads their memory
        without holding them, so the caller keeps them until the generator is done (a temporary mask, freed and
        reused, gave other tokens now and then)."""
        og = self.og
        params = og.GeneratorParams(self.model)
        params.set_search_options(max_length=input_ids.shape[1] + max_new_tokens, do_sample=False)
        generator = og.Generator(self.model, params)
        caches, mask = context
        inputs = {"context_attention_mask": mask.astype(np.int64).view(np.int64)}  # genai: int64 'l'
        inputs |= {name: np.ascontiguousarray(c) for name, c in zip(self.graphs.context_names, caches, strict=True)}
        for name, array in inputs.items():
            generator.set_model_input(name, array)
        generator.append_tokens(input_ids.astype(np.int32))
        return generator, inputs

    def generate(
        self, input_ids: np.ndarray, context: tuple[list[np.ndarray], np.ndarray], max_new_tokens: int
    ) -> tuple[list[int], list[np.ndarray]]:
        """One prompt (1, T) over a context (`GraphRuntime.encode_*`'s K/V and mask) -> the greedy tokens and the
        logits genai chose each from."""
        generator, _inputs = self.start(input_ids, context, max_new_tokens)
        tokens, logits = [], []
        while not generator.is_done() and len(tokens) < max_new_tokens:
            logits.append(np.array(generator.get_logits())[0, -1])
            generator.generate_next_token()
            tokens.append(int(generator.get_next_tokens()[0]))
        return tokens, logits


def write_genai_config(folder: Path, manifest: OnnxManifest, config) -> str | None:
    """Writes genai_config.json into an export folder; returns why not when genai cannot drive it."""
    reason = unsupported(manifest)
    if reason is None:
        generation = manifest.generation or {}
        text = json.dumps(genai_config(manifest, config, generation), indent=2) + "\n"
        (Path(folder) / GENAI_CONFIG).write_text(text)
    return reason
