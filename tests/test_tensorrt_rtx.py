"""The exported graphs through a real TensorRT-family ONNX parser and builder on CPU (TensorRT-RTX).

The fused dattn::DecomposedAttention nodes are imported through their model-local function (no plugin is
registered: TensorRT-RTX aborts on custom plugins). The build runs in a child process: TensorRT objects never live
in the test process. TensorRT-RTX, like TensorRT 11, has no weak-typing flags (BuilderFlag.FP16, BF16, ...) and
builds strongly typed networks only: an fp16 or bf16 engine comes from an fp16 or bf16 export, as `trt` builds it.
"""

import ast
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from dattn_export.artifacts import GraphValue
from dattn_export.demo_model import write_demo_checkpoint
from dattn_export.stages.onnx_export import export_onnx
from dattn_export.stages.trt_build import Limits, profile_shapes

ANYRES = {"mm_image_aspect_ratio": "anyres", "mm_image_grid_points": [[1, 2], [2, 1], [2, 2]]}


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("tensorrt_rtx_bindings") is None,
    reason="the tensorrt-rtx-cu13-libs/-bindings wheels are not installed (pip install '.[test]' on Linux x86-64)",
)
@pytest.mark.parametrize(
    "family, overrides, dtype",
    [  # every pair of (family, input, half type) once: 6 builds where the whole product takes 12
        ("mistral", {}, "fp16"),
        ("mistral", {"video": True}, "bf16"),
        ("mistral", ANYRES, "fp16"),
        ("gemma2", {}, "bf16"),
        ("gemma2", {"video": True}, "fp16"),
        ("gemma2", ANYRES, "bf16"),
        ("mistral", {"wings_rank": 8}, "fp32"),
    ],
)
def test_tensorrt_rtx_parses_and_builds_every_graph(tmp_path, family, overrides, dtype):
    """Image models' three graphs (an anyres model's vision graph takes a thumbnail and rows x columns of tiles);
    video models' four (frames, audio, the context streams' K/V, the decoder whose fused nodes take two context
    segments); in fp16 and bf16 (strongly typed, the engines' tensors of the graphs' type) and in fp32."""
    opset = 22 if dtype == "bf16" else 18  # ONNX takes bfloat16 convolutions from opset 22
    export_onnx(
        write_demo_checkpoint(tmp_path / "ckpt", family, **overrides), tmp_path / "onnx", dtype=dtype, opset=opset
    )
    script = Path(__file__).parent / "helpers" / "trt_engines.py"
    result = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "onnx"), "--module", "tensorrt_rtx_bindings"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    engines = json.loads(result.stdout)
    graphs = (
        {"vision", "audio", "context_kv", "decoder"} if overrides.get("video") else {"vision", "context_kv", "decoder"}
    )
    assert set(engines) == graphs and all(engine["bytes"] > 10_000 for engine in engines.values())
    float_type = {"fp32": "FLOAT", "fp16": "HALF", "bf16": "BF16"}[dtype]
    for name, engine in engines.items():  # every float input and output of every engine in the export's type
        assert set(engine["float_types"]) == {float_type}, (name, engine["float_types"])


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


REMOVED_FLAGS = {"FP16", "BF16", "INT8", "FP8", "INT4", "FP4", "OBEY_PRECISION_CONSTRAINTS",
                 "PREFER_PRECISION_CONSTRAINTS", "STRICT_TYPES"}  # fmt: skip
REMOVED_MEMBERS = {
    "platform_has_fast_fp16",
    "platform_has_fast_int8",
    "set_output_type",
    "int8_calibrator",
}


def removed_api_uses(source: str) -> list[int]:
    """Lines of Python code (not comments or strings) that use what TensorRT 11 removed: a weak-typing builder flag,
    however spelled (`trt.BuilderFlag.FP16`, `getattr(trt.BuilderFlag, "FP16")`), or a removed member."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        flag = (
            isinstance(node, ast.Attribute)
            and node.attr in REMOVED_FLAGS
            and ast.unparse(node.value).endswith("BuilderFlag")
        )
        looked_up = (
            isinstance(node, ast.Call)
            and ast.unparse(node.func) == "getattr"
            and len(node.args) > 1
            and (
                ast.unparse(node.args[0]).endswith("BuilderFlag")
                and isinstance(node.args[1], ast.Constant)
                and node.args[1].value in REMOVED_FLAGS
            )
        )
        member = isinstance(node, ast.Attribute) and node.attr in REMOVED_MEMBERS
        layer_precision = isinstance(node, ast.Assign) and any(  # ILayer.precision = ...: a precision constraint
            isinstance(target, ast.Attribute) and target.attr == "precision" for target in node.targets
        )
        if flag or looked_up or member or layer_precision:
            lines.append(node.lineno)
    return sorted(lines)


def test_no_code_path_calls_an_api_tensorrt_11_removed():
    """TensorRT 11 removed weak typing: the precision builder flags, precision constraints, per-layer precision and
    the platform queries (NVIDIA's "Migrating from TensorRT 10.x to 11.x"). The builds above run against TensorRT-RTX,
    which has none of them either; this scan keeps them from coming back in a path no CPU test builds."""
    package = Path(__file__).parent.parent / "dattn_export"
    found = [
        f"{path.relative_to(package)}:{line}"
        for path in package.rglob("*.py")
        for line in removed_api_uses(path.read_text())
    ]
    assert not found, found
    # the scan finds each spelling of what was removed
    weak = (
        "config.set_flag(trt.BuilderFlag.FP16)\nflag = getattr(trt.BuilderFlag, 'BF16')\nlayer.precision = trt.half\n"
    )
    assert removed_api_uses(weak) == [1, 2, 3]
