"""Decoding: `greedy`, the exact reference loop every backend is held to (new tokens, the text KV cache, the
context's K/V made once), and transformers' own `generate` driving the model (sampling, beams, streamers, stop
strings, every logits processor): the text K/V in a transformers `DynamicCache`, the context's K/V made from the media
at the first step and carried in the model's keyword arguments, expanded with the batch for beams and
`num_return_sequences`. Mixed into the model (modeling_dattn.py); ships with it."""

from __future__ import annotations

import functools
import inspect

import torch
from torch import Tensor
from transformers import DynamicCache, GenerationMixin

from .context import KV
from .streams import MEDIA_INPUTS

CACHES = {None: False, "dynamic": False, "offloaded": True}  # cache_implementation -> offloading: what D-Attn takes


class DAttnGenerationMixin(GenerationMixin):
    """transformers' generation with D-Attn's context: `generate` is transformers' own; `greedy` the reference."""

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

    # --- transformers' generate: the hooks its loop calls -------------------------------------------------------

    def _prepare_cache_for_generation(self, generation_config, model_kwargs: dict, *args, **kwargs):
        """The text cache: a DynamicCache of full layers. Built from the config it would give the sliding-window
        layers a cache that keeps w - 1 past keys, where D-Attn's window, as the released code calls flash-attn,
        lets a query see w + 1: the window is the attention's mask over every key, as in `greedy`."""
        if model_kwargs.get("past_key_values") is not None or generation_config.use_cache is False:
            return super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
        implementation = generation_config.cache_implementation
        if implementation not in CACHES:
            raise ValueError(
                f"cache_implementation={implementation!r}: this model's text cache is a DynamicCache ('dynamic', "
                "'offloaded'), its sliding window applied by the attention's mask over every key; a static or "
                "sliding cache would keep fewer keys than its window sees"
            )
        model_kwargs["past_key_values"] = DynamicCache(offloading=CACHES[implementation])

    def _validate_model_kwargs(self, model_kwargs: dict) -> None:
        """The media the processor gives (MEDIA_INPUTS) reach the forward through its keyword arguments."""
        super()._validate_model_kwargs({k: v for k, v in model_kwargs.items() if k not in MEDIA_INPUTS})

    def prepare_inputs_for_generation(self, input_ids: Tensor, past_key_values=None, attention_mask=None,
                                      context_key_values: list[KV] | None = None, context_mask: Tensor | None = None,
                                      **kwargs):  # fmt: skip
        """transformers' inputs, except: the model counts its text positions itself (the released models' text
        tokens alone, visual tokens taking none), and once the context is made (the first step) the media are not
        passed again; a context given for fewer rows than the batch (encoded once, then beams or several returned
        sequences) is repeated for each row as transformers repeats the prompts."""
        inputs = super().prepare_inputs_for_generation(
            input_ids, past_key_values=past_key_values, attention_mask=attention_mask, **kwargs
        )
        inputs.pop("position_ids", None)
        # what transformers keeps in the keyword arguments for its own use (`tokenizer`, for stop strings) stays there
        inputs = {key: value for key, value in inputs.items() if key in forward_inputs(type(self))}
        if context_key_values is not None:
            rows = inputs["input_ids"].shape[0]
            for key in MEDIA_INPUTS:
                inputs.pop(key, None)
            inputs["context_key_values"] = [tuple(each_row(t, rows) for t in kv) for kv in context_key_values]
            inputs["context_mask"] = None if context_mask is None else each_row(context_mask, rows)
        return inputs

    def _update_model_kwargs_for_generation(self, outputs, model_kwargs: dict, *args, **kwargs) -> dict:
        """transformers' update, and the context the step made (or was given), for the next steps; the text cache
        under the name generate keeps it by (the output names it `cache`)."""
        model_kwargs = super()._update_model_kwargs_for_generation(outputs, model_kwargs, *args, **kwargs)
        model_kwargs["past_key_values"] = outputs.cache
        model_kwargs["context_key_values"] = outputs.context_key_values
        model_kwargs["context_mask"] = outputs.context_mask
        return model_kwargs


@functools.cache
def forward_inputs(model_class: type) -> frozenset[str]:
    """What the model's forward takes: its parameters and the processor's media."""
    return frozenset(inspect.signature(model_class.forward).parameters) | frozenset(MEDIA_INPUTS)


def each_row(tensor: Tensor, rows: int) -> Tensor:
    """`tensor` (batch, ...) for `rows` rows: each of its rows repeated in turn (transformers' expansion of a batch
    for beams and returned sequences)."""
    return tensor if tensor.shape[0] == rows else tensor.repeat_interleave(rows // tensor.shape[0], dim=0)
