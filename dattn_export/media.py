"""A prompt's media, from the files given to the context the model reads: `Media` (the paths, checked against
the model), `DecodedMedia` (pictures, video frames at the tower's square, the sound track's samples), then the
context streams' K/V from the reference model (`encode_media`) or from the graphs (`graph_context`). generate,
validate and analyze share it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .errors import InputError
from .modeling.images import PreparedFrames, anyres_tiles, prepare_pictures
from .processing import (
    AUDIO_RATE,
    audio_features,
    frame_square,
    load_audio,
    load_audio_processor,
    load_frame_folder,
    load_image_processor,
    load_video,
    media_duration,
    open_image,
    time_ranges,
)
from .ui import stage

MEDIA_MARKERS = ("<image>", "<video>")  # where a prompt says its picture or video sits (text, not special tokens)


@dataclass
class Media:
    """What a prompt comes with: images (an image model), or a video model's frames (a video file or a folder of
    frames) and audio (a file, else the video's own track when it has one)."""

    images: list[Path] = field(default_factory=list)
    video: Path | None = None
    frames: Path | None = None
    audio: Path | None = None

    def check(self, config, prompt: str = "") -> None:
        """What the model cannot take, one line each; `prompt`: one that names media (`<image>`, `<video>`) comes
        with them."""
        if marker := next((m for m in MEDIA_MARKERS if m in prompt), None):
            if not (self.images or self.video or self.frames or self.audio):
                given = "--video, --frames or --audio" if config.is_video else "--image"
                raise InputError(
                    "--prompt",
                    f"names {marker} but no media was given: pass it with {given} (or drop {marker} to ask about "
                    "the text alone)",
                )
        if config.is_video and self.images:
            raise InputError(self.images[0], "is an image, but the model is a video model: pass --video or --frames")
        given = self.video or self.frames or self.audio
        if not config.is_video and given:
            raise InputError(given, "is video or audio, but the model is an image model: pass --image")
        if self.video and self.frames:
            raise InputError(self.frames, "and --video both give frames: pass one")
        if config.is_anyres and len(self.images) > 1:
            raise InputError(self.images[1], "is a second image: an anyres model takes one image a prompt")


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


def decode_media(media: Media, folder: Path, config) -> DecodedMedia:
    """Every file read and decoded before any model work, so that a bad one is the first and only message; video
    frames resized to the tower's square as they are decoded (`frame_square`)."""
    square = frame_square(folder, config) if media.video or media.frames else None
    frames = samples = None
    if media.video:  # with its own sound track (when it has one) unless an audio file is given
        frames, samples = load_video(media.video, square=square, sound=not media.audio)
    elif media.frames:
        frames = load_frame_folder(media.frames, square)
    if media.audio:
        samples = load_audio(media.audio)
    duration = media_duration(media.video) if media.video else None
    return DecodedMedia([open_image(p) for p in media.images], frames, samples, duration)


def encode_media(model, folder: Path, media: DecodedMedia, seconds: dict[str, float]) -> dict:
    """The context streams' K/V and masks for `model.generate`: pictures (the model prepares them as the released
    code does), or a video model's frames and audio."""
    streams, config = {}, model.config
    if media.images:
        what = "the image's thumbnail and tiles" if config.is_anyres else f"{len(media.images)} image(s)"
        with stage(f"encode {what}: visual K/V for every layer", seconds):
            processor = load_image_processor(folder, config)
            streams["context_key_values"], streams["context_mask"] = model.model.encode_pictures(
                media.images, processor
            )
    pixels, audio = video_inputs(folder, config, media)
    if pixels is not None:
        with stage(f"encode {len(pixels)} frame(s): visual K/V for every layer", seconds):
            streams["context_key_values"], streams["context_mask"] = model.model.encode_video([pixels])
    if audio is not None:
        with stage(f"encode {len(media.samples) / AUDIO_RATE:.1f} s of audio: audio K/V for every layer", seconds):
            streams["audio_key_values"], streams["audio_mask"] = model.model.encode_audio([audio[0]], [audio[1]])
    return streams


def video_inputs(folder: Path, config, media: DecodedMedia) -> tuple[PreparedFrames | None, tuple | None]:
    """A video model's tower inputs: frames (F, 3, H, W), prepared as pictures are a part at a time as the tower
    reads them, and audio (log-mel 30 s chunks, its length in mel frames), each None when absent."""
    pixels = audio = None
    if media.frames:
        pixels = PreparedFrames(media.frames, config.mm_image_aspect_ratio, load_image_processor(folder, config))
    if media.samples is not None:
        audio = audio_features(media.samples, load_audio_processor(folder, config))
    return pixels, audio


def graph_context(graphs, folder: Path, config, media: DecodedMedia) -> tuple[list[np.ndarray], np.ndarray]:
    """The context our graphs compute for decoded media (`GraphRuntime`'s caches and mask): a video model's
    frames and audio, an anyres image, images (each prepared as the released code prepares it), or none."""
    if config.is_video:
        pixels, audio = video_inputs(folder, config, media)
        return graphs.encode_video(pixels, None if audio is None else (audio[0].numpy(), audio[1]))
    if not media.images:
        return graphs.no_context(1)
    processor = load_image_processor(folder, config)
    if config.is_anyres:
        tiles, (columns, rows) = anyres_tiles(media.images[0], processor, config.mm_image_grid_points)
        return graphs.encode_anyres(tiles.numpy(), columns, rows)
    return graphs.encode_images(prepare_pictures(media.images, config.mm_image_aspect_ratio, processor)[None].numpy())
