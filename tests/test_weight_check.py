"""The quantized weights' check (stages/weight_check.py): its dequantization against ONNX Runtime's own kernels, its
bound against the literal formula and ORT's quantizer, healthy exports of both families passing, and every kind
of corruption a quantizer bug makes failing with its matrix named."""

import json
import shutil

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from helpers.builders import build_model, checkpoint_of
from helpers.cli import run_cli
from helpers.quantized import (
    initializer,
    nodes_of,
    set_initializer,
    shift_scales,
    shift_zero_point,
    swap_layers,
    take_matrix,
    transpose_block,
)
from onnx import TensorProto, helper

from dattn_export.artifacts import Scheme
from dattn_export.demo_model import write_demo_checkpoint
from dattn_export.stages.onnx_export import export_onnx
from dattn_export.stages.onnx_quantize import weight_quantizer
from dattn_export.stages.weight_check import (
    Initializers,
    check_weights,
    gather_block_quantized,
    in_blocks,
    matmul_nbits,
    rounding_bound,
)


def run_node(node: onnx.NodeProto, initializers: list, feeds: dict, tmp_path) -> tuple[np.ndarray, Initializers]:
    """One com.microsoft node on ONNX Runtime, and the same model's initializers as the check reads them."""
    inputs = [helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
              for name, v in feeds.items()]  # fmt: skip
    graph = helper.make_graph([node], "one", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              initializer=initializers)  # fmt: skip
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets, ir_version=10)
    onnx.save(model, tmp_path / "one.onnx")
    session = ort.InferenceSession(str(tmp_path / "one.onnx"), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0], Initializers(tmp_path / "one.onnx")


@pytest.mark.parametrize("bits, symmetric", [(4, True), (4, False), (8, True), (8, False)])
def test_matmul_nbits_dequantizes_as_onnx_runtime_does(tmp_path, bits, symmetric):
    """B's values as MatMulNBits computes with them: the identity times B on ONNX Runtime (fp32 compute), over a K
    that is no multiple of the block (the last block padded)."""
    k, n, block = 80, 24, 32
    weight = np.random.default_rng(bits).standard_normal((k, n)).astype(np.float32)
    scheme = Scheme(f"int{bits}", block, symmetric)
    packed, scales, zero_points = weight_quantizer(scheme).qbits_block_quant(weight)
    arrays = {"B": packed, "scales": scales} | ({} if symmetric else {"zero_points": zero_points})
    node = helper.make_node("MatMulNBits", ["A", *arrays], ["y"], domain="com.microsoft", K=k, N=n, bits=bits,
                            block_size=block, accuracy_level=0)  # fmt: skip
    initializers = [onnx.numpy_helper.from_array(v, name) for name, v in arrays.items()]
    expected, read = run_node(node, initializers, {"A": np.eye(k, dtype=np.float32)}, tmp_path)
    quantized = matmul_nbits(node, read)
    got = quantized.dequantize(0, n).reshape(n, -1)[:, :k]
    np.testing.assert_array_equal(got, expected.T)
    assert quantized.symmetric == symmetric


@pytest.mark.parametrize("symmetric", [True, False])
def test_gather_block_quantized_dequantizes_as_onnx_runtime_does(tmp_path, symmetric):
    """A 4-bit table as GatherBlockQuantized looks every row up: INT4 symmetric, UINT4 with zero points, packed over
    the whole tensor as the export writes it."""
    rows, width, block = 7, 48, 16
    table = np.random.default_rng(3).standard_normal((rows, width)).astype(np.float32)
    packed, scales, zero_points = weight_quantizer(Scheme("int4", block, symmetric)).quantize_ndarray(
        table, 1, block, symmetric
    )
    kind = TensorProto.INT4 if symmetric else TensorProto.UINT4
    initializers = [helper.make_tensor("data", kind, [rows, width], packed.tobytes(), raw=True),
                    onnx.numpy_helper.from_array(scales, "scales")]  # fmt: skip
    names = ["data", "indices", "scales"]
    if not symmetric:
        initializers.append(
            helper.make_tensor("zero_points", kind, list(scales.shape), zero_points.tobytes(), raw=True)
        )
        names.append("zero_points")
    node = helper.make_node("GatherBlockQuantized", names, ["y"], domain="com.microsoft", gather_axis=0,
                            quantize_axis=1, block_size=block)  # fmt: skip
    expected, read = run_node(node, initializers, {"indices": np.arange(rows, dtype=np.int64)}, tmp_path)
    got = gather_block_quantized(node, read).dequantize(0, rows).reshape(rows, width)
    np.testing.assert_array_equal(got, expected)


