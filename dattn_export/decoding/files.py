"""Pictures and folders of frames as the released code opens them (RGB); video and audio files are read by the code
a Hub repo ships (`modeling/video_decoding.py`, `modeling/sound_decoding.py`)."""

from __future__ import annotations

from pathlib import Path

from PIL import Image

from ..errors import InputError
from ..folders import MEDIA_SUFFIXES
from ..modeling.media_files import tower_square
from ..sidefiles import reading

IMAGE_SUFFIXES = MEDIA_SUFFIXES["--image"]


def open_image(path: Path) -> Image.Image:
    """An image file as RGB (the released code's `.convert('RGB')`); a picture over Pillow's decompression-bomb
    limit (about 179 Mpixels) is refused before it is decoded."""
    with reading(path, "image"):
        with Image.open(path) as image:
            return image.convert("RGB")


def load_frame_folder(folder: Path, square: int | None = None) -> list[Image.Image]:
    """A folder of frame images, in file-name order; with `square`, each resized to it as it is read."""
    files = sorted(f for f in Path(folder).iterdir() if f.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise InputError(folder, f"holds no frame images ({', '.join(sorted(IMAGE_SUFFIXES))})")
    return [open_image(f) if square is None else tower_square(open_image(f), square) for f in files]
