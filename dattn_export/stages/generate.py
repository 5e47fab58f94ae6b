"""Run a prompt (and images) through a checkpoint with the reference model: greedy decoding."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..checkpoints.names import parameter_counts
from ..checkpoints.source import build_model, open_source
from ..processing import load_image_processor, load_images, load_tokenizer
from ..ui import stage


@dataclass
class PromptResult:
    prompt_ids: list[int]
    generated_ids: list[int]
    text: str
    visual_tokens: int
    parameters: dict[str, int]
    seconds: dict[str, float] = field(default_factory=dict)


def eos_token_id(folder: Path, config) -> int | None:
    path = Path(folder) / "generation_config.json"
    eos = json.loads(path.read_text()).get("eos_token_id") if path.is_file() else config.eos_token_id
    return eos[0] if isinstance(eos, list) else eos


@torch.no_grad()
def run_prompt(folder: Path, prompt: str, image_paths: list[Path], max_new_tokens: int) -> PromptResult:
    seconds: dict[str, float] = {}
    with stage("load checkpoint", seconds):
        source = open_source(folder)
        source.refuse_video("generate")
        model = build_model(source)
        tokenizer = load_tokenizer(folder, model.config)
        image_processor = load_image_processor(folder, model.config)
    inputs = tokenizer(prompt, return_tensors="pt")
    visual_kv = visual_mask = None
    if image_paths:
        with stage(f"encode {len(image_paths)} image(s): visual K/V for every layer", seconds):
            pixels = load_images(image_paths, image_processor)
            visual_kv, visual_mask = model.model.encode_images(pixels)
    with stage(f"generate up to {max_new_tokens} tokens (greedy, KV cache)", seconds):
        generated = model.generate(
            inputs["input_ids"],
            attention_mask=inputs["attention_mask"],
            max_new_tokens=max_new_tokens,
            visual_key_values=visual_kv,
            visual_mask=visual_mask,
            eos_token_id=eos_token_id(folder, model.config),
        )[0].tolist()
    return PromptResult(
        prompt_ids=inputs["input_ids"][0].tolist(),
        generated_ids=generated,
        text=tokenizer.decode(generated, skip_special_tokens=True),
        visual_tokens=0 if visual_kv is None else visual_kv[0][0].shape[2],
        parameters=parameter_counts({n: tuple(p.shape) for n, p in model.named_parameters()}),
        seconds=seconds,
    )
