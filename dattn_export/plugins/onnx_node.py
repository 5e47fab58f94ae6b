"""`dattn::DecomposedAttention` in ONNX: the node the exporter emits for each attention, and the model-local function
of standard ops behind it, so ONNX Runtime (and any runtime without the plugin) executes it. Tested against the
contract's reference.

The numeric attributes (scale, softcap, window, causal) are read from each node (`ref_attr_name`), so one function
serves layers with and without a sliding window. What changes the graph's structure (merge mode, soft-capping
on/off, causal visual keys, compute dtype) is fixed per model: every node of a model shares it, and the
exporter checks that.

Grouped-query attention never copies K/V: queries (B, Hq, T, D) are viewed as (B, Hkv, G, T, D) and K/V
as (B, Hkv, 1, S, D), so each MatMul broadcasts K/V over the group. At decode (T = 1) that makes every product
a matrix-vector one, which ONNX Runtime's CPU MatMul runs about twice as fast as the (G*T)-row product of a
(B, Hkv, G*T, D) view: the step is bound by reading the visual K/V (bench/serving.py). The alpha
merge shares one running max and sum between the two segments instead of concatenating their logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper

from . import contract
from .contract import Attributes

FLOAT_MIN = float(np.finfo(np.float32).min)


@dataclass(frozen=True)
class Variant:
    """What the function body's structure depends on; the same for every node of one model."""

    merge: str  # alpha | sum
    softcap: bool
    causal_context: bool
    compute_cast: bool  # inputs are fp16/bf16: compute in fp32 like the reference
    num_contexts: int = 1  # with the sum merge, one softmax per context segment

    @classmethod
    def of_node(cls, node: onnx.NodeProto, compute_cast: bool) -> Variant:
        attributes = contract.from_node(node)
        return cls(
            attributes.merge,
            attributes.softcap > 0,
            bool(attributes.causal_context),
            compute_cast,
            attributes.num_contexts,
        )


def emit_node(q, k, v, key_mask, q_vis, k_vis, v_vis, context_mask, **keywords) -> torch.Tensor:
    """`DAttnAttention.op` while exporting: one custom-domain node whose attributes carry everything a kernel
    needs (the exporter keeps a bare custom node; the function body is attached afterwards)."""
    attributes = Attributes.from_reference(**keywords).node_attributes(q.shape[1], k.shape[1], q.shape[3])
    inputs = [q, k, v, key_mask, q_vis, k_vis, v_vis, context_mask]
    return torch.onnx.ops.symbolic(
        contract.ID, inputs, attributes, dtype=q.dtype, shape=q.shape, version=contract.VERSION
    )


def fused_nodes(model: torch.nn.Module):
    """While active, every attention of `model` exports as one `dattn::DecomposedAttention` node."""
    return contract.using_op(model, emit_node)


class _Body:
    """Builds the function's nodes; each op returns the name of its (single) output."""

    def __init__(self):
        self.nodes: list[onnx.NodeProto] = []

    def op(self, op_type: str, *inputs: str, **attributes) -> str:
        name = f"_{len(self.nodes)}_{op_type}"
        self.nodes.append(helper.make_node(op_type, list(inputs), [name], **attributes))
        return name

    def const(self, value, dtype=np.int64) -> str:
        array = np.array(value, dtype=dtype)
        return self.op("Constant", value=onnx.numpy_helper.from_array(array))

    def attribute(self, name: str, kind: str) -> str:
        """A scalar from the calling node's attribute `name` (kind: int | float)."""
        node = helper.make_node("Constant", [], [f"_{len(self.nodes)}_{name}"])
        ref = onnx.AttributeProto(name=f"value_{kind}", ref_attr_name=name)
        ref.type = onnx.AttributeProto.INT if kind == "int" else onnx.AttributeProto.FLOAT
        node.attribute.append(ref)
        self.nodes.append(node)
        return node.output[0]

    def dim(self, tensor: str, axis: int) -> str:
        """One dimension of `tensor` as a 1-D int64 tensor."""
        return self.op("Shape", tensor, start=axis, end=axis + 1)


