"""LLaVA-style adapter-only saves (`mm_projector.bin`): the stage-1 adapter, combined with a base model."""

from __future__ import annotations

from pathlib import Path

from ..folders import ADAPTER_FILE
from .hf import read_state_dict_file
from .registry import CheckpointReader, register


@register
class AdapterReader(CheckpointReader):
    layout = "adapter-only"
    adapter_only = True

    def __init__(self, path: Path):
        super().__init__(path)
        file = path / ADAPTER_FILE if path.is_dir() else path
        self.config_dir = file.parent
        self.tensors = read_state_dict_file(file)
        self.notes.append(f"{len(self.tensors)} adapter tensor(s) in {file.name}")
