"""The graphs' contract: what each exported graph takes and gives (names, example inputs, dynamic axes, cache
names, outputs) and the module of the reference model it is traced from. The export traces them; validate and
polygraphy's data run the same modules as each graph's reference; the runtimes read the names from the manifest
the export writes from these specs. The op inside is `plugins/contract.py`'s."""

from __future__ import annotations

import dataclasses
import sys

import torch
from torch import nn
from torch.export import Dim


def kv_names(prefix: str, config) -> list[str]:
    return [f"{prefix}.{i}.{part}" for i in range(config.num_hidden_layers) for part in config.cache_parts(i)]


def layer_caches(flat: list, config) -> list[tuple]:
    """A graph's flat cache tensors, in `kv_names` order, as the model's per-layer tuples."""
    caches, start = [], 0
    for i in range(config.num_hidden_layers):
        end = start + len(config.cache_parts(i))
        caches.append(tuple(flat[start:end]))
        start = end
    return caches


Axes = dict[int, Dim] | None  # an input's dynamic axes (None: all static)


@dataclasses.dataclass(frozen=True)
class GraphSpec:
    """One graph to export: the module traced, its inputs by name in the order the module takes them (each an
    example, with no axis of size 0 or 1 where the axis is dynamic, or the exporter would specialise it; and its
    dynamic axes), its outputs' names. `layout` says how the module takes the inputs: per argument, one tensor
    (None) or a list of that many (a cache per layer part)."""

    module: nn.Module
    inputs: dict[str, tuple[torch.Tensor, Axes]]
    outputs: list[str]
    layout: tuple[int | None, ...]

    def arguments(self, flat: list) -> tuple:
        """Values in `inputs` order, grouped as the module takes them."""
        grouped, at = [], 0
        for count in self.layout:
            grouped.append(flat[at] if count is None else list(flat[at : at + count]))
            at += 1 if count is None else count
        return tuple(grouped)

    @property
    def args(self) -> tuple:
        return self.arguments([example for example, _ in self.inputs.values()])

    @property
    def dynamic_shapes(self) -> tuple:
        return self.arguments([axes for _, axes in self.inputs.values()])


class VisionGraph(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, pixel_values):
        return self.model.model.embed_images(pixel_values), self.model.model.image_mask(pixel_values).long()


class StreamGraph(nn.Module):
    """One of the model's methods that embed (part of) one sample's context stream: frame_stream, audio_stream,
    anyres_stream; it takes the method's inputs as one list."""

    def __init__(self, model, method: str):
        super().__init__()
        self.model, self.method = model, method

    def forward(self, inputs):
        return getattr(self.model.model, self.method)(*inputs)


class FramesGraph(StreamGraph):
    """frame_stream of a space-to-depth model, its pooled side the length of `pooled_grid`: a shape the graph reads
    (ONNX Resize to a size computed from it), so that one graph pools a video of any length as the released pool
    does past its resize budget."""

    def __init__(self, model):
        super().__init__(model, "frame_stream")

    def forward(self, inputs):
        *frame_inputs, pooled_grid = inputs
        return super().forward([*frame_inputs, pooled_grid.shape[0]])


class ContextKVGraph(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, context_embeds, context_attention_mask):
        return [t for layer in self.model.model.encode_context(context_embeds, context_attention_mask) for t in layer]


class DecoderGraph(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, position_ids, attention_mask, context_attention_mask, past, visual):
        config = self.model.config
        out = self.model(
            input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=layer_caches(past, config),
            context_key_values=layer_caches(visual, config),
            context_mask=context_attention_mask,
        )
        return out.logits, [t for layer in out.past_key_values for t in layer]


def stream_spec(model, method: str, inputs: dict[str, tuple[torch.Tensor, Axes]], outputs: list[str]) -> GraphSpec:
    return GraphSpec(StreamGraph(model, method), inputs, outputs, (len(inputs),))


