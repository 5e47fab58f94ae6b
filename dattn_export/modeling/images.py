"""Pictures to pixel values as the released code prepares them (bytedance/vidi `img_utils.process_images`), by the
config's `mm_image_aspect_ratio`:
  resize  the picture resized to the tower's square (bicubic), then the tower's processor: the released default;
  pad     the picture pasted centred on a square of the processor's mean colour (`expand2square`), then the processor;
  crop    the processor alone (CLIP: the shortest edge resized, then a centre crop; SigLIP: resized to its square);
  anyres  a thumbnail (the picture resized to the tower's square) and the tiles of the tiling of
          `mm_image_grid_points` that keeps most of it (the picture resized to the tiling's resolution, cut row by row).
The tower's square is the released towers' `output_size`: CLIP's shortest edge, SigLIP's height. Video frames follow
the same rule (the released training asserts `resize` for video). Pictures come in as RGB, as the released loaders
open them (`.convert('RGB')`).

Ships with the model (PIL and the tower's image processor only), so a Hub repo's usage prepares pictures with it.
"""

from __future__ import annotations

import math

import torch
from PIL import Image

from .configuration_dattn import ASPECT_RATIOS


def tower_side(processor) -> int:
    """The side of the tower's square, as the released towers set their processor's `output_size`."""
    size = processor.size
    return size["shortest_edge"] if "shortest_edge" in size else size["height"]


def pad_to_square(picture: Image.Image, colour: tuple[int, ...]) -> Image.Image:
    """The picture centred on a square of `colour` as wide as its longer side (a square picture as it is)."""
    width, height = picture.size
    if width == height:
        return picture
    side = max(width, height)
    square = Image.new(picture.mode, (side, side), colour)
    square.paste(picture, ((side - width) // 2, (side - height) // 2))
    return square


def squared(pictures: list[Image.Image], rule: str, processor) -> list[Image.Image]:
    """The pictures as the processor takes them under `rule` (resize, pad or crop)."""
    if rule == "resize":
        side = tower_side(processor)
        return [picture.resize((side, side), resample=Image.BICUBIC) for picture in pictures]
    if rule == "pad":
        colour = tuple(int(channel * 255) for channel in processor.image_mean)
        return [pad_to_square(picture, colour) for picture in pictures]
    if rule == "crop":
        return list(pictures)
    raise ValueError(f"mm_image_aspect_ratio {rule!r}: pictures are prepared by one of {ASPECT_RATIOS}")


UNSCALED = {"do_rescale": False, "do_normalize": False}  # an image processor's call that stops at the pixels' bytes


def prepare_pictures(pictures: list[Image.Image], rule: str, processor, **options) -> torch.Tensor:
    """(N, 3, H, W) pixel values of RGB pictures under `rule` (resize, pad or crop; anyres: `anyres_tiles`).
    `options` go to the processor's call."""
    return processor(squared(pictures, rule, processor), return_tensors="pt", **options)["pixel_values"]


def as_bytes(pixels: torch.Tensor) -> torch.Tensor:
    """Pixel values an image processor neither rescaled nor normalized (UNSCALED: whole numbers 0-255) as uint8."""
    return pixels.round().to(torch.uint8) if pixels.is_floating_point() else pixels.to(torch.uint8)


class PreparedFrames:
    """A video's frames (RGB PIL images at the tower's square) read as their pixel values (N, 3, H, W), each slice
    prepared when it is read: the tower takes a part of the frames a run, so a long video never holds every frame's
    float pixels at once (an hour at 1 frame/s of 384 px squares is 6.4 GB of them). Reads as the model and the
    runtimes read frames: `len`, `shape`, slices."""

    ndim = 4

    def __init__(self, pictures: list[Image.Image], rule: str, processor):
        self.pictures, self.rule, self.processor = list(pictures), rule, processor

    def __len__(self) -> int:
        return len(self.pictures)

    def __getitem__(self, frames: slice) -> torch.Tensor:
        return prepare_pictures(self.pictures[frames], self.rule, self.processor)

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self), *self[:1].shape[1:])


def anyres_grid(image_size: tuple[int, int], grid_points: list, tile: int) -> tuple[int, int]:
    """The tiling (columns, rows) of `grid_points` whose resolution (tiles of `tile` pixels) keeps most of a
    (width, height) image once it is fitted in, the least padding breaking ties (img_utils.select_best_resolution)."""
    width, height = image_size
    best, kept, wasted = None, 0, math.inf
    for columns, rows in grid_points:
        scale = min(columns * tile / width, rows * tile / height)
        effective = min(int(width * scale) * int(height * scale), width * height)
        waste = columns * tile * rows * tile - effective
        if effective > kept or (effective == kept and waste < wasted):
            best, kept, wasted = (columns, rows), effective, waste
    return best


def anyres_tiles(picture: Image.Image, processor, grid_points: list, **options) -> tuple[torch.Tensor, tuple[int, int]]:
    """(1 + columns x rows, 3, side, side): the picture resized to one tile (the thumbnail), then the picture resized
    to the best tiling's resolution and cut into tiles row by row (img_utils.process_anyres_image); and that tiling
    (columns, rows). `options` go to the processor's call."""
    side = tower_side(processor)
    columns, rows = anyres_grid(picture.size, grid_points, side)
    resized = picture.resize((columns * side, rows * side), resample=Image.BICUBIC)
    corners = [(x, y) for y in range(0, rows * side, side) for x in range(0, columns * side, side)]
    tiles = [resized.crop((x, y, x + side, y + side)) for x, y in corners]
    thumbnail = picture.resize((side, side), resample=Image.BICUBIC)
    return processor([thumbnail, *tiles], return_tensors="pt", **options)["pixel_values"], (columns, rows)
