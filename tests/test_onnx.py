"""ONNX export: the graphs, run by ONNX Runtime, against the PyTorch reference."""

import functools
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from helpers.builders import build_model, checkpoint_of, images, left_padded_batch, released_model
from helpers.checks import ATOL, SHAPES, run_case
from helpers.cli import error_line, run_cli
from polygraphy.comparator import RunResults

import dattn_export
from dattn_export.demo_model import write_demo_checkpoint
from dattn_export.runtime import graph as graph_runtime
from dattn_export.runtime.ort import OrtModel
from dattn_export.stages.onnx_export import export_onnx
from dattn_export.stages.validate import Comparison, validate


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A tiny model of a family and its export (weights in .data files with `external`), made once for the tests that
    only read them: (model, folder, manifest)."""
    import dattn_export.stages.onnx_export as onnx_export

    @functools.cache
    def export(family: str, external: bool = False):
        model, root = build_model(family), tmp_path_factory.mktemp(f"{family}-export")
        with pytest.MonkeyPatch.context() as patch:
            if external:  # past the threshold (64 MiB) whatever the size
                patch.setattr(onnx_export, "EXTERNAL_DATA_BYTES", 0)
            manifest = export_onnx(checkpoint_of(model, root / "ckpt"), root / "onnx")
        return model, root / "onnx", manifest

    return export


@pytest.mark.slow
@pytest.mark.parametrize(  # with test_wings.py's four (WINGS layers beside plain ones), every family and mode
    "family, mode", [("mistral", "dattn-sum"), ("mistral", "mmca"), ("gemma2", "dattn-sum"), ("gemma2", "sattn")]
)
def test_onnx_runtime_matches_reference(tmp_path, family, mode):
    model = build_model(family, dattn_mode=mode)
    manifest = export_onnx(checkpoint_of(model, tmp_path / "ckpt"), tmp_path / "onnx")
    assert manifest.graphs["decoder"].fused_attention_nodes == model.config.num_hidden_layers
    runtime = OrtModel(tmp_path / "onnx")
    for seed, shape in enumerate(SHAPES):
        run_case(model, runtime, *shape, seed=seed)

    # greedy generation through the graphs with the KV cache: the reference's tokens
    ids, mask = left_padded_batch([9])
    pixels = images(1, 1)
    visual, context_mask = runtime.encode_images(pixels.numpy())
    expected = model.greedy(ids, pixels, mask, max_new_tokens=20)
    got = runtime.generate(ids.numpy(), mask.numpy(), visual, 20, context_mask=context_mask)
    assert got.tolist() == expected.tolist()

    # one image's visual K/V, reused for two prompts, gives each prompt's from-scratch logits
    for seed in (1, 2):
        ids, mask = left_padded_batch([6 + 5 * seed], seed=seed)
        logits, _ = runtime.decode(ids.numpy(), mask.numpy(), runtime.empty_kv(1), visual)
        with torch.no_grad():
            scratch = model(ids, pixels, mask).logits.numpy()
        np.testing.assert_allclose(logits, scratch, atol=ATOL, rtol=0)


@pytest.mark.slow
def test_chunked_visual_encoding_and_prompt_pieces_equal_one_run(exported, monkeypatch):
    """Diagonal V2V: visual tokens never mix, so the runtime may encode a long image sequence in chunks; a prompt
    past the attention budget runs in pieces of tokens (left-padded batch), the same logits and cache."""
    model, folder, _ = exported("gemma2")
    runtime = OrtModel(folder)
    embeds, _ = runtime.embed_images(images(2, 3).numpy())  # 48 visual tokens
    whole, chunked = runtime.encode_context(embeds), runtime.encode_context(embeds, chunk=10)
    for a, b in zip(whole, chunked):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)
    with torch.no_grad():
        reference = model.model.encode_context(torch.from_numpy(embeds))
    np.testing.assert_allclose(chunked[-1], reference[-1][1].numpy(), atol=1e-5, rtol=0)
    ids, mask = (t.numpy() for t in left_padded_batch([9, 6]))
    whole_logits, whole_past = runtime.decode(ids, mask, runtime.empty_kv(2), whole)
    monkeypatch.setattr(graph_runtime, "ATTENTION_BUDGET", 120)  # 48 visual + 9 text keys: two tokens a run
    logits, past = runtime.decode(ids, mask, runtime.empty_kv(2), whole)
    np.testing.assert_allclose(logits, whole_logits, atol=1e-5, rtol=0)
    for a, b in zip(past, whole_past, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_large_graphs_keep_weights_in_external_data(exported):
    """Graphs whose weights pass the threshold (64 MiB; 0 here) keep them in a .data file beside the .onnx."""
    model, folder, _ = exported("mistral", external=True)
    for graph in ("vision", "context_kv", "decoder"):
        data = folder / f"{graph}.onnx.data"
        assert data.is_file() and data.stat().st_size > 10_000, graph
        proto = onnx.load(folder / f"{graph}.onnx", load_external_data=False)
        assert any(t.data_location == onnx.TensorProto.EXTERNAL for t in proto.graph.initializer), graph
    run_case(model, OrtModel(folder), 3, 52, 0, 2, seed=3)


@pytest.mark.slow
def test_visual_kv_reads_the_decoders_weights_from_its_data_file(exported):
    """Every layer weight context_kv.onnx has in common with decoder.onnx (the norms, K/V projections and MLPs) is on
    the disk once, in decoder.onnx.data, at the bytes the decoder reads; o_proj's folded group sum is context_kv's own.
    Each data file holds exactly what the graphs read from it."""
    from dattn_export.runtime.ort import external_tensors

    model, folder, manifest = exported("mistral", external=True)
    ranges = {
        g: external_tensors(onnx.load(folder / f"{g}.onnx", load_external_data=False).graph) for g in manifest.graphs
    }
    decoder_ranges = set(ranges["decoder"].values())
    shared = {name: r for name, r in ranges["context_kv"].items() if r[0] == "decoder.onnx.data"}
    assert set(shared.values()) <= decoder_ranges
    assert sum(length for _, _, length in shared.values()) == manifest.graphs["context_kv"].weight_bytes_in_decoder_data
    layers = model.config.num_hidden_layers
    # k_proj, v_proj and the MLP's three of each layer (the last layer's o_proj and MLP are dropped: their output is
    # never read), and both norms where they are used
    assert len([r for r in shared.values() if r[2] > 4 * model.config.hidden_size]) == 2 * layers + 3 * (layers - 1)
    own = [length for file, _, length in ranges["context_kv"].values() if file == "context_kv.onnx.data"]
    config = model.config  # o_proj summed over each query group: (kv heads x head dim, hidden) in fp32
    assert own == [config.num_key_value_heads * config.head_dim * config.hidden_size * 4] * (layers - 1)
    for graph, found in ranges.items():
        assert {r[0] for r in found.values()} <= {f"{graph}.onnx.data", "decoder.onnx.data"}, graph
    for file in {r[0] for found in ranges.values() for r in found.values()}:
        read = {(offset, length) for found in ranges.values() for f, offset, length in found.values() if f == file}
        assert sum(length for _, length in read) == (folder / file).stat().st_size, file  # no byte unread


def test_fused_node_and_function(exported, tmp_path):
    _, folder, _ = exported("gemma2")
    decoder = onnx.load(folder / "decoder.onnx")
    nodes = [n for n in decoder.graph.node if n.domain == "dattn"]
    assert [n.op_type for n in nodes] == ["DecomposedAttention"] * 3
    attrs = [{a.name: onnx.helper.get_attribute_value(a) for a in n.attribute} for n in nodes]
    assert [a["window"] for a in attrs] == [8, 0, 8]  # Gemma 2's sliding / global layers
    assert attrs[0]["num_kv_heads"] == 1 and attrs[0]["head_dim"] == 32 and abs(attrs[0]["scale"] - 24**-0.5) < 1e-7
    assert attrs[0]["softcap"] == 50.0 and attrs[0]["merge"] == b"alpha" and attrs[0]["plugin_namespace"] == b"dattn"
    assert [(f.domain, f.name) for f in decoder.functions] == [("dattn", "DecomposedAttention")]
    assert {(o.domain, o.version) for o in decoder.opset_import} == {("", 18), ("dattn", 1)}
    assert decoder.ir_version <= 10
    # the visual stream is diagonal: no attention node at all in context_kv.onnx
    assert not [n for n in onnx.load(folder / "context_kv.onnx").graph.node if n.domain == "dattn"]
    # no node keeps the exporter's notes (the stack it was traced from: this machine's paths, our line numbers)
    source = str(Path(dattn_export.__file__).parent).encode()  # where our code lies on this machine
    for graph in folder.glob("*.onnx"):
        assert not [n for n in onnx.load(graph).graph.node if n.metadata_props], graph.name
        assert source not in graph.read_bytes(), graph.name
    # every RMSNorm (four a layer, the final one) runs as ONNX Runtime's fused kernel
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(str(folder / "decoder.onnx"), options, providers=["CPUExecutionProvider"])
    optimized = [n.op_type for n in onnx.load(tmp_path / "optimized.onnx").graph.node]
    assert optimized.count("SimplifiedLayerNormalization") == 3 * 4 + 1


@pytest.mark.slow
def test_standard_attention_and_fp16(tmp_path):
    model = build_model("mistral", dattn_diagonal=False)  # V2V is then attention too
    checkpoint = checkpoint_of(model, tmp_path / "ckpt")
    export_onnx(checkpoint, tmp_path / "standard", attention="standard")
    for graph in ("context_kv", "decoder"):
        assert not [n for n in onnx.load(tmp_path / "standard" / f"{graph}.onnx").graph.node if n.domain]
    runtime = OrtModel(tmp_path / "standard")
    run_case(model, runtime, 3, 52, 0, 2, seed=7)
    run_case(model, runtime, 3, 1, 41, 1, seed=8)

    export_onnx(checkpoint, tmp_path / "fp16", dtype="fp16")
    report = validate(tmp_path / "fp16", checkpoint, steps=8)
    assert report.passed and report.dtype == "float16", report.to_json()
    logits_error = max(c.max_abs for c in report.comparisons if c.output.startswith("logits"))
    assert 1e-4 < logits_error <= report.tolerance  # fp16 really ran: errors above fp32's, within fp16's bound


@pytest.mark.slow  # 30 s; the fast tier checks the verdict's rule and validate's refusals
def test_validate_command_writes_report(tmp_path):
    checkpoint = write_demo_checkpoint(tmp_path / "ckpt")
    assert run_cli("onnx", checkpoint, "-o", tmp_path / "onnx").returncode == 0
    result = run_cli("validate", tmp_path / "onnx", "--max-new-tokens", "6")
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "onnx" / "validation_report.json").read_text())
    assert report["passed"] and report["agreement"] == 6 and report["reference"] == str(checkpoint.absolute())
    assert "logits (decode steps)" in [c["output"] for c in report["comparisons"]] and "6/6 agree" in result.stdout
    # the same graphs held to no error at all fail: exit 1, the report says so and names its bounds
    strict = run_cli("validate", tmp_path / "onnx", "--max-new-tokens", "2", "--atol", "0", "--rtol", "0")
    report = json.loads((tmp_path / "onnx" / "validation_report.json").read_text())
    assert strict.returncode == 1 and not report["passed"] and (report["tolerance"], report["rtol"]) == (0, 0)
    assert "logits within atol 0)" in strict.stdout and "FAILED: logits beyond tolerance" in strict.stdout


@pytest.mark.slow
def test_polygraphy_checks_the_saved_data(pipeline, tmp_path):
    """validate --save-polygraphy: polygraphy's own CLI reads every graph's inputs and reference outputs and passes
    on ONNX Runtime (prefill and each decode step); with the reference's logits nudged by 1e-3 it fails."""
    shutil.copytree(pipeline / "onnx", tmp_path / "onnx")  # getting started's export; validate writes its report
    report = validate(tmp_path / "onnx", steps=4, save_polygraphy=tmp_path / "poly")
    assert report.passed and len(report.polygraphy_commands) == 3
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}  # the venv's CLI
    for command in report.polygraphy_commands:
        result = subprocess.run(shlex.split(command), capture_output=True, text=True, env=env)
        assert result.returncode == 0 and "PASSED" in result.stdout + result.stderr, result.stdout + result.stderr
    saved = RunResults.load(str(tmp_path / "poly" / "decoder.outputs.json"))
    assert len(saved[0][1]) == 4  # the prefill and 3 decode steps
    for iteration in saved[0][1]:
        iteration["logits"] = iteration["logits"] + 1e-3
    saved.save(str(tmp_path / "poly" / "decoder.outputs.json"))
    decoder = next(c for c in report.polygraphy_commands if "decoder.onnx" in c)
    result = subprocess.run(shlex.split(decoder), capture_output=True, text=True, env=env)
    assert result.returncode != 0 and "FAILED" in result.stdout + result.stderr


