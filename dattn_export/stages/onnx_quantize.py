"""`onnx --quantize int4|int8`: weight-only quantization by ONNX Runtime's own block quantizer (MatMulNBits: block-wise
integer weights with a scale per block) of the LLM's MatMuls in context_kv.onnx and decoder.onnx, and with
--quantize-embedding of the embedding table's Gather (GatherBlockQuantized, 4 bits whatever the scheme: blocks along
the hidden axis, so a looked-up row is dequantized alone). The fused attention nodes and their function are kept as
they are, and so is the vision tower (see KEPT). A decode step reads every weight once, so on a CPU its time
follows the weights' bytes.

The graphs are rewritten as ONNX Runtime's MatMulNBitsQuantizer rewrites them (the same nodes, names and
attributes; each weight quantized by its own `qbits_block_quant` / `quantize_ndarray`), but on the export's
in-memory graph before it is written, with every quantized tensor lazy: each weight is read from the checkpoint,
quantized and written one at a time, and the embedding table a chunk of rows at a time. ORT's quantizer loads the
whole fp32 graph (36 GB at 9 B parameters).

The quantized decoder is not held to the fp32 tolerance: `validate` applies the accuracy gate (accuracy_gate.py)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import onnx_ir as ir

from ..artifacts import Scheme, WeightSource
from ..patches import kept_root_logger

QUANTIZED_GRAPHS = ("context_kv", "decoder")  # the LLM's layers: 8 B of a 9 B model's parameters
KEPT = (
    "the vision and audio towers keep the export's dtype: they run once per picture or part of a video, not once "
    "per generated token, and are under a tenth of the weights"
)
MS_DOMAIN = "com.microsoft"
EMBEDDING_ROWS_BYTES = 64 << 20  # the embedding table is quantized this many bytes of rows at a time


def weight_quantizer(scheme: Scheme, bits: int | None = None):
    """ONNX Runtime's weight-only quantizer for the scheme (`bits`: another width than the scheme's)."""
    with kept_root_logger():  # its import calls logging.basicConfig(level=INFO): patches.py
        from onnxruntime.quantization.matmul_nbits_quantizer import (
            DefaultWeightOnlyQuantConfig,
            DefaultWeightOnlyQuantizer,
        )

    config = DefaultWeightOnlyQuantConfig(
        block_size=scheme.block_size, is_symmetric=scheme.symmetric, bits=bits or scheme.bits
    )
    return DefaultWeightOnlyQuantizer(config)


def quantized_bytes(model, scheme: Scheme) -> int:
    """About the bytes of the quantized model's weights: each decoder layer's matrix in `scheme.bits` per weight
    plus a 4-byte scale (and a zero point) per block; everything else as it is."""
    per_weight = scheme.bits / 8 + (4 + (not scheme.symmetric)) / scheme.block_size
    return int(
        sum(
            p.numel() * per_weight if p.dim() == 2 and ".layers." in name and "mm_" not in name else p.nbytes
            for name, p in model.named_parameters()
        )
    )


class QuantizedMatrix:
    """One MatMul weight's blocks, scales (and zero points): ORT's `qbits_block_quant` of the weight, computed when
    the first of them is written and dropped once each has been."""

    def __init__(self, weight: ir.TensorProtocol, scheme: Scheme):
        self.weight, self.scheme, self.held, self.taken = weight, scheme, None, set()

    def part(self, index: int, count: int) -> np.ndarray:
        if self.held is None:
            # C order: the quantizer's kernel reads the buffer as it lies, and a folded Transpose is a strided view
            matrix = np.ascontiguousarray(self.weight.numpy(), dtype=np.float32)
            self.held = weight_quantizer(self.scheme).qbits_block_quant(matrix)
        part = self.held[index]
        self.taken.add(index)
        if len(self.taken) == count:
            self.held, self.taken = None, set()
        return part


class QuantizedTable:
    """The embedding table's 4-bit blocks along the hidden axis: ORT's `quantize_ndarray`, a chunk of rows at a time
    (rows are quantized independently, so the chunks' packed bytes and scales are the whole table's, in order)."""

    def __init__(self, table: ir.TensorProtocol, scheme: Scheme):
        self.table, self.scheme = table, scheme
        self.rows, self.width = table.shape[0], table.shape[1]

    def chunks(self) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray | None]]:
        rows = max(1, int(EMBEDDING_ROWS_BYTES // (self.width * self.table.dtype.itemsize)))
        quantize = weight_quantizer(self.scheme, bits=4).quantize_ndarray
        # bound to its checkpoint tensor (onnx_weights.StreamedWeight): chunk by chunk
        if hasattr(self.table, "weight"):
            pieces = (c.numpy() for c in self.table.weight.chunks(rows * self.width))
        else:
            whole = self.table.numpy().reshape(-1)
            pieces = (whole[i : i + rows * self.width] for i in range(0, len(whole), rows * self.width))
        for piece in pieces:
            yield quantize(piece.reshape(-1, self.width), 1, self.scheme.block_size, self.scheme.symmetric)

    def part(self, index: int) -> np.ndarray:
        return np.concatenate([chunk[index] for chunk in self.chunks()])


class PackedTableTensor(ir.LazyTensor):
    """The table's packed 4-bit values, written a chunk of rows at a time."""

    def __init__(self, table: QuantizedTable, dtype: ir.DataType, name: str):
        shape = ir.Shape([table.rows, table.width])
        super().__init__(lambda: ir.PackedTensor(table.part(0), dtype, shape=shape), dtype, shape, name=name)
        self.quantized = table

    def tofile(self, file) -> None:
        for packed, _, _ in self.quantized.chunks():
            file.write(packed)


