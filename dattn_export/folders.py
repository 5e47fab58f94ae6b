"""What a path given to a command is, told before any heavy import: a missing path, a Hub id, or a folder of the
wrong kind answers at once, naming the command that takes that folder or the one that makes the right one.

The pipeline's folders, in order: training output (a checkpoint) -> a converted folder -> an ONNX export ->
TensorRT engines. Each `dattn-export` output folder is marked by its manifest.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .errors import InputError, from_os_error

CONVERT_MANIFEST = "dattn_manifest.json"
ONNX_MANIFEST = "onnx_manifest.json"
TRT_MANIFEST = "trt_manifest.json"


@dataclass(frozen=True)
class FolderKind:
    what: str
    marker: str | None  # the manifest that marks it (None: training output, found by its layout)
    taken_by: str  # the commands that read one
    made_by: str | None = None  # the command that writes one, from the previous kinds in PIPELINE
    name: str = "OUT"  # how examples name one


CHECKPOINT = FolderKind("training output (a checkpoint)", None, "`info`, `convert`, `onnx`, `generate` and `analyze`")
CONVERTED = FolderKind(
    "a converted folder",
    CONVERT_MANIFEST,
    "`verify`, `onnx`, `generate`, `analyze`, `serve` and `push`",
    "convert",
    "CONVERTED",
)
ONNX = FolderKind(
    "an ONNX export", ONNX_MANIFEST, "`validate`, `trt` and `generate --backend ort|genai`", "onnx", "ONNX"
)
ENGINES = FolderKind(
    "a TensorRT engines folder", TRT_MANIFEST, "`validate --backend trt` and `generate --backend trt`", "trt", "ENGINES"
)
PIPELINE = (CHECKPOINT, CONVERTED, ONNX, ENGINES)
TRAINING_OUTPUT = (CHECKPOINT, CONVERTED)  # what the checkpoint readers take (a converted folder is one)
MAKES_FROM = {CONVERTED: (CHECKPOINT,), ONNX: TRAINING_OUTPUT, ENGINES: (ONNX,)}
# what runs a model, one name per runtime for every command (each takes those it can use), and the folder it reads
BACKENDS = {
    "torch": TRAINING_OUTPUT,  # the PyTorch reference
    "ort": (ONNX,),  # our graphs on ONNX Runtime
    "trt": (ENGINES,),  # our graphs as TensorRT engines
    "genai": (ONNX,),  # onnxruntime-genai decoding, the context by our graphs on ONNX Runtime
}


def kind_of(path: Path) -> FolderKind:
    """The folder's kind, from its manifest (the latest stage's wins: an export holds no convert manifest)."""
    for kind in reversed(PIPELINE):
        if kind.marker and (path / kind.marker).is_file():
            return kind
    return CHECKPOINT


def resolve(given: str | Path, command: str, *takes: FolderKind, hub: bool = True) -> Path:
    """The local folder (or file) `given` names for `command`, which reads the kinds `takes`: a local path as
    it is, else, where `hub`, a Hub repo id `NS/NAME[@REVISION]` downloaded (see `hub.download`). Raises one
    InputError line for a missing path or a folder of another kind, with the next step in it."""
    text = str(given)
    path = Path(given)
    try:
        os.stat(path)
    except FileNotFoundError:
        from .hub import download, parse_repo_id

        if not (hub and parse_repo_id(text) and not path.is_absolute() and not text.startswith(".")):
            raise InputError(text, "does not exist") from None
        path = download(text)
    except OSError as e:  # a symbolic link loop, a path through a file
        raise from_os_error(e, path) from None
    if path.is_dir():
        check_kind(path, command, takes)
    return path


def check_kind(path: Path, command: str, takes: tuple[FolderKind, ...]) -> None:
    """One InputError line, with the next step, unless the folder `path` is of a kind `command` takes."""
    kind = kind_of(path)
    if kind in takes:
        return
    wanted = takes[0]
    if PIPELINE.index(kind) < PIPELINE.index(wanted):  # an earlier stage's folder: the commands that lead on
        problem = f"is {kind.what}, not {wanted.what}: first run {steps(path, kind, wanted)}"
    else:
        accepted = " or ".join(k.what for k in takes)
        problem = f"is {kind.what} (for {kind.taken_by}); `{command}` takes {accepted}"
    raise InputError(path, problem)


def steps(path: Path, kind: FolderKind, wanted: FolderKind) -> str:
    """The commands that make a `wanted` folder from `path`, a `kind` folder."""
    made_from = MAKES_FROM[wanted]
    source = path if kind in made_from else made_from[0].name
    step = f"`dattn-export {wanted.made_by} {source} -o {wanted.name}`"
    return step if kind in made_from else f"{steps(path, kind, made_from[0])}, then {step}"