@pytest.mark.parametrize("atol, rtol", [(1e-3, 0.0), (0.0, 0.05), (1e-3, 0.01), (0.0, 0.0)])
def test_the_verdict_is_numpys_allclose(atol, rtol):
    """A gated output passes exactly where numpy's allclose(got, reference, rtol, atol) does."""
    g = torch.Generator().manual_seed(3)
    expected = torch.randn(4, 50, generator=g) * 3
    for scale in (1e-4, 1e-3, 1e-2, 0.0):
        got = (expected + torch.randn(4, 50, generator=g) * scale).numpy()
        comparison = Comparison.of("decoder", "logits", got, expected, (atol, rtol))
        assert comparison.within == np.allclose(got, expected.numpy(), rtol=rtol, atol=atol), (scale, atol, rtol)
    assert Comparison.of("vision", "context_embeds", got, expected).within is None  # not gated


def test_error_percentiles_are_numpys():
    """The report's p90/p95/p99 of the abs error, as polygraphy prints them."""
    got, expected = np.zeros(200, np.float32), torch.linspace(-1, 1, 200)
    comparison = Comparison.of("g", "o", got, expected)
    error = np.abs(expected.numpy())
    assert (comparison.p90, comparison.p95, comparison.p99) == tuple(
        pytest.approx(float(np.percentile(error, q))) for q in (90, 95, 99)
    )
    assert comparison.max_abs == 1.0 and comparison.max_rel == 1.0


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--opset", "13"], "'--opset': 13 is not in the range 18<=x<=23"),
        (["--dtype", "bf16"], "--dtype bf16: needs --opset 22 or later"),
        pytest.param(["--dtype", "fp16", "__overflow__"], "beyond fp16's 65504", marks=pytest.mark.slow),
        (["__not_dattn__"], "is not a D-Attn model"),
    ],
)
def test_onnx_bad_input(tmp_path, args, expected):
    checkpoint = write_demo_checkpoint(tmp_path / "ckpt")
    if "__overflow__" in args:
        from safetensors.torch import load_file, save_file

        shard = sorted(checkpoint.glob("model-*.safetensors"))[0]
        tensors = load_file(shard)
        next(iter(tensors.values()))[0, 0] = 1e5
        save_file(tensors, shard, metadata={"format": "pt"})
    if "__not_dattn__" in args:
        config = json.loads((checkpoint / "config.json").read_text())
        (checkpoint / "config.json").write_text(json.dumps({**config, "model_type": "mistral"}))
    result = run_cli("onnx", checkpoint, "-o", tmp_path / "onnx", *[a for a in args if not a.startswith("__")])
    assert result.returncode == 2, result.stderr
    assert expected in error_line(result.stderr)  # the graphs written before the fault have their lines in a log
    assert not (tmp_path / "onnx").exists() and not list(tmp_path.glob(".onnx.partial-*"))


