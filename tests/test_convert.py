"""convert / verify / info: every training-output layout round-trips to exactly the original parameters."""

import json

import pytest
import torch
from helpers.builders import images, left_padded_batch, model_and_tensors, write_hf
from helpers.checks import assert_converted_equals
from safetensors.torch import load_file

from dattn_export.checkpoints.source import load_model
from dattn_export.folders import CONVERT_MANIFEST
from dattn_export.stages.convert import convert
from dattn_export.stages.info import describe
from dattn_export.stages.verify import verify


def logits(model):
    ids, mask = left_padded_batch([6, 4])
    with torch.no_grad():
        return model(ids, images(2), mask).logits


@pytest.mark.parametrize(
    "fmt, shards", [("safetensors", 1), ("safetensors", 3), ("bin", 1), ("bin", 2), ("legacy-bin", 2)]
)
def test_hf_layouts_round_trip(tmp_path, fmt, shards):
    model, tensors = model_and_tensors()
    source = write_hf(tmp_path / "src", model, tensors, fmt, shards)
    result = convert(source, tmp_path / "out", dtype="fp32", max_shard_size="300KB")
    assert_converted_equals(tmp_path / "out", tensors)
    assert len(list((tmp_path / "out").glob("model-*-of-*.safetensors"))) == 4  # 1.1 MB in 300 KB shards
    torch.testing.assert_close(logits(load_model(tmp_path / "out")), logits(model), atol=0, rtol=0)
    assert all(check.ok for check in verify(tmp_path / "out", against=source))
    assert (tmp_path / "out" / "tokenizer.json").is_file() and result.dtype == torch.float32


def test_adapter_only_save_over_base(tmp_path):
    base_model, base_tensors = model_and_tensors(seed=0)
    base = write_hf(tmp_path / "base", base_model, base_tensors)
    _, trained = model_and_tensors(seed=5)
    adapter = {  # LLaVA's names for the projector
        "model.mm_projector.0.weight": trained["model.mm_rand_projector.model.0.weight"],
        "model.mm_projector.0.bias": trained["model.mm_rand_projector.model.0.bias"],
        "model.mm_projector.2.weight": trained["model.mm_rand_projector.model.2.weight"],
        "model.mm_projector.2.bias": trained["model.mm_rand_projector.model.2.bias"],
        "model.mm_rand_norm.weight": trained["model.mm_rand_norm.weight"],
    }
    (tmp_path / "stage1").mkdir()
    torch.save(adapter, tmp_path / "stage1" / "mm_projector.bin")
    convert(tmp_path / "stage1", tmp_path / "out", dtype="fp32", base=base)
    replaced = {n for n in trained if n.startswith(("model.mm_rand_projector", "model.mm_rand_norm"))}
    assert len(replaced) == 5
    assert_converted_equals(tmp_path / "out", {n: trained[n] if n in replaced else t for n, t in base_tensors.items()})


def test_vision_config_from_known_tower_or_shapes(tmp_path):
    model, tensors = model_and_tensors("mistral")
    source = write_hf(tmp_path / "src", model, tensors)
    config = json.loads((source / "config.json").read_text())
    tower = config.pop("vision_config")
    (source / "config.json").write_text(json.dumps(config))
    report = describe(source)
    assert "pass --vision-heads" in report.problems[0]
    convert(source, tmp_path / "out", dtype="fp32", vision_heads=tower["num_attention_heads"])
    written = json.loads((tmp_path / "out" / "config.json").read_text())["vision_config"]
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "image_size",
        "patch_size",
        "num_attention_heads",
    ):
        assert written[key] == tower[key], key
    assert describe(tmp_path / "out").architecture["vision_config"].endswith("(config.json vision_config)")
    torch.testing.assert_close(logits(load_model(tmp_path / "out")), logits(model), atol=0, rtol=0)


def test_info_reports_layout_parameters_and_dtypes(tmp_path):
    model, tensors = model_and_tensors()
    source = write_hf(tmp_path / "src", model, {n: t.to(torch.bfloat16) for n, t in tensors.items()})
    report = describe(source)
    assert report.layout == "hf-safetensors" and report.dtypes == {"bfloat16": len(tensors)}
    vision = sum(t.numel() for n, t in tensors.items() if n.startswith("model.mm_vis."))
    assert report.parameters["vision tower"] == vision
    assert sum(report.parameters.values()) == sum(t.numel() for t in tensors.values())
    assert report.bytes == 2 * sum(t.numel() for t in tensors.values()) and report.problems == []
    assert report.architecture["kv_heads"] == 1 and report.architecture["tokens_per_image"] == 16