def initializer(graph: ir.Graph, name: str, tensor: ir.TensorProtocol) -> ir.Value:
    value = ir.Value(name=name, type=ir.TensorType(tensor.dtype), shape=tensor.shape, const_value=tensor)
    graph.register_initializer(value)
    return value


def lazy_array(compute, dtype: ir.DataType, shape: list[int], name: str) -> ir.LazyTensor:
    return ir.LazyTensor(lambda: ir.Tensor(compute()), dtype, ir.Shape(shape), name=name)


def constant_matrix(value: ir.Value | None) -> ir.TensorProtocol | None:
    """A 2-D floating-point initializer (what ORT's quantizer takes: a constant weight)."""
    if value is None or not value.is_initializer() or value.const_value is None or len(value.shape) != 2:
        return None
    return value.const_value if value.dtype.is_floating_point() else None


def quantize_matmul(graph: ir.Graph, node: ir.Node, weight: ir.TensorProtocol, scheme: Scheme) -> str:
    """MatMul(A, W) -> MatMulNBits(A, W_Q{bits}, W_scales[, W_zero_points]), as ORT's quantizer writes it."""
    rows, cols = weight.shape
    blocks = -(-rows // scheme.block_size)
    per_byte = 8 // scheme.bits
    quantized, name, count = QuantizedMatrix(weight, scheme), node.inputs[1].name, 2 if scheme.symmetric else 3
    blob = -(-scheme.block_size // per_byte)
    parts = [
        lazy_array(lambda: quantized.part(0, count), ir.DataType.UINT8, [cols, blocks, blob], f"{name}_Q{scheme.bits}"),
        lazy_array(lambda: quantized.part(1, count), weight.dtype, [cols, blocks], f"{name}_scales"),
        lazy_array(lambda: quantized.part(2, count), ir.DataType.UINT8, [cols, -(-blocks // per_byte)],
                   f"{name}_zero_points"),
    ][:count]  # fmt: skip
    attributes = dict(K=rows, N=cols, bits=scheme.bits, block_size=scheme.block_size)
    if scheme.accuracy_level:
        attributes["accuracy_level"] = scheme.accuracy_level
    inputs = [node.inputs[0], *(initializer(graph, t.name, t) for t in parts)]
    return replace(graph, node, "MatMulNBits", inputs, attributes, f"{node.name}_Q{scheme.bits}")


def quantize_gather(graph: ir.Graph, node: ir.Node, table: ir.TensorProtocol, scheme: Scheme) -> str:
    """Gather(E, ids) -> GatherBlockQuantized(E_Q4, ids, E_scales[, E_zero_points]), 4 bits, as ORT writes it."""
    quantized, name = QuantizedTable(table, scheme), node.inputs[0].name
    dtype = ir.DataType.INT4 if scheme.symmetric else ir.DataType.UINT4
    blocks = [quantized.rows, -(-quantized.width // scheme.block_size)]
    parts = [
        PackedTableTensor(quantized, dtype, f"{name}_Q4"),
        lazy_array(lambda: quantized.part(1), table.dtype, blocks, f"{name}_scales"),
    ]
    if not scheme.symmetric:
        parts.append(
            ir.LazyTensor(
                lambda: ir.PackedTensor(quantized.part(2), dtype, shape=blocks),
                dtype,
                ir.Shape(blocks),
                name=f"{name}_zero_points",
            )
        )
    values = [initializer(graph, t.name, t) for t in parts]
    attributes = dict(gather_axis=node.attributes.get_int("axis", 0), quantize_axis=1, block_size=scheme.block_size)
    graph.opset_imports[""] = max(graph.opset_imports[""], 21)  # the 4-bit types
    return replace(
        graph, node, "GatherBlockQuantized", [values[0], node.inputs[1], *values[1:]], attributes, f"{node.name}_Q4"
    )


def replace(graph: ir.Graph, node: ir.Node, op_type: str, inputs: list, attributes: dict, name: str) -> str:
    """`node` replaced by one com.microsoft node computing its output (keeping its name); weights it alone used go.
    Returns the new node's name."""
    new = ir.node(op_type, inputs, attributes, domain=MS_DOMAIN, name=name)
    new.outputs[0].name, old = None, node.outputs[0]
    ir.convenience.replace_nodes_and_values(graph, node, [node], [new], [old], [new.outputs[0]])
    for value in node.inputs:
        if value is not None and value.is_initializer() and not value.uses():
            graph.initializers.pop(value.name)
    graph.opset_imports[MS_DOMAIN] = 1
    return name


def quantize_graph(model: ir.Model, scheme: Scheme, hidden: int, vocab: int) -> dict[str, WeightSource | None]:
    """Rewrite the graph's constant-weight MatMuls (the lm_head, shape (hidden, vocab), only with `scheme.lm_head`)
    and with `scheme.embedding` its table Gathers. Returns each new node's weight as computed from the checkpoint
    (None: unknown), by node name."""
    graph, sources = model.graph, {}
    for node in list(graph):
        if node.domain != "":
            continue
        if node.op_type == "MatMul" and (weight := constant_matrix(node.inputs[1])) is not None:
            if tuple(weight.shape) == (hidden, vocab) and not scheme.lm_head:
                continue
            sources[quantize_matmul(graph, node, weight, scheme)] = getattr(weight, "source", None)
        elif node.op_type == "Gather" and scheme.embedding and (table := constant_matrix(node.inputs[0])) is not None:
            sources[quantize_gather(graph, node, table, scheme)] = getattr(table, "source", None)
    for name, value in list(graph.initializers.items()):  # as ORT's clean_initializers: else written, never read
        if not value.uses() and not value.is_graph_output():
            graph.initializers.pop(name)
    return sources
