"""What the output folders hold: file names, the three manifests as small typed schemas, the files carried from a
checkpoint, the model code shipped with a converted folder, the dtype names, and atomic folder writing."""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import shutil
import tempfile
import types
import typing
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from .errors import DattnError, EnvironmentFailure, InputError, from_os_error
from .folders import CONVERT_MANIFEST, ONNX_MANIFEST, TRT_MANIFEST, check_output
from .modeling.streams import STREAMS, ContextStream, context_graphs, frame_tokens
from .sidefiles import read_json, reading
from .ui import human_bytes

VALIDATION_REPORT = "validation_report.json"
CARRIED_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
    "chat_template.json",
    "chat_template.jinja",
    "preprocessor_config.json",
    "processor_config.json",
)
MODELING_DIR = Path(__file__).parent / "modeling"
# the model's code a Hub repo ships (modeling/, every module but the package's own), so OUT loads with
# trust_remote_code=True: the configs, the model, its processor and the media decoders they use
REMOTE_CODE = tuple(sorted(path.name for path in MODELING_DIR.glob("*.py") if path.name != "__init__.py"))


@dataclass(frozen=True)
class DType:
    """One floating-point dtype under each of its names."""

    short: str  # what the CLI takes, and Triton's name
    torch: torch.dtype
    onnx: str  # onnx.TensorProto's name, lower case, as manifests record graph values
    numpy: type | None  # None: numpy has no bfloat16

    @property
    def name(self) -> str:
        """torch's name without the prefix: what manifests and configs record."""
        return dtype_name(self.torch)


DTYPES = {
    d.short: d
    for d in (
        DType("fp32", torch.float32, "float", np.float32),
        DType("fp16", torch.float16, "float16", np.float16),
        DType("bf16", torch.bfloat16, "bfloat16", None),
    )
}  # under dtypes.TORCH_NAMES' short names (tests/test_cli.py checks that both name the same types)


def named_dtype(name: str) -> torch.dtype:
    """The torch dtype a manifest or config records by `dtype_name` (float32, bfloat16, float16)."""
    return next(d.torch for d in DTYPES.values() if d.name == name)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# --- manifests ----------------------------------------------------------------------------------------------


def from_json(kind, value):
    """`value` (parsed JSON) as `kind`: dataclasses field by field, dict[str, X] and list[X] item by item, `X | None`
    as X or None. A value of the wrong kind raises TypeError."""
    origin = typing.get_origin(kind)
    if origin in (typing.Union, types.UnionType):
        present = [arg for arg in typing.get_args(kind) if arg is not type(None)]
        return None if value is None else from_json(present[0], value)
    if dataclasses.is_dataclass(kind):
        if not isinstance(value, dict):
            raise TypeError(f"{kind.__name__} is a JSON {type(value).__name__}, not an object")
        hints = typing.get_type_hints(kind)
        return kind(
            **{f.name: from_json(hints[f.name], value[f.name]) for f in dataclasses.fields(kind) if f.name in value}
        )
    if origin is dict:
        if not isinstance(value, dict):
            raise TypeError(f"a map is a JSON {type(value).__name__}")
        item = typing.get_args(kind)[1]
        return {k: from_json(item, v) for k, v in value.items()}
    if origin is list:
        if not isinstance(value, list):
            raise TypeError(f"a list is a JSON {type(value).__name__}")
        return [from_json(typing.get_args(kind)[0], v) for v in value]
    if kind in JSON_KINDS:  # JSON's own kinds: a bool is no int, an int is a float
        if not isinstance(value, JSON_KINDS[kind]) or (isinstance(value, bool) and kind is not bool):
            raise TypeError(f"a {kind.__name__} is a JSON {type(value).__name__}")
    return value


JSON_KINDS = {str: str, int: int, float: (int, float), bool: bool, dict: dict, list: list}