def test_verify_detects_tampering(tmp_path):
    model, tensors = model_and_tensors()
    convert(write_hf(tmp_path / "src", model, tensors), tmp_path / "out", dtype="fp32")
    shard = tmp_path / "out" / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF
    shard.write_bytes(bytes(data))
    checks = {c.name: c for c in verify(tmp_path / "out", against=tmp_path / "src")}
    assert (
        not checks["files: size and sha256"].ok
        and "model.safetensors sha256" in checks["files: size and sha256"].detail
    )
    assert not checks["tensors reload"].ok


@pytest.mark.parametrize("hash_lag", [0, 1 << 30])
def test_writer_streams_mapped_and_buffered_tensors(tmp_path, monkeypatch, hash_lag):
    """The shard writer (tensors mapped and copied, produced into buffers whole and a range at a time) against
    safetensors' own reader and hashlib over the written file, with hashing allowed no lag at all (every mapped
    tensor waits for its hash) or a lag larger than the file."""
    import hashlib

    from dattn_export.checkpoints import safetensors_writer
    from dattn_export.checkpoints.safetensors_writer import PlannedTensor, write_safetensors

    monkeypatch.setattr(safetensors_writer, "HASH_LAG", hash_lag)
    monkeypatch.setattr(safetensors_writer, "PIECE_BYTES", 16)
    generator = torch.Generator().manual_seed(0)
    tensors = {
        f"t{i}": torch.randn(7 + i, 5, generator=generator).to(torch.bfloat16 if i % 3 else torch.float32)
        for i in range(9)
    }
    raw = tmp_path / "raw.bin"  # the mapped tensors' bytes lie here, as in a checkpoint's file
    offsets, blob = {}, b""
    for name, t in tensors.items():
        offsets[name], blob = len(blob), blob + t.view(torch.uint8).numpy().tobytes()
    raw.write_bytes(blob)

    def planned(i, name, t):
        if i % 2:  # mapped: copied in the kernel from raw.bin
            return PlannedTensor(name, t.dtype, tuple(t.shape), lambda _, t=t: t, (raw, offsets[name]))
        if i % 4 == 2:  # produced a range at a time (PIECE_BYTES is 16 here)

            def produce_range(out, start, stop, t=t):
                return out[: (stop - start) * t.itemsize].view(t.dtype).copy_(t.view(-1)[start:stop])

            return PlannedTensor(name, t.dtype, tuple(t.shape), None, produce_range=produce_range)
        return PlannedTensor(
            name, t.dtype, tuple(t.shape), lambda out, t=t: out[: t.nbytes].view(t.dtype).view(t.shape).copy_(t)
        )

    out = tmp_path / "model.safetensors"
    written = write_safetensors(out, [planned(i, n, t) for i, (n, t) in enumerate(tensors.items())])
    assert written.size == out.stat().st_size
    assert written.sha256 == hashlib.sha256(out.read_bytes()).hexdigest()
    loaded = load_file(out)
    assert loaded.keys() == tensors.keys() and all(torch.equal(loaded[n], t) for n, t in tensors.items())


def test_large_casts_go_through_the_buffers_in_pieces_with_the_same_bytes(tmp_path, monkeypatch):
    """A cast larger than PIECE_BYTES goes through the writer's buffers a piece at a time (no buffer of its size):
    the same files, byte for byte, as whole, and each tensor the source's cast."""
    from dattn_export.checkpoints import safetensors_writer

    model, tensors = model_and_tensors()
    source = write_hf(tmp_path / "src", model, tensors, "safetensors", 2)
    monkeypatch.setattr(safetensors_writer, "PIECE_BYTES", 1 << 40)
    convert(source, tmp_path / "whole", dtype="bf16", max_shard_size="300KB")
    monkeypatch.setattr(safetensors_writer, "PIECE_BYTES", 4096)
    assert sum(t.numel() * 2 > 4096 for t in tensors.values()) >= 10
    convert(source, tmp_path / "pieces", dtype="bf16", max_shard_size="300KB")
    shards = sorted(p.name for p in (tmp_path / "whole").glob("model-*.safetensors"))
    assert len(shards) > 1 and shards == sorted(p.name for p in (tmp_path / "pieces").glob("model-*.safetensors"))
    for name in shards:
        assert (tmp_path / "whole" / name).read_bytes() == (tmp_path / "pieces" / name).read_bytes()
    loaded = {k: v for name in shards for k, v in load_file(tmp_path / "pieces" / name).items()}
    assert len(loaded) == len(tensors)
    manifest = json.loads((tmp_path / "pieces" / CONVERT_MANIFEST).read_text())
    for name, entry in manifest["tensors"].items():
        assert torch.equal(loaded[name], tensors[entry["source_name"]].to(torch.bfloat16)), name
