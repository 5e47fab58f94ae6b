"""onnx --quantize int4|int8 (ONNX Runtime's MatMulNBits) and validate's accuracy gate.

The gate is held on tiny models trained first on two corpora (`helpers/quantized.py`): healthy int4 and int8 exports
of both pass it (and the weight check), exports whose scales are shifted a row or whose layers are swapped fail the
weight check and the gate alone, and graphs of another model fail it, so passing is not automatic."""

import json

import numpy as np
import onnx
import pytest
from helpers.builders import build_model, checkpoint_of, released_model
from helpers.cli import run_cli
from helpers.quantized import CORPORA, broken_export, train
from onnx import TensorProto, numpy_helper

from dattn_export.artifacts import OnnxManifest, Quantization, Scheme
from dattn_export.demo_model import write_demo_checkpoint
from dattn_export.runtime.ort import external_tensors
from dattn_export.stages import onnx_quantize as quantize
from dattn_export.stages.accuracy_gate import GATES, gate
from dattn_export.stages.onnx_export import export_onnx
from dattn_export.stages.onnx_quantize import QUANTIZED_GRAPHS
from dattn_export.stages.validate import validate
from dattn_export.stages.weight_check import check_weights


@pytest.fixture(scope="module", params=list(CORPORA))
def trained(request, tmp_path_factory):
    work = tmp_path_factory.mktemp(f"quantize-{request.param}")
    base = write_demo_checkpoint(work / "base")
    return checkpoint_of(train(base, CORPORA[request.param]), work / "trained"), work


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_decoder_passes_the_gate(trained, scheme):
    checkpoint, work = trained
    out = work / scheme
    exported = run_cli("onnx", checkpoint, "-o", out, "--quantize", scheme)
    assert exported.returncode == 0 and "[INFO]" not in exported.stderr, exported.stderr[-2000:]  # no library's logs
    manifest = json.loads((out / "onnx_manifest.json").read_text())
    assert manifest["quantization"]["scheme"] == scheme
    context_kv = [n.op_type for n in onnx.load(out / "context_kv.onnx").graph.node]
    assert manifest["quantization"]["matmuls"] == {"context_kv": context_kv.count("MatMulNBits"), "decoder": 21}
    assert "MatMul" not in context_kv  # the visual stream's layers: every weight quantized
    graph = onnx.load(out / "decoder.onnx")
    ops = [n.op_type for n in graph.graph.node]
    assert ops.count("MatMulNBits") == 21 and ops.count("DecomposedAttention") == 3  # 3 layers x 7
    assert any(n.op_type == "MatMul" for n in graph.graph.node)  # the lm_head, kept fp32 by default
    report = validate(out, checkpoint, steps=12)
    assert report.passed, report.gate
    assert report.gate.positions == 48 and report.gate.thresholds == GATES[scheme]
    assert report.weights.passed and len(report.weights.matrices) == sum(manifest["quantization"]["matmuls"].values())
    print(f"{scheme}: weights' worst ratio to the rounding bound {report.weights.worst.worst_ratio:.6f}")
    refused = run_cli("trt", out, "-o", work / f"{scheme}-engines")  # TensorRT's parser has no MatMulNBits
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 2 and len(lines) == 1 and "MatMulNBits" in lines[0], refused.stderr


@pytest.mark.slow
def test_quantized_embedding_passes_the_gate(trained):
    """--quantize-embedding: the table's Gather becomes GatherBlockQuantized (4 bits). On a hidden size of 64 it
    passes the int4 gate with blocks of 16, not of 32 (two blocks a row): why the embedding is not quantized by
    default."""
    checkpoint, work = trained
    out = work / "int4-embedding"
    export = ("onnx", checkpoint, "-o", out, "--quantize", "int4", "--quantize-embedding", "--block-size", "16")
    assert run_cli(*export).returncode == 0
    assert json.loads((out / "onnx_manifest.json").read_text())["quantization"]["embedding"] is True
    ops = [n.op_type for n in onnx.load(out / "decoder.onnx").graph.node]
    assert ops.count("GatherBlockQuantized") == 1 and "Gather" not in ops
    report = validate(out, checkpoint, steps=12)
    assert report.passed, report.gate


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["shift-one", "swap", "shift-three"])
def test_broken_exports_fail(trained, damage):
    """One matrix's scales shifted a row (a quantizer that misaligns them), or two layers exchanged: the weight check
    fails first, naming the first damaged matrix, and the accuracy gate alone fails them too. Three matrices' scales
    a row off in the second layer: the weight check fails it (a gate over a few prompts once passed it)."""
    checkpoint, work = trained
    healthy = work / "int4"
    if not healthy.exists():
        export_onnx(checkpoint, healthy, quantize=Scheme("int4"))
    broken = broken_export(healthy, work / f"int4-{damage}", damage)
    report = validate(broken, checkpoint, steps=12)
    first = {"shift-one": "layers.0.mlp.down_proj", "swap": "layers.0.self_attn.q_proj",
             "shift-three": "layers.1.self_attn.q_proj"}[damage]  # fmt: skip
    assert not report.passed and report.gate is None and f"model.{first}.weight" in report.weights.first_failure()
    if damage != "shift-three":
        report = validate(broken, checkpoint, steps=12, weight_check=False)
        assert not report.passed, report.gate
        assert report.gate.top5_mass < GATES["int4"].top5_mass and report.gate.mean_kl > GATES["int4"].mean_kl