def test_the_bound_is_half_a_step_of_the_schemes_grid():
    """The formula on one block by hand: symmetric int4 puts max |w| = 1 at 8 steps of 1/8, so the other sign's
    -0.95 lies 0.075 beyond its 7 steps; asymmetric int4 spans [min(w, 0), max(w, 0)] in 15 steps."""
    ulps = 4 * float(np.finfo(np.float32).eps)
    block = np.array([[[1.0, -0.95, 0.3, 0.0]]], np.float32)
    symmetric = rounding_bound(block, 4, symmetric=True)[0, 0]
    np.testing.assert_allclose(symmetric, [1 / 16 + ulps, 1 / 16 + 0.075 + ulps, 1 / 16 + ulps, 1 / 16 + ulps],
                               rtol=1e-6)  # fmt: skip
    tie = np.array([[[-1.0, 0.95, 1.0, -0.9]]], np.float32)  # both signs reach 1: either may be the short side
    np.testing.assert_allclose(rounding_bound(tie, 4, symmetric=True)[0, 0],
                               [1 / 16 + 0.125, 1 / 16 + 0.075, 1 / 16 + 0.125, 1 / 16 + 0.025], rtol=1e-5)  # fmt: skip
    positive = np.array([[[0.5, 1.0, 0.75, 0.6]]], np.float32)  # the grid still reaches 0
    np.testing.assert_allclose(rounding_bound(positive, 4, symmetric=False)[0, 0], 1 / 30 + ulps, rtol=1e-6)
    np.testing.assert_allclose(rounding_bound(block, 8, symmetric=False)[0, 0], 1.95 / 255 / 2 + ulps, rtol=1e-6)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
def test_onnx_runtimes_quantizer_meets_the_bound_tightly(bits, symmetric):
    """ORT's block quantizer, on Gaussian, heavy-tailed, one-signed and few-valued weights (both signs reaching a
    block's largest |w|, as bfloat16's coarse values often do): every element within the bound, and the worst close
    to it (the bound is not loose)."""
    rng = np.random.default_rng(0)
    weight = np.concatenate([rng.standard_normal((512, 64)), rng.standard_t(2, (512, 64)),
                             rng.uniform(0.1, 1, (512, 64)), rng.integers(-4, 5, (512, 64)) / 4],
                            axis=1).astype(np.float32)  # fmt: skip
    packed, scales, zero_points = weight_quantizer(Scheme(f"int{bits}", 32, symmetric)).qbits_block_quant(weight)
    from dattn_export.stages.weight_check import QuantizedNode, unpack

    columns, blocks = weight.shape[1], weight.shape[0] // 32
    points = 1 << (bits - 1) if symmetric else unpack(zero_points, bits, blocks)
    got = QuantizedNode(columns, 512, 32, bits, packed, scales, points, signed=False).dequantize(0, columns)
    expected = in_blocks(np.ascontiguousarray(weight.T), 32)
    ratio = np.abs(got - expected) / rounding_bound(expected, bits, symmetric)
    assert 0.95 < ratio.max() <= 1.0, ratio.max()


# --- exports of both families, healthy and damaged --------------------------------------------------------------

