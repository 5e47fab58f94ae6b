"""The checkpoint's processor, offline (`load_processor`: the shipped DAttnProcessor, its components found in a folder
of any layout): its tokenizer (a prompt's ids: `prompts.py`), its image processor (pictures prepared as the released
code prepares them; their bytes finished on vLLM's workers by `normalize_pixels`) and its audio feature extractor
(Whisper's log-mel chunks). Opening media files is `media.py`'s and the shipped decoders'."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoTokenizer, CLIPImageProcessorPil, SiglipImageProcessorPil, WhisperFeatureExtractor

from .checkpoints.towers import tower_folder
from .errors import InputError
from .modeling.processing_dattn import (
    FEATURE_EXTRACTOR,
    DAttnProcessor,
    default_audio_processor,
    saved_feature_extractor,
)
from .sidefiles import read_json, reading

PROCESSOR_FILE = "preprocessor_config.json"  # an image processor's, or a tower folder's feature extractor's
PROCESSOR_CONFIG = "processor_config.json"  # the processor's, its feature extractor nested (FEATURE_EXTRACTOR)
PROCESSOR_CLASS = "processing_dattn.DAttnProcessor"  # AutoProcessor's (modeling/processing_dattn.py, shipped)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

IMAGE_PROCESSORS = {"siglip_vision_model": SiglipImageProcessorPil, "clip_vision_model": CLIPImageProcessorPil}


def load_tokenizer(folder: Path, config):
    names = [name for name in TOKENIZER_FILES if (Path(folder) / name).is_file()]
    if not names:
        raise InputError(folder, "has no tokenizer (tokenizer.json / tokenizer_config.json)")
    for name in names:  # a cut file is named, not the library's parse error
        if name.endswith(".json"):
            read_json(Path(folder) / name, name)
    with reading(Path(folder) / names[0], "tokenizer"):
        return AutoTokenizer.from_pretrained(str(folder), config=config, local_files_only=True)


def load_processor(folder: Path, config, tokenizer=None) -> DAttnProcessor:
    """The folder's processor, the one object every command and the vLLM plugin prepare a prompt and its media with,
    as AutoProcessor gives it to a Hub user, from a folder of any layout (a converted folder's processor files, else a
    released checkpoint's tower folders): the image processor (`load_image_processor`), the audio feature extractor
    (`load_audio_processor`) and the tokenizer (the folder's where none is given), each loaded once."""
    tokenizer = load_tokenizer(folder, config) if tokenizer is None else tokenizer
    processor = DAttnProcessor(load_image_processor(folder, config), load_audio_processor(folder, config), tokenizer)
    processor.model_config = config
    return processor


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


def save_processor_files(out: Path, folder: Path, config) -> None:
    """What AutoProcessor loads a converted folder's processor from: processor_config.json naming the shipped class,
    with the audio tower's feature extractor (`load_audio_processor`) as transformers 5 nests a processor's; and the
    image processor's preprocessor_config.json where the checkpoint carried none (its tower's defaults)."""
    if not (Path(out) / PROCESSOR_FILE).is_file():
        load_image_processor(folder, config).save_pretrained(str(out))
    fields = {"processor_class": PROCESSOR_CLASS.split(".")[1], "auto_map": {"AutoProcessor": PROCESSOR_CLASS}}
    fields[FEATURE_EXTRACTOR] = load_audio_processor(folder, config).to_dict()
    (Path(out) / PROCESSOR_CONFIG).write_text(json.dumps(fields, indent=2) + "\n")


def normalize_pixels(pixels: torch.Tensor, image_processor) -> torch.Tensor:
    """`DAttnProcessor.picture_bytes`' (or `anyres_bytes`') pixels as its `pictures` gives them, float32: rescaled
    (in float64, then float32) and normalized, as the image processor computes them (tests/test_images.py compares
    the two)."""
    scale = image_processor.rescale_factor if image_processor.do_rescale else 1.0
    x = (pixels.double() * scale).float()
    if not image_processor.do_normalize:
        return x
    mean, std = (torch.tensor(v, dtype=torch.float32, device=x.device)[:, None, None] for v in (
        image_processor.image_mean, image_processor.image_std
    ))  # fmt: skip
    return (x - mean) / std


def load_audio_processor(folder: Path, config) -> WhisperFeatureExtractor:
    """The folder's processor's feature extractor (a converted folder's: what DAttnProcessor prepares sound with),
    else the audio tower folder's, else Whisper's at the tower's mel bins, its chunk the encoder's input
    (2 x max_source_positions mel frames: 3000 for Whisper)."""
    own = Path(folder) / PROCESSOR_CONFIG
    if own.is_file() and (saved := saved_feature_extractor(read_json(own, PROCESSOR_CONFIG))):
        return saved
    found = tower_folder(config.mm_audio_tower, folder)
    if found is not None and (found / PROCESSOR_FILE).is_file():
        return WhisperFeatureExtractor.from_pretrained(str(found), local_files_only=True)
    return default_audio_processor(config.audio_config)
