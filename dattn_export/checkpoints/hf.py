"""Hugging Face `save_pretrained` / Trainer `save_model` output: safetensors or .bin, sharded or single."""

from __future__ import annotations

from pathlib import Path

from ..errors import InputError
from ..folders import SHARDED_FILES
from ..sidefiles import read_json
from .lazy import LazyTensor, LoadedTensor, read_safetensors, read_torch_file
from .registry import CheckpointReader, register


def read_state_dict_file(file: Path) -> dict[str, LazyTensor | LoadedTensor]:
    state = read_torch_file(file)
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(t, (LazyTensor, LoadedTensor)) for t in state.values()):
        raise InputError(file, "is not a state dict of tensors")
    return state


class ShardedReader(CheckpointReader):
    """`<single_name>`, or shards listed by `<index_name>` (a `weight_map` from tensor to shard file)."""

    single_name: str
    index_name: str

    @staticmethod
    def read_shard(file: Path) -> dict[str, LazyTensor]:
        raise NotImplementedError

    def __init__(self, path: Path):
        super().__init__(path)
        index_path = path / self.index_name
        weight_map = None
        if index_path.is_file():
            weight_map = read_json(index_path, "safetensors/bin index").get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise InputError(index_path, "has no 'weight_map'")
            for name, shard in weight_map.items():
                if not isinstance(shard, str) or Path(shard).name != shard or shard in ("", ".", ".."):
                    raise InputError(index_path, f"maps {name} to {shard!r}, not the name of a file in this folder")
            shards = sorted(set(weight_map.values()))
            for shard in shards:
                if not (path / shard).is_file():
                    raise InputError(index_path, f"references missing shard {shard}")
        else:
            shards = [self.single_name]
        for shard in shards:
            for name, tensor in self.read_shard(path / shard).items():
                if name in self.tensors:
                    raise InputError(path / shard, f"tensor {name} is also stored in {self.tensors[name].file.name}")
                self.tensors[name] = tensor
        for name, shard in (weight_map or {}).items():
            if name not in self.tensors or self.tensors[name].file.name != shard:
                raise InputError(index_path, f"maps {name} to {shard}, which does not hold it")
        self.notes.append(f"{len(shards)} file(s): {shards[0]}{' ...' if len(shards) > 1 else ''}")


@register
class SafetensorsReader(ShardedReader):
    layout = "hf-safetensors"
    single_name, index_name = SHARDED_FILES[layout]
    read_shard = staticmethod(read_safetensors)


@register
class TorchBinReader(ShardedReader):
    layout = "hf-bin"
    single_name, index_name = SHARDED_FILES[layout]
    read_shard = staticmethod(read_state_dict_file)
