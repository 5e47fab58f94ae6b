"""`convert`: any training output -> a clean Hugging Face model folder with a manifest.

Tensors stream one at a time from the source (read with pread) into sharded safetensors written in a
temporary folder beside OUT, which is renamed into place only when everything, manifest included, is done.
"""

from __future__ import annotations

import datetime
import json
import re
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import __version__
from ..artifacts import (
    ConvertManifest,
    ConvertModel,
    ConvertSource,
    FileEntry,
    TensorEntry,
    Tool,
    atomic_dir,
    check_output,
    copy_remote_code,
    dtype_name,
    sha256_file,
)
from ..checkpoints.names import parameter_counts
from ..checkpoints.plan import plan_tensors
from ..checkpoints.safetensors_writer import (
    PlannedTensor,
    RangeCopier,
    WrittenFile,
    plan_shards,
    shard_names,
    write_shards,
)
from ..checkpoints.source import Source, open_source, tied_names
from ..errors import InputError
from ..modeling.modeling_dattn import MODEL_CLASSES
from ..processing import PROCESSOR_CLASS, save_processor_files
from ..ui import quiet

SIZE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
}


def parse_size(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).upper() not in SIZE_UNITS:
        raise InputError("--max-shard-size", f"{text!r} is not a size like 5GB, 500MB or 2GiB")
    size = int(float(match.group(1)) * SIZE_UNITS[match.group(2).upper()])
    if size < 1:
        raise InputError("--max-shard-size", f"{text!r}: a shard holds at least one byte")
    return size


def untie(source: Source) -> list[str]:
    """Tied tensors are stored once: drop the copies, after checking they really are equal."""
    dropped = []
    for name, target in MODEL_CLASSES[source.config.model_type]._tied_weights_keys.items():
        if name in tied_names(source.config) and name in source.tensors:
            copy, original = source.tensors[name], source.tensors[target]
            if copy != original and not torch.equal(copy.load(), original.load()):
                raise InputError(
                    copy.file,
                    f"tensor {source.stored_names[name]} differs from {target}, but config.json "
                    "ties them (tie_word_embeddings=true)",
                )
            dropped.append(name)
    return dropped


def output_config(source: Source, dtype: torch.dtype) -> dict:
    """config.json normalised: model_type, dtype, the full vision_config, architectures and auto_map."""
    config = source.config
    model_class = MODEL_CLASSES[config.model_type]
    fields = config.to_dict()
    fields.update(
        architectures=[model_class.__name__],
        auto_map={
            "AutoConfig": f"configuration_dattn.{config.__class__.__name__}",
            "AutoModelForCausalLM": f"modeling_dattn.{model_class.__name__}",
            "AutoModelForImageTextToText": f"modeling_dattn.{model_class.__name__}",
            "AutoProcessor": PROCESSOR_CLASS,
        },
        dtype=dtype_name(dtype),
        torch_dtype=dtype_name(dtype),  # the key transformers 4.x reads
    )
    return fields


@dataclass
class ConvertResult:
    source: Source
    out: Path
    dtype: torch.dtype
    files: dict[str, WrittenFile]
    manifest: ConvertManifest
    tensor_count: int
    weight_bytes: int
    dropped: list[str]
    seconds: float  # the whole conversion
    writing_seconds: float  # of it, writing the tensors (the rate the progress line shows)
    copy: str  # how tensors stored as they are were copied (the kernel's copy, or reads and writes)


def convert(
    checkpoint: Path,
    out: Path,
    dtype: str = "auto",
    max_shard_size: str = "5GB",
    force: bool = False,
    base: Path | None = None,
    vision_heads: int | None = None,
    progress=quiet,
) -> ConvertResult:
    """`progress`: `ui.progress` to show the bytes written (the CLI's), or `ui.quiet`."""
    start = time.perf_counter()
    max_bytes = parse_size(max_shard_size)
    source = open_source(checkpoint, base, vision_heads)
    check_output(out, force, source.inputs())
    source.raise_first_problem()
    source.carried()
    target = source.output_dtype(dtype)
    dropped = untie(source)
    kept = {name: lazy for name, lazy in source.tensors.items() if name not in dropped}
    planned = plan_tensors(kept, source.stored_names, target)
    weight_bytes = sum(t.nbytes for t in planned)
    shards = plan_shards(planned, max_bytes)
    copier = RangeCopier()
    with atomic_dir(out, overwrite=force, reading=source.inputs(), needed=weight_bytes) as tmp:
        with progress("writing tensors", weight_bytes) as advance:
            writing = time.perf_counter()
            files = write_shards(shards, tmp, on_written=lambda t: advance(t.nbytes, t.name), copier=copier)
            writing = time.perf_counter() - writing
        (tmp / "config.json").write_text(json.dumps(output_config(source, target), indent=2, sort_keys=True) + "\n")
        source.carry_files(tmp)
        save_processor_files(tmp, source.reader.config_dir, source.config)
        copy_remote_code(tmp)
        for path in sorted(tmp.iterdir()):
            if path.name not in files:
                files[path.name] = WrittenFile(path.stat().st_size, sha256_file(path))
        manifest = build_manifest(source, target, files, shards)
        manifest.write(tmp)
    return ConvertResult(
        source,
        Path(out),
        target,
        files,
        manifest,
        len(planned),
        weight_bytes,
        dropped,
        time.perf_counter() - start,
        writing,
        copier.method if any(t.copy_from for t in planned) else "none (every tensor was cast)",
    )


def build_manifest(
    source: Source, dtype: torch.dtype, files: dict[str, WrittenFile], shards: list[list[PlannedTensor]]
) -> ConvertManifest:
    planned = [t for shard in shards for t in shard]
    shard_of = {t.name: file for file, shard in zip(shard_names(len(shards)), shards) for t in shard}
    return ConvertManifest(
        format="dattn-export-manifest/1",
        tool=Tool("dattn-export", __version__),
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        source=ConvertSource(
            str(Path(source.reader.path).absolute()), source.reader.layout, source.reader.notes, source.vision_origin
        ),
        model=ConvertModel(
            source.config.model_type, source.config.dattn_mode, parameter_counts({t.name: t.shape for t in planned})
        ),
        dtype=dtype_name(dtype),
        files={name: FileEntry(f.size, f.sha256) for name, f in sorted(files.items())},
        tensors={
            t.name: TensorEntry(
                dtype_name(t.dtype),
                list(t.shape),
                shard_of[t.name],
                source.stored_names[t.name],
                dtype_name(source.tensors[t.name].dtype),
            )
            for t in planned
        },
    )
