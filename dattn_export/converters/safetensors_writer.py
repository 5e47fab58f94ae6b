"""Hugging Face sharded safetensors: `model-0000k-of-0000n.safetensors` + `model.safetensors.index.json`."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

INDEX_NAME = "model.safetensors.index.json"


def plan_shards(sizes: list[tuple[str, int]], max_shard_bytes: int) -> list[list[str]]:
    """Group tensors in order into shards of at most `max_shard_bytes` (a larger tensor gets its own)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, nbytes in sizes:
        if shards[-1] and used + nbytes > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += nbytes
    return shards


def write_shards(
    shards: list[list[str]], load: Callable[[str], torch.Tensor], out_dir: Path, metadata: dict | None = None
) -> dict:
    """Write each shard (loading its tensors only then) and the index; returns the index."""
    out_dir = Path(out_dir)
    weight_map, total = {}, 0
    single = len(shards) == 1
    for k, names in enumerate(shards, start=1):
        file = "model.safetensors" if single else f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        tensors = {name: load(name).contiguous() for name in names}
        save_file(tensors, out_dir / file, metadata={"format": "pt", **(metadata or {})})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update(dict.fromkeys(names, file))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    if not single:
        (out_dir / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return index