@pytest.mark.slow
@pytest.mark.parametrize("family, dtype", [("gemma2", "fp16"), ("video", "fp32")])
def test_streamed_export_writes_what_torch_writes_for_the_loaded_model(tmp_path, monkeypatch, family, dtype):
    """Our export traces stand-in weights and streams each weight from the checkpoint as it writes (lazy folds of the
    weights included, the tied head's transpose a block of rows at a time): every graph's .onnx.data is byte for byte
    what torch.onnx.export writes for the model with its weights loaded (context_kv's tensor for tensor: it reads those
    the decoder holds from decoder.onnx.data)."""
    import warnings

    from dattn_export import onnx_weights
    from dattn_export.artifacts import DTYPES
    from dattn_export.checkpoints.source import load_model
    from dattn_export.graphs import graph_specs
    from dattn_export.plugins.onnx_node import fused_nodes
    from dattn_export.stages import onnx_export

    model = released_model("mistral", video=True) if family == "video" else build_model(family)
    checkpoint = checkpoint_of(model, tmp_path / "ckpt")
    monkeypatch.setattr(onnx_export, "EXTERNAL_DATA_BYTES", 0)  # keep every graph's .data file
    monkeypatch.setattr(onnx_weights, "WRITE_CHUNK_BYTES", 1000)  # weights, and transposed ones, in many pieces
    monkeypatch.setattr(onnx_weights, "TRANSPOSE_BLOCK_BYTES", 3000)
    manifest = export_onnx(checkpoint, tmp_path / "ours", dtype=dtype)
    torch_dtype = DTYPES[dtype].torch
    (tmp_path / "torch").mkdir()
    for name, spec in graph_specs(load_model(checkpoint, torch_dtype), torch_dtype).items():
        with torch.no_grad(), warnings.catch_warnings(), fused_nodes(spec.module):
            warnings.simplefilter("ignore")
            program = torch.onnx.export(
                spec.module,
                spec.args,
                dynamic_shapes=spec.dynamic_shapes,
                input_names=list(spec.inputs),
                output_names=spec.outputs,
                dynamo=True,
                opset_version=manifest.opset,
                verbose=False,
            )
        program.save(tmp_path / "torch" / f"{name}.onnx", external_data=True)
        ours = (tmp_path / "ours" / f"{name}.onnx.data").read_bytes()
        if name != "context_kv":
            assert ours == (tmp_path / "torch" / f"{name}.onnx.data").read_bytes(), name
        else:  # most of its tensors are read from decoder.onnx.data: each tensor's bytes are torch's
            assert len(ours) < (tmp_path / "torch" / f"{name}.onnx.data").stat().st_size / 2
            ours, theirs = (onnx.load(tmp_path / d / f"{name}.onnx").graph.initializer for d in ("ours", "torch"))
            assert {t.name: t.raw_data for t in ours} == {t.name: t.raw_data for t in theirs}


