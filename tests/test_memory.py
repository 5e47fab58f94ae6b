"""Real size on a small machine: the reference model built without random initialisation and, where it does not fit,
run layer by layer with the whole model's numbers; exports that never hold the weights; one-line refusals with the
figures where a command cannot fit; and the peak anonymous memory of a 1 GB model's commands, bounded by its bytes."""

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers.builders import build_model, checkpoint_of, released_model
from helpers.cli import error_line, run_cli

from dattn_export import memory
from dattn_export.checkpoints import weights
from dattn_export.checkpoints.source import build_model as build_reference
from dattn_export.checkpoints.source import open_source
from dattn_export.checkpoints.weights import layers, parameter_bytes, streamed_bytes, tables
from dattn_export.stages.verify import probe_logits

MODELS = {
    "gemma2": lambda: build_model("gemma2"),
    "mistral-wings": lambda: build_model("mistral", wings_rank=4),
    "video": lambda: released_model("mistral", video=True),
}


def on_meta(model) -> dict[str, bool]:
    """Per layer and table (the units `stream` reads one at a time): are all its weights on the meta device?"""
    units = layers(model) | tables(model)
    return {name: all(p.is_meta for p in unit.parameters()) for name, unit in units.items()}


@pytest.mark.parametrize("name", list(MODELS))
def test_layer_by_layer_reference_gives_the_whole_models_logits(tmp_path, name, monkeypatch):
    monkeypatch.setattr(weights, "TABLE_CHUNK_BYTES", 4000)  # the embedding and the head read in many chunks
    source = open_source(checkpoint_of(MODELS[name](), tmp_path / "ckpt"))
    whole, streamed = build_reference(source, whole=True), build_reference(source, whole=False)
    assert not any(on_meta(whole).values())
    held = on_meta(streamed)
    assert {"model.layers.0", "model.embed_tokens.weight", "lm_head.weight"} <= set(held) and all(held.values())
    with torch.no_grad():
        expected, got = probe_logits(whole), probe_logits(streamed)
        one_token = torch.tensor([[5]])  # a decode step: a matrix-vector product, whose kernels differ
        expected_step, got_step = whole(one_token).logits, streamed(one_token).logits
    assert all(on_meta(streamed).values())  # dropped again after use
    assert torch.equal(got, expected) and torch.equal(got_step, expected_step)


def test_the_reference_streams_where_the_whole_model_does_not_fit(tmp_path, monkeypatch):
    source = open_source(checkpoint_of(build_model("gemma2"), tmp_path / "ckpt"))
    whole = build_reference(source, whole=True)
    all_bytes = parameter_bytes(whole)
    budget = memory.HEADROOM + (streamed_bytes(whole) + all_bytes) // 2  # room for a layer at a time, not for all
    monkeypatch.setenv(memory.MEMORY_ENV, str(budget / (1 << 30)))
    assert all(on_meta(build_reference(source)).values())
    monkeypatch.setenv(memory.MEMORY_ENV, str((memory.HEADROOM + all_bytes) / (1 << 30)))
    assert not any(on_meta(build_reference(source)).values())


def cli(*args, memory_gib: float | None = None):
    env = os.environ | ({memory.MEMORY_ENV: str(memory_gib)} if memory_gib is not None else {})
    return run_cli(*args, env=env, timeout=600)


@pytest.mark.slow
def test_what_cannot_fit_is_refused_in_one_line_with_the_figures(tmp_path):
    checkpoint = checkpoint_of(build_model("gemma2"), tmp_path / "ckpt")
    assert cli("onnx", checkpoint, "-o", tmp_path / "onnx").returncode == 0
    assert cli("convert", checkpoint, "-o", tmp_path / "converted").returncode == 0
    cases = {
        "the reference model in float32, layer by layer": ("verify", tmp_path / "converted"),
        "onnx: the largest weight": ("onnx", checkpoint, "-o", tmp_path / "int4", "--quantize", "int4"),
        "ONNX Runtime's sessions": ("validate", tmp_path / "onnx"),
    }
    for what, args in cases.items():
        result = cli(*args, memory_gib=0.5)
        line = error_line(result.stderr)  # verify's lines for the checks it had made come first in a log
        assert result.returncode == 3, (args, result.stderr)
        assert line.startswith(f"Error: memory: {what}") and "but this machine has 0.5 GiB available" in line
    assert not (tmp_path / "int4").exists()


# A Mistral-shaped model of about 1 GB in bf16 (tiny towers): big enough that holding its weights shows.
ONE_GB = dict(
    hidden_size=2048, intermediate_size=5632, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
    head_dim=128, vocab_size=32000,
)  # fmt: skip
PEAK_SCRIPT = """
import json, subprocess, sys
from dattn_export.memory import AnonPeak
process = subprocess.Popen(sys.argv[1:])
sampler = AnonPeak(process.pid, interval=0.005)
sampler.start()
code = process.wait()
print(json.dumps({"code": code, "peak": sampler.stop()}))
"""


def peak_anon(*args, memory_gib: float | None = None) -> int:
    """The peak anonymous memory of one CLI command run in its own process."""
    env = os.environ | ({memory.MEMORY_ENV: str(memory_gib)} if memory_gib is not None else {})
    command = [sys.executable, "-c", PEAK_SCRIPT, sys.executable, "-m", "dattn_export", *map(str, args)]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    assert measured["code"] == 0, result.stderr[-2000:]
    return measured["peak"]


def peaks(folder, checkpoint, verify_memory_gib: float | None = None) -> dict[str, int]:
    """Peak anonymous memory of onnx --dtype fp16, convert and verify of one checkpoint."""
    return dict(
        onnx=peak_anon("onnx", checkpoint, "-o", folder / "onnx", "--dtype", "fp16"),
        convert=peak_anon("convert", checkpoint, "-o", folder / "converted"),
        verify=peak_anon("verify", folder / "converted", "--against", checkpoint, memory_gib=verify_memory_gib),
    )


@pytest.mark.slow
def test_peak_memory_of_a_1gb_model_is_bounded_by_its_bytes(tmp_path):
    model = build_model("mistral", **ONE_GB).to(torch.bfloat16)
    checkpoint = checkpoint_of(model, tmp_path / "big" / "ckpt")
    weight_bytes = parameter_bytes(model)
    del model
    assert weight_bytes > 0.9e9
    # each command on a tiny model: the interpreter and the libraries it imports, no weights to speak of
    (tmp_path / "tiny").mkdir()
    baseline = peaks(tmp_path / "tiny", checkpoint_of(build_model("mistral"), tmp_path / "tiny" / "ckpt"))
    # verify's fp32 reference (2 GB) made not to fit: one layer (0.18 GB) and a chunk of the embedding or head at a time
    big = peaks(tmp_path / "big", checkpoint, verify_memory_gib=2.3)
    above = {command: (big[command] - baseline[command]) / weight_bytes for command in big}
    print(f"{weight_bytes / 1e9:.2f} GB of weights; peak anonymous memory above a tiny model's, per byte: {above}")
    assert above["onnx"] < 0.5  # one tensor at a time (the largest: the head, 0.13 GB)
    assert above["convert"] < 0.25
    assert above["verify"] < 0.45  # the whole fp32 model: 2.0 per byte; streamed, measured 0.25
