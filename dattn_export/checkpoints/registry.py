"""One registry of checkpoint readers, one per layout: the reader of the layout `folders.checkpoint_layout` tells from
a path's file names (before any heavy import) opens it.

A reader exposes every tensor lazily (nothing is read before `.load()`), under the names as stored, and
the folder that holds config.json and the tokenizer files.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import InputError, from_os_error
from ..folders import ADAPTER_NEEDS_BASE, checkpoint_layout
from .lazy import GatheredTensor, LazyTensor, LoadedTensor
from .names import canonical_name

READERS: dict[str, type[CheckpointReader]] = {}  # by layout name
Lazy = LazyTensor | GatheredTensor | LoadedTensor


class CheckpointReader:
    layout: str  # its name in folders.LAYOUTS, shown to users
    adapter_only = False  # holds only adapter weights: needs a base model

    def __init__(self, path: Path):
        self.path = Path(path)
        self.tensors: dict[str, Lazy] = {}
        self.config_dir = self.path
        self.notes: list[str] = []  # facts worth telling the user (what was read, from where)
        self.paths: list[Path] = [self.path]  # every checkpoint read (an overlay's and its base's)


def register(reader: type[CheckpointReader]) -> type[CheckpointReader]:
    READERS[reader.layout] = reader
    return reader


def detect_reader(path: Path) -> type[CheckpointReader]:
    try:
        os.stat(path)
    except OSError as e:  # missing, a symbolic link loop, a path through a file
        raise from_os_error(e, path) from None
    return READERS[checkpoint_layout(path).name]


def open_checkpoint(path: str | Path, base: str | Path | None = None) -> CheckpointReader:
    """Open `path` lazily. With `base`, the tensors of `path` replace those of the model at `base`."""
    path = Path(path)
    reader = detect_reader(path)(path)
    if base is not None:
        return OverlayReader(open_checkpoint(base), reader)
    if reader.adapter_only:
        raise InputError(path, ADAPTER_NEEDS_BASE)
    return reader


class OverlayReader(CheckpointReader):
    """A base model with some tensors replaced (LLaVA-style adapter-only saves). Names are canonical."""

    def __init__(self, base: CheckpointReader, overlay: CheckpointReader):
        super().__init__(overlay.path)
        self.tensors = {canonical_name(n): t for n, t in base.tensors.items()}
        replaced = [canonical_name(n) for n in overlay.tensors]
        self.tensors.update(zip(replaced, overlay.tensors.values()))
        self.config_dir = overlay.config_dir if (overlay.config_dir / "config.json").is_file() else base.config_dir
        self.layout = f"{overlay.layout} + base {base.layout}"
        self.paths = [*overlay.paths, *base.paths]
        self.notes = [*overlay.notes, f"{len(replaced)} tensor(s) over the base at {base.path}", *base.notes]
