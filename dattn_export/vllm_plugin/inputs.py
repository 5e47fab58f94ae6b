"""The seam between the plugin's processor and its model: the fields a batch of pictures or videos travels in, as
vLLM's typed schemas (`TensorSchema`: every field's shape, checked in one parse step), split item by item."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Annotated

import torch
from vllm.utils.tensor_schema import TensorSchema, TensorShape

from ..modeling.streams import ContextStream
from .context_cache import DIGEST_BYTES


def picture_parts(tiling: torch.Tensor) -> torch.Tensor:
    """Each picture's parts from its tiling (columns, rows): an anyres picture's thumbnail and tiles; one for a
    picture not tiled, (0, 0)."""
    return 1 + tiling.prod(-1)


def video_field_parts(streams: Sequence[ContextStream], sizes: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each video stream's field -> each video's parts in it, from the videos' sizes (videos, [parts, amount] per
    stream)."""
    return {stream.served_field: parts for stream, parts in zip(streams, sizes[:, 0::2].T, strict=True)}


class PictureInputs(TensorSchema):
    """Pictures as the processor sends them: their parts (a picture not tiled: itself; an anyres one: its thumbnail,
    then its tiles) as bytes until the model normalizes them, a picture's after another's; each picture's tiling
    (columns, rows; (0, 0): not tiled) and digest (`context_cache`).
    Dimensions: p: the parts of every picture; h, w: a part's height and width; n: pictures."""

    pixel_values: Annotated[torch.Tensor, TensorShape("p", 3, "h", "w")]
    tiling: Annotated[torch.Tensor, TensorShape("n", 2)]
    digest: Annotated[torch.Tensor, TensorShape("n", DIGEST_BYTES)]

    @classmethod
    def parse(cls, inputs: Mapping[str, object]) -> PictureInputs:
        return cls(pixel_values=inputs["pixel_values"], tiling=inputs["tiling"], digest=inputs["digest"])

    def validate(self) -> None:
        super().validate()
        if (parts := int(picture_parts(self.tiling).sum())) != len(self.pixel_values):
            raise ValueError(f"pixel_values holds {len(self.pixel_values)} parts; the pictures' tilings, {parts}")

    def items(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each picture's parts (parts, 3, h, w) and tiling."""
        return list(zip(self.pixel_values.split(picture_parts(self.tiling).tolist()), self.tiling))


class VideoInputs(TensorSchema):
    """Videos as the processor sends them: each stream's media in its field (its `served_field`), a video's parts after
    another's: the frames as the tower's squares, bytes until the model normalizes them; the sound track's log-mel
    chunks (a video without one: one chunk of zeros); each video's sizes (per stream, in the model's order: its
    parts, and the amount its tokens count) and digest (`context_cache`).
    Dimensions: f: the frames of every video; s: the tower's side; c: the chunks of every video; m: mel bins; t: a
    chunk's mel frames; n: videos; k: two per stream."""

    frame_pixels: Annotated[torch.Tensor, TensorShape("f", 3, "s", "s")]
    audio_mels: Annotated[torch.Tensor | None, TensorShape("c", "m", "t")]
    sizes: Annotated[torch.Tensor, TensorShape("n", "k")]
    digest: Annotated[torch.Tensor, TensorShape("n", DIGEST_BYTES)]

    @classmethod
    def parse(cls, streams: Sequence[ContextStream], inputs: Mapping[str, object]) -> VideoInputs:
        """A model's (its `streams`) batch of videos; a stream the model lacks has no field."""
        fields = {stream.served_field: inputs[stream.served_field] for stream in streams}
        sizes = inputs["sizes"]
        return cls(
            **fields, sizes=sizes, digest=inputs["digest"], streams=streams, resolve_bindings={"k": 2 * len(streams)}
        )

    def validate(self) -> None:
        super().validate()
        for field, parts in video_field_parts(self.streams, self.sizes).items():
            if (given := len(self[field])) != int(parts.sum()):
                raise ValueError(f"{field} holds {given} parts; the videos' sizes, {int(parts.sum())}")

    def items(self) -> list[tuple[torch.Tensor, ...]]:
        """Each video's media, a tensor per stream in the model's order, then its sizes."""
        fields = [
            self[field].split(parts.tolist()) for field, parts in video_field_parts(self.streams, self.sizes).items()
        ]
        return list(zip(*fields, self.sizes))
