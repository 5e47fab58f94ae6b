"""Damaged inputs to every command: one line naming the file or option and the problem, the exit code that says
whose problem it is (2 input, 3 environment), no traceback, nothing left at OUT, the input untouched.

The commands run in this process through the CLI's own entry (Click's runner): the same group, option parsing and
error table as a console run, without a Python start per case. `test_convert_errors.py` and `test_cli.py` hold
more cases, run as real subprocesses."""

import collections
import json
import os
import pickle
import shutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from helpers import damage
from helpers.builders import model_and_tensors, write_hf

from dattn_export.cli import main
from dattn_export.demo_model import write_demo_checkpoint


@pytest.fixture(scope="module")
def originals(tmp_path_factory, pipeline):
    """A demo checkpoint (sharded, released layout), its converted folder and its ONNX export (getting started's),
    a video model, and an HF folder of .bin shards: every case damages a copy of one."""
    root = tmp_path_factory.mktemp("originals")
    for name in ("dattn-demo/checkpoint", "dattn-demo/towers", "converted", "onnx"):
        (root / Path(name).name).symlink_to(pipeline / name)
    (root / "video").symlink_to(write_demo_checkpoint(root / "video-model" / "video", video=True))
    model, tensors = model_and_tensors("mistral")
    write_hf(root / "bin", model, tensors, fmt="bin", shards=2)
    return root


@dataclass
class Workspace:
    """A case's copies: `folder(name)` copies an original once and returns it; `out` is where an output would go."""

    originals: Path
    root: Path
    copies: dict = field(default_factory=dict)

    def folder(self, name: str) -> Path:
        if name not in self.copies:
            shutil.copytree(self.originals / name, self.root / name, symlinks=True)
            self.copies[name] = self.root / name
        return self.copies[name]

    @property
    def out(self) -> Path:
        return self.root / "out"

    def shard(self, name: str = "checkpoint") -> Path:
        return sorted(self.folder(name).glob("model-*.safetensors"))[0]

    def json(self, path: Path, **changes) -> Path:
        path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
        return path


class TypedRebuild:
    """Pickles as torch's `_rebuild_from_type_v2(_rebuild_tensor_v2, Tensor, args, {})` with the given rebuild
    arguments: what a crafted file can hand the unpickler's tensor rebuild."""

    def __init__(self, args):
        self.args = args

    def __reduce__(self):
        return torch._tensor._rebuild_from_type_v2, (torch._utils._rebuild_tensor_v2, torch.Tensor, self.args, {})


def crafted_bin(ws: Workspace, args) -> Path:
    """The .bin folder's first shard replaced by a torch.save whose tensor is rebuilt from `args`."""
    file = first_bin(ws)
    torch.save({"model.norm.weight": TypedRebuild(args)}, file)
    return file


def storage(length: int = 4):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.arange(float(length)).storage()


def legacy_with_global(ws: Workspace) -> Path:
    """A pre-1.6 (non-zip) torch file that names a function: torch's weights-only loader refuses it."""
    file = sorted(ws.folder("bin").glob("pytorch_model-*.bin"))[0]
    torch.save({"x": torch.ones(2), "hook": print}, file, _use_new_zipfile_serialization=False)
    return file


def symlink_loop(path: Path) -> Path:
    path.unlink(missing_ok=True)
    path.symlink_to(path.name)
    return path


def remove(path: Path) -> Path:
    path.unlink()
    return path


# name -> (setup(ws) -> (arguments, the path or option the line must name), exit code, text the line contains)
def converting_with_config(**fields):
    """A case: `convert` of the checkpoint whose config.json has `fields` changed."""
    return lambda ws: (
        ["convert", ws.folder("checkpoint"), "-o", ws.out],
        ws.json(ws.folder("checkpoint") / "config.json", **fields),
    )