EXPORTS = {
    # the demo model (Mistral), int4 symmetric: the visual stream's o_proj is its per-KV-head sum (a fold)
    "mistral-int4": lambda work: (write_demo_checkpoint(work / "mistral"), Scheme("int4")),
    # Gemma 2, int8 asymmetric, the tied head and the embedding table (GatherBlockQuantized, 4 bits) quantized too
    "gemma2-int8": lambda work: (
        checkpoint_of(build_model("gemma2"), work / "gemma2"),
        Scheme("int8", 16, symmetric=False, lm_head=True, embedding=True),
    ),
}


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    work, made = tmp_path_factory.mktemp("weight-check"), {}
    for name, make in EXPORTS.items():
        checkpoint, scheme = make(work)
        export_onnx(checkpoint, work / name, quantize=scheme)
        made[name] = (work / name, checkpoint)
    return made


def damaged(exports, tmp_path, name: str, graph: str, damage) -> tuple:
    """A copy of an export with `damage(model)` done to one graph."""
    folder, checkpoint = exports[name]
    shutil.copytree(folder, tmp_path / name)
    model = onnx.load(tmp_path / name / f"{graph}.onnx")
    damage(model)
    onnx.save(model, tmp_path / name / f"{graph}.onnx")
    return tmp_path / name, checkpoint


def failed_on(folder, checkpoint) -> list[tuple[str, str]]:
    """The (graph, node) of every matrix the check fails; the check must not pass."""
    report = check_weights(folder, checkpoint)
    assert not report.passed and not report.problems, report.problems
    return [(m.location.removesuffix(".onnx"), m.node) for m in report.matrices if not m.passed]


@pytest.mark.parametrize("name", list(EXPORTS))
def test_healthy_exports_pass(exports, name):
    folder, checkpoint = exports[name]
    report = check_weights(folder, checkpoint)
    assert report.passed and not report.problems
    manifest = json.loads((folder / "onnx_manifest.json").read_text())["quantization"]
    ops = [n.op_type for g in ("context_kv", "decoder") for n in onnx.load(folder / f"{g}.onnx").graph.node]
    assert len(report.matrices) == ops.count("MatMulNBits") + ops.count("GatherBlockQuantized")
    assert sum(manifest["matmuls"].values()) == ops.count("MatMulNBits")
    sources = {m.source for m in report.matrices}
    if name == "mistral-int4":  # the visual stream's o_proj: its fold, recomputed from the checkpoint
        assert "Reshape(ReduceSum(Reshape(model.layers.0.self_attn.o_proj.weight)))" in sources
    else:  # the table, and the tied head read from it
        assert {m.op for m in report.matrices} == {"MatMulNBits", "GatherBlockQuantized"}
    worst = report.worst
    print(f"{name}: {len(report.matrices)} matrices, worst ratio to the bound {worst.worst_ratio:.6f} ({worst.node})")
    assert 0.9 < worst.worst_ratio <= 1.0


@pytest.mark.parametrize("graph, index", [("decoder", 0), ("decoder", 16), ("context_kv", 8)])
def test_scales_a_row_off_fail_naming_the_matrix(exports, tmp_path, graph, index):
    """One matrix's scales moved by one output row, in the first, the last or the visual stream's layers."""
    folder, checkpoint = damaged(
        exports, tmp_path, "mistral-int4", graph, lambda m: shift_scales(m, [nodes_of(m, "MatMulNBits")[index]])
    )
    node = nodes_of(onnx.load(folder / f"{graph}.onnx"), "MatMulNBits")[index].name
    assert failed_on(folder, checkpoint) == [(graph, node)]