def graph_specs(model, dtype: torch.dtype) -> dict[str, GraphSpec]:
    """Every graph of the model's export, by name: its context stream's (vision; a video model's audio too), the
    visual stream's K/V per layer, and the decoder."""
    config = model.config
    heads = {"key": config.num_key_value_heads, "value": config.num_key_value_heads}
    heads |= {"wings_key": config.wings_heads, "wings_value": config.wings_heads}
    batch, seq, past, total, visual = (
        Dim(n) for n in ("batch", "sequence", "past_sequence", "total_sequence", "context_sequence")
    )
    b, t, p = 2, 3, 4
    v = 2 * config.tokens_per_image  # two images' tokens
    parts = [part for i in range(config.num_hidden_layers) for part in config.cache_parts(i)]

    def caches(prefix: str, length: int, axis: Dim) -> dict[str, tuple[torch.Tensor, Axes]]:
        examples = (torch.randn(b, heads[part], length, config.head_dim, dtype=dtype) for part in parts)
        return {name: (x, {0: batch, 2: axis}) for name, x in zip(kv_names(prefix, config), examples, strict=True)}

    streams = {stream.graph: stream.part_on(sys.modules[__name__], "spec")(model, dtype) for stream in config.streams}
    visual_inputs = {
        "context_embeds": (torch.randn(b, v, config.hidden_size, dtype=dtype), {0: batch, 1: visual}),
        "context_attention_mask": (torch.ones(b, v, dtype=torch.int64), {0: batch, 1: visual}),
    }
    decoder_inputs = {
        "input_ids": (torch.randint(3, config.vocab_size, (b, t)), {0: batch, 1: seq}),
        "position_ids": (torch.arange(p, p + t).expand(b, -1), {0: batch, 1: seq}),
        "attention_mask": (torch.ones(b, p + t, dtype=torch.int64), {0: batch, 1: total}),
        "context_attention_mask": (torch.ones(b, v, dtype=torch.int64), {0: batch, 1: visual}),
        **caches("past_key_values", p, past),
        **caches("context_key_values", v, visual),
    }
    return streams | {
        "context_kv": GraphSpec(
            ContextKVGraph(model), visual_inputs, kv_names("context_key_values", config), (None, None)
        ),
        "decoder": GraphSpec(
            DecoderGraph(model),
            decoder_inputs,
            ["logits", *kv_names("present", config)],
            (None, None, None, None, len(parts), len(parts)),
        ),
    }


def spec_image(model, dtype: torch.dtype) -> GraphSpec:
    """An image model's vision graph: a batch of samples' images, each sample as many."""
    size = model.config.vision_config["image_size"]
    pixels = torch.randn(2, 2, 3, size, size, dtype=dtype)
    inputs = {"pixel_values": (pixels, {0: Dim("batch"), 1: Dim("images")})}
    return GraphSpec(VisionGraph(model), inputs, ["context_embeds", "context_attention_mask"], (None,))


def spec_tiles(model, dtype: torch.dtype) -> GraphSpec:
    """An anyres model's vision graph: one image's thumbnail and its tiles, rows x columns of them."""
    size = model.config.vision_config["image_size"]
    inputs = {
        "thumbnail": (torch.randn(1, 3, size, size, dtype=dtype), None),
        "tiles": (torch.randn(2, 3, 3, size, size, dtype=dtype), {0: Dim("tile_rows"), 1: Dim("tile_columns")}),
    }
    return stream_spec(model, "anyres_stream", inputs, ["context_embeds"])


def spec_frames(model, dtype: torch.dtype) -> GraphSpec:
    """A video model's frames graph: part of one video's frames."""
    config = model.config
    size, frames = config.vision_config["image_size"], Dim("frames")
    frame_inputs = {
        "pixel_values": (torch.randn(3, 3, size, size, dtype=dtype), {0: frames}),
        "frame_index": (torch.arange(2, 5), {0: frames}),
        "num_frames": (torch.tensor(9), None),
    }
    if config.mm_pool_rule == "space-to-depth":  # the pooled side, for any video length: its values are not read
        frame_inputs["pooled_grid"] = (torch.arange(config.patch_grid + 2), {0: Dim("pooled_side")})
        return GraphSpec(FramesGraph(model), frame_inputs, ["context_embeds"], (len(frame_inputs),))
    return stream_spec(model, "frame_stream", frame_inputs, ["context_embeds"])


def spec_audio(model, dtype: torch.dtype) -> GraphSpec:
    """A video model's audio graph: part of one sample's log-mel 30 s chunks."""
    audio = model.config.audio_config
    chunk_frames = 2 * audio["max_source_positions"]  # Whisper's 30 s of log-mel frames
    inputs = {
        "input_features": (torch.randn(2, audio["num_mel_bins"], chunk_frames, dtype=dtype), {0: Dim("chunks")}),
        "first_chunk": (torch.tensor(1), None),
        "mel_frames": (torch.tensor(3 * chunk_frames), None),
    }
    return stream_spec(model, "audio_stream", inputs, ["audio_embeds", "audio_attention_mask"])
