"""What the output folders hold: file names, the three manifests as small typed schemas, the files carried from a
checkpoint, the model code shipped with a converted folder, the dtype names, and atomic folder writing."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import tempfile
import typing
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from .errors import InputError

CONVERT_MANIFEST = "dattn_manifest.json"
ONNX_MANIFEST = "onnx_manifest.json"
TRT_MANIFEST = "trt_manifest.json"
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
REMOTE_CODE = ("configuration_dattn.py", "modeling_dattn.py", "attention.py")  # so OUT loads with trust_remote_code


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
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# --- manifests ----------------------------------------------------------------------------------------------


def from_json(kind, value):
    """`value` (parsed JSON) as `kind`: dataclasses field by field, dict[str, X] and list[X] item by item."""
    origin = typing.get_origin(kind)
    if dataclasses.is_dataclass(kind):
        hints = typing.get_type_hints(kind)
        return kind(
            **{f.name: from_json(hints[f.name], value[f.name]) for f in dataclasses.fields(kind) if f.name in value}
        )
    if origin is dict:
        item = typing.get_args(kind)[1]
        return {k: from_json(item, v) for k, v in value.items()}
    if origin is list:
        return [from_json(typing.get_args(kind)[0], v) for v in value]
    return value


class Manifest:
    """A JSON file in an output folder, read and written as its dataclass."""

    FILE: typing.ClassVar[str]

    @classmethod
    def read(cls, folder: Path, what: str = "a folder written by dattn-export"):
        path = Path(folder) / cls.FILE
        if not path.is_file():
            raise InputError(folder, f"has no {cls.FILE}: not {what}")
        try:
            return from_json(cls, json.loads(path.read_text()))
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
            raise InputError(path, f"is not a readable {cls.FILE} ({type(e).__name__}: {e})") from None

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
    visual_tokens_per_image: int
    text_positions: str
    wings: Wings | None
    audio_tower: str | None = None  # a checkpoint's audio tower: what it does (audio.onnx), or why it has no graph
    input_type: str = "image"  # image | video (mm_input_type)
    num_contexts: int = 1  # context streams the decoder's visual_attention_mask names: video: 1 frames, 2 audio
    visual_tokens_per_frame: int | None = None
    max_video_frames: int | None = None  # past it the released pool resizes its grids, which vision.onnx does not
    mel_frames_per_audio_token: int | None = None  # a sample's audio tokens: its log-mel frames // this


@dataclass
class AttentionExport:
    implementation: str  # fused | standard
    op: dict | None  # the fused op's domain, type, version and plugin attributes


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
    quantization: dict | None = None  # decoder.onnx's weight-only quantization (stages/quantize.py)
    genai: str | None = None  # genai_config.json (onnxruntime-genai drives the decoder), or why it cannot


@dataclass
class TrtManifest(OnnxManifest):
    """trt_manifest.json: the ONNX manifest of the graphs the engines were built from, and the build's facts."""

    FILE: typing.ClassVar[str] = TRT_MANIFEST
    engines: dict[str, str] = field(default_factory=dict)
    precision: str = "fp32"
    limits: dict[str, int] = field(default_factory=dict)
    plugin: bool = False
    tensorrt: str = ""


# --- files --------------------------------------------------------------------------------------------------


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def carry_files(source: Path, destination: Path, names=CARRIED_FILES) -> None:
    """Copy the tokenizer, processor and generation files that `source` has into `destination`."""
    for name in names:
        if (Path(source) / name).is_file():
            shutil.copyfile(Path(source) / name, Path(destination) / name)


def copy_remote_code(destination: Path) -> None:
    """The model code a Hub repo ships, so that it loads with trust_remote_code=True and without this package."""
    for name in REMOTE_CODE:
        shutil.copyfile(MODELING_DIR / name, Path(destination) / name)


@contextmanager
def atomic_dir(final: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield an empty temporary folder beside `final`; on success it replaces `final`, on any failure
    (exception, Ctrl-C) it is removed. A run killed outright leaves only a hidden `.NAME.partial-*`
    folder, which the next run for the same target removes."""
    final = Path(final).absolute()
    if final.exists() and not overwrite:
        raise InputError(final, "already exists (pass --force to replace it)")
    final.parent.mkdir(parents=True, exist_ok=True)
    for stale in final.parent.glob(f".{final.name}.partial-*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.partial-", dir=final.parent))
    try:
        yield tmp
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