def test_the_issues_corruption_exits_1_naming_the_first_bad_matrix(exports, tmp_path):
    """Layer 1's q, v and down projections' scales each a row off: an accuracy gate over a few prompts passed this
    on a trained model; `validate` now exits 1 on the weights, naming the first."""
    folder, _ = damaged(exports, tmp_path, "mistral-int4", "decoder",
                        lambda m: shift_scales(m, [nodes_of(m, "MatMulNBits")[i] for i in (7, 9, 13)]))  # fmt: skip
    result = run_cli("validate", folder, "--weights-only")
    assert result.returncode == 1, result.stderr[-2000:]
    verdict = result.stdout.strip().splitlines()[-1]
    assert verdict.startswith("FAILED: decoder.onnx node node_linear_7_Q4 (model.layers.1.self_attn.q_proj.weight)")
    assert "x its rounding bound" in verdict
    report = json.loads((folder / "validation_report.json").read_text())
    failed = [m["node"] for m in report["weights"]["matrices"] if m["worst_ratio"] > 1]
    assert failed == ["node_linear_7_Q4", "node_linear_9_Q4", "node_linear_13_Q4"] and not report["passed"]
    full = run_cli("validate", folder)  # the whole validate stops there, before the graphs run
    assert full.returncode == 1 and full.stdout.strip().splitlines()[-1] == verdict


def test_a_shifted_zero_point_fails(exports, tmp_path):
    """One block's zero point one higher, in an asymmetric export."""
    folder, checkpoint = damaged(
        exports, tmp_path, "gemma2-int8", "decoder", lambda m: shift_zero_point(m, nodes_of(m, "MatMulNBits")[3])
    )
    report = check_weights(folder, checkpoint)
    bad = [m for m in report.matrices if not m.passed]
    assert len(bad) == 1 and (bad[0].row, bad[0].block) == (0, 0) and bad[0].source.endswith("o_proj.weight")


def test_two_layers_swapped_fail(exports, tmp_path):
    folder, checkpoint = damaged(exports, tmp_path, "mistral-int4", "decoder", lambda m: swap_layers(m, 3))
    names = [n.name for n in nodes_of(onnx.load(folder / "decoder.onnx"), "MatMulNBits")]
    assert failed_on(folder, checkpoint) == [("decoder", name) for name in names[:14]]


def test_a_transposed_block_fails(exports, tmp_path):
    folder, checkpoint = damaged(
        exports, tmp_path, "mistral-int4", "decoder", lambda m: transpose_block(m, nodes_of(m, "MatMulNBits")[4], 32)
    )
    assert failed_on(folder, checkpoint) == [("decoder", "node_linear_4_Q4")]


def test_a_matrix_from_another_layer_fails(exports, tmp_path):
    """Layer 0's q_proj replaced by layer 2's, which has its shape, scales and all."""

    def damage(model):
        nodes = nodes_of(model, "MatMulNBits")
        take_matrix(model, nodes[0], nodes[14])

    folder, checkpoint = damaged(exports, tmp_path, "mistral-int4", "decoder", damage)
    assert failed_on(folder, checkpoint) == [("decoder", "node_linear_Q4")]


def test_a_tables_scales_a_row_off_fail(exports, tmp_path):
    def damage(model):
        node = nodes_of(model, "GatherBlockQuantized")[0]
        scales = initializer(model, node.input[2])
        set_initializer(model, node.input[2], np.roll(scales, 1, axis=0))

    folder, checkpoint = damaged(exports, tmp_path, "gemma2-int8", "decoder", damage)
    failed = failed_on(folder, checkpoint)
    assert len(failed) == 1 and failed[0][1].endswith("_Q4")  # the table's node (4 bits whatever the scheme)


def test_an_export_without_recorded_sources_is_refused_in_one_line(exports, tmp_path):
    """An export from before the sources were recorded: it says to export again, rather than pass unchecked."""
    folder, checkpoint = exports["mistral-int4"]
    shutil.copytree(folder, tmp_path / "old")
    manifest = json.loads((tmp_path / "old" / "onnx_manifest.json").read_text())
    del manifest["quantization"]["sources"]
    (tmp_path / "old" / "onnx_manifest.json").write_text(json.dumps(manifest))
    report = check_weights(tmp_path / "old", checkpoint)
    assert not report.passed and report.problems[0].endswith("export it again")
