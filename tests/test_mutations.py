"""Property: a mutated checkpoint either converts to exactly what the `safetensors` library reads from it, or is
refused in one line (exit 2 or 3, no traceback, no OUT left behind); a mutated manifest either verifies, fails
verification (its table), or is refused in one line. Hypothesis draws the mutations of real files (headers the
safetensors library wrote, the index, config.json, the converted folder's manifest), with a fixed seed and a bounded
number of examples, so CI runs the same cases every time."""

import json
import shutil
import struct
import tempfile
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from helpers.builders import model_and_tensors, write_hf
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from safetensors import SafetensorError, safe_open

from dattn_export.cli import main
from dattn_export.stages.convert import convert

SETTINGS = settings(  # max_examples: the loaded profile's (conftest.py: the full run's or the fast tier's)
    deadline=None,
    derandomize=True,  # the same examples every run
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
DTYPE_NAMES = ["F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL", "F8_E4M3", "F8_E5M2", "F4", "f32"]
JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**40), 2**40),
    st.integers(-3, 3),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
    st.lists(st.integers(-4, 4), max_size=3),
)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A checkpoint whose shards the safetensors library wrote, and its converted folder."""
    root = tmp_path_factory.mktemp("mutations")
    model, tensors = model_and_tensors("mistral")
    write_hf(root / "checkpoint", model, tensors, shards=3)
    convert(root / "checkpoint", root / "converted")
    return root


def fresh_copy(source: Path, name: str) -> tuple[Path, Path]:
    work = Path(tempfile.mkdtemp(dir=source))
    shutil.copytree(source / name, work / name)
    return work, work / name


def read_header(shard: Path) -> tuple[dict, bytes]:
    raw = shard.read_bytes()
    length = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8 : 8 + length]), raw[8 + length :]


def write_header(shard: Path, header_bytes: bytes, data: bytes, length: int | None = None) -> None:
    shard.write_bytes(struct.pack("<Q", len(header_bytes) if length is None else length) + header_bytes + data)


@st.composite
def header_mutation(draw):
    """(shard index, mutation) where mutation(header dict, data) -> (header bytes, data, length prefix or None)."""
    shard = draw(st.integers(0, 2))
    kind = draw(
        st.sampled_from(["offset", "shape", "dtype", "drop", "extra", "swap", "bytes", "length", "cut", "append"])
    )
    pick, value = draw(st.integers(0, 10**6)), draw(JUNK)
    near = draw(st.integers(-9, 9))

    def mutate(header: dict, data: bytes):
        names = sorted(n for n in header if n != "__metadata__")
        name = names[pick % len(names)]
        entry, length = header[name], None
        if kind == "offset":
            which = pick % 2
            entry["data_offsets"][which] = entry["data_offsets"][which] + near if near else value
        elif kind == "shape":
            entry["shape"] = value if near == 0 else [*entry["shape"][:-1], max(entry["shape"][-1] + near, 0)]
        elif kind == "dtype":
            entry["dtype"] = DTYPE_NAMES[pick % len(DTYPE_NAMES)]
        elif kind == "drop":
            del entry[["dtype", "shape", "data_offsets"][pick % 3]]
        elif kind == "extra":
            entry["extra"] = value
        elif kind == "swap":
            other = header[names[(pick + 1) % len(names)]]
            entry["data_offsets"], other["data_offsets"] = other["data_offsets"], entry["data_offsets"]
        text = json.dumps(header).encode()
        if kind == "bytes":
            position = pick % len(text)
            text = text[:position] + bytes([(text[position] + 1 + near % 250) % 256]) + text[position + 1 :]
        elif kind == "length":
            length = max(len(text) + near * 8, 0) if near else abs(value) if isinstance(value, int) else 0
        elif kind == "cut":
            data = data[: pick % max(len(data), 1)]
        elif kind == "append":
            data = data + b"\0" * (abs(near) + 1)
        text += b" " * (-len(text) % 8)
        return text, data, length

    return shard, mutate


def safetensors_reads(folder: Path) -> dict[str, torch.Tensor] | None:
    """Every tensor the safetensors library reads from the folder's shards (those the index names), or None if it
    refuses one."""
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    tensors = {}
    try:
        for shard in sorted(set(index["weight_map"].values())):
            with safe_open(folder / shard, framework="pt") as f:
                tensors.update({name: f.get_tensor(name) for name in f.keys()})
    except (SafetensorError, OSError, TypeError):
        return None
    return tensors


def converted_tensors(out: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for shard in out.glob("*.safetensors"):
        with safe_open(shard, framework="pt") as f:
            tensors.update({name: f.get_tensor(name) for name in f.keys()})
    return tensors


def assert_refused_in_one_line(result, work: Path, out: Path) -> None:
    lines = result.stderr.strip().splitlines()
    assert result.exit_code in (2, 3), (result.exit_code, result.stderr, result.exception)
    assert len(lines) == 1 and lines[0].startswith("Error: ") and "Traceback" not in result.stderr, result.stderr
    assert not out.exists() and not list(work.glob(".out.partial-*")), "output left behind"


def convert_mutant(work: Path, folder: Path):
    out = work / "out"
    result = CliRunner().invoke(main, ["convert", str(folder), "-o", str(out)], prog_name="dattn-export")
    event("refused" if result.exit_code else "converted")  # --hypothesis-show-statistics counts both
    if result.exit_code != 0:
        assert_refused_in_one_line(result, work, out)
        return None
    return converted_tensors(out)


@SETTINGS
@given(mutation=header_mutation())
def test_mutated_headers_convert_as_safetensors_reads_them_or_are_refused(source, mutation):
    shard_index, mutate = mutation
    work, folder = fresh_copy(source, "checkpoint")
    shard = sorted(folder.glob("model-*.safetensors"))[shard_index]
    write_header(shard, *mutate(*read_header(shard)))
    converted = convert_mutant(work, folder)
    if converted is not None:
        expected = safetensors_reads(folder)
        assert expected is not None, "converted a file the safetensors library refuses"
        assert converted.keys() <= expected.keys()
        for name, tensor in converted.items():
            assert torch.equal(tensor, expected[name].to(tensor.dtype)), name
    shutil.rmtree(work)


@SETTINGS
@given(key=st.integers(0, 10**6), value=JUNK, drop=st.booleans())
def test_mutated_indexes_convert_as_safetensors_reads_them_or_are_refused(source, key, value, drop):
    work, folder = fresh_copy(source, "checkpoint")
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    names = sorted(index["weight_map"])
    name = names[key % len(names)]
    if drop:
        del index["weight_map"][name]
    else:
        shards = sorted(set(index["weight_map"].values()))
        index["weight_map"][name] = shards[key % 3] if isinstance(value, bool) else value
    index_path.write_text(json.dumps(index))
    converted = convert_mutant(work, folder)
    if converted is not None:
        expected = safetensors_reads(folder)
        assert expected is not None and all(torch.equal(t, expected[n].to(t.dtype)) for n, t in converted.items())
    shutil.rmtree(work)


CONFIG_KEYS = [
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "vocab_size", "max_position_embeddings", "rms_norm_eps", "sliding_window", "dtype", "model_type",
    "tie_word_embeddings", "dattn_mode", "mm_vision_select_layer", "mm_image_aspect_ratio", "mm_input_type",
    "vision_config.hidden_size", "vision_config.image_size", "vision_config.patch_size",
    "vision_config.num_attention_heads", "vision_config.model_type", "vision_config",
]  # fmt: skip


@SETTINGS
@given(key=st.sampled_from(CONFIG_KEYS), value=JUNK)
def test_mutated_configs_convert_the_stored_tensors_or_are_refused(source, key, value):
    work, folder = fresh_copy(source, "checkpoint")
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    parent, _, leaf = key.rpartition(".")
    (config[parent] if parent else config)[leaf] = value
    config_path.write_text(json.dumps(config))
    converted = convert_mutant(work, folder)
    if converted is not None:
        expected = safetensors_reads(folder)
        assert all(torch.equal(t, expected[n].to(t.dtype)) for n, t in converted.items())
    shutil.rmtree(work)


@SETTINGS
@given(path=st.lists(st.integers(0, 10**6), min_size=1, max_size=4), value=JUNK)
def test_mutated_manifests_verify_fail_or_are_refused(source, path, value):
    """`verify` with a mutated dattn_manifest.json: passes, fails its checks (exit 1, the table), or is refused in
    one line; never a traceback, never an internal error."""
    work, folder = fresh_copy(source, "converted")
    manifest_path = folder / "dattn_manifest.json"
    manifest = json.loads(manifest_path.read_text())
    node = manifest
    for step in path[:-1]:  # walk down the manifest's objects
        if not isinstance(node, dict) or not node:
            break
        child = node[sorted(node)[step % len(node)]]
        if not isinstance(child, dict) or not child:
            break
        node = child
    node[sorted(node)[path[-1] % len(node)]] = value
    manifest_path.write_text(json.dumps(manifest))
    result = CliRunner().invoke(main, ["verify", str(folder)], prog_name="dattn-export")
    event({0: "verified", 1: "failed its checks"}.get(result.exit_code, "refused"))
    assert "Traceback" not in result.stderr and "internal error" not in result.stderr, result.stderr
    if result.exit_code == 1:
        assert "FAILED" in result.stdout, result.stdout
    elif result.exit_code != 0:
        assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    shutil.rmtree(work)
