"""Malformed inputs to `convert`: one line naming the path, exit code 2, no traceback, nothing left behind."""

import collections
import json
import pickle
import shutil
import warnings
import zipfile

import pytest
import torch
from helpers.builders import Payload, model_and_tensors, write_hf
from helpers.cli import run_cli
from safetensors.torch import save_file


@pytest.fixture(scope="module")
def sources(tmp_path_factory, real_checkpoints):
    """An HF folder, and a ZeRO-3 run DeepSpeed saved (world size 2): the damage is done to copies of these."""
    root = tmp_path_factory.mktemp("sources")
    model, tensors = model_and_tensors("mistral")
    write_hf(root / "hf", model, tensors, shards=3)
    shutil.copytree(real_checkpoints["zero3-bf16-w2"], root / "zero")
    return root


def first_shard(folder):
    return sorted(folder.glob("model-*.safetensors"))[0]


def edit_json(path, **changes):
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def truncate(folder):
    shard = first_shard(folder)
    shard.write_bytes(shard.read_bytes()[:-64])
    return shard


def huge_header(folder):
    shard = first_shard(folder)
    data = bytearray(shard.read_bytes())
    data[:8] = (2**40).to_bytes(8, "little")
    shard.write_bytes(bytes(data))
    return shard


def bad_json_header(folder):
    shard = first_shard(folder)
    data = bytearray(shard.read_bytes())
    data[8:12] = b"{{{{"
    shard.write_bytes(bytes(data))
    return shard


def duplicate_across_shards(folder):
    """Another shard also stores model.norm.weight: the later file read is named, the earlier mentioned."""
    from safetensors.torch import load_file

    holder = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]["model.norm.weight"]
    other = next(p for p in sorted(folder.glob("model-*.safetensors")) if p.name != holder)
    tensors = load_file(other)
    tensors["model.norm.weight"] = torch.ones(64)
    save_file(tensors, other, metadata={"format": "pt"})
    return max(other, folder / holder)


def missing_shard(folder):
    first_shard(folder).unlink()
    return folder / "model.safetensors.index.json"


def shape_mismatch(folder):
    edit_json(folder / "config.json", intermediate_size=96)
    return folder


def missing_tensor(folder):
    shard = first_shard(folder)
    from safetensors.torch import load_file

    tensors = load_file(shard)
    tensors.pop(next(iter(tensors)))
    save_file(tensors, shard, metadata={"format": "pt"})
    index = folder / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"]
    index.write_text(
        json.dumps({"weight_map": {k: v for k, v in weight_map.items() if k in tensors or v != shard.name}})
    )
    return folder


def malicious_bin(folder, marker):
    for path in folder.glob("model*"):
        path.unlink()
    (folder / "pytorch_model.bin").write_bytes(pickle.dumps({"x": Payload(marker)}))
    return folder / "pytorch_model.bin"


def malicious_zip_bin(folder, marker):
    """A torch.save-style zip whose data.pkl calls os.system."""
    for path in folder.glob("model*"):
        path.unlink()
    with zipfile.ZipFile(folder / "pytorch_model.bin", "w") as archive:
        archive.writestr("archive/data.pkl", pickle.dumps({"x": Payload(marker)}, protocol=2))
    return folder / "pytorch_model.bin"


class TypedRebuild:
    """Pickles as torch's `_rebuild_from_type_v2(func, new_type, args, state)` (how torch saves a tensor that
    carries attributes) with the parts given; args rebuild a real 4-element tensor."""

    def __init__(self, func, new_type, state):
        self.func, self.new_type, self.state = func, new_type, state

    def __reduce__(self):
        with warnings.catch_warnings():  # a TypedStorage is what torch's own tensor pickling puts here
            warnings.simplefilter("ignore")
            storage = torch.arange(4.0).storage()
        args = (storage, 0, (4,), (1,), False, collections.OrderedDict())
        return torch._tensor._rebuild_from_type_v2, (self.func, self.new_type, args, self.state)


class CallsTensor:
    def __reduce__(self):
        return torch.Tensor, (4,)


def saved_bin(make):
    """A damage that replaces the weights by a torch.save zip holding `make(marker)`."""

    def damage(folder, marker):
        for path in folder.glob("model*"):
            path.unlink()
        torch.save({"x": make(marker)}, folder / "pytorch_model.bin")
        return folder / "pytorch_model.bin"

    return damage


def nan_weights(folder):
    shard = first_shard(folder)
    from safetensors.torch import load_file

    tensors = load_file(shard)
    name = next(n for n, t in tensors.items() if t.is_floating_point())
    tensors[name][0] = float("nan")
    save_file(tensors, shard, metadata={"format": "pt"})
    return shard


def fp16_overflow(folder):
    shard = first_shard(folder)
    from safetensors.torch import load_file

    tensors = load_file(shard)
    name = next(n for n, t in tensors.items() if t.is_floating_point())
    tensors[name][0] = 1e6
    save_file(tensors, shard, metadata={"format": "pt"})
    return shard


def remove_rank(folder):
    target = next((folder / "global_step2").glob("*zero_pp_rank_1_*optim_states.pt"))
    target.unlink()
    return folder / "global_step2"


