"""The GPU check's dry run (tools/gpu_check): what travels to a GPU machine fits and installs there, and the check
itself runs through Triton's interpreter and writes the schema the GPU run writes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tools" / "gpu_check" / "gpu_check.py"
COLUMNS = {
    "kernel": {"attention", "dtype", "merge", "softcap", "window", "heads", "kv_heads", "head_dim", "context", "phase",
               "max_abs", "tolerance", "passed"},
    "models": {"model", "hidden", "layers", "dtype", "logits_max_abs", "relative", "tokens_agree", "passed"},
    "speed": {"attention", "context", "phase", "dattn_ms", "sdpa_ms", "speedup"},
    "prefill": {"model", "context_tokens", "ms", "tflops", "peak_tflops", "of_peak", "passed"},
    "bounds": {"device", "matmul_tflops", "copy_gbs"},
    "plugin": {"attention", "dtype", "merge", "context", "phase", "tactic", "tiles", "max_abs", "tolerance",
               "plugin_ms", "torch_op_ms", "sdpa_ms", "vs_torch_op", "passed"},
    "decode": {"model", "context_tokens", "ms_per_token", "bound_ms", "vs_bound", "passed"},
    "validate": {"model", "dtype", "logits_max_abs", "tolerance", "tokens_agree", "tokens", "passed"},
    "hour": {"model", "frames", "visual_tokens", "audio_tokens", "first_token_s", "tokens_per_s", "peak_gpu_gib"},
    "tests": {"test", "outcome", "passed"},
    "not_run": {"what", "why"},
}  # fmt: skip


@pytest.mark.slow
def test_the_dry_run_checks_all_but_the_gpu(tmp_path):
    pytest.importorskip("triton", reason="triton is not installed (the [test] extra installs it on Linux x86-64)")
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "dry-run", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "TRITON_INTERPRET": "1"},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    dry = json.loads((tmp_path / "dry_run.json").read_text())
    assert dry["problems"] == [] and dry["travelling_mib"] < 64
    # ours, pure Python, and PyAV's for the machine's Python (the kernel tests import our video decoding)
    assert [wheel.split("-")[0] for wheel in dry["wheels"]] == ["av", "dattn_export"]
    assert dry["wheels"][1].endswith("py3-none-any.whl") and "manylinux" in dry["wheels"][0]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["schema"] == 1 and report["dry_run"] and report["passed"]
    for part, columns in COLUMNS.items():
        assert report[part] and all(columns <= set(row) for row in report[part]), part
    kernel = report["kernel"]
    assert {row["dtype"] for row in kernel} == {"float32", "float16", "bfloat16"}
    assert {row["merge"] for row in kernel} == {"alpha", "sum"}
    assert {row["phase"] for row in kernel} == {"prefill", "decode"}
    assert all(row["max_abs"] <= row["tolerance"] for row in kernel)
    assert any(row["softcap"] and row["window"] for row in kernel)  # Gemma 2's attention: soft-capped, windowed
    assert all(row["tokens_agree"] <= row["tokens"] for row in report["models"])
    # the TensorRT plugins' kernels, launched with TensorRT's arguments (the CPU stand-in here): every case at the
    # tiles the torch op takes, every tactic of each shape, against the reference
    from dattn_export.plugins.tensorrt_plugin import tactics

    plugin = report["plugin"]
    assert {(row["dtype"], row["merge"], row["phase"]) for row in plugin} >= {(row["dtype"], row["merge"], row["phase"])
                                                                            for row in kernel}  # fmt: skip
    for name in {row["attention"] for row in plugin}:
        tried = {row["tactic"] for row in plugin if row["attention"] == name and row["dtype"] == "float16"}
        assert tried == set(range(len(tactics(32, 2))))  # the dry run's head dim: 32
    assert all(row["max_abs"] <= row["tolerance"] for row in plugin)
    # the deployed PyTorch model: decoding beside its bound, validate --backend torch, the (short) video answered
    assert all(row["bound_ms"] > 0 for row in report["decode"]) and len(report["validate"]) == 3
    assert {row["model"] for row in report["hour"]} == {"mistral", "gemma2"}
    assert all(row["frames"] > 0 and row["audio_tokens"] > 0 for row in report["hour"])
    # the kernel tests that run there, collected here: the CUDA dispatch's gpu tests among them
    tests = [row["test"] for row in report["tests"]]
    assert any("test_cuda_dispatch_runs_the_kernel" in test for test in tests)
    assert any("test_kernel_matches_reference" in test for test in tests) and not any("ptx" in test for test in tests)
    markdown = (tmp_path / "gpu_check.md").read_text()
    assert "## Kernel against the fp32 reference" in markdown and "## Not run" in markdown


def test_a_wheel_that_cannot_travel_is_refused(tmp_path):
    """pip's dry run on the GPU machine's Python (3.12, x86-64, no index) refuses a wheel built for another Python:
    the check the dry run makes of what it carries can fail."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import gpu_check
    finally:
        sys.path.pop(0)
    wrong = tmp_path / "numpy-2.0.0-cp39-cp39-manylinux_2_17_x86_64.whl"
    wrong.write_bytes(b"not a wheel")
    assert "is not a supported wheel on this platform" in gpu_check.wheels_install_there([wrong])
