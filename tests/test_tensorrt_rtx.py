"""The exported graphs through a real TensorRT-family ONNX parser and builder on CPU (TensorRT-RTX).

The fused dattn::DecomposedAttention nodes are imported through their model-local function (no plugin is
registered). The build runs in a child process: TensorRT objects never live in the test process.
"""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from dattn_export.artifacts import GraphValue
from dattn_export.stages.demo import write_demo_checkpoint
from dattn_export.stages.onnx_export import export_onnx
from dattn_export.stages.trt_build import Limits, profile_shapes

ANYRES = {"mm_image_aspect_ratio": "anyres", "mm_image_grid_points": [[1, 2], [2, 1], [2, 2]]}


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("tensorrt_rtx_bindings") is None,
    reason="the tensorrt-rtx-cu13-libs/-bindings wheels are not installed (pip install '.[test]' on Linux x86-64)",
)
@pytest.mark.parametrize(
    "family, overrides",
    [
        ("mistral", {}),
        ("gemma2", {}),
        ("mistral", {"wings_rank": 8}),
        ("mistral", {"video": True}),
        ("gemma2", {"video": True}),
        ("gemma2", ANYRES),
    ],
)
def test_tensorrt_rtx_parses_and_builds_every_graph(tmp_path, family, overrides):
    """Image models' three graphs (an anyres model's vision graph takes a thumbnail and rows x columns of tiles);
    video models' four (frames, audio, the context streams' K/V, the decoder whose fused nodes take two context
    segments)."""
    export_onnx(write_demo_checkpoint(tmp_path / "ckpt", family, **overrides), tmp_path / "onnx")
    script = Path(__file__).parent / "helpers" / "trt_engines.py"
    result = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "onnx"), "--module", "tensorrt_rtx_bindings"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    sizes = json.loads(result.stdout)
    graphs = (
        {"vision", "audio", "context_kv", "decoder"} if overrides.get("video") else {"vision", "context_kv", "decoder"}
    )
    assert set(sizes) == graphs and all(size > 10_000 for size in sizes.values())


def test_profiles_cover_prefill_decode_and_no_image():
    decoder_inputs = [
        GraphValue("input_ids", "int64", ["batch", "sequence"]),
        GraphValue("attention_mask", "int64", ["batch", "total_sequence"]),
        GraphValue("past_key_values.0.key", "float", ["batch", 8, "past_sequence", 64]),
        GraphValue("context_key_values.0.key", "float", ["batch", 8, "context_sequence", 64]),
    ]
    shapes = profile_shapes(decoder_inputs, Limits(max_batch=4, max_text_tokens=512, max_context_tokens=9216))
    assert shapes["input_ids"] == ([1, 1], [4, 128], [4, 512])
    assert shapes["past_key_values.0.key"][0] == [1, 8, 0, 64]  # prefill: empty cache
    assert shapes["context_key_values.0.key"] == ([1, 8, 0, 64], [4, 8, 4608, 64], [4, 8, 9216, 64])
    assert shapes["attention_mask"][2] == [4, 512]