CASES = {
    # --- convert: safetensors headers, as the safetensors library validates them ---
    "overlapping data_offsets": (
        lambda ws: (
            ["convert", ws.folder("checkpoint"), "-o", ws.out],
            damage.edit_header(ws.shard(), damage.overlapping_offsets),
        ),
        2,
        "overlaps the bytes of another tensor",
    ),
    "negative data_offsets": (
        lambda ws: (
            ["convert", ws.folder("checkpoint"), "-o", ws.out],
            damage.edit_header(ws.shard(), damage.negative_offsets),
        ),
        2,
        "malformed safetensors header entry",
    ),
    "bytes between tensors": (
        lambda ws: (
            ["convert", ws.folder("checkpoint"), "-o", ws.out],
            damage.edit_header(ws.shard(), damage.gap_between_tensors),
        ),
        2,
        "unused",
    ),
    "bytes after the last tensor": (
        lambda ws: (["convert", ws.folder("checkpoint"), "-o", ws.out], append(ws.shard(), b"\0" * 8)),
        2,
        "belong to none",
    ),
    "unknown dtype": (
        lambda ws: (
            ["convert", ws.folder("checkpoint"), "-o", ws.out],
            damage.edit_header(ws.shard(), lambda h: h[damage.tensors_by_offset(h)[0]].update(dtype="F4")),
        ),
        2,
        "malformed safetensors header entry",
    ),
    "boolean in a shape": (
        lambda ws: (
            ["convert", ws.folder("checkpoint"), "-o", ws.out],
            damage.edit_header(ws.shard(), lambda h: h[damage.tensors_by_offset(h)[0]].update(shape=[True, 64])),
        ),
        2,
        "malformed safetensors header entry",
    ),
    "duplicate tensor name in a header": (
        lambda ws: (
            ["convert", ws.folder("checkpoint"), "-o", ws.out],
            raw_header(
                ws.shard(),
                b'{"a":{"dtype":"F32","shape":[0],"data_offsets":[0,0]},"a":{"dtype":"F32","shape":[0],"data_offsets":[0,0]}}',
            ),
        ),
        2,
        "appears twice",
    ),
    "non-string metadata": (
        lambda ws: (
            ["convert", ws.folder("checkpoint"), "-o", ws.out],
            damage.edit_header(ws.shard(), lambda h: h.update(__metadata__={"format": 1})),
        ),
        2,
        "__metadata__ is not a map of strings",
    ),
    "header of NaN": (
        lambda ws: (["convert", ws.folder("checkpoint"), "-o", ws.out], raw_header(ws.shard(), b'{"a": NaN}')),
        2,
        "header is not valid JSON",
    ),
    # --- convert: indexes and configs ---
    "index maps a tensor to null": (
        lambda ws: (
            ["convert", ws.folder("checkpoint"), "-o", ws.out],
            ws.json(
                ws.folder("checkpoint") / "model.safetensors.index.json",
                weight_map={
                    **json.loads((ws.folder("checkpoint") / "model.safetensors.index.json").read_text())["weight_map"],
                    "model.norm.weight": None,
                },
            ),
        ),
        2,
        "maps model.norm.weight to None",
    ),
    "index names a file outside the folder": (
        lambda ws: (
            ["convert", ws.folder("checkpoint"), "-o", ws.out],
            ws.json(
                ws.folder("checkpoint") / "model.safetensors.index.json",
                weight_map={"model.norm.weight": "../elsewhere.safetensors"},
            ),
        ),
        2,
        "not the name of a file in this folder",
    ),
    "index is a list": (
        lambda ws: (
            ["convert", ws.folder("checkpoint"), "-o", ws.out],
            write(ws.folder("checkpoint") / "model.safetensors.index.json", b"[]"),
        ),
        2,
        "is not a safetensors/bin index",
    ),
    "negative hidden size": (
        converting_with_config(hidden_size=-64),
        2,
        "hidden_size must be a positive integer of at most 16777216, got -64",
    ),
    "zero layers of vision tower": (
        lambda ws: (
            ["convert", ws.folder("converted"), "-o", ws.out],
            ws.json(
                ws.folder("converted") / "config.json",
                vision_config={
                    **json.loads((ws.folder("converted") / "config.json").read_text())["vision_config"],
                    "num_hidden_layers": 0,
                },
            ),
        ),
        2,
        "vision_config.num_hidden_layers must be a positive integer",
    ),
    "query heads not a multiple of KV heads": (
        converting_with_config(num_key_value_heads=3),
        2,
        "is not a multiple of num_key_value_heads 3",
    ),
    "unknown dtype in config": (
        converting_with_config(torch_dtype="int8"),
        2,
        "is not one of float32",
    ),
    "select layer past the tower": (
        converting_with_config(mm_vision_select_layer=-9),
        2,
        "mm_vision_select_layer -9 is not a layer",
    ),
    "cut tokenizer.json": (
        lambda ws: (
            ["convert", ws.folder("checkpoint"), "-o", ws.out],
            damage.cut(ws.folder("checkpoint") / "tokenizer.json"),
        ),
        2,
        "not a readable tokenizer.json",
    ),
    "cut generation_config.json": (
        lambda ws: (
            ["convert", ws.folder("checkpoint"), "-o", ws.out],
            damage.cut(ws.folder("checkpoint") / "generation_config.json"),
        ),
        2,
        "not a readable generation_config.json",
    ),
    "tower config not JSON": (
        lambda ws: (
            ["convert", ws.folder("checkpoint"), "-o", ws.out],
            (
                ws.json(ws.folder("checkpoint") / "config.json", mm_vision_tower=str(ws.root / "tower")),
                (ws.root / "tower").mkdir(),
                (ws.root / "tower" / "config.json").write_text("{"),
            )[0]
            and ws.root / "tower" / "config.json",
        ),
        2,
        "not a readable tower config.json",
    ),
    # --- convert: torch files and the restricted unpickler ---
    "zip entry that fails to inflate": (
        lambda ws: (
            ["convert", ws.folder("bin"), "-o", ws.out],
            damage.bad_zip_member(sorted(ws.folder("bin").glob("pytorch_model-*.bin"))[0]),
        ),
        2,
        "damaged zip archive",
    ),
    "truncated .bin": (
        lambda ws: (
            ["convert", ws.folder("bin"), "-o", ws.out],
            damage.cut(sorted(ws.folder("bin").glob("pytorch_model-*.bin"))[0]),
        ),
        2,
        "zip archive without its end (truncated?)",
    ),
    "legacy pickle naming a class": (
        lambda ws: (["convert", ws.folder("bin"), "-o", ws.out], legacy_with_global(ws)),
        2,
        "refused to unpickle a legacy (pre-1.6) torch file: Unsupported global: GLOBAL print",
    ),
    "tensor rebuilt from a non-storage": (
        lambda ws: (
            ["convert", ws.folder("bin"), "-o", ws.out],
            crafted_bin(ws, ("not a storage", 0, (4,), (1,), False, collections.OrderedDict())),
        ),
        2,
        "rebuilt from a str, not from a storage",
    ),
    "tensor with a negative size": (
        lambda ws: (
            ["convert", ws.folder("bin"), "-o", ws.out],
            crafted_bin(ws, (storage(), 0, (-4,), (1,), False, collections.OrderedDict())),
        ),
        2,
        "not made of non-negative integers",
    ),
    "tensor with strides of another rank": (
        lambda ws: (
            ["convert", ws.folder("bin"), "-o", ws.out],
            crafted_bin(ws, (storage(), 0, (2, 2), (1,), False, collections.OrderedDict())),
        ),
        2,
        "has strides [1]",
    ),
    "tensor past its storage": (
        lambda ws: (
            ["convert", ws.folder("bin"), "-o", ws.out],
            crafted_bin(ws, (storage(), 2, (4,), (1,), False, collections.OrderedDict())),
        ),
        2,
        "reaches past its storage",
    ),
    "storage larger than its zip entry": (
        lambda ws: (
            ["convert", ws.folder("bin"), "-o", ws.out],
            crafted_bin(ws, (storage(), 0, (4,), (1,), False, collections.OrderedDict())) and damage_storage_size(ws),
        ),
        2,
        "claims",
    ),
    "plain pickle of data": (
        lambda ws: (["convert", ws.folder("bin"), "-o", ws.out], write(first_bin(ws), pickle.dumps({"a": 1}))),
        2,
        "plain pickle without tensors",
    ),
    # --- convert: folders, DeepSpeed, paths ---
    "symbolic link loop as the checkpoint": (
        lambda ws: (["convert", symlink_loop(ws.root / "loop"), "-o", ws.out], ws.root / "loop"),
        2,
        "a symbolic link loop",
    ),
    "symbolic link loop inside a DeepSpeed folder": (
        lambda ws: (
            ["convert", zero_folder(ws), "-o", ws.out],
            symlink_loop(next(zero_folder(ws).glob("*model_states.pt"))),
        ),
        2,
        "a symbolic link loop",
    ),
    "optimizer states without model states": (
        lambda ws: (
            ["convert", zero_folder(ws), "-o", ws.out],
            [remove(f) for f in zero_folder(ws).glob("*model_states.pt")] and zero_folder(ws),
        ),
        2,
        "has optimizer states but no *_model_states.pt",
    ),
    "param_shapes holding a string": (
        lambda ws: (["convert", zero_folder(ws), "-o", ws.out], bad_param_shapes(ws)),
        2,
        "not a list of sizes",
    ),
    "a file that is no checkpoint": (
        lambda ws: (
            ["convert", ws.folder("checkpoint") / "demo.png", "-o", ws.out],
            ws.folder("checkpoint") / "demo.png",
        ),
        2,
        "is a file: `convert` takes a folder",
    ),
    "OUT is the checkpoint (--force)": (
        lambda ws: (
            ["convert", ws.folder("checkpoint"), "-o", ws.folder("checkpoint"), "--force"],
            ws.folder("checkpoint"),
        ),
        2,
        "is the input being read",
    ),
    "OUT inside the checkpoint": (
        lambda ws: (
            ["convert", ws.folder("checkpoint"), "-o", ws.folder("checkpoint") / "converted"],
            ws.folder("checkpoint"),
        ),
        2,
        "which is being read",
    ),
    "OUT contains the checkpoint (--force)": (
        lambda ws: (["convert", ws.folder("checkpoint"), "-o", ws.root, "--force"], ws.root),
        2,
        "contains",
    ),
    "OUT inside the vision tower's folder": (
        lambda ws: (
            ["convert", ws.folder("checkpoint"), "-o", ws.originals / "towers" / "tiny-siglip" / "out"],
            "tiny-siglip",
        ),
        2,
        "which is being read",
    ),
    "OUT under a file": (
        lambda ws: (
            ["convert", ws.folder("checkpoint"), "-o", write(ws.root / "a-file", b"") / "out"],
            "a-file",
        ),
        2,
        "is a file: the output",
    ),
    "OUT exists without --force": (
        lambda ws: (["convert", ws.folder("checkpoint"), "-o", ws.folder("converted")], ws.folder("converted")),
        2,
        "already exists (pass --force to replace it)",
    ),
    "shard size of zero": (
        lambda ws: (["convert", ws.folder("checkpoint"), "-o", ws.out, "--max-shard-size", "0GB"], "--max-shard-size"),
        2,
        "a shard holds at least one byte",
    ),
    "shard size of two dots": (
        lambda ws: (
            ["convert", ws.folder("checkpoint"), "-o", ws.out, "--max-shard-size", "1.2.3GB"],
            "--max-shard-size",
        ),
        2,
        "is not a size like 5GB",
    ),
    "unknown --dtype": (
        lambda ws: (["convert", ws.folder("checkpoint"), "-o", ws.out, "--dtype", "fp8"], "--dtype"),
        2,
        "'fp8' is not one of",
    ),
    # --- info ---
    "info: missing path": (lambda ws: (["info", ws.root / "nowhere"], ws.root / "nowhere"), 2, "does not exist"),
    "info: symbolic link loop": (
        lambda ws: (["info", symlink_loop(ws.root / "loop")], ws.root / "loop"),
        2,
        "symbolic link loop",
    ),
    "info: header length past the file": (
        lambda ws: (["info", ws.folder("checkpoint")], write(ws.shard(), (10**9).to_bytes(8, "little"))),
        2,
        "header length 1000000000 is larger than the file (8 bytes)",
    ),
    "info: empty folder": (
        lambda ws: (["info", (ws.root / "empty").mkdir() or ws.root / "empty"], ws.root / "empty"),
        2,
        "is an empty folder",
    ),
    # --- verify ---
    "verify: no manifest": (
        lambda ws: (["verify", ws.folder("checkpoint")], ws.folder("checkpoint")),
        2,
        "not a converted folder: first run `dattn-export convert",
    ),
    "verify: manifest not JSON": (
        lambda ws: (["verify", ws.folder("converted")], damage.cut(ws.folder("converted") / "dattn_manifest.json")),
        2,
        "not a readable dattn_manifest.json",
    ),
    "verify: manifest without tensors": (
        lambda ws: (
            ["verify", ws.folder("converted")],
            drop_key(ws.folder("converted") / "dattn_manifest.json", "tensors"),
        ),
        2,
        "not a readable dattn_manifest.json",
    ),
    "verify: manifest files as a list": (
        lambda ws: (
            ["verify", ws.folder("converted")],
            ws.json(ws.folder("converted") / "dattn_manifest.json", files=[]),
        ),
        2,
        "not a readable dattn_manifest.json",
    ),
    "verify: --against missing": (
        lambda ws: (["verify", ws.folder("converted"), "--against", ws.root / "nowhere"], ws.root / "nowhere"),
        2,
        "does not exist",
    ),
    "verify: ONNX export given": (
        lambda ws: (["verify", ws.folder("onnx")], ws.folder("onnx")),
        2,
        "is an ONNX export (for `validate`, `trt` and `generate --backend ort|genai`); `verify` takes",
    ),
    # --- onnx ---
    "onnx: opset 17": (
        lambda ws: (["onnx", ws.folder("converted"), "-o", ws.out, "--opset", "17"], "--opset"),
        2,
        "17 is not in the range 18<=x<=23",
    ),
    "onnx: block size 24": (
        lambda ws: (
            ["onnx", ws.folder("converted"), "-o", ws.out, "--quantize", "int4", "--block-size", "24"],
            "--block-size",
        ),
        2,
        "'24' is not one of",
    ),
    "onnx: bf16 at opset 18": (
        lambda ws: (["onnx", ws.folder("converted"), "-o", ws.out, "--dtype", "bf16"], "--dtype bf16"),
        2,
        "needs --opset 22",
    ),
    "onnx: int4 of an fp16 export": (
        lambda ws: (
            ["onnx", ws.folder("converted"), "-o", ws.out, "--quantize", "int4", "--dtype", "fp16"],
            "--quantize",
        ),
        2,
        "of an fp32 export",
    ),
    "onnx: OUT is the checkpoint": (
        lambda ws: (["onnx", ws.folder("converted"), "-o", ws.folder("converted"), "--force"], ws.folder("converted")),
        2,
        "is the input being read",
    ),
    "onnx: an ONNX export given": (lambda ws: (["onnx", ws.folder("onnx"), "-o", ws.out], ws.folder("onnx")), 2, ""),
    "onnx: negative vocabulary": (
        lambda ws: (
            ["onnx", ws.folder("converted"), "-o", ws.out],
            ws.json(ws.folder("converted") / "config.json", vocab_size=-1),
        ),
        2,
        "vocab_size must be a positive integer",
    ),
    # --- validate ---
    "validate: no ONNX manifest": (
        lambda ws: (["validate", ws.folder("converted")], ws.folder("converted")),
        2,
        "is a converted folder, not an ONNX export: first run `dattn-export onnx",
    ),
    "validate: manifest without a decoder": (
        lambda ws: (["validate", ws.folder("onnx")], drop_graph(ws.folder("onnx") / "onnx_manifest.json", "decoder")),
        2,
        "names no decoder graph",
    ),
    "validate: manifest not JSON": (
        lambda ws: (["validate", ws.folder("onnx")], damage.cut(ws.folder("onnx") / "onnx_manifest.json")),
        2,
        "not a readable onnx_manifest.json",
    ),
    "validate: manifest graphs as a list": (
        lambda ws: (["validate", ws.folder("onnx")], ws.json(ws.folder("onnx") / "onnx_manifest.json", graphs=[])),
        2,
        "not a readable onnx_manifest.json",
    ),
    "validate: an export of an older format": (
        lambda ws: (
            ["validate", ws.folder("onnx")],
            ws.json(ws.folder("onnx") / "onnx_manifest.json", format="dattn-export-onnx/1"),
        ),
        2,
        "is a dattn-export-onnx/1 export, this dattn-export reads dattn-export-onnx/2: run `onnx` again",
    ),
    "validate: a graph file cut": (
        lambda ws: (["validate", ws.folder("onnx"), "--steps", "1"], damage.cut(ws.folder("onnx") / "decoder.onnx")),
        2,
        "ONNX Runtime cannot load it",
    ),
    "validate: image of 10^10 pixels": (
        lambda ws: (
            [
                "validate",
                ws.folder("onnx"),
                "--image",
                damage.png_claiming_pixels(ws.root / "bomb.png", 100000, 100000),
            ],
            ws.root / "bomb.png",
        ),
        2,
        "not a readable image (DecompressionBombError",
    ),
    "validate: image that is text": (
        lambda ws: (
            ["validate", ws.folder("onnx"), "--image", write(ws.root / "text.png", b"hello")],
            ws.root / "text.png",
        ),
        2,
        "not a readable image",
    ),
    "validate: zero steps": (
        lambda ws: (["validate", ws.folder("onnx"), "--steps", "0"], "--steps"),
        2,
        "0 is not in the range x>=1",
    ),
    "validate: --against missing": (
        lambda ws: (["validate", ws.folder("onnx"), "--against", ws.root / "nowhere"], ws.root / "nowhere"),
        2,
        "does not exist",
    ),
    "validate: cut tokenizer.json": (
        lambda ws: (["validate", ws.folder("onnx"), "--steps", "1"], damage.cut(ws.folder("onnx") / "tokenizer.json")),
        2,
        "not a readable tokenizer.json",
    ),
    # --- generate ---
    "generate: --max-new-tokens -3": (
        lambda ws: (
            ["generate", ws.folder("checkpoint"), "--prompt", "hi", "--max-new-tokens", "-3"],
            "--max-new-tokens",
        ),
        2,
        "-3 is not in the range x>=1",
    ),
    "generate: image of 10^10 pixels": (
        lambda ws: (
            [
                "generate",
                ws.folder("checkpoint"),
                "--prompt",
                "hi",
                "--image",
                damage.png_claiming_pixels(ws.root / "bomb.png", 100000, 100000),
            ],
            ws.root / "bomb.png",
        ),
        2,
        "DecompressionBombError",
    ),
    "generate: image missing": (
        lambda ws: (
            ["generate", ws.folder("checkpoint"), "--prompt", "hi", "--image", ws.root / "missing.png"],
            ws.root / "missing.png",
        ),
        2,
        "does not exist",
    ),
    "generate: cut tokenizer.json": (
        lambda ws: (
            ["generate", ws.folder("checkpoint"), "--prompt", "hi"],
            damage.cut(ws.folder("checkpoint") / "tokenizer.json"),
        ),
        2,
        "not a readable tokenizer.json",
    ),
    "generate: cut generation_config.json": (
        lambda ws: (
            ["generate", ws.folder("checkpoint"), "--prompt", "hi", "--max-new-tokens", "1"],
            damage.cut(ws.folder("checkpoint") / "generation_config.json"),
        ),
        2,
        "not a readable generation config",
    ),
    "generate: eos id past the vocabulary": (
        lambda ws: (
            ["generate", ws.folder("checkpoint"), "--prompt", "hi", "--max-new-tokens", "1"],
            ws.json(ws.folder("checkpoint") / "generation_config.json", eos_token_id=10**6),
        ),
        2,
        "is not a token id of the 512-token vocabulary",
    ),
    "generate: a video for an image model": (
        lambda ws: (
            ["generate", ws.folder("checkpoint"), "--prompt", "hi", "--video", ws.folder("video") / "demo.mov"],
            ws.folder("video") / "demo.mov",
        ),
        2,
        "is video or audio, but the model is an image model",
    ),
    "generate: an image for a video model": (
        lambda ws: (
            ["generate", ws.folder("video"), "--prompt", "hi", "--image", ws.folder("checkpoint") / "demo.png"],
            ws.folder("checkpoint") / "demo.png",
        ),
        2,
        "but the model is a video model",
    ),
    "generate: a corrupt video": (
        lambda ws: (
            [
                "generate",
                ws.folder("video"),
                "--prompt",
                "hi",
                "--video",
                damage.cut(ws.folder("video") / "demo.mov", 0.01),
            ],
            ws.folder("video") / "demo.mov",
        ),
        2,
        "cannot be decoded",
    ),
    "generate: frames from an empty folder": (
        lambda ws: (
            [
                "generate",
                ws.folder("video"),
                "--prompt",
                "hi",
                "--frames",
                (ws.root / "frames").mkdir() or ws.root / "frames",
            ],
            ws.root / "frames",
        ),
        2,
        "holds no frame images",
    ),
    "generate: genai on a checkpoint": (
        lambda ws: (
            ["generate", ws.folder("checkpoint"), "--prompt", "hi", "--backend", "genai"],
            ws.folder("checkpoint"),
        ),
        2,
        "",
    ),
    "generate: genai config cut": (
        lambda ws: (
            ["generate", ws.folder("onnx"), "--prompt", "hi", "--backend", "genai"],
            damage.cut(ws.folder("onnx") / "genai_config.json"),
        ),
        2,
        "not a readable genai_config.json",
    ),
    # --- analyze ---
    "analyze: no image": (
        lambda ws: (["analyze", ws.folder("checkpoint"), "--prompt", "hi", "-o", ws.out], "--image"),
        2,
        "nothing to analyze",
    ),
    "analyze: OUT is the checkpoint": (
        lambda ws: (
            [
                "analyze",
                ws.folder("checkpoint"),
                "--image",
                ws.folder("checkpoint") / "demo.png",
                "--prompt",
                "hi",
                "-o",
                ws.folder("checkpoint"),
                "--force",
            ],
            ws.folder("checkpoint"),
        ),
        2,
        "is the input being read",
    ),
    "analyze: nothing after the image": (
        lambda ws: (
            [
                "analyze",
                ws.folder("checkpoint"),
                "--image",
                ws.folder("checkpoint") / "demo.png",
                "--raw-prompt",
                "hi <image>",
                "-o",
                ws.out,
            ],
            "--raw-prompt",
        ),
        2,
        "has no text after the image",
    ),
    # --- push ---
    "push: repo id with --": (
        lambda ws: (["push", ws.folder("converted"), "--repo-id", "alice/a--b", "--dry-run"], "--repo-id"),
        2,
        "is not a Hub repo id",
    ),
    "push: repo id without a namespace": (
        lambda ws: (["push", ws.folder("converted"), "--repo-id", "model", "--dry-run"], "--repo-id"),
        2,
        "is not of the form namespace/name",
    ),
    "push: repo id with a space": (
        lambda ws: (["push", ws.folder("converted"), "--repo-id", "alice/my model", "--dry-run"], "--repo-id"),
        2,
        "is not a Hub repo id",
    ),
    "push: validation report not JSON": (
        lambda ws: (
            [
                "push",
                ws.folder("converted"),
                "--repo-id",
                "alice/x",
                "--dry-run",
                "--validation-report",
                write(ws.root / "r.json", b"{"),
            ],
            ws.root / "r.json",
        ),
        2,
        "not a readable validation_report.json",
    ),
    "push: a checkpoint, not a converted folder": (
        lambda ws: (["push", ws.folder("checkpoint"), "--repo-id", "alice/x", "--dry-run"], ws.folder("checkpoint")),
        2,
        "not a converted folder: first run `dattn-export convert",
    ),
    "push: a shard changed after convert": (
        lambda ws: (
            ["push", ws.folder("converted"), "--repo-id", "alice/x", "--dry-run"],
            flip_last_byte(sorted(ws.folder("converted").glob("*.safetensors"))[0]) and ws.folder("converted"),
        ),
        2,
        "does not verify",
    ),
    # --- trt ---
    "trt: not an ONNX export": (
        lambda ws: (["trt", ws.folder("converted"), "-o", ws.out], ws.folder("converted")),
        2,
        "is a converted folder, not an ONNX export: first run `dattn-export onnx",
    ),
    "trt: OUT is the export": (
        lambda ws: (["trt", ws.folder("onnx"), "-o", ws.folder("onnx"), "--force"], ws.folder("onnx")),
        2,
        "is the input being read",
    ),
    "trt: no TensorRT here": (
        lambda ws: (["trt", ws.folder("onnx"), "-o", ws.out], "tensorrt"),
        3,
        "is not installed: building and running TensorRT engines needs it",
    ),
    "trt: zero batch": (
        lambda ws: (["trt", ws.folder("onnx"), "-o", ws.out, "--max-batch", "0"], "--max-batch"),
        2,
        "0 is not in the range x>=1",
    ),
    # --- serve ---
    "serve: not a converted folder": (
        lambda ws: (["serve", ws.folder("checkpoint")], ws.folder("checkpoint")),
        2,
        "not a converted folder: first run `dattn-export convert",
    ),
    "serve: port 0": (
        lambda ws: (["serve", ws.folder("converted"), "--port", "0"], "--port"),
        2,
        "0 is not in the range 1<=x<=65535",
    ),
    "serve: no ranks": (
        lambda ws: (["serve", ws.folder("converted"), "-tp", "0"], "--tensor-parallel-size"),
        2,
        "0 is not in the range x>=1",
    ),
    # --- demo ---
    "demo: unknown family": (
        lambda ws: (["demo", ws.out, "--family", "llama"], "--family"),
        2,
        "'llama' is not one of",
    ),
    "demo: a video model of a family with no released task": (
        lambda ws: (["demo", ws.out, "--family", "qwen2", "--input", "video"], "--input"),
        2,
        "no released retrieval task",
    ),
    "demo: zero tokens": (
        lambda ws: (["demo", ws.out, "--max-new-tokens", "0"], "--max-new-tokens"),
        2,
        "0 is not in the range x>=1",
    ),
    "unknown command": (lambda ws: (["convertt", ws.folder("checkpoint")], "convertt"), 2, "No such command"),
}


