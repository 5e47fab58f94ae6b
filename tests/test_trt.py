"""TensorRT: the plugin's TensorRT-free parts on CPU; engines, TRT-vs-PyTorch and timings on a GPU only."""

import importlib.util
import json
import subprocess
import sys

import pytest
import torch

from dattn_export.trt_plugin import Attributes, int_arguments, launch_grid, output_shape

HAVE_TENSORRT = importlib.util.find_spec("tensorrt") is not None
gpu = pytest.mark.skipif(not (HAVE_TENSORRT and torch.cuda.is_available()),
                         reason="needs TensorRT (NVIDIA's wheels) and an NVIDIA GPU")  # fmt: skip


def test_attributes_are_checked():
    Attributes(8, 2, 128, 0.088, 50.0, 4096, "alpha", 0)
    for bad in (dict(merge="max"), dict(head_dim=96), dict(num_kv_heads=3), dict(window=-1)):
        fields = {**dict(num_heads=8, num_kv_heads=2, head_dim=128, scale=0.088, softcap=0.0, window=0, merge="sum",
                         causal_visual=0), **bad}  # fmt: skip
        with pytest.raises(ValueError, match="dattn::DecomposedAttention"):
            Attributes(**fields)


def test_shape_inference_grid_and_scalar_arguments():
    attributes = Attributes(8, 2, 64, 0.125, 0.0, 0, "alpha", 0)
    assert output_shape((3, 8, 17, 64), (3, 2, 40, 64), (3, 2, 576, 64), attributes) == (3, 8, 17, 64)
    with pytest.raises(ValueError, match="k is"):
        output_shape((3, 8, 17, 64), (3, 4, 40, 64), (3, 2, 576, 64), attributes)
    assert launch_grid((3, 8, 17, 64)) == (2, 24)
    # the strides the kernel gets equal those of contiguous tensors of these shapes
    q, k, kv = torch.empty(3, 8, 17, 64), torch.empty(3, 2, 40, 64), torch.empty(3, 2, 576, 64)
    expected = [8, 4, 17, 40, 576, *q.stride()[:3], *k.stride()[:3], *kv.stride()[:3]]
    assert int_arguments(q.shape, k.shape, kv.shape) == expected


def test_trt_command_says_what_is_missing(tmp_path):
    (tmp_path / "onnx").mkdir()
    (tmp_path / "onnx" / "onnx_manifest.json").write_text(json.dumps({"graphs": {}}))
    result = subprocess.run([sys.executable, "-m", "dattn_export", "trt", tmp_path / "onnx", "-o", tmp_path / "engines"],
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    if HAVE_TENSORRT and torch.cuda.is_available():
        pytest.skip("TensorRT and a GPU are present: nothing is missing")
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "tensorrt" in result.stderr.lower() or "no CUDA GPU" in result.stderr
    assert not (tmp_path / "engines").exists()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_engines_match_pytorch_with_plugin_and_with_function(tmp_path, family):
    """Engines with the plugin and engines with the ONNX function fallback both validate against PyTorch."""
    from dattn_export.demo import write_demo_checkpoint
    from dattn_export.onnx_export import export_onnx
    from dattn_export.tensorrt import Limits, build_engines
    from dattn_export.validate import validate

    checkpoint = write_demo_checkpoint(tmp_path / "ckpt", family)
    export_onnx(checkpoint, tmp_path / "onnx")
    limits = Limits(max_batch=2, max_text_tokens=128, max_visual_tokens=64)
    for name, use_plugin in (("plugin", True), ("function", False)):
        manifest = build_engines(tmp_path / "onnx", tmp_path / name, "fp32", limits, None, False, use_plugin=use_plugin)
        assert manifest["plugin"] is use_plugin
        report = validate(tmp_path / name, checkpoint, backend="trt", steps=10)
        assert report.passed, report.to_json()
