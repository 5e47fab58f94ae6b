"""The ONNX function body of dattn::DecomposedAttention, run by ONNX Runtime, against the reference op."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from helpers.checks import context_segments
from onnx import TensorProto, helper

from dattn_export.plugins import contract
from dattn_export.plugins.contract import Attributes
from dattn_export.plugins.onnx_node import Variant, build_function

OPSET = 18


def single_node_model(attributes: dict, variant: Variant, dtype=TensorProto.FLOAT, mask_type=TensorProto.BOOL) -> bytes:
    node = helper.make_node(contract.TYPE, list(contract.INPUTS), ["out"], domain=contract.DOMAIN, **attributes)

    def value(name, elem, rank):
        return helper.make_tensor_value_info(name, elem, [None] * rank)

    inputs = [value(n, mask_type if "mask" in n else dtype, 2 if "mask" in n else 4) for n in contract.INPUTS]
    graph = helper.make_graph([node], "dattn", inputs, [value("out", dtype, 4)])
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(contract.DOMAIN, contract.VERSION)],
        functions=[build_function(variant, OPSET)],
        ir_version=10,
    )
    onnx.checker.check_model(model, full_check=True)
    return model.SerializeToString()


def problem(batch, heads, kv_heads, queries, past, visual, dim, seed):
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g)
    keys = past + queries
    key_mask = torch.ones(batch, keys, dtype=torch.bool)
    key_mask[0, :2] = False  # left padding
    context_mask = torch.ones(batch, visual, dtype=torch.bool)
    if visual > 3:
        context_mask[-1, -3:] = False  # fewer images in the last row
    return dict(
        q=rand(batch, heads, queries, dim),
        k=rand(batch, kv_heads, keys, dim),
        v=rand(batch, kv_heads, keys, dim),
        key_mask=key_mask,
        q_vis=rand(batch, heads, queries, dim),
        k_vis=rand(batch, kv_heads, visual, dim),
        v_vis=rand(batch, kv_heads, visual, dim),
        context_mask=context_mask,
    )


GRID = [
    # heads, kv_heads, queries, past, visual, softcap, window, merge, causal_context
    (8, 8, 5, 0, 7, None, None, "alpha", False),
    (8, 2, 5, 3, 7, None, None, "alpha", False),
    (8, 1, 1, 9, 13, 1.5, None, "alpha", False),  # decode step, GQA 8, soft-capping that bites
    (8, 2, 6, 4, 9, None, 3, "alpha", False),  # sliding window
    (4, 2, 4, 2, 6, 2.0, 4, "sum", False),
    (4, 2, 4, 2, 0, None, None, "sum", False),  # no image: an empty visual segment
    (4, 2, 4, 2, 0, None, None, "alpha", False),
    (4, 4, 7, 0, 5, None, 4, "alpha", True),  # not debiased: visual keys are causal slots
    (4, 2, 3, 2, 5, 1.0, None, "sum", True),
]


@pytest.mark.parametrize("heads, kv_heads, queries, past, visual, softcap, window, merge, causal_context", GRID)
def test_function_body_matches_reference(
    heads, kv_heads, queries, past, visual, softcap, window, merge, causal_context
):
    inputs = problem(2, heads, kv_heads, queries, past, visual, 16, seed=heads + queries + visual)
    attributes = Attributes.from_reference(
        scale=0.3, softcap=softcap, window=window, merge=merge, causal_context=causal_context
    )
    variant = Variant(merge, softcap is not None, causal_context, compute_cast=False)
    node = single_node_model(attributes.node_attributes(heads, kv_heads, 16), variant)
    session = ort.InferenceSession(node, providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {n: t.numpy() for n, t in inputs.items()})
    expected = contract.reference(tuple(inputs.values()), attributes)
    np.testing.assert_allclose(got, expected.numpy(), atol=1e-5, rtol=0)
    assert np.abs(expected.numpy()).max() > 0.1


@pytest.mark.parametrize("lengths", [[9, 6], [5, 8, 3]])
@pytest.mark.parametrize("merge, queries, window", [("sum", 4, None), ("sum", 1, 3), ("alpha", 4, 3)])
def test_function_body_with_context_segments(lengths, merge, queries, window):
    """N context segments (a video model's frames and audio): the mask gives each key's segment (int64, as the
    decoder graphs feed it), one row without segment 2."""
    inputs = problem(2, 8, 2, queries, 5, sum(lengths), 16, seed=sum(lengths) + queries)
    inputs["key_mask"], inputs["context_mask"] = inputs["key_mask"].long(), context_segments(2, lengths)
    attributes = Attributes.from_reference(
        scale=0.3, softcap=2.0, window=window, merge=merge, num_contexts=len(lengths)
    )
    variant = Variant(merge, True, False, compute_cast=False, num_contexts=len(lengths))
    model = single_node_model(attributes.node_attributes(8, 2, 16), variant, mask_type=TensorProto.INT64)
    session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {n: t.numpy() for n, t in inputs.items()})
    expected = contract.reference(tuple(inputs.values()), attributes)
    np.testing.assert_allclose(got, expected.numpy(), atol=1e-5, rtol=0)


@pytest.mark.parametrize("merge", ["alpha", "sum"])
def test_function_body_without_causality(merge):
    """causal=0 (MMCA's attention within an image): every real key is visible; an absent attribute means 1 (as does
    every other absent attribute: its default in the contract)."""
    inputs = problem(2, 4, 2, 6, 0, 0, 16, seed=11)
    variant = Variant(merge, False, False, compute_cast=False)
    feeds = {n: t.numpy() for n, t in inputs.items()}
    args = tuple(inputs.values())
    for causal in (0, 1, None):
        attributes = Attributes(0.3, merge=merge, causal=1 if causal is None else causal)
        node_attributes = attributes.node_attributes(4, 2, 16)
        if causal is None:  # only what has no default
            node_attributes = {k: v for k, v in node_attributes.items() if k not in Attributes.defaults()}
        session = ort.InferenceSession(single_node_model(node_attributes, variant), providers=["CPUExecutionProvider"])
        (got,) = session.run(None, feeds)
        np.testing.assert_allclose(got, contract.reference(args, attributes).numpy(), atol=1e-5, rtol=0)
    bidirectional = contract.reference(args, Attributes(0.3, merge=merge, causal=0))
    assert (bidirectional - contract.reference(args, Attributes(0.3, merge=merge))).abs().max() > 0.05


def test_function_body_fp16_computes_in_fp32():
    inputs = problem(2, 8, 2, 3, 4, 6, 16, seed=3)
    inputs = {n: t.half() if t.is_floating_point() else t for n, t in inputs.items()}
    attributes = Attributes(0.25)
    model = single_node_model(
        attributes.node_attributes(8, 2, 16), Variant("alpha", False, False, compute_cast=True), TensorProto.FLOAT16
    )
    session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {n: t.numpy() for n, t in inputs.items()})
    expected = contract.reference(tuple(inputs.values()), attributes)
    assert got.dtype == np.float16
    np.testing.assert_allclose(got.astype(np.float32), expected.float().numpy(), atol=2e-3, rtol=0)


@pytest.mark.parametrize("softcap", [None, 1.5])
def test_function_body_keeps_ort_matmuls_unscaled(tmp_path, softcap):
    """ONNX Runtime fuses a constant factor on a MatMul's product into it (FusedMatMul alpha), and at decode its
    alpha != 1 path reads K 3x slower (bench/serving.py): the body scales the query instead. This checks the
    graph ORT actually runs."""
    attributes = Attributes.from_reference(scale=0.3, softcap=softcap)
    variant = Variant("sum", softcap is not None, False, compute_cast=False)
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    model = single_node_model(attributes.node_attributes(8, 2, 16), variant)
    ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    matmuls = [n for n in onnx.load(tmp_path / "optimized.onnx").graph.node if n.op_type.endswith("MatMul")]
    assert len(matmuls) == 4  # text and visual: logits and values
    alphas = [helper.get_attribute_value(a) for n in matmuls for a in n.attribute if a.name == "alpha"]
    assert alphas and all(alpha == 1.0 for alpha in alphas)