class Manifest:
    """A JSON file in an output folder, read and written as its dataclass."""

    FILE: typing.ClassVar[str]

    @classmethod
    def read(cls, folder: Path, what: str = "a folder written by dattn-export"):
        path = Path(folder) / cls.FILE
        if not path.is_file():
            raise InputError(folder, f"has no {cls.FILE}: not {what}")
        fields = read_json(path, cls.FILE)
        with reading(path, cls.FILE):
            manifest = from_json(cls, fields)
        manifest.check(path)
        return manifest

    def check(self, path: Path) -> None:
        """What a reader of this manifest relies on beyond its fields' presence (raises InputError naming `path`)."""

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    def write(self, folder: Path) -> None:
        (Path(folder) / self.FILE).write_text(json.dumps(self.to_json(), indent=2) + "\n")


@dataclass
class Tool:
    name: str
    version: str


@dataclass
class FileEntry:
    size: int
    sha256: str


@dataclass
class TensorEntry:
    dtype: str
    shape: list[int]
    file: str
    source_name: str
    source_dtype: str


@dataclass
class ConvertSource:
    path: str
    layout: str
    notes: list[str]
    vision_config: str


@dataclass
class ConvertModel:
    model_type: str
    dattn_mode: str
    parameters: dict[str, int]


@dataclass
class QuantizationRecord:
    """How `quantize` made a folder: the scheme (stages/quantize.COMPRESSED_SCHEMES), compressed-tensors' format, the
    group size (None: a scale per channel), the 16-bit folder quantized and the matrices quantized (their weights'
    names)."""

    scheme: str
    format: str
    group_size: int | None
    source: str
    matrices: list[str]


@dataclass
class ConvertManifest(Manifest):
    """dattn_manifest.json: where a converted folder came from, and every file's and tensor's facts."""

    FILE: typing.ClassVar[str] = CONVERT_MANIFEST
    format: str
    tool: Tool
    created: str
    source: ConvertSource
    model: ConvertModel
    dtype: str
    files: dict[str, FileEntry]
    tensors: dict[str, TensorEntry]
    quantization: QuantizationRecord | None = None  # a folder `quantize` wrote


@dataclass
class GraphValue:
    name: str
    dtype: str  # onnx.TensorProto's name, lower case
    shape: list  # ints, or the names of dynamic axes


@dataclass
class Graph:
    file: str
    fused_attention_nodes: int
    inputs: list[GraphValue]
    outputs: list[GraphValue]
    weight_bytes_in_decoder_data: int = 0  # its weights that decoder.onnx.data holds, read from there


@dataclass
class ExportSource:
    path: str
    layout: str


@dataclass
class Wings:
    rank: int
    layers: list[int]
    heads: int


@dataclass
class ExportedModel:
    model_type: str
    dattn_mode: str
    merge: str
    diagonal: bool
    debias: bool
    layers: int
    hidden_size: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    image_size: int
    tokens_per_image: int
    text_positions: str
    wings: Wings | None
    audio_tower: str | None = None  # a checkpoint's audio tower: what it does (audio.onnx), or why it has no graph
    input_type: str = "image"  # image | video (mm_input_type)
    num_contexts: int = 1  # the segments of the decoder's context_attention_mask (modeling/streams.py)
    tokens_per_frame: int | None = None  # within the released resize budget (frame_tokens: of a video's length)
    pool_rule: str | None = None  # a video model's mm_pool_rule, mm_image_pool_size and tower grid: its tokens
    pool_size: int | None = None
    patch_grid: int | None = None
    mel_frames_per_audio_token: int | None = None  # a sample's audio tokens: its log-mel frames // this

    def frame_tokens(self, total_frames: int) -> int:
        """Tokens per frame of a video of `total_frames` frames, as the model's config counts them."""
        return frame_tokens(self.pool_rule, self.pool_size, self.patch_grid, total_frames)

    @property
    def streams(self) -> tuple[ContextStream, ...]:
        """The streams of its input type, in the context's order (an anyres model's tiles count as its image)."""
        return STREAMS[self.input_type]


SCHEMES = {"int4": 4, "int8": 8}  # weight-only quantization: its bits per weight


