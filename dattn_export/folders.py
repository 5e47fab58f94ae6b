"""What a path given to a command is, told before any heavy import: a missing path, a Hub id, a folder of the
wrong kind, or training output in no layout we read answers at once, naming the command that takes that folder or
the one that makes the right one.

The pipeline's folders, in order: training output (a checkpoint) -> a converted folder -> an ONNX export ->
TensorRT engines. Each `dattn-export` output folder is marked by its manifest.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Callable, Iterable
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
    files: tuple[str, ...] = ()  # the single files that are one (all else is a folder)


ADAPTER_FILE = "mm_projector.bin"  # a LLaVA-style adapter-only save, the one checkpoint that is a file
ADAPTER_HOLDS = "holds only adapter weights"
ADAPTER_NEEDS_BASE = f"{ADAPTER_HOLDS}: pass --base with the model folder they were trained on"
CHECKPOINT = FolderKind(
    "training output (a checkpoint)",
    None,
    "`info`, `convert`, `onnx`, `generate` and `analyze`",
    files=(ADAPTER_FILE,),
)
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


@dataclass(frozen=True)
class Layout:
    """A checkpoint layout, told by its file names alone; `checkpoints/` holds the reader registered for each."""

    name: str  # as users see it
    description: str
    detect: Callable[[Path], bool]


# the Hugging Face layouts' files: one weights file, or shards listed by an index (their readers read these names)
SHARDED_FILES = {
    "hf-safetensors": ("model.safetensors", "model.safetensors.index.json"),
    "hf-bin": ("pytorch_model.bin", "pytorch_model.bin.index.json"),
}


# DeepSpeed's files: each rank's module states and optimizer states in a step's folder, the step folders in a run's
ZERO_MODEL_STATES, ZERO_OPTIM_STATES, ZERO_STEPS = "*_model_states.pt", "*_optim_states.pt", "global_step*/"


def sharded(layout: str) -> Callable[[Path], bool]:
    return lambda path: path.is_dir() and any((path / name).is_file() for name in SHARDED_FILES[layout])


# in detection order: a Trainer folder also holds HF weights files; an adapter's folder may also hold a config
LAYOUTS = {
    layout.name: layout
    for layout in (
        Layout(
            "trainer-checkpoint",
            "Trainer checkpoint-N/ folder with a DeepSpeed global_stepN/ (and maybe gathered weights)",
            lambda path: path.is_dir() and ((path / "latest").is_file() or any(path.glob(ZERO_STEPS))),
        ),
        Layout(
            "adapter-only",
            f"{ADAPTER_FILE} (needs --base)",
            lambda path: (path / ADAPTER_FILE).is_file() if path.is_dir() else path.name == ADAPTER_FILE,
        ),
        Layout(
            "hf-safetensors",
            "model.safetensors, or model-*-of-*.safetensors + model.safetensors.index.json",
            sharded("hf-safetensors"),
        ),
        Layout(
            "hf-bin",
            "pytorch_model.bin, or pytorch_model-*-of-*.bin + pytorch_model.bin.index.json",
            sharded("hf-bin"),
        ),
        Layout(
            "deepspeed-zero",
            f"DeepSpeed global_stepN/ folder: {ZERO_MODEL_STATES} + {ZERO_OPTIM_STATES} (ZeRO-1/2/3)",
            lambda path: path.is_dir() and any(any(path.glob(p)) for p in (ZERO_MODEL_STATES, ZERO_OPTIM_STATES)),
        ),
    )
}


def checkpoint_layout(path: Path) -> Layout:
    """The layout of training output at `path` (a folder, or an adapter's file), from file names alone; one
    InputError line for an empty folder or one in no layout."""
    if path.is_dir() and not any(path.iterdir()):
        raise InputError(path, "is an empty folder")
    for layout in LAYOUTS.values():
        if layout.detect(path):
            return layout
    known = "; ".join(f"{layout.name} ({layout.description})" for layout in LAYOUTS.values())
    raise InputError(path, f"no checkpoint layout recognised; known layouts: {known}")


def kind_of(path: Path) -> FolderKind:
    """The folder's kind, from its manifest (the latest stage's wins: an export holds no convert manifest)."""
    for kind in reversed(PIPELINE):
        if kind.marker and (path / kind.marker).is_file():
            return kind
    return CHECKPOINT


def resolve(
    given: str | Path,
    command: str,
    *takes: FolderKind,
    hub: bool = True,
    base: Path | None = None,
    base_option: bool = False,
) -> Path:
    """The local folder (or file) `given` names for `command`, which reads the kinds `takes`: a local path as
    it is, else, where `hub`, a Hub repo id `NS/NAME[@REVISION]` downloaded (see `hub.download`). Raises one
    InputError line for a missing path, a folder of another kind or an adapter-only save without its `base`, with
    the next step in it. `base_option`: `command` has --base, given as `base`."""
    text = str(given)
    path = Path(given)
    try:
        os.stat(path)
    except FileNotFoundError:
        if not (hub and could_be_repo_id(text)):
            raise InputError(text, missing(path)) from None
        if meant := local_near_miss(text):  # a typo in a local path's first part, not a repo id
            raise InputError(text, f"{missing(path)}; not looked up on the Hub as a repo id: {meant!r} exists here")
        from .hub import download

        path = download(text)
    except OSError as e:  # a symbolic link loop, a path through a file
        raise from_os_error(e, path) from None
    if path.is_dir():
        layout = check_kind(path, command, takes)
    elif not any(path.name in kind.files for kind in takes):
        raise InputError(path, file_for_folder(path, command, takes))
    else:  # the adapter's file, the one checkpoint that is a file
        layout = checkpoint_layout(path)
    if base is None and layout is LAYOUTS["adapter-only"]:
        if base_option:
            raise InputError(path, ADAPTER_NEEDS_BASE)
        raise InputError(
            path, f"{ADAPTER_HOLDS}: `{command}` takes a whole model; first run `dattn-export convert {path} --base "
            "BASE_MODEL -o CONVERTED`, then pass CONVERTED",
        )  # fmt: skip
    return path


def local_near_miss(text: str) -> str | None:
    """For a missing path that reads as a Hub repo id `NS/NAME`: the existing local path it is a typo of (its first
    part a near miss of a folder here, the rest as given), or None."""
    first, _, rest = text.partition("/")
    folders = [p.name for p in Path.cwd().iterdir() if p.is_dir()]
    close = difflib.get_close_matches(first, folders, n=1)
    return f"{close[0]}/{rest}" if close and Path(close[0], rest).exists() else None


def file_for_folder(path: Path, command: str, takes: tuple[FolderKind, ...]) -> str:
    """What to say of a file given where `command` takes a folder: pass its folder, where that is one of the kinds
    `command` takes (a shard, a manifest), else what the command takes."""
    try:
        check_kind(path.parent, command, takes)
    except InputError:
        accepted = " or ".join(kind.what for kind in takes)
        return f"is a file: `{command}` takes a folder, {accepted}, and the one that holds it is none"
    return f"is a file: `{command}` takes a folder; pass the one that holds it, {path.parent}"


def could_be_repo_id(text: str) -> bool:
    """`NS/NAME[@REVISION]` whose namespace is no local folder: `checkpoints/run1` beside a `checkpoints/` folder is a
    mistyped local path, never a download."""
    from .hub import parse_repo_id

    path = Path(text)
    return (
        bool(parse_repo_id(text)) and not path.is_absolute() and not text.startswith(".") and not path.parent.exists()
    )


# the files a media option takes, by their suffixes (a folder of frames: None); its "did you mean" offers those
MEDIA_SUFFIXES = {
    "--image": {".png", ".jpg", ".jpeg", ".bmp", ".webp"},
    "--video": {".mp4", ".mov", ".mkv", ".webm", ".avi", ".m4v", ".mpg", ".mpeg", ".ts", ".flv", ".3gp"},
    "--audio": {".wav", ".mp3", ".flac", ".m4a", ".aac", ".ogg", ".opus"},
    "--frames": None,
}


def missing(path: Path, option: str | None = None) -> str:
    """What is wrong with a path that does not exist: the deepest part of it that does, and what that holds; the
    near-miss it offers, for a media `option`, one of the kind the option takes (a folder for --frames)."""
    existing = next((p for p in path.absolute().parents if p.exists()), None)
    if existing is None or not existing.is_dir():
        return "does not exist"
    absent = path.absolute().relative_to(existing).parts[0]
    names = [p.name for p in existing.iterdir()]
    if option in MEDIA_SUFFIXES and absent == path.name:  # the file itself is what is missing: offer its kind
        suffixes = MEDIA_SUFFIXES[option]
        names = [
            p.name for p in existing.iterdir() if (p.is_dir() if suffixes is None else p.suffix.lower() in suffixes)
        ]
    close = difflib.get_close_matches(absent, names, n=1)
    return f"does not exist (no {absent!r} in {existing}{f'; did you mean {close[0]!r}?' if close else ''})"


def check_kind(path: Path, command: str, takes: tuple[FolderKind, ...]) -> Layout | None:
    """One InputError line, with the next step, unless the folder `path` is of a kind `command` takes; training
    output's layout (None for the other kinds)."""
    kind = kind_of(path)
    if kind in takes:
        return checkpoint_layout(path) if kind is CHECKPOINT else None
    if inside := [p for p in sorted(path.iterdir()) if p.is_dir() and kind_of(p) in takes and kind_of(p).marker]:
        names = " or ".join(str(p) for p in inside)
        raise InputError(path, f"is not {takes[0].what} but holds one: `dattn-export {command} {names}`")
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