@pytest.mark.slow
def test_the_gate_fails_for_graphs_of_another_model(trained):
    """Graphs of the base (untrained) model validated against the trained one: the weight check fails, and so does
    the same gate alone."""
    checkpoint, work = trained
    export_onnx(work / "base", work / "other", quantize=Scheme("int8"))
    assert not validate(work / "other", checkpoint, steps=12).weights.passed
    report = validate(work / "other", checkpoint, steps=12, weight_check=False)
    assert not report.passed and report.gate.greedy_mass < GATES["int8"].greedy_mass


def test_gate_metrics_are_literal():
    """Greedy mass, top-5 mass and KL(reference || quantized), computed by hand on two positions: the second one's
    greedy token differs, and the quantized top 5 misses the reference's fifth token."""
    reference = [np.log([[0.6999, 0.1, 0.1, 0.05, 0.03, 0.02, 0.0001], [0.1, 0.6, 0.1, 0.1, 0.05, 0.02, 0.03]])]
    quantized = [np.log([[0.5999, 0.2, 0.1, 0.05, 0.03, 0.02, 0.0001], [0.5, 0.2, 0.1, 0.1, 0.02, 0.05, 0.03]])]
    result = gate("int4", reference, quantized)
    p, q = np.exp(reference[0]), np.exp(quantized[0])
    kl = (p * np.log(p / q)).sum(-1)
    assert result.greedy_mass == pytest.approx((1.0 + 0.1 / 0.6) / 2)
    # position 2: the quantized top 5 is tokens 0, 1, 2, 3, 5 (mass 0.92 of the reference's), the reference's 0-4 (0.95)
    assert result.top5_mass == pytest.approx((1.0 + 0.92 / 0.95) / 2)
    assert result.agreement == 0.5
    assert result.mean_kl == pytest.approx(kl.mean()) and result.max_kl == pytest.approx(kl.max())