@dataclass(frozen=True)
class Scheme:
    """What --quantize asked for (stages/onnx_quantize.py does it)."""

    scheme: str  # int4 | int8
    block_size: int = 32
    symmetric: bool = True
    lm_head: bool = False  # quantized too (by default it stays fp32: the logits are what the gate judges)
    embedding: bool = False  # the embedding table quantized too (GatherBlockQuantized; by default it stays fp32)
    accuracy_level: int = 4  # MatMulNBits' compute: 4 = int8 activations (fast with int8 dot products), 0 = fp32

    @property
    def bits(self) -> int:
        return SCHEMES[self.scheme]


@dataclass(frozen=True)
class WeightSource:
    """How a graph's weight is computed from the checkpoint, as the export's constant folding computed it: one of a
    checkpoint tensor (`tensor`, its canonical name), an ONNX op of the default domain (`op`, `attributes`) over
    `inputs`, or a small constant (a Reshape's shape, a ReduceSum's axes: `constant`, flat, of numpy `dtype` and
    `shape`). A Linear's weight is Transpose(tensor); a diagonal V2V's o_proj, its per-KV-head sum."""

    tensor: str | None = None
    op: str | None = None
    attributes: dict = field(default_factory=dict)
    inputs: list[WeightSource | None] = field(default_factory=list)  # None: an optional input left out
    constant: list | None = None
    dtype: str | None = None
    shape: list[int] | None = None

    def describe(self) -> str:
        """`layers.0.mlp.up_proj.weight`, `ReduceSum(Reshape(layers.0.self_attn.o_proj.weight))`: constants and a
        Linear's transpose left out."""
        if self.tensor is not None or self.op is None:
            return self.tensor or "a constant"
        named = [s.describe() for s in self.inputs if s is not None and s.constant is None]
        inner = ", ".join(named)
        return inner if self.op == "Transpose" else f"{self.op}({inner})"


def without_empty(source: dict | None) -> dict | None:
    """A WeightSource's JSON without its empty fields, at every depth."""
    if source is None:
        return None
    source = {key: value for key, value in source.items() if value is not None and (key == "constant" or value)}
    if "inputs" in source:
        source["inputs"] = [without_empty(s) for s in source["inputs"]]
    return source


@dataclass(frozen=True)
class Quantization(Scheme):
    """How context_kv.onnx and decoder.onnx were quantized, as the export's manifest records it."""

    matmuls: dict[str, int] = field(default_factory=dict)  # per graph: MatMuls turned into MatMulNBits
    kept: str = ""  # what keeps the export's dtype, and why
    # per graph, each quantized node's weight as computed from the checkpoint: what `validate` checks its
    # dequantized values against (stages/weight_check.py)
    sources: dict[str, dict[str, WeightSource]] = field(default_factory=dict)


@dataclass
class AttentionExport:
    implementation: str  # fused | standard
    op: dict | None  # the fused op's domain, type, version and plugin attributes


ONNX_FORMAT = "dattn-export-onnx/2"  # /2: "context" names the graphs' context inputs (were "visual", audio included)


@dataclass
class OnnxManifest(Manifest):
    """onnx_manifest.json: the exported graphs' inputs and outputs, and the model facts a runtime needs."""

    FILE: typing.ClassVar[str] = ONNX_MANIFEST
    format: str
    tool: Tool
    source: ExportSource
    model: ExportedModel
    attention: AttentionExport
    dtype: str
    opset: int
    graphs: dict[str, Graph]
    generation: dict
    files: list[str]
    quantization: Quantization | None = None
    genai: str | None = None  # genai_config.json (onnxruntime-genai drives the decoder), or why it cannot

    def to_json(self) -> dict:
        fields = dataclasses.asdict(self)
        if fields["quantization"]:  # each weight's source without the fields its kind leaves empty
            fields["quantization"]["sources"] = {
                graph: {node: without_empty(source) for node, source in nodes.items()}
                for graph, nodes in fields["quantization"]["sources"].items()
            }
        return fields

    def check(self, path: Path) -> None:
        if self.format != ONNX_FORMAT:
            raise InputError(
                path, f"is a {self.format} export, this dattn-export reads {ONNX_FORMAT}: run `onnx` again"
            )
        needed = context_graphs(self.model.input_type)
        missing = [name for name in needed if name not in self.graphs]
        if missing:
            raise InputError(path, f"names no {', '.join(missing)} graph: the export is incomplete (run `onnx` again)")
        if not any(value.name.startswith("past_key_values.") for value in self.graphs["decoder"].inputs):
            raise InputError(path, "its decoder graph has no past_key_values inputs: not a D-Attn decoder")


