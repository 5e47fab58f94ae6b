"""`validate --backend torch`: the PyTorch model as it runs deployed, against the fp32 reference on the same device.

Deployed: in 16 bits (the checkpoint's, else bf16) with `torch.ops.dattn` as every attention, decoding from a static
cache; on a GPU (`--device cuda`) that op is the Triton kernel and each decode step is replayed from a CUDA graph
(runtime/static_decode.py), as `generate --device cuda` runs it. The reference: the same checkpoint in fp32 with the
reference math and the dynamic cache. On the same prompt and media (the demo's by default): the context's K/V, the
prompt's logits and every decode step's logits on the reference's own tokens (teacher-forced), each within a share
of the reference's largest logit (`SCALE_TOLERANCES`, as the GPU check holds a bf16 model); the free-running greedy
tokens are reported, not gated, since 16-bit logits may part from fp32's at a near tie."""

from __future__ import annotations

from pathlib import Path

import torch

from ..artifacts import dtype_name
from ..checkpoints.source import build_model, open_source
from ..demo_model import demo_prompt
from ..media import context_tokens, decode_media, encode_media
from ..media_options import Media
from ..modeling.marked_prompts import prompt_ids
from ..plugins.torch_op import model_op
from ..processing import load_processor
from ..prompts import Prompt, as_prompt
from ..runtime.static_decode import static_generate
from .generate import gpu_dtype
from .validate import Comparison, ValidationReport, default_media

# the largest logit error a 16-bit model may have against fp32, as a share of the largest fp32 logit (measured on an
# H200: bf16 within 1.1-1.4% on the demo models and a 2-layer model of Mistral-7B's width)
SCALE_TOLERANCES = {"bfloat16": 0.05, "float16": 0.02}


@torch.no_grad()
def validate_model(folder: Path, device: str = "cpu", steps: int = 20, prompt: str | Prompt | None = None,
                   media: Media | None = None) -> ValidationReport:  # fmt: skip
    folder = Path(folder)
    source = open_source(folder)
    config = source.config
    media = media or Media()
    media.check(config)  # a prompt is asked about the default media where none is given
    processor = load_processor(folder, config)
    tokenizer = processor.tokenizer
    prompt = as_prompt(prompt) if prompt else demo_prompt(config.modality, tokenizer)
    decoded = decode_media(media, processor, [prompt]) if media.given else default_media(config)
    text = prompt.text_for(tokenizer, config.family, media=True, length=decoded.duration)
    dtype = gpu_dtype(source)
    reference = build_model(source, torch.float32, device=device)
    ids = torch.tensor([prompt_ids(tokenizer, text)], device=device)
    streams = encode_media(reference, processor, decoded, {})
    expected_tokens = reference.greedy(ids, max_new_tokens=steps, **streams)[0].tolist()
    expected = [reference(ids, **streams).logits[:, -1].float()]
    expected += step_logits(reference, ids, expected_tokens, streams)
    del reference
    deployed = build_model(source, dtype, device=device)
    deployed_streams = encode_media(deployed, processor, decoded, {})
    graph = device == "cuda"
    forced = static_generate(deployed, ids, len(expected_tokens), op=model_op, cuda_graph=graph, keep_logits=True,
                             forced=expected_tokens, **deployed_streams)  # fmt: skip
    free = static_generate(deployed, ids, steps, op=model_op, cuda_graph=graph, **deployed_streams)
    scale = max(e.abs().max().item() for e in expected)
    tolerance = SCALE_TOLERANCES[dtype_name(dtype)] * scale
    report = ValidationReport(str(folder), str(folder), "torch", dtype_name(dtype), tolerance, ids.shape[1], 0,
                              device=device, tokens_gated=False)  # fmt: skip
    if streams:
        report.visual_tokens, report.audio_tokens = context_tokens(config, streams["context_mask"].cpu())
        for got, want in zip(deployed_streams["context_key_values"], streams["context_key_values"], strict=True):
            report.comparisons.append(
                Comparison.of("context", "context K/V", got[0].float().cpu().numpy(), want[0].cpu())
            )
        report.comparisons[-len(streams["context_key_values"]) :] = [
            max(report.comparisons[-len(streams["context_key_values"]) :], key=lambda c: c.max_abs)
        ]  # the worst layer's
    bounds = (tolerance, 0.0)
    report.comparisons.append(Comparison.of("model", "logits (prefill)", forced.step_logits[0].cpu().numpy(),
                                            expected[0].cpu(), bounds))  # fmt: skip
    steps_compared = [Comparison.of("model", "logits (decode steps)", got.cpu().numpy(), want.cpu(), bounds)
                      for got, want in zip(forced.step_logits[1:], expected[1:])]  # fmt: skip
    if steps_compared:
        worst = max(steps_compared, key=lambda c: c.max_abs)
        worst.within = all(c.within for c in steps_compared)
        report.comparisons.append(worst)
    report.reference_tokens, report.backend_tokens = expected_tokens, free.tokens[0]
    return report  # no report file: FOLDER is the checkpoint, an input


def step_logits(model, ids: torch.Tensor, tokens: list[int], streams: dict) -> list[torch.Tensor]:
    """The next-token logits after each of `tokens` but the last, the dynamic cache's decoding on those tokens."""
    out = model(ids, **streams)
    logits, mask = [], torch.ones_like(ids)
    for token in tokens[:-1]:
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        step = torch.tensor([[token]], device=ids.device)
        out = model(step, attention_mask=mask, past_key_values=out.past_key_values, **streams)
        logits.append(out.logits[:, -1].float())
    return logits
