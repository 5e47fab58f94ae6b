"""The media a prompt comes with, as the command line gives them (`Media`: images, or a video model's video, frames
and audio), checked against the model before anything is decoded; light, so that the CLI refuses what a model cannot
take before torch is imported (`check_early`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

from .errors import InputError
from .modeling.marked_prompts import media_marker
from .modeling.streams import streams_of
from .prompts import Prompt
from .sidefiles import read_json

MEDIA_OPTIONS = {"images": "--image", "video": "--video", "frames": "--frames", "audio": "--audio"}  # Media's fields
MEDIA_KINDS = {"images": "an image", "video": "video or audio", "frames": "video or audio", "audio": "video or audio"}
MODEL_KINDS = {"image": "an image model", "video": "a video model"}  # by modality


@dataclass
class Media:
    """What a prompt comes with: images (an image model), or a video model's frames (a video file or a folder of
    frames) and audio (a file, else the video's own track when it has one)."""

    images: list[Path] = field(default_factory=list)
    video: Path | None = None
    frames: Path | None = None
    audio: Path | None = None

    @property
    def given(self) -> bool:
        return bool(self.images or self.video or self.frames or self.audio)

    def check(self, config, prompt: Prompt | None = None) -> None:
        """What the model cannot take, one line each; `prompt`: a finished one that names media (`<image>`,
        `<video>`) comes with them."""
        takes = [kind for kind in MEDIA_OPTIONS if any(kind in stream.media for stream in config.streams)]
        options = " or ".join(", ".join(MEDIA_OPTIONS[kind] for kind in takes).rsplit(", ", 1))
        if prompt is not None and prompt.kind == "raw" and (marker := media_marker(prompt.text)):
            if not self.given:
                raise InputError(
                    "--raw-prompt",
                    f"names {marker} but no media was given: pass it with {options} (or drop {marker} to ask about "
                    "the text alone)",
                )
        if given := next((kind for kind in MEDIA_OPTIONS if getattr(self, kind) and kind not in takes), None):
            path = self.images[0] if given == "images" else getattr(self, given)
            raise InputError(
                path, f"is {MEDIA_KINDS[given]}, but the model is {MODEL_KINDS[config.modality]}: pass {options}"
            )
        if self.video and self.frames:
            raise InputError(self.frames, "and --video both give frames: pass one")
        for stream in config.streams:
            if stream.pictures is not None and len(self.images) > stream.pictures:
                most = stream.pictures
                raise InputError(self.images[most], f"is image {most + 1}, but the model takes {most} a prompt")


def check_early(media: Media, folder: Path, prompts: list[Prompt]) -> None:
    """`Media.check` for each prompt against the folder's config.json as it is (its input type and picture rule),
    where the folder holds one: what the model cannot take is refused before the model's code is imported (the
    commands check again against the model's config)."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        return
    fields = read_json(path, "config.json")
    streams = streams_of(fields.get("mm_input_type", "image"), fields.get("mm_image_aspect_ratio", "resize"))
    config = SimpleNamespace(streams=streams, modality=streams[0].modality)
    for prompt in prompts or [None]:
        media.check(config, prompt)
