"""`convert`: any training output -> a clean Hugging Face model folder with a manifest.

Tensors stream one at a time from the source (read with pread) into sharded safetensors written in a
temporary folder beside OUT, which is renamed into place only when everything, manifest included, is done.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.progress import Progress

from . import __version__
from .converters.lazy import GatheredTensor, LazyTensor, contiguous_stride
from .converters.registry import Lazy
from .converters.safetensors_writer import PlannedTensor, WrittenFile, plan_shards, shard_names, write_shards
from .errors import InputError
from .fileio import atomic_dir
from .loading import (
    Source,
    cast_scratch,
    check_values,
    checked_cast,
    needs_cast,
    open_source,
    tied_names,
)
from .modeling_dattn import MODEL_CLASSES
from .names import parameter_counts

MANIFEST_NAME = "dattn_manifest.json"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
CARRIED_FILES = (
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "merges.txt", "generation_config.json", "chat_template.json", "chat_template.jinja",
    "preprocessor_config.json", "processor_config.json",
)  # fmt: skip
REMOTE_CODE = ("configuration_dattn.py", "modeling_dattn.py", "attention.py")  # so OUT loads with trust_remote_code
SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def carry_files(source: Path, destination: Path, names=CARRIED_FILES) -> None:
    """Copy the tokenizer, processor and generation files that `source` has into `destination`."""
    for name in names:
        if (Path(source) / name).is_file():
            shutil.copyfile(Path(source) / name, Path(destination) / name)


def parse_size(text: str) -> int:
    match = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).upper() not in SIZE_UNITS:
        raise InputError("--max-shard-size", f"{text!r} is not a size like 5GB, 500MB or 2GiB")
    return int(float(match.group(1)) * SIZE_UNITS[match.group(2).upper()])


def output_dtype(requested: str, source: Source) -> torch.dtype:
    """auto: the dtype config.json declares (the training dtype); if none, the dtype most weights have."""
    if requested != "auto":
        return DTYPES[requested]
    declared = source.config.dtype  # config.json's torch_dtype (4.x) or dtype (5.x)
    if isinstance(declared, str):
        declared = getattr(torch, declared, None)
    if isinstance(declared, torch.dtype) and declared.is_floating_point:
        return declared
    sizes: dict[torch.dtype, int] = {}
    for t in source.tensors.values():
        if t.dtype.is_floating_point:
            sizes[t.dtype] = sizes.get(t.dtype, 0) + t.nbytes
    return max(sizes, key=sizes.get)


def lazy_is_contiguous(lazy: Lazy) -> bool:
    """Its bytes lie in one run of its file, in order: they can be copied as they are."""
    return isinstance(lazy, LazyTensor) and lazy.stride in (None, contiguous_stride(lazy.shape))


def checked_in_place(stored_name: str, lazy: LazyTensor) -> torch.Tensor:
    """A tensor the output stores as it is: checked where it lies in its file (mapped, never copied to memory)."""
    tensor = lazy.mapped()
    check_values(stored_name, lazy.file, tensor, lazy.dtype)
    return tensor


def checked_cast_mapped(stored_name: str, lazy: LazyTensor | GatheredTensor, dtype: torch.dtype, out: torch.Tensor):
    """A tensor that needs a cast: checked and cast piece by piece from where it lies (mapped) into `out`."""
    cast = out[: lazy.numel * dtype.itemsize].view(dtype)
    start = 0
    for piece in lazy.mapped_pieces():
        check_values(stored_name, lazy.file, piece, dtype)
        cast[start : start + piece.numel()].copy_(piece)
        start += piece.numel()
    return cast.view(lazy.shape)


def untie(source: Source) -> list[str]:
    """Tied tensors are stored once: drop the copies, after checking they really are equal."""
    dropped = []
    for name, target in MODEL_CLASSES[source.config.model_type]._tied_weights_keys.items():
        if name in tied_names(source.config) and name in source.tensors:
            copy, original = source.tensors[name], source.tensors[target]
            if copy != original and not torch.equal(copy.load(), original.load()):
                raise InputError(copy.file, f"tensor {source.stored_names[name]} differs from {target}, but config.json "
                                            "ties them (tie_word_embeddings=true)")  # fmt: skip
            dropped.append(name)
    return dropped


def output_config(source: Source, dtype: torch.dtype) -> dict:
    """config.json normalised: model_type, dtype, the full vision_config, architectures and auto_map."""
    config = source.config
    model_class = MODEL_CLASSES[config.model_type]
    fields = config.to_dict()
    fields.update(
        architectures=[model_class.__name__],
        auto_map={"AutoConfig": f"configuration_dattn.{config.__class__.__name__}",
                  "AutoModelForCausalLM": f"modeling_dattn.{model_class.__name__}"},
        dtype=str(dtype).removeprefix("torch."),
        torch_dtype=str(dtype).removeprefix("torch."),  # the key transformers 4.x reads
    )  # fmt: skip
    return fields


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass
class ConvertResult:
    source: Source
    out: Path
    dtype: torch.dtype
    files: dict[str, WrittenFile]
    tensor_count: int
    weight_bytes: int
    dropped: list[str]
    seconds: float


def convert(
    checkpoint: Path, out: Path, dtype: str = "auto", max_shard_size: str = "5GB", force: bool = False,
    base: Path | None = None, vision_heads: int | None = None, progress=None,
) -> ConvertResult:  # fmt: skip
    start = time.perf_counter()
    max_bytes = parse_size(max_shard_size)
    source = open_source(checkpoint, base, vision_heads)
    source.raise_first_problem()
    target = output_dtype(dtype, source)
    dropped = untie(source)
    order = [n for n in source.tensors if n not in dropped]
    mappable = lambda t: t.nbytes and (isinstance(t, GatheredTensor) or lazy_is_contiguous(t))  # noqa: E731
    scratch = cast_scratch([source.tensors[n] for n in order if not mappable(source.tensors[n])], target)  # producer's
    planned = []
    for name in order:
        lazy, stored_name = source.tensors[name], source.stored_names[name]
        casting = needs_cast(lazy, target)
        out_dtype = target if casting else lazy.dtype
        if not casting and lazy_is_contiguous(lazy) and lazy.nbytes:  # the bytes as they are
            produce, copy_from = lambda _, n=stored_name, t=lazy: checked_in_place(n, t), (lazy.file, lazy.offset)
        elif casting and mappable(lazy):
            produce, copy_from = lambda out, n=stored_name, t=lazy, d=out_dtype: checked_cast_mapped(n, t, d, out), None
        else:
            produce, copy_from = lambda out, n=stored_name, t=lazy, d=out_dtype: checked_cast(n, t, d, out, scratch), None
        planned.append(PlannedTensor(name, out_dtype, tuple(lazy.shape), produce, copy_from))
    weight_bytes = sum(t.nbytes for t in planned)
    shards = plan_shards(planned, max_bytes)
    with atomic_dir(out, overwrite=force) as tmp:
        with progress or Progress(disable=True) as bar:
            task = bar.add_task("writing tensors", total=weight_bytes)
            files = write_shards(shards, tmp, on_written=lambda t: bar.update(task, advance=t.nbytes, description=t.name))
        (tmp / "config.json").write_text(json.dumps(output_config(source, target), indent=2, sort_keys=True) + "\n")
        carry_files(source.reader.config_dir, tmp)
        for name in REMOTE_CODE:
            shutil.copyfile(Path(__file__).parent / name, tmp / name)
        for path in sorted(tmp.iterdir()):
            if path.name not in files:
                files[path.name] = WrittenFile(path.stat().st_size, sha256_file(path))
        manifest = build_manifest(source, target, files, shards)
        (tmp / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")
    return ConvertResult(source, Path(out), target, files, len(planned), weight_bytes, dropped, time.perf_counter() - start)


def build_manifest(
    source: Source, dtype: torch.dtype, files: dict[str, WrittenFile], shards: list[list[PlannedTensor]]
) -> dict:
    planned = [t for shard in shards for t in shard]
    shard_of = {t.name: file for file, shard in zip(shard_names(len(shards)), shards) for t in shard}
    return {
        "format": "dattn-export-manifest/1",
        "tool": {"name": "dattn-export", "version": __version__},
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "source": {
            "path": str(Path(source.reader.path).absolute()),
            "layout": source.reader.layout,
            "notes": source.reader.notes,
            "vision_config": source.vision_origin,
        },
        "model": {
            "model_type": source.config.model_type,
            "dattn_mode": source.config.dattn_mode,
            "parameters": parameter_counts({t.name: t.shape for t in planned}),
        },
        "dtype": str(dtype).removeprefix("torch."),
        "files": {name: {"size": f.size, "sha256": f.sha256} for name, f in sorted(files.items())},
        "tensors": {
            t.name: {
                "dtype": str(t.dtype).removeprefix("torch."),
                "shape": list(t.shape),
                "file": shard_of[t.name],
                "source_name": source.stored_names[t.name],
                "source_dtype": str(source.tensors[t.name].dtype).removeprefix("torch."),
            }
            for t in planned
        },
    }