def build_function(variant: Variant, opset: int) -> onnx.FunctionProto:
    b = _Body()
    q, k, v, key_mask, q_vis, k_vis, v_vis, context_mask = contract.INPUTS
    if variant.compute_cast:
        q, k, v, q_vis, k_vis, v_vis = (b.op("Cast", x, to=TensorProto.FLOAT) for x in (q, k, v, q_vis, k_vis, v_vis))
    as_1d = lambda x: b.op("Reshape", x, b.const([1]))
    kv_heads = as_1d(b.attribute("num_kv_heads", "int"))
    groups = b.op("Div", as_1d(b.attribute("num_heads", "int")), kv_heads)
    batch, queries, head_dim, keys, num_context = b.dim(q, 0), b.dim(q, 2), b.dim(q, 3), b.dim(k, 2), b.dim(k_vis, 2)
    minus_one = b.const([-1])
    scale = b.attribute("scale", "float")

    # K/V (B, Hkv, S, D) -> (B, Hkv, 1, S, D), broadcast over the group; queries (B, Hq, T, D) -> (B, Hkv, G, T, D)
    k, v, k_vis, v_vis = (b.op("Unsqueeze", x, b.const([2])) for x in (k, v, k_vis, v_vis))
    grouped_shape = b.op("Concat", batch, kv_heads, groups, queries, head_dim, axis=0)  # text and visual queries

    # The query is scaled, not the product: ORT would fuse a constant factor on the product into the MatMul
    # (alpha), and its alpha != 1 path is 3x slower at decode. Before the reshape, it does not fuse.
    if variant.softcap:
        cap = b.attribute("softcap", "float")
        query_scale = b.op("Div", scale, cap)  # tanh(q.k * scale / cap) * cap
    else:
        query_scale = scale

    def logits(query: str, key: str) -> str:  # -> (B, Hkv, G, T, S), scaled, soft-capped
        scaled = b.op("Mul", query, query_scale)
        grouped = b.op("Reshape", scaled, grouped_shape, allowzero=1)  # a view: keys are not repeated
        s = b.op("MatMul", grouped, b.op("Transpose", key, perm=[0, 1, 2, 4, 3]))
        return b.op("Mul", b.op("Tanh", s), cap) if variant.softcap else s

    # slots: visual keys first when they are causal; text keys next; the queries are the last `queries` slots
    zero, one = b.const(0), b.const(1)
    scalar = lambda x: b.op("Squeeze", x, b.const([0]))
    offset = num_context if variant.causal_context else b.const([0])
    key_slots_end = b.op("Add", offset, keys)
    query_slot = b.op("Range", scalar(b.op("Sub", key_slots_end, queries)), scalar(key_slots_end), one)
    window = b.attribute("window", "int")
    no_window = b.op("Equal", window, zero)
    not_causal = b.op("Equal", b.attribute("causal", "int"), zero)

    def visible(key_slot: str, mask: str) -> str:  # (B, 1, 1, T, S) bool: causal (unless causal=0), windowed, real keys
        distance = b.op("Sub", b.op("Unsqueeze", query_slot, b.const([1])), b.op("Unsqueeze", key_slot, b.const([0])))
        ordered = b.op("Or", b.op("GreaterOrEqual", distance, zero), not_causal)
        ok = b.op("And", ordered, b.op("Or", no_window, b.op("Less", distance, window)))
        ok = b.op(
            "And",
            b.op("Unsqueeze", ok, b.const([0])),
            b.op("Unsqueeze", b.op("Cast", mask, to=TensorProto.BOOL), b.const([1])),
        )
        return b.op("Unsqueeze", ok, b.const([1, 2]))

    neg_inf = b.const(-np.inf, np.float32)
    s_txt = logits(q, k)
    s_txt = b.op("Where", visible(b.op("Range", scalar(offset), scalar(key_slots_end), one), key_mask), s_txt, neg_inf)
    s_vis = logits(q_vis, k_vis)
    segment = b.op("Unsqueeze", b.op("Cast", context_mask, to=TensorProto.INT64), b.const([1, 2, 3]))  # (B,1,1,1,V)

    def context_logits(index: int | None) -> str:  # s_vis where the query sees a key of segment `index` (None: any)
        ok = b.op("Not", b.op("Equal", segment, zero)) if index is None else b.op("Equal", segment, b.const(index))
        if variant.causal_context:
            ok = b.op("And", ok, visible(b.op("Range", zero, scalar(num_context), one), context_mask))
        return b.op("Where", ok, s_vis, neg_inf)

    def reduce(op: str, x: str, pad: float) -> str:
        """Reduce the last axis over x plus one column of `pad`: defined when the axis is empty (no image),
        which ONNX Runtime would otherwise keep as a zero-length axis."""
        column = b.op(
            "ConstantOfShape",
            b.op("Concat", b.op("Shape", x, start=0, end=-1), b.const([1]), axis=0),
            value=onnx.numpy_helper.from_array(np.array([pad], np.float32)),
        )
        return b.op(op, b.op("Concat", x, column, axis=-1), minus_one, keepdims=1)

    def weights(s: str, row_max: str) -> tuple[str, str]:  # exp(s - max) and its row sum
        p = b.op("Exp", b.op("Sub", s, row_max))
        return p, reduce("ReduceSum", p, 0.0)

    def values(p: str, value: str) -> str:  # (B, Hkv, G, T, S) x (B, Hkv, 1, S, D) -> (B, Hkv, G, T, D)
        return b.op("MatMul", p, value)

    def safe(total: str) -> str:  # a row that sees no key gives 0, not NaN
        return b.op("Where", b.op("Equal", total, b.const(0.0, np.float32)), b.const(1.0, np.float32), total)

    max_txt = reduce("ReduceMax", s_txt, FLOAT_MIN)
    if variant.merge == "alpha":  # one softmax over [context ; text]: shared max and sum
        s_vis = context_logits(None)
        row_max = b.op("Max", max_txt, reduce("ReduceMax", s_vis, FLOAT_MIN))
        (p_txt, sum_txt), (p_vis, sum_vis) = weights(s_txt, row_max), weights(s_vis, row_max)
        total = safe(b.op("Add", sum_txt, sum_vis))
        out = b.op("Div", b.op("Add", values(p_txt, v), values(p_vis, v_vis)), total)
    else:  # one softmax per segment (text, then each context segment), summed
        p_txt, sum_txt = weights(s_txt, max_txt)
        out = b.op("Div", values(p_txt, v), safe(sum_txt))
        for index in range(1, variant.num_contexts + 1):
            s_segment = context_logits(index)
            p_vis, sum_vis = weights(s_segment, reduce("ReduceMax", s_segment, FLOAT_MIN))
            out = b.op("Add", out, b.op("Div", values(p_vis, v_vis), safe(sum_vis)))
    out = b.op("Reshape", out, b.op("Shape", "q"))  # (B, Hkv, G, T, D) -> (B, Hq, T, D)
    if variant.compute_cast:
        out = b.op("CastLike", out, "q")
    b.nodes.append(helper.make_node("Identity", [out], ["out"]))
    defaults = Attributes.defaults()
    required = [
        *contract.SHAPE_ATTRIBUTES,
        *(n for n in Attributes.names() if n not in defaults),
        *contract.PLUGIN_ATTRIBUTES,
    ]
    return helper.make_function(
        contract.DOMAIN,
        contract.TYPE,
        list(contract.INPUTS),
        ["out"],
        b.nodes,
        [helper.make_opsetid("", opset)],
        required,
        attribute_protos=[helper.make_attribute(name, value) for name, value in defaults.items()],
    )


def attach_function(model: onnx.ModelProto, low_precision: bool) -> Variant | None:
    """Attach the function body to a model whose attention is `dattn::DecomposedAttention` nodes.
    `low_precision`: the graph's activations are fp16/bf16 (the body then computes in fp32)."""
    nodes = [n for n in model.graph.node if n.domain == contract.DOMAIN and n.op_type == contract.TYPE]
    if not nodes:
        return None
    variants = {Variant.of_node(n, low_precision) for n in nodes}
    if len(variants) != 1:
        raise ValueError(f"DecomposedAttention nodes of one model differ in structure: {variants}")
    variant = variants.pop()
    opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    del model.functions[:]
    model.functions.append(build_function(variant, opset))
    return variant
