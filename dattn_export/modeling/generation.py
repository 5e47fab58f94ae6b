"""Decoding: `greedy`, the exact reference loop every backend is held to (new tokens, the text KV cache, the
context's K/V made once), and transformers' `generate` on top of it, which takes the processor's output as it is and
returns the prompts' ids followed by the new ones. Mixed into the model (modeling_dattn.py); ships with it."""

from __future__ import annotations

import copy

import torch
from torch import Tensor
from transformers import GenerationConfig, GenerationMixin

from .context import KV
from .streams import MEDIA_INPUTS


class DAttnGenerationMixin(GenerationMixin):
    """transformers' mark of a model that generates (its name ends so), with D-Attn's own decoding."""

    @torch.no_grad()
    def greedy(
        self,
        input_ids: Tensor,
        pixel_values: Tensor | None = None,
        attention_mask: Tensor | None = None,
        max_new_tokens: int = 20,
        context_key_values: list[KV] | None = None,
        eos_token_id: int | list[int] | None = None,
        context_mask: Tensor | None = None,
        pad_token_id: int | None = None,
        **media: Tensor | None,
    ) -> Tensor:
        """The new tokens (B, up to max_new_tokens), greedy, with the text KV cache; the context's K/V (an image's, a
        video's frames and audio) computed once (or reused). A row that gave an end token (`eos_token_id`, one or
        several) goes on with `pad_token_id` (else that end token); decoding ends once every row has."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        ends = torch.tensor([] if eos_token_id is None else eos_token_id, dtype=torch.long, device=input_ids.device)
        ends = ends.flatten()
        if pad_token_id is None:
            pad_token_id = int(ends[0]) if len(ends) else 0
        streams = dict(context_key_values=context_key_values, context_mask=context_mask)
        out = self(input_ids, pixel_values, attention_mask, **streams, **media)
        tokens, finished = [], torch.zeros(input_ids.shape[0], 1, dtype=torch.bool, device=input_ids.device)
        for step in range(max_new_tokens):
            next_token = out.logits[:, -1].argmax(-1, keepdim=True).masked_fill(finished, pad_token_id)
            tokens.append(next_token)
            finished = finished | torch.isin(next_token, ends)
            if step == max_new_tokens - 1 or finished.all():
                break
            attention_mask = torch.cat([attention_mask, torch.ones_like(next_token)], dim=1)
            out = self(
                next_token,
                attention_mask=attention_mask,
                past_key_values=out.past_key_values,
                context_key_values=out.context_key_values,
                context_mask=out.context_mask,
            )
        return torch.cat(tokens, dim=1)

    @torch.no_grad()
    def generate(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        generation_config: GenerationConfig | None = None,
        context_key_values: list[KV] | None = None,
        context_mask: Tensor | None = None,
        **inputs,
    ) -> Tensor:
        """transformers' `generate`, greedy: the processor's output as it is (`model.generate(**inputs,
        max_new_tokens=...)`), or a context encoded once for several questions (`context_key_values` and
        `context_mask` from `model.model.encode_inputs`). Returns each prompt's ids and then its new ones, a row
        that ended padded, as transformers' models do. Settings come from `generation_config` (the repo's
        generation_config.json) and `inputs`; sampling and beams are refused rather than silently ignored."""
        media = {key: inputs.pop(key) for key in MEDIA_INPUTS if key in inputs}
        settings = copy.deepcopy(generation_config or self.generation_config)
        if unused := settings.update(**inputs):
            raise ValueError(f"generate does not take {sorted(unused)}")
        if settings.do_sample or (settings.num_beams or 1) > 1 or settings.return_dict_in_generate:
            raise ValueError("this model decodes greedily: do_sample=False, num_beams=1, return_dict_in_generate=False")
        steps = settings.max_new_tokens
        if steps is None:  # transformers' default: 20 tokens in all
            steps = max((settings.max_length or 20) - input_ids.shape[1], 1)
        new = self.greedy(
            input_ids,
            attention_mask=attention_mask,
            max_new_tokens=steps,
            context_key_values=context_key_values,
            context_mask=context_mask,
            eos_token_id=settings.eos_token_id,
            pad_token_id=settings.pad_token_id,
            **media,
        )
        return torch.cat([input_ids, new], dim=1)
