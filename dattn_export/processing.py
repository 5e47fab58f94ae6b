"""Tokenizer and image preprocessing for a checkpoint folder, offline."""

from __future__ import annotations

from pathlib import Path

import torch
from PIL import Image, UnidentifiedImageError
from transformers import AutoTokenizer, CLIPImageProcessorPil, SiglipImageProcessorPil

from .checkpoints.towers import tower_folder
from .errors import InputError

PROCESSOR_FILE = "preprocessor_config.json"

IMAGE_PROCESSORS = {"siglip_vision_model": SiglipImageProcessorPil, "clip_vision_model": CLIPImageProcessorPil}


def load_tokenizer(folder: Path, config):
    if not (Path(folder) / "tokenizer.json").is_file() and not (Path(folder) / "tokenizer_config.json").is_file():
        raise InputError(folder, "has no tokenizer (tokenizer.json / tokenizer_config.json)")
    return AutoTokenizer.from_pretrained(str(folder), config=config, local_files_only=True)


def processor_folder(folder: Path, config) -> Path | None:
    """Where the image preprocessor is: the checkpoint's preprocessor_config.json, else the vision tower folder's
    (released checkpoints name the tower and load its processor from there)."""
    for candidate in (Path(folder), tower_folder(config.mm_vision_tower, folder)):
        if candidate is not None and (candidate / PROCESSOR_FILE).is_file():
            return candidate
    return None


def load_image_processor(folder: Path, config):
    """The checkpoint's or its vision tower's preprocessor, else the tower's defaults at its image size."""
    processor_class = IMAGE_PROCESSORS[config.vision_config["model_type"]]
    if found := processor_folder(folder, config):
        return processor_class.from_pretrained(str(found), local_files_only=True)
    size = config.vision_config["image_size"]
    return processor_class(size={"height": size, "width": size}, do_center_crop=False)


def load_images(paths: list[Path], image_processor) -> torch.Tensor:
    """Image files -> (1, images, 3, H, W) pixel values."""
    pictures = []
    for path in paths:
        try:
            pictures.append(Image.open(path).convert("RGB"))
        except (OSError, UnidentifiedImageError) as e:
            raise InputError(path, f"not a readable image ({e})") from None
    return image_processor(pictures, return_tensors="pt")["pixel_values"][None]