def write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def append(path: Path, data: bytes) -> Path:
    with open(path, "ab") as f:
        f.write(data)
    return path


def raw_header(shard: Path, header: bytes) -> Path:
    """The shard replaced by a safetensors file of this header and no data."""
    damage.write_header(shard, header, b"")
    return shard


def first_bin(ws: Workspace) -> Path:
    return sorted(ws.folder("bin").glob("pytorch_model-*.bin"))[0]


def zero_folder(ws: Workspace) -> Path:
    """A DeepSpeed ZeRO-2 folder of two ranks written with torch.save in DeepSpeed's layout (the real DeepSpeed runs
    are in test_real_checkpoints; these damages need only the files' structure)."""
    folder = ws.root / "global_step1"
    if not folder.exists():
        folder.mkdir()
        shapes = {"model.norm.weight": torch.Size([4]), "lm_head.weight": torch.Size([2, 2])}
        torch.save(
            {"module": {}, "param_shapes": [shapes], "buffer_names": [], "ds_version": "0.19"},
            folder / "mp_rank_00_model_states.pt",
        )
        for rank in range(2):
            state = {"zero_stage": 2, "partition_count": 2, "single_partition_of_fp32_groups": [torch.zeros(4)]}
            torch.save({"optimizer_state_dict": state}, folder / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
    return folder


def bad_param_shapes(ws: Workspace) -> Path:
    file = zero_folder(ws) / "mp_rank_00_model_states.pt"
    torch.save({"module": {}, "param_shapes": [{"model.norm.weight": "four"}], "buffer_names": []}, file)
    return file


def damage_storage_size(ws: Workspace) -> Path:
    """The tensor's storage entry in the zip is shorter than its storage size says."""
    import zipfile

    file = sorted(ws.folder("bin").glob("pytorch_model-*.bin"))[0]
    with zipfile.ZipFile(file) as archive:
        members = {i.filename: archive.read(i) for i in archive.infolist()}
    with zipfile.ZipFile(file, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data[:8] if "/data/" in name else data)
    return file


def drop_key(path: Path, key: str) -> Path:
    fields = json.loads(path.read_text())
    del fields[key]
    path.write_text(json.dumps(fields))
    return path


def drop_graph(path: Path, graph: str) -> Path:
    fields = json.loads(path.read_text())
    del fields["graphs"][graph]
    path.write_text(json.dumps(fields))
    return path


def flip_last_byte(path: Path) -> Path:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    return path


def snapshot(folder: Path) -> dict:
    """Every file's bytes, through the links to getting started's folders."""
    files = sorted(Path(root) / name for root, _, names in os.walk(folder, followlinks=True) for name in names)
    return {p.relative_to(folder): p.read_bytes() for p in files if p.is_file() and not p.is_symlink()}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_gives_one_line(originals, tmp_path, case, monkeypatch):
    setup, code, expected = CASES[case]
    monkeypatch.chdir(tmp_path)
    ws = Workspace(originals, tmp_path)
    args, named = setup(ws)
    before = snapshot(originals)
    result = CliRunner().invoke(main, [str(a) for a in args], prog_name="dattn-export")
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr, result.exception)
    assert len(lines) == 1 and lines[0].startswith("Error: ") and "Traceback" not in result.stderr, result.stderr
    assert expected in lines[0], lines[0]
    assert str(named) in lines[0] or Path(str(named)).name in lines[0], lines[0]
    assert not ws.out.exists() and not list(tmp_path.glob(".out.partial-*")), "output left behind"
    assert snapshot(originals) == before, "an original was changed"
    for folder in ("checkpoint", "converted"):  # an input that OUT overlapped is untouched
        if folder in ws.copies and case.startswith("OUT"):
            assert snapshot(ws.copies[folder]) == snapshot(originals / folder)


def test_bad_inputs_cover_every_command():
    commands = {
        args
        for args in (
            "convert",
            "info",
            "verify",
            "onnx",
            "validate",
            "generate",
            "analyze",
            "push",
            "trt",
            "serve",
            "demo",
        )
    }
    named = {case.split(":")[0] for case in CASES if ":" in case} | {"convert"}
    assert commands <= named and len(CASES) >= 80, (commands - named, len(CASES))
