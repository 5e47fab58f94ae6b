"""Media files opened as the released decoders open them: a file or its bytes in memory (a served request's), its
duration as ffprobe gives it, pictures as RGB, folders of frames, and a frame resized to the tower's square."""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

import av
from PIL import Image

from ..errors import InputError
from ..folders import MEDIA_SUFFIXES
from ..sidefiles import reading

IMAGE_SUFFIXES = MEDIA_SUFFIXES["--image"]


@dataclass(frozen=True, repr=False)
class FileBytes:
    """A media file's bytes in memory (a served request's video), named in errors by `name`: each reader opens them
    anew, so that they decode in pieces as the file on disk would."""

    data: bytes
    name: str = "<bytes>"

    def __str__(self) -> str:
        return self.name

    __repr__ = __str__


def open_media(path: Path | FileBytes):
    """A media file, or its bytes."""
    try:
        return av.open(io.BytesIO(path.data) if isinstance(path, FileBytes) else str(path))
    except (av.FFmpegError, OSError) as e:
        raise InputError(path, f"cannot be decoded ({str(e).strip()})") from None


def media_duration(path: Path | FileBytes) -> float:
    """A media file's duration in seconds as ffprobe's `format=duration` gives it (the container's)."""
    with open_media(path) as container:
        if container.duration is None:
            raise InputError(path, "states no duration")
        return container.duration / av.time_base


def open_image(path: Path) -> Image.Image:
    """An image file as RGB (the released code's `.convert('RGB')`); a picture over Pillow's decompression-bomb
    limit (about 179 Mpixels) is refused before it is decoded."""
    with reading(path, "image"):
        with Image.open(path) as image:
            return image.convert("RGB")


def tower_square(frame: Image.Image, size: int) -> Image.Image:
    """A frame resized to the tower's square (bicubic: the released `resize` preparation, which video models use); a
    frame already that size is left as it is (Pillow copies it)."""
    return frame.resize((size, size), resample=Image.BICUBIC)


def load_frame_folder(folder: Path, square: int | None = None) -> list[Image.Image]:
    """A folder of frame images, in file-name order; with `square`, each resized to it as it is read."""
    files = sorted(f for f in Path(folder).iterdir() if f.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise InputError(folder, f"holds no frame images ({', '.join(sorted(IMAGE_SUFFIXES))})")
    return [open_image(f) if square is None else tower_square(open_image(f), square) for f in files]