HAVE_ORT_CUDA = "CUDAExecutionProvider" in ort.get_available_providers()


@pytest.mark.slow
def test_ort_on_cuda_without_its_provider_is_one_line(pipeline):
    """`--device cuda` where ONNX Runtime has no CUDA provider (the CPU build): the environment's, exit 3, naming
    onnxruntime-gpu."""
    if HAVE_ORT_CUDA:
        pytest.skip("onnxruntime-gpu is installed here: nothing is missing")
    result = run_cli("validate", pipeline / "onnx", "--device", "cuda")
    (line,) = result.stderr.strip().splitlines()
    assert result.returncode == 3 and "--device cuda: ONNX Runtime" in line and "onnxruntime-gpu" in line, line


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_ORT_CUDA, reason="needs onnxruntime-gpu (the [gpu] extra) and an NVIDIA GPU")
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_validate_on_onnx_runtime_s_cuda_provider(tmp_path, family, dtype):
    """The same graphs on ONNX Runtime's CUDA provider pass validate within their dtype's tolerance, and give the
    CPU provider's greedy tokens."""
    checkpoint = write_demo_checkpoint(tmp_path / "ckpt", family)
    export_onnx(checkpoint, tmp_path / "onnx", dtype=dtype)
    on_gpu = validate(tmp_path / "onnx", checkpoint, steps=8, device="cuda")
    on_cpu = validate(tmp_path / "onnx", checkpoint, steps=8)
    assert on_gpu.passed and on_gpu.device == "cuda", on_gpu.to_json()
    assert on_gpu.backend_tokens == on_cpu.backend_tokens
