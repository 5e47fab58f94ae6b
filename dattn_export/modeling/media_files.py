"""Media files opened as the released decoders open them: a file or its bytes in memory (a served request's, a URL's),
its duration as ffprobe gives it, and a frame resized to the tower's square. Ships with the model (the processor
decodes videos with `video_decoding.py`); a repo asked about pictures alone needs no PyAV."""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

from PIL import Image

try:  # PyAV reads video and audio files: a repo asked about pictures alone does without it (`import_av` says so)
    import av
except ImportError:
    av = None

PYAV_MISSING = "reading video and audio files needs PyAV, the decoder transformers uses: pip install av"


class MediaError(ValueError):
    """A media file that cannot be read as the model needs it: `path: problem` (dattn-export's CLI prints it as one
    line, an input error)."""

    def __init__(self, path, problem: str):
        self.path, self.problem = str(path), problem
        super().__init__(f"{self.path}: {problem}")


@dataclass(frozen=True, repr=False)
class FileBytes:
    """A media file's bytes in memory (a served request's video), named in errors by `name`: each reader opens them
    anew, so that they decode in pieces as the file on disk would."""

    data: bytes
    name: str = "<bytes>"

    def __str__(self) -> str:
        return self.name

    __repr__ = __str__


def import_av():
    """PyAV, or an ImportError naming it."""
    if av is None:
        raise ImportError(PYAV_MISSING)
    return av


def open_media(path: Path | FileBytes):
    """A media file, or its bytes."""
    av = import_av()
    try:
        return av.open(io.BytesIO(path.data) if isinstance(path, FileBytes) else str(path))
    except (av.FFmpegError, OSError) as e:
        raise MediaError(path, f"cannot be decoded ({str(e).strip()})") from None


def media_duration(path: Path | FileBytes) -> float:
    """A media file's duration in seconds as ffprobe's `format=duration` gives it (the container's)."""
    av = import_av()
    with open_media(path) as container:
        if container.duration is None:
            raise MediaError(path, "states no duration")
        return container.duration / av.time_base


def resized_to_tower(frame: Image.Image, size: int) -> Image.Image:
    """A frame resized to the tower's square (bicubic: the released `resize` preparation, which video models use); a
    frame already that size is left as it is (Pillow copies it)."""
    return frame.resize((size, size), resample=Image.BICUBIC)