def ort_quantized(path, scheme: Scheme, hidden: int, vocab: int) -> onnx.ModelProto:
    """What ONNX Runtime's MatMulNBitsQuantizer makes of one graph of a plain fp32 export: the lm_head excluded
    unless `scheme.lm_head` (as `onnx --quantize` does), the embedding's Gather quantized with `scheme.embedding`
    (the decoder's: the graph that has the table)."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    model = onnx.load(path)
    weights = {i.name: tuple(i.dims) for i in model.graph.initializer}
    head = [n.name for n in model.graph.node if n.op_type == "MatMul" and weights.get(n.input[1]) == (hidden, vocab)]
    common = dict(block_size=scheme.block_size, is_symmetric=scheme.symmetric)
    quantizer = MatMulNBitsQuantizer(
        model,
        bits=scheme.bits,
        nodes_to_exclude=[] if scheme.lm_head else head,
        accuracy_level=scheme.accuracy_level or None,
        **common,
    )
    quantizer.process()
    model = quantizer.model.model
    if scheme.embedding and path.stem == "decoder":
        quantizer = MatMulNBitsQuantizer(model, bits=4, op_types_to_quantize=("Gather",), **common)
        quantizer.process()
        model = quantizer.model.model
    return model


def graph_contents(model: onnx.ModelProto) -> tuple[dict, list, dict]:
    """Tensors, nodes (computed values named by the order they are made in: the rewriter after the quantizer numbers
    its own) and opsets."""
    tensors = {
        i.name: (i.data_type, tuple(i.dims), numpy_helper.to_array(i).tobytes()) for i in model.graph.initializer
    }
    made = {name: f"#{k}" for k, name in enumerate(o for n in model.graph.node for o in n.output)}
    nodes = [
        (n.op_type, n.domain, n.name, [made.get(i, i) for i in n.input], sorted(map(str, n.attribute)))
        for n in model.graph.node
    ]
    return tensors, nodes, {o.domain: o.version for o in model.opset_import}


@pytest.mark.parametrize(
    "family, scheme",
    [
        # o_proj above onnxscript's folding size
        pytest.param("mistral", Scheme("int4", 32, True, False, False, 4), marks=pytest.mark.slow),
        # tied head; asymmetric, the table quantized too
        pytest.param("gemma2", Scheme("int8", 16, False, False, True, 0), marks=pytest.mark.slow),
        pytest.param("video", Scheme("int4", 16, False, True, False, 4), marks=pytest.mark.slow),  # the head too
    ],
)
def test_streamed_quantization_writes_what_onnx_runtimes_quantizer_writes(tmp_path, monkeypatch, family, scheme):
    """`onnx --quantize` quantizes each weight as it streams from the checkpoint; ONNX Runtime's quantizer, run on
    the whole plain fp32 export, is the reference: every graph's tensors (names, types, shapes, bytes), nodes and
    opsets are the same."""
    from dattn_export.stages import onnx_export

    wide = dict(hidden_size=128, intermediate_size=256, head_dim=32) if family == "mistral" else {}
    model = released_model("mistral", video=True) if family == "video" else build_model(family, **wide)
    checkpoint = checkpoint_of(model, tmp_path / "ckpt")
    monkeypatch.setattr(onnx_export, "EXTERNAL_DATA_BYTES", 0)  # both with .data files, as at full size
    monkeypatch.setattr(quantize, "EMBEDDING_ROWS_BYTES", 1000)  # the table in many chunks of rows
    manifest = export_onnx(checkpoint, tmp_path / "streamed", quantize=scheme)
    export_onnx(checkpoint, tmp_path / "plain")
    weights = check_weights(tmp_path / "streamed", checkpoint)  # every matrix within the scheme's rounding
    assert weights.passed and len(weights.matrices) == sum(manifest.quantization.matmuls.values()) + scheme.embedding
    # the decoder's matrices whose bytes context_kv.onnx reads too are checked once, there
    assert {m.same_as.split()[0] for m in weights.matrices if m.same_as} == {"context_kv.onnx"}
    # the manifest reads back as written, its optional parts typed (quantization, a video model's fields)
    assert OnnxManifest.read(tmp_path / "streamed") == manifest and isinstance(manifest.quantization, Quantization)
    config = model.config
    for name in QUANTIZED_GRAPHS:
        expected = ort_quantized(tmp_path / "plain" / f"{name}.onnx", scheme, config.hidden_size, config.vocab_size)
        got = onnx.load(tmp_path / "streamed" / f"{name}.onnx")
        assert graph_contents(got) == graph_contents(expected), name
        listed = external_tensors(onnx.load(tmp_path / "streamed" / f"{name}.onnx", load_external_data=False).graph)
        written = sum(length for file, _, length in listed.values() if file == f"{name}.onnx.data")
        assert (tmp_path / "streamed" / f"{name}.onnx.data").stat().st_size == written  # no weight written unread
        quantized = sum(n.op_type == "MatMulNBits" for n in got.graph.node)
        assert quantized == manifest.quantization.matmuls[name] > 0
        if name == "context_kv":  # every matrix, o_proj's group sum (folded whatever its size) too: each layer's
            # k_proj and v_proj, and o_proj and the MLP's three of all layers but the last (whose output is not read)
            layers = config.num_hidden_layers
            scales = {n.input[2] for n in got.graph.node if n.op_type == "MatMulNBits"}
            floats = [i.name for i in got.graph.initializer if len(i.dims) == 2 and i.data_type == TensorProto.FLOAT]
            matrices = [f for f in floats if f not in scales]
            assert not matrices and quantized == 2 * layers + 4 * (layers - 1), matrices
    gathers = [n.op_type for n in onnx.load(tmp_path / "streamed" / "decoder.onnx").graph.node if "Gather" in n.op_type]
    assert ("GatherBlockQuantized" in gathers) == scheme.embedding