def wrong_world_size(folder):
    """Optimizer files of world size 2 whose partition_count says 3."""
    step = folder / "global_step2"
    for file in step.glob("*optim_states.pt"):
        state = torch.load(file, weights_only=False)
        state["optimizer_state_dict"]["partition_count"] = 3
        torch.save(state, file)
    return step


def no_optimizer_files(folder):
    for file in (folder / "global_step2").glob("*optim_states.pt"):
        file.unlink()
    return folder / "global_step2"


def empty_folder(folder):
    for path in folder.iterdir():
        path.unlink()
    return folder


# name: (source kind, damage(folder[, marker]) -> path the error must name, text the error must contain, extra args)
CASES = {
    "truncated safetensors": ("hf", truncate, "past the end of the file", []),
    "header length beyond file": ("hf", huge_header, "is larger than the file", []),
    "bad JSON header": ("hf", bad_json_header, "header is not valid JSON", []),
    "index names a missing shard": ("hf", missing_shard, "references missing shard", []),
    "duplicate tensor across shards": ("hf", duplicate_across_shards, "is also stored in", []),
    "shape contradicts config": ("hf", shape_mismatch, "but config.json implies", []),
    "missing tensor": ("hf", missing_tensor, "missing tensor", []),
    "unknown model_type": (
        "hf",
        lambda d: edit_json(d / "config.json", model_type="llava") or d / "config.json",
        "model_type 'llava' is not a D-Attn model",
        [],
    ),
    "config.json not JSON": (
        "hf",
        lambda d: (d / "config.json").write_text("{") or d / "config.json",
        "not a readable config.json",
        [],
    ),
    "no config.json": ("hf", lambda d: (d / "config.json").unlink() or d, "has no config.json", []),
    "no vision config, unknown tower": (
        "hf",
        lambda d: edit_json(d / "config.json", vision_config=None) or d / "config.json",
        "pass --vision-heads",
        [],
    ),
    "NaN in weights": ("hf", nan_weights, "NaN/Inf value(s)", []),
    "fp16 overflow": ("hf", fp16_overflow, "beyond fp16's 65504", ["--dtype", "fp16"]),
    "pickle with os.system (plain)": ("hf", malicious_bin, "refused to unpickle", []),
    "pickle with os.system (torch zip)": (
        "hf",
        malicious_zip_bin,
        "refused to unpickle: it references posix.system",
        [],
    ),
    "tensor attributes rebuilding a non-tensor type": (
        "hf",
        saved_bin(lambda _: TypedRebuild(torch._utils._rebuild_tensor_v2, collections.OrderedDict, {})),
        "refused to unpickle: _rebuild_from_type_v2 makes a <class 'collections.OrderedDict'>",
        [],
    ),
    "tensor attributes not a plain dict": (
        "hf",
        saved_bin(lambda _: TypedRebuild(torch._utils._rebuild_tensor_v2, torch.Tensor, [("ds_id", "0_1")])),
        "sets attributes from a list, not a plain dict",
        [],
    ),
    "tensor attributes carrying os.system": (
        "hf",
        saved_bin(
            lambda marker: TypedRebuild(torch._utils._rebuild_tensor_v2, torch.Tensor, {"ds_id": Payload(marker)})
        ),
        "refused to unpickle: it references posix.system",
        [],
    ),
    "tensor rebuilt by a non-tensor function": (
        "hf",
        saved_bin(lambda _: TypedRebuild(collections.OrderedDict, torch.nn.Parameter, {})),
        "_rebuild_from_type_v2 rebuilds with 'OrderedDict', not a tensor",
        [],
    ),
    "torch.Tensor called by the pickle": ("hf", saved_bin(lambda _: CallsTensor()), "it calls torch.Tensor", []),
    "missing ZeRO rank file": ("zero", remove_rank, "rank file(s) [1] missing", []),
    "wrong world size": ("zero", wrong_world_size, "world size 3 (partition_count)", []),
    "ZeRO without optimizer files": ("zero", no_optimizer_files, "no *_optim_states.pt", []),
    "empty folder": ("hf", empty_folder, "is an empty folder", []),
    "adapter-only without --base": ("hf", lambda d: torch.save({}, d / "mm_projector.bin") or d, "pass --base", []),
    "bad --max-shard-size": ("hf", lambda d: d, "is not a size like 5GB", ["--max-shard-size", "lots"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_malformed_input(sources, tmp_path, case):
    kind, damage, expected, extra = CASES[case]
    folder = tmp_path / "src"
    shutil.copytree(sources / kind, folder)
    marker = tmp_path / "pwned"
    named = damage(folder, marker) if "marker" in damage.__code__.co_varnames else damage(folder)
    source = folder / "global_step2" if kind == "zero" and case != "empty folder" else folder
    out = tmp_path / "out"
    result = run_cli("convert", source, "-o", out, *extra)
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert expected in lines[0], lines[0]
    assert str(named) in lines[0] or (case == "bad --max-shard-size" and "--max-shard-size" in lines[0]), lines[0]
    assert not out.exists() and not list(tmp_path.glob(".out.partial-*")), "output left behind"
    assert not marker.exists(), "pickled code ran"
