"""A prompt's media, from the files given to the context the model reads: `Media` (the paths, checked against
the model: `media_options.py`), `DecodedMedia` (pictures, video frames at the tower's square, the sound track's
samples; pictures and folders of frames opened here as the released code opens them), prepared by the folder's one
DAttnProcessor (`processing.load_processor`), then the context streams' K/V from the reference model (`encode_media`)
or from the graphs (`graph_context`). generate, validate, analyze and retrieve share it."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from .answers import time_ranges
from .errors import InputError
from .folders import MEDIA_SUFFIXES
from .media_options import Media
from .modeling.images import PreparedFrames
from .modeling.marked_prompts import media_marker
from .modeling.media_files import media_duration, resized_to_tower
from .modeling.processing_dattn import DAttnProcessor
from .modeling.sound_decoding import AUDIO_RATE, load_audio
from .modeling.streams import AUDIO
from .modeling.video_decoding import load_video
from .prompts import Prompt
from .sidefiles import reading
from .ui import err, stage

UNMARKED = (
    "note: the prompt {prompt!r} has no <image> before its question: the released models were trained on "
    "'<image>' and a newline there (for a video too), which dattn-export cuts out as their code does; without "
    "it their answers may differ"
)

IMAGE_SUFFIXES = MEDIA_SUFFIXES["--image"]


def open_image(path: Path) -> Image.Image:
    """An image file as RGB (the released code's `.convert('RGB')`); a picture over Pillow's decompression-bomb
    limit (about 179 Mpixels) is refused before it is decoded. Video and audio files are read by the code a Hub repo
    ships (`modeling/video_decoding.py`, `modeling/sound_decoding.py`)."""
    with reading(path, "image"):
        with Image.open(path) as image:
            return image.convert("RGB")


def load_frame_folder(folder: Path, square: int | None = None) -> list[Image.Image]:
    """A folder of frame images, in file-name order; with `square`, each resized to it as it is read."""
    files = sorted(f for f in Path(folder).iterdir() if f.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise InputError(folder, f"holds no frame images ({', '.join(sorted(IMAGE_SUFFIXES))})")
    return [open_image(f) if square is None else resized_to_tower(open_image(f), square) for f in files]


@dataclass
class DecodedMedia:
    images: list
    frames: list | None
    samples: np.ndarray | None
    duration: float | None = None  # a video file's, in seconds

    def time_ranges(self, text: str, config) -> list[str] | None:
        """The answer's ranges as the released inference script prints them, for a video file (of a family that was
        released)."""
        if self.duration is None or config.family.released_range_pattern is None:
            return None
        return time_ranges(text, self.duration, config.family)


def decode_media(media: Media, processor: DAttnProcessor, prompts: Sequence[Prompt] = ()) -> DecodedMedia:
    """Every file read and decoded before any model work, so that a bad one is the first and only message; video
    frames resized to the tower's square as they are decoded (the processor's `frame_square`). Then a note for each
    finished prompt of `prompts` that comes with media but names none where the released models expect it."""
    square = processor.frame_square if media.video or media.frames else None
    frames = samples = None
    if media.video:  # with its own sound track (when it has one) unless an audio file is given
        frames, samples = load_video(media.video, square=square, sound=not media.audio)
    elif media.frames:
        frames = load_frame_folder(media.frames, square)
    if media.audio:
        samples = load_audio(media.audio)
    duration = media_duration(media.video) if media.video else None
    decoded = DecodedMedia([open_image(p) for p in media.images], frames, samples, duration)
    for prompt in prompts if media.given else ():
        if prompt.kind == "raw" and media_marker(prompt.text) is None:
            err.print(UNMARKED.format(prompt=prompt.text), markup=False)
    return decoded


def encode_media(model, processor: DAttnProcessor, media: DecodedMedia, seconds: dict[str, float]) -> dict:
    """The context's K/V and segment ids for `model.generate` (none without media): pictures, or a video model's
    frames and audio, prepared by the processor and joined as every backend joins them."""
    contexts = []
    if media.images:
        with stage(f"encode {len(media.images)} image(s): visual K/V for every layer", seconds):
            contexts.append(model.model.encode_inputs(**processor.pictures([media.images])))
    pixels, audio = video_inputs(processor, media)
    if pixels is not None:
        with stage(f"encode {len(pixels)} frame(s): visual K/V for every layer", seconds):
            contexts.append(model.model.encode_video([pixels]))
    if audio is not None:
        with stage(f"encode {len(media.samples) / AUDIO_RATE:.1f} s of audio: audio K/V for every layer", seconds):
            contexts.append(model.model.encode_audio([audio[0]], [audio[1]]))
    if not contexts:
        return {}
    context_key_values, context_mask = model.model.join_contexts(*contexts)
    return {"context_key_values": context_key_values, "context_mask": context_mask}


def context_tokens(config, segments) -> tuple[int, int | None]:
    """A context's tokens, counted by its keys' segment ids (an array or a tensor): the first stream's (visual), and
    the audio stream's (None for a model without one)."""
    visual = int((segments == config.streams[0].segment).sum())
    return visual, int((segments == AUDIO.segment).sum()) if AUDIO in config.streams else None


def video_inputs(processor: DAttnProcessor, media: DecodedMedia) -> tuple[PreparedFrames | None, tuple | None]:
    """A video model's tower inputs: frames (F, 3, H, W), prepared as pictures are a part at a time as the tower
    reads them, and audio (log-mel 30 s chunks, its length in mel frames), each None when absent."""
    pixels = processor.prepared_frames(media.frames) if media.frames else None
    audio = processor.sound_features(media.samples) if media.samples is not None else None
    return pixels, audio


def graph_context(graphs, processor: DAttnProcessor, media: DecodedMedia) -> tuple[list[np.ndarray], np.ndarray]:
    """The context our graphs compute for decoded media (`GraphRuntime`'s caches and mask), by the model's first
    stream (`graph_context_{its name}`): a video model's frames and audio, an anyres image, images (each prepared by
    the processor), or none."""
    return processor.model_config.streams[0].part_on(sys.modules[__name__], "graph_context")(graphs, processor, media)


def graph_context_frames(graphs, processor: DAttnProcessor, media: DecodedMedia):
    pixels, audio = video_inputs(processor, media)
    return graphs.encode_streams({"frames": pixels, "audio": None if audio is None else (audio[0].numpy(), audio[1])})


def graph_context_tiles(graphs, processor: DAttnProcessor, media: DecodedMedia):
    if not media.images:
        return graphs.no_context(1)
    tiles, (columns, rows) = processor.anyres(media.images[0])
    return graphs.encode_anyres(tiles.numpy(), columns, rows)


def graph_context_image(graphs, processor: DAttnProcessor, media: DecodedMedia):
    if not media.images:
        return graphs.no_context(1)
    return graphs.encode_images(processor.pictures([media.images])["pixel_values"].numpy())
