"""Hugging Face `save_pretrained` / Trainer `save_model` output: safetensors or .bin, sharded or single."""

from __future__ import annotations

import json
import pickle
import zipfile
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..errors import InputError
from .registry import CheckpointReader, register


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(path, f"not readable JSON ({e})") from None


class ShardedReader(CheckpointReader):
    """A folder with `<stem>.<ext>` or `<stem>-0000k-of-0000n.<ext>` + `<stem>.<ext>.index.json`."""

    single_name: str
    index_name: str

    @classmethod
    def detect(cls, path: Path) -> bool:
        return path.is_dir() and ((path / cls.index_name).is_file() or (path / cls.single_name).is_file())

    def __init__(self, path: Path):
        super().__init__(path)
        index_path = path / self.index_name
        if index_path.is_file():
            weight_map = read_json(index_path).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise InputError(index_path, "has no 'weight_map'")
            shards = sorted(set(weight_map.values()))
            for shard in shards:
                if not (path / shard).is_file():
                    raise InputError(index_path, f"references missing shard {shard}")
        else:
            shards = [self.single_name]
        self._files: dict[str, Path] = {}
        self._shards = {shard: self.open_shard(path / shard) for shard in shards}
        for shard, names in self._shards.items():
            for name in names:
                if name in self._files:
                    raise InputError(path / shard, f"tensor {name} is also stored in {self._files[name].name}")
                self._files[name] = path / shard
        if index_path.is_file():
            for name, shard in weight_map.items():
                if self._files.get(name) != path / shard:
                    raise InputError(index_path, f"maps {name} to {shard}, which does not hold it")

    def open_shard(self, file: Path) -> dict:
        raise NotImplementedError

    def names(self) -> list[str]:
        return list(self._files)

    def file_of(self, name: str) -> Path:
        return self._files[name]


@register
class SafetensorsReader(ShardedReader):
    layout = "hf-safetensors"
    description = "model.safetensors or model-*-of-*.safetensors + model.safetensors.index.json"
    single_name = "model.safetensors"
    index_name = "model.safetensors.index.json"

    def open_shard(self, file: Path) -> dict:
        try:
            handle = safe_open(file, framework="pt")
            return {name: handle for name in handle.keys()}
        except (SafetensorError, OSError) as e:
            raise InputError(file, f"not a readable safetensors file ({e})") from None

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def load(self, name: str) -> torch.Tensor:
        try:
            return self._handle(name).get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise InputError(self.file_of(name), f"cannot read tensor {name} ({e})") from None

    def _handle(self, name: str):
        return self._shards[self.file_of(name).name][name]


@register
class TorchBinReader(ShardedReader):
    layout = "hf-bin"
    description = "pytorch_model.bin or pytorch_model-*-of-*.bin + pytorch_model.bin.index.json"
    single_name = "pytorch_model.bin"
    index_name = "pytorch_model.bin.index.json"

    def open_shard(self, file: Path) -> dict:
        state = load_torch_file(file)
        if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
            raise InputError(file, "is not a state dict of tensors")
        return state

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._shards[self.file_of(name).name][name].shape)

    def load(self, name: str) -> torch.Tensor:
        return self._shards[self.file_of(name).name][name]


def load_torch_file(file: Path):
    """torch.load that never runs pickled code (weights_only); memory-mapped when the file is a zip archive
    (torch.save's format since 1.6; legacy files cannot be mapped)."""
    try:
        return torch.load(file, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(file))
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError) as e:
        raise InputError(file, f"refused or unreadable PyTorch pickle ({str(e).strip().splitlines()[0]})") from None
