"""`quantize`: a converted folder's decoder layers quantized in compressed-tensors' format, the one vLLM serves (its
compressed_tensors schemes: CUTLASS and Marlin kernels on GPUs; int8 W8A8 and 4-bit W4A16 on CPUs) and transformers
loads (its CompressedTensorsHfQuantizer), with config.json's `quantization_config` saying how.

  w8a8   int8 weights, a scale per output channel; activations quantized per token as they come (dynamic)
  w4a16  4-bit weights in groups along the input (128, or --group-size), a scale per group; 16-bit activations
  fp8    float8 (e4m3) weights, a scale per output channel; activations per token, dynamic: GPUs with FP8 only

Each matrix is quantized by compressed-tensors itself (its preset scheme, `calculate_qparams` on the matrix's own
range per channel or group, its compressor's rounding and packing): round to nearest, as llm-compressor's
`QuantizationModifier` does without calibration data (none of these schemes needs any; GPTQ or AutoRound, which do,
are left to those tools). What is quantized, per family alike (`IGNORE`, written in the config): the decoder layers'
attention and MLP projections, over 95% of the weights and all of a decode step's reads. What stays in 16 bits: the
towers and adapters (run once per picture or part of a video), the embeddings and the head (their rows are read one
at a time, or decide every token), and the WINGS learners.

Streamed as `convert` writes: one matrix in memory at a time, read from where it lies and quantized as it is written;
the manifest records the scheme and each quantized matrix's source tensor, and `verify` holds every one to it within
the scheme's rounding (`weight_check.py`'s table of bounds)."""

from __future__ import annotations

import functools
import json
import threading
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import NamedTuple

import torch

from .. import __version__
from ..artifacts import (
    ConvertManifest,
    FileEntry,
    QuantizationRecord,
    TensorEntry,
    Tool,
    atomic_dir,
    carried_files,
    copy_remote_code,
    dtype_name,
    named_dtype,
    sha256_file,
)
from ..checkpoints.plan import checked_cast, plan_tensors
from ..checkpoints.safetensors_writer import (
    PlannedTensor,
    RangeCopier,
    WrittenFile,
    plan_shards,
    shard_names,
    write_shards,
)
from ..checkpoints.source import open_source
from ..errors import InputError
from ..modeling.modeling_dattn import MODEL_CLASSES
from ..ui import quiet


class CompressedScheme(NamedTuple):
    preset: str  # compressed-tensors' preset
    format: str  # its storage format
    gate: str  # the accuracy gate's row it is held to when served (accuracy_gate.GATES, measured there)


COMPRESSED_SCHEMES = {
    "w8a8": CompressedScheme("W8A8", "int-quantized", "int8"),
    "w4a16": CompressedScheme("W4A16", "pack-quantized", "w4a16"),
    "fp8": CompressedScheme("FP8_DYNAMIC", "float-quantized", "int8"),
}
# the Linear modules that stay in 16 bits, as both engines read config.json's `ignore` (a name, or `re:` a pattern):
# every other Linear module's weight is quantized (`quantized_matrices`)
IGNORE = ["lm_head", "re:.*mm_vis.*", "re:.*mm_aud.*", "re:.*mm_rand.*", "re:.*wings.*"]
SHARD_BYTES = 5 * 10**9  # as `convert` shards by default
MEMO = 4  # quantized matrices kept for their other tensors (a matrix's are written one after another)


def quantized_matrices(config) -> set[str]:
    """The weights a scheme quantizes: those of every Linear module `IGNORE` leaves, matched by compressed-tensors as
    llm-compressor and vLLM match them, on the model's modules (built on the meta device: no memory, any size)."""
    from compressed_tensors.utils.match import match_named_modules

    with torch.device("meta"):
        model = MODEL_CLASSES[config.model_type](config)
    return {f"{name}.weight" for name, _ in match_named_modules(model, ["Linear"], IGNORE)}


def scheme_of(name: str, group_size: int | None = None):
    """compressed-tensors' scheme object for `name` (COMPRESSED_SCHEMES), for every Linear module not ignored."""
    from compressed_tensors.quantization import preset_name_to_scheme

    scheme = preset_name_to_scheme(COMPRESSED_SCHEMES[name].preset, ["Linear"])
    if group_size is not None:
        if scheme.weights.group_size is None:
            raise InputError("--group-size", f"{name} has a scale per channel, not per group")
        scheme.weights.group_size = group_size
    return scheme