@dataclass
class TrtManifest(OnnxManifest):
    """trt_manifest.json: the ONNX manifest of the graphs the engines were built from, and the build's facts."""

    FILE: typing.ClassVar[str] = TRT_MANIFEST
    engines: dict[str, str] = field(default_factory=dict)
    precision: str = "fp32"
    profile: dict[str, list] = field(default_factory=dict)  # dynamic axis -> [min, opt, max]
    plugin: bool = False
    tensorrt: str = ""


# --- files --------------------------------------------------------------------------------------------------


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def carried_files(source: Path, names=CARRIED_FILES) -> list[Path]:
    """The tokenizer, processor and generation files that `source` has; a JSON one that does not parse is refused,
    naming it, rather than carried into an output that fails later."""
    found = [Path(source) / name for name in names if (Path(source) / name).is_file()]
    for path in found:
        if path.suffix == ".json":
            read_json(path, path.name)
    return found


def carry_files(source: Path, destination: Path, names=CARRIED_FILES) -> None:
    """Copy the files `carried_files` finds in `source` into `destination`."""
    for path in carried_files(source, names):
        shutil.copyfile(path, Path(destination) / path.name)


def copy_remote_code(destination: Path) -> None:
    """The model code a Hub repo ships, so that it loads with trust_remote_code=True and without this package."""
    for name in REMOTE_CODE:
        shutil.copyfile(MODELING_DIR / name, Path(destination) / name)


def check_free_space(folder: Path, needed: int) -> None:
    """Refuse before writing when the disk cannot hold `needed` bytes, with 1% and 1 MB to spare (configs, tokenizers,
    manifests, the filesystem's own blocks)."""
    free = shutil.disk_usage(folder).free
    if needed and free < needed + needed // 100 + (1 << 20):
        raise EnvironmentFailure(
            folder, f"needs about {human_bytes(needed)} for the output but its disk has {human_bytes(free)} free"
        )


def output_error(error: OSError, final: Path, tmp: Path, needed: int) -> DattnError:
    """An OSError while writing OUT as one line naming OUT (not its hidden partial folder)."""
    name = str(error.filename or final).replace(str(tmp), str(final))
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        free = shutil.disk_usage(final.parent).free
        size = f" (the output needs about {human_bytes(needed)})" if needed else ""
        return EnvironmentFailure(name, f"the disk filled up while writing{size}: {human_bytes(free)} free now")
    return from_os_error(error, name)


def atomic_write(path: Path, text: str) -> None:
    """`text` as the file at `path`, whole or not at all: written beside it, then renamed over it."""
    tmp = path.with_name(f".{path.name}.partial")
    try:
        tmp.write_text(text)
        tmp.replace(path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise from_os_error(e, path) from None


@contextmanager
def atomic_dir(
    final: str | Path, overwrite: bool = False, reading: Iterable[str | Path] = (), needed: int = 0
) -> Iterator[Path]:
    """Yield an empty temporary folder beside `final`; on success it replaces `final`, on any failure
    (exception, Ctrl-C) it is removed. A run killed outright leaves only a hidden `.NAME.partial-*`
    folder, which the next run for the same target removes. `reading`: the inputs of this run, which `final` must
    stay apart from; `needed`: about how many bytes will be written, checked against the free space first. Errors of
    the output's place (a full or read-only disk, no permission, a path through a file) are one line naming it."""
    final = check_output(final, overwrite, reading)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        check_free_space(final.parent, needed)
        for stale in final.parent.glob(f".{final.name}.partial-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.partial-", dir=final.parent))
    except OSError as e:
        raise from_os_error(e, final.parent) from None
    try:
        yield tmp
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise output_error(e, final, tmp, needed) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
