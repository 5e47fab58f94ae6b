"""One registry of checkpoint layouts: each reader says whether it recognises a path and opens it lazily."""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path

import torch

from ..errors import InputError

READERS: list[type[CheckpointReader]] = []


class CheckpointReader(ABC):
    """Lazy access to the tensors of one checkpoint; nothing is read before `load`."""

    layout: str  # short name shown to users
    description: str

    def __init__(self, path: Path):
        self.path = Path(path)

    @classmethod
    @abstractmethod
    def detect(cls, path: Path) -> bool:
        """Cheap check (file names, no tensor data) that `path` is in this layout."""

    @abstractmethod
    def names(self) -> list[str]:
        """Tensor names as stored."""

    @abstractmethod
    def file_of(self, name: str) -> Path:
        """The file that holds `name` (for error messages)."""

    @abstractmethod
    def shape(self, name: str) -> tuple[int, ...]: ...

    @abstractmethod
    def load(self, name: str) -> torch.Tensor: ...


def register(reader: type[CheckpointReader]) -> type[CheckpointReader]:
    READERS.append(reader)
    return reader


def open_checkpoint(path: str | Path) -> CheckpointReader:
    path = Path(path)
    if not path.exists():
        raise InputError(path, "does not exist")
    for reader in READERS:
        if reader.detect(path):
            return reader(path)
    known = "; ".join(f"{r.layout} ({r.description})" for r in READERS)
    raise InputError(path, f"no checkpoint layout recognised; known layouts: {known}")