def quantization_config(name: str, group_size: int | None = None) -> dict:
    """config.json's quantization_config (compressed-tensors' own serialization)."""
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus

    return QuantizationConfig(
        config_groups={"group_0": scheme_of(name, group_size)},
        format=COMPRESSED_SCHEMES[name].format,
        ignore=IGNORE,
        quantization_status=QuantizationStatus.COMPRESSED,
    ).to_dict()


class MatrixQuantizer:
    """One scheme's quantization of a matrix into its stored tensors (`weight`, `weight_scale`; 4-bit:
    `weight_packed`, `weight_scale`, `weight_shape`), in the folder's dtype for the scales. The last few results are
    kept: a matrix's tensors are written one after another."""

    def __init__(self, scheme, compression_format: str):
        from compressed_tensors.compressors import BaseCompressor

        self.scheme, self.compressor = scheme, BaseCompressor.load_from_registry(compression_format)
        self.names = self.compressor.compression_param_names(scheme)
        self.done: dict[str, dict[str, torch.Tensor]] = {}
        self.lock = threading.Lock()

    def scales(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The scale and zero point of each output channel or group, from its own range."""
        from compressed_tensors.quantization.utils import calculate_qparams

        group = self.scheme.weights.group_size
        grouped = weight if group is None else weight.unflatten(1, (-1, group))
        low, high = grouped.amin(-1), grouped.amax(-1)
        if group is None:
            low, high = low[:, None], high[:, None]
        return calculate_qparams(low, high, self.scheme.weights)

    def quantize(self, name: str, weight: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        with self.lock:
            if name in self.done:
                return self.done[name]
        scale, zero_point = self.scales(weight.float())
        # stored in the folder's dtype (as llm-compressor stores it), rounded up so that no element lands past the
        # grid's end, and quantized with as stored
        scale = (scale * (1 + torch.finfo(dtype).eps)).to(dtype)
        state = {"weight": weight.float(), "weight_scale": scale.float(), "weight_zero_point": zero_point}
        stored = self.compressor.compress(state, self.scheme)
        stored["weight_scale"] = scale
        stored = {part: tensor.contiguous() for part, tensor in stored.items() if part in self.names}
        with self.lock:
            self.done[name] = stored
            while len(self.done) > MEMO:
                self.done.pop(next(iter(self.done)))
        return stored

    @functools.cache  # noqa: B019 (one quantizer a run; the layers' matrices share a few shapes)
    def shapes(self, shape: tuple[int, int], dtype: torch.dtype) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """Each stored tensor's dtype and shape for a (rows, columns) matrix: the writer plans them ahead."""
        probe = self.compressor.compress(
            {"weight": torch.zeros(shape), "weight_scale": torch.ones(self.scales(torch.zeros(shape))[0].shape)},
            self.scheme,
        )
        return {part: (dtype if part == "weight_scale" else t.dtype, tuple(t.shape)) for part, t in probe.items()
                if part in self.names}  # fmt: skip


GROUP_SIZES = (128, 64, 32, 16)  # what --group-size offers where the default does not divide a layer: vLLM's kernels'


def check_quantizable(source, scheme, matrices: set[str]) -> None:
    """The folder can be quantized so: a converted one (its manifest), not quantized already, its matrices a whole
    number of groups."""
    if getattr(source.config, "quantization_config", None):
        raise InputError(source.reader.path, "is quantized already: quantize its unquantized folder")
    group = scheme.weights.group_size
    features = {name: source.tensors[name].shape[1] for name in matrices}
    if group and (name := next((n for n, count in features.items() if count % group), None)):
        fits = next((size for size in GROUP_SIZES if size < group and all(c % size == 0 for c in features.values())), 0)
        way_out = f"pass --group-size {fits}, the largest" if fits else "no group size of"
        raise InputError(
            source.reader.path,
            f"{name} has {features[name]} input features, not a whole number of groups of {group}: {way_out} of "
            f"{', '.join(map(str, GROUP_SIZES))} that divides every quantized layer's input features (one group "
            "size serves the whole folder: compressed-tensors' config holds one scheme, and vLLM's 4-bit kernels "
            "take whole groups)",
        )


@dataclass
class QuantizeResult:
    out: Path
    scheme: str
    format: str  # compressed-tensors'
    group_size: int | None
    matrices: int  # quantized
    kept: int  # tensors kept as they are
    source_bytes: int
    written_bytes: int
    seconds: float


def quantize(
    folder: Path, out: Path, scheme: str, group_size: int | None = None, force: bool = False, progress=quiet
) -> QuantizeResult:
    """`progress`: `ui.progress` to show the bytes written (the CLI's), or `ui.quiet`."""
    start = time.perf_counter()
    folder, out = Path(folder), Path(out)
    manifest = ConvertManifest.read(folder)
    source = open_source(folder)
    spec, compression = COMPRESSED_SCHEMES[scheme], scheme_of(scheme, group_size)
    quantized = quantized_matrices(source.config)
    check_quantizable(source, compression, quantized)
    quantizer = MatrixQuantizer(compression, spec.format)
    planned, matrices, kept = [], [], {}
    for name, lazy in source.tensors.items():
        if name not in quantized:
            kept[name] = lazy
            continue
        matrices.append(name)
        module, load = name.removesuffix("weight"), partial(checked_cast, name, lazy, lazy.dtype)
        for part, (dtype, shape) in quantizer.shapes(tuple(lazy.shape), lazy.dtype).items():
            produce = lambda _, n=name, ld=load, p=part, d=lazy.dtype: quantizer.quantize(n, ld(), d)[p]
            planned.append(PlannedTensor(module + part, dtype, shape, produce))
    planned += plan_tensors(kept, {name: name for name in kept}, named_dtype(manifest.dtype))  # as they are
    shards = plan_shards(planned, SHARD_BYTES)
    shard_of = {t.name: file for file, tensors in zip(shard_names(len(shards)), shards) for t in tensors}
    written_bytes = sum(t.nbytes for t in planned)
    with atomic_dir(out, overwrite=force, reading=[folder], needed=written_bytes) as tmp:
        with progress(f"quantizing {len(matrices)} matrices ({scheme})", written_bytes) as advance:
            files = write_shards(shards, tmp, lambda t: advance(t.nbytes, t.name), RangeCopier())
        config = json.loads((folder / "config.json").read_text())
        config["quantization_config"] = quantization_config(scheme, group_size)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        for path in carried_files(folder):
            (tmp / path.name).write_bytes(path.read_bytes())
        copy_remote_code(tmp)
        for path in sorted(tmp.iterdir()):
            if path.name not in files:
                files[path.name] = WrittenFile(path.stat().st_size, sha256_file(path))
        ConvertManifest(
            format=manifest.format,
            tool=Tool("dattn-export", __version__),
            created=manifest.created,
            source=manifest.source,
            model=manifest.model,
            dtype=manifest.dtype,
            files={name: FileEntry(f.size, f.sha256) for name, f in sorted(files.items())},
            tensors={
                name: TensorEntry(
                    dtype_name(t.dtype),
                    list(t.shape),
                    shard_of[name],
                    manifest.tensors[source_name(name, matrices)].source_name,
                    manifest.tensors[source_name(name, matrices)].source_dtype,
                )
                for name, t in ((t.name, t) for t in planned)
            },  # fmt: skip
            quantization=QuantizationRecord(
                scheme, spec.format, compression.weights.group_size, str(folder.absolute()), matrices
            ),  # fmt: skip
        ).write(tmp)
    return QuantizeResult(
        out=out,
        scheme=scheme,
        format=spec.format,
        group_size=compression.weights.group_size,
        matrices=len(matrices),
        kept=len(kept),
        source_bytes=source.nbytes,
        written_bytes=written_bytes,
        seconds=time.perf_counter() - start,
    )


def source_name(stored: str, matrices: list[str]) -> str:
    """The 16-bit tensor a stored tensor comes from: its matrix's weight, or itself."""
    module = stored.rsplit(".", 1)[0] + ".weight"
    return module if module in matrices else stored