def check_apart(out: Path, source: str | Path) -> None:
    """OUT may not be a checkpoint being read, lie inside one, or contain one: replacing it (--force) would delete the
    input, and writing into it would change what is read."""
    out, source_path = Path(out).resolve(), Path(source).resolve()
    if out == source_path:
        raise InputError(out, "is the input being read: write the output to another folder")
    if source_path in out.parents:
        raise InputError(out, f"lies inside {source_path}, which is being read: write the output elsewhere")
    if out in source_path.parents:
        raise InputError(out, f"contains {source_path}, which is being read: write the output elsewhere")


def check_output(final: str | Path, overwrite: bool, reading: Iterable[str | Path] = ()) -> Path:
    """Before any work: OUT stays apart from the inputs and does not exist unless it may be replaced. Returns it
    absolute."""
    final = Path(final).absolute()
    for source in reading:
        check_apart(final, source)
    existing = next(p for p in final.parents if p.exists())
    if not existing.is_dir():
        raise InputError(existing, f"is a file: the output {final} cannot be a folder under it")
    if final.exists() and not overwrite:
        raise InputError(final, "already exists (pass --force to replace it)")
    return final


# what `demo` writes in its folder, and all it replaces
DEMO_FOLDERS = ("checkpoint", "towers", "converted", "onnx", "held-out", "untrained")


def check_demo_folder(directory: Path, force: bool) -> None:
    """`demo`'s folder: a folder that holds anything is the user's, refused unless `force`, which replaces only
    DEMO_FOLDERS in it."""
    if directory.exists() and not directory.is_dir():
        raise InputError(directory, "is a file: the demo writes a folder")
    held = sorted(p.name for p in directory.iterdir()) if directory.exists() else []
    if held and not force:
        shown = ", ".join(held[:4]) + (", ..." if len(held) > 4 else "")
        raise InputError(
            directory,
            f"is not empty (it holds {shown}): choose a new folder, or pass --force to replace the demo's own "
            f"{', '.join(DEMO_FOLDERS)} in it (nothing else is touched)",
        )
