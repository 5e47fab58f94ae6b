"""The quantized weights themselves, against the checkpoint they were quantized from.

A block-quantized matrix is its source within the scheme's rounding: each block of `block_size` elements along the
reduction axis has one scale (and with --asymmetric a zero point), set from the block's own range, and every element
is the point of that grid nearest to it. So every dequantized element lies within half a step of its source element:
  symmetric   step = max |w| / 2^(bits-1); the grid runs from -2^(bits-1) to 2^(bits-1) - 1 steps with the sign
              that puts the block's largest |w| on its long side, so an element of the other sign beyond
              (2^(bits-1) - 1) steps may also be off by that excess (at most one more half step; either sign,
              where both reach the largest |w|, as bfloat16 weights often do)
  asymmetric  step = (max(w, 0) - min(w, 0)) / (2^bits - 1)
plus 4 float32 ulps of the block's largest |w| for the arithmetic. ONNX Runtime's quantizer sets exactly these
steps (tests/test_weight_check.py holds it to them), but the bound is the scheme's, not the quantizer's: any
quantization that keeps every element within it is correct. A misaligned scale, a shifted zero point, a transposed
block, a swapped layer or a matrix from elsewhere breaks it whatever the prompts; on an accuracy gate over a few
prompts such a bug can pass as coarse but healthy quantization.

Each node's weight is dequantized here as ONNX Runtime's kernels read it (MatMulNBits: (q - zero point) * scale,
4-bit values low nibble first, 2^(bits-1) the zero point when there is none; GatherBlockQuantized likewise along
its quantize axis), and compared with the source the export's manifest records for it (`WeightSource`: a checkpoint
tensor, or the fold of one, like a diagonal V2V's per-KV-head o_proj). A matrix at a time, a chunk of rows at a time:
at 7-9 B parameters the check holds a few chunks, never a model."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import torch

from ..artifacts import OnnxManifest, WeightSource
from ..checkpoints.source import open_source
from ..errors import InputError
from ..ui import quiet
from .onnx_quantize import QUANTIZED_GRAPHS

CHUNK_BYTES = 64 << 20  # source rows (float32) read at a time
SLICE_BYTES = 1 << 20  # and compared on a core at a time: what stays in its cache
TINY = np.finfo(np.float32).tiny
ARITHMETIC_ULPS = 4 * float(np.finfo(np.float32).eps)  # of a block's largest |w|: dequantization's own rounding


@dataclass
class MatrixCheck:
    """One quantized matrix against its source: the largest error over its rounding bound, and where. Both readers
    give one: an ONNX export's quantized node (`location` its graph's file, `node` the node, `source` the checkpoint
    tensor it folds) and a compressed-tensors folder's matrix (`location` its shard; the matrix is its own source)."""

    location: str  # the file that stores it: decoder.onnx, or a safetensors shard
    node: str
    op: str
    source: str  # WeightSource.describe(), or the matrix's own name
    rows: int  # in the quantized layout: output features (MatMulNBits) or table rows
    columns: int  # the axis scales are set along
    scale_unit: str  # what one scale covers along it: a "block" (ONNX), a "group", or a whole row ("channel")
    worst_ratio: float  # max over elements of |dequantized - source| / bound; within the scheme: <= 1
    row: int  # the worst element's row and block
    block: int
    error: float  # the worst element's |dequantized - source|, and its bound
    bound: float
    same_as: str | None = None  # another graph's node reading the same bytes for the same source: checked there

    @property
    def passed(self) -> bool:
        return self.worst_ratio <= 1.0

    def matrix(self) -> str:
        return f"matrix {self.node}" if self.source == self.node else f"node {self.node} ({self.source})"

    def position(self) -> str:
        """The worst element's place: its row, and its block or group where a row has several scales."""
        return f"row {self.row}" if self.scale_unit == "channel" else f"row {self.row}, {self.scale_unit} {self.block}"

    def failure(self) -> str:
        return (
            f"{self.location} {self.matrix()}: {self.position()} is "
            f"{self.worst_ratio:.3g}x its rounding bound (error {self.error:.3g}, bound {self.bound:.3g})"
        )


@dataclass
class WeightCheck:
    scheme: str
    bits: int
    matrices: list[MatrixCheck] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # what could not be compared: a bug or a damaged export

    @property
    def passed(self) -> bool:
        return not self.problems and all(m.passed for m in self.matrices)

    @property
    def worst(self) -> MatrixCheck | None:
        return max(self.matrices, key=lambda m: m.worst_ratio, default=None)

    def first_failure(self) -> str | None:
        bad = [m.failure() for m in self.matrices if not m.passed]
        return next(iter(self.problems + bad), None)


# --- dequantization, as ONNX Runtime's kernels read the packed weights --------------------------------------------


def unpack(packed: np.ndarray, bits: int, count: int, signed: bool = False) -> np.ndarray:
    """Integers packed along the last axis, `bits` each (4: two a byte, the low nibble first), the first `count`."""
    if bits == 8:
        values = packed.astype(np.int32)
    else:
        values = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1).astype(np.int32)
    values = values[..., :count]
    return np.where(values >= 1 << (bits - 1), values - (1 << bits), values) if signed else values


def byte_values(bits: int, signed: bool) -> np.ndarray:
    """Each byte's values as float32, (256, values a byte): unpacking by one lookup."""
    values = unpack(np.arange(256, dtype=np.uint8)[:, None], bits, 8 // bits, signed)
    return values.astype(np.float32)


def rounding_bound(source: np.ndarray, bits: int, symmetric: bool) -> np.ndarray:
    """Each element's bound (see the module's docstring) for (rows, blocks, block) source values, zero-padded."""
    magnitude = np.abs(source)
    largest = magnitude.max(-1, keepdims=True)
    if symmetric:
        step = largest / (1 << (bits - 1))
        # the long side is the largest |w|'s sign; where both signs reach it, the quantizer may take either
        on_short_side = ((source < 0) & (source == largest).any(-1, keepdims=True)) | (
            (source > 0) & (source == -largest).any(-1, keepdims=True)
        )
        beyond = np.maximum(0.0, magnitude - ((1 << (bits - 1)) - 1) * step)
        bound = step / 2 + np.where(on_short_side, beyond, 0.0)
    else:
        span = np.maximum(source.max(-1, keepdims=True), 0) - np.minimum(source.min(-1, keepdims=True), 0)
        bound = np.broadcast_to(span / ((1 << bits) - 1) / 2, source.shape)
    return bound + ARITHMETIC_ULPS * largest


def half_steps(source: np.ndarray, bits: int, symmetric: bool) -> np.ndarray:
    """(rows, blocks) half a step and the ulps of each block: `rounding_bound` of every element not past the short
    side of a symmetric grid (the bound's least, a block's value), without an array the size of the source."""
    high, low = source.max(-1), source.min(-1)
    largest = np.maximum(high, -low)
    if symmetric:
        return largest / (1 << bits) + ARITHMETIC_ULPS * largest
    return (np.maximum(high, 0) - np.minimum(low, 0)) / ((1 << bits) - 1) / 2 + ARITHMETIC_ULPS * largest


def in_blocks(matrix: np.ndarray, block: int) -> np.ndarray:
    """(rows, columns) -> (rows, blocks, block), the last block zero-padded as the quantizer pads it."""
    rows, columns = matrix.shape
    if columns % block == 0:
        return matrix.reshape(rows, columns // block, block)
    blocks = -(-columns // block)
    padded = np.zeros((rows, blocks * block), np.float32)
    padded[:, :columns] = matrix
    return padded.reshape(rows, blocks, block)


# --- a quantized node's tensors, read where they lie ---------------------------------------------------------------


class Initializers:
    """A graph's initializers as raw bytes, mapped from their external data where they have it (nothing is read
    until a range is used)."""

    def __init__(self, path: Path):
        self.folder = path.parent
        self.graph = onnx.load(path, load_external_data=False).graph
        self.tensors = {t.name: t for t in self.graph.initializer}
        self.path = path

    def raw(self, name: str) -> np.ndarray:
        tensor = self.tensors.get(name)
        if tensor is None:
            raise InputError(self.path, f"names {name} as a quantized node's input but holds no such initializer")
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            info = onnx.external_data_helper.ExternalDataInfo(tensor)
            return np.memmap(self.folder / info.location, np.uint8, "r", info.offset, (info.length,))
        if tensor.HasField("raw_data"):
            return np.frombuffer(tensor.raw_data, np.uint8)
        return np.ascontiguousarray(onnx.numpy_helper.to_array(tensor)).view(np.uint8).reshape(-1)

    def place(self, name: str) -> tuple:
        """What tells a tensor's bytes from another's: where an external tensor's lie (file, offset, length), or
        a small tensor's own bytes."""
        tensor = self.tensors[name]
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            return (tensor.data_type, tuple(tensor.dims), self.raw(name).tobytes())
        info = onnx.external_data_helper.ExternalDataInfo(tensor)
        return info.location, info.offset, info.length

    def array(self, name: str, dtype) -> np.ndarray:
        tensor = self.tensors.get(name)
        raw = self.raw(name)
        return raw.view(dtype).reshape(tuple(tensor.dims))


@dataclass
class QuantizedNode:
    """One node's packed weight, in rows: `dequantize(first, last)` gives its rows [first, last) as float32."""

    rows: int
    columns: int
    block: int
    bits: int
    values: np.ndarray  # (rows, blocks, bytes a block) packed, or (rows, packed bytes of a row) for a table
    scales: np.ndarray  # (rows, blocks)
    zero_points: np.ndarray | int  # (rows, blocks), or one for every block
    signed: bool  # the values are two's complement (INT4)

    @property
    def symmetric(self) -> bool:
        return np.isscalar(self.zero_points)

    @property
    def short_side(self) -> bool:
        """Its grid runs one step further on one side than the other (symmetric: -2^(bits-1) to 2^(bits-1) - 1)."""
        return self.symmetric

    def bound(self, expected: np.ndarray) -> np.ndarray:
        """(rows, blocks, 1): each block's half step (`half_steps`); `worst_element` widens it past the short side."""
        return half_steps(expected, self.bits, self.symmetric)[..., None]

    def dequantize(self, first: int, last: int) -> np.ndarray:
        """(q - zero point) * scale of rows [first, last): (rows, blocks, block) float32."""
        blocks = self.scales.shape[1]
        values = byte_values(self.bits, self.signed)[np.asarray(self.values[first:last])]
        values = values.reshape(last - first, blocks, -1)[..., : self.block]
        zero_points = self.zero_points if self.symmetric else self.zero_points[first:last, :, None]
        values -= zero_points
        values *= np.asarray(self.scales[first:last])[..., None]
        return values


FLOAT8_MAX, FLOAT8_MANTISSA, FLOAT8_SMALLEST = 448.0, 3, 2.0**-9  # e4m3: its largest, mantissa bits, least step


class CompressedMatrix:
    """One matrix of a folder `quantize` wrote (compressed-tensors' stored tensors), dequantized by compressed-tensors
    itself, with the interface of `QuantizedNode`. Its grids, per channel (the block: a whole row) or group:
      int    step = max |w| / ((2^bits - 1) / 2), values -2^(bits-1) .. 2^(bits-1) - 1: every element within half a
             step (the largest |w| sits at 2^(bits-1) - 1/2 steps, rounded onto the grid's end)
      float  (fp8 e4m3) scale = max |w| / 448: within half of the format's spacing at the element, 2^-4 of it, and
             half its least step (2^-9 x scale) near zero."""

    def __init__(self, weight: torch.Tensor, group_size: int | None, bits: int, float_type: bool, slack: float):
        self.weight = weight.float().numpy()  # dequantized, (rows, columns)
        self.rows, self.columns = self.weight.shape
        self.block, self.bits, self.float_type = group_size or self.columns, bits, float_type
        self.slack = slack  # of the scales' own rounding into their dtype (up: a step at most this much wider)
        self.symmetric, self.short_side = True, False

    def dequantize(self, first: int, last: int) -> np.ndarray:
        return in_blocks(self.weight[first:last], self.block)

    def bound(self, expected: np.ndarray) -> np.ndarray:
        largest = np.abs(expected).max(-1, keepdims=True)
        ulps = ARITHMETIC_ULPS * largest
        if not self.float_type:
            return self.slack * largest / ((1 << self.bits) - 1) + ulps  # half of largest / ((2^bits - 1) / 2)
        scale = self.slack * largest / FLOAT8_MAX
        relative = np.abs(expected) * 2.0 ** -(FLOAT8_MANTISSA + 1)
        return np.maximum(relative, scale * FLOAT8_SMALLEST / 2) + ulps


def attributes_of(node: onnx.NodeProto) -> dict:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def matmul_nbits(node: onnx.NodeProto, initializers: Initializers) -> QuantizedNode:
    """MatMulNBits(A, B, scales[, zero_points]): B (N, blocks, bytes a block), N rows of K quantized columns; zero
    points (N, bytes of a row's), each row starting on a byte; 2^(bits-1) where there are none."""
    attributes = attributes_of(node)
    rows, columns, bits, block = attributes["N"], attributes["K"], attributes["bits"], attributes["block_size"]
    blocks = -(-columns // block)
    values = initializers.raw(node.input[1]).reshape(rows, blocks, block * bits // 8)
    scales = initializers.array(node.input[2], np.float32).reshape(rows, blocks)
    zero_points = 1 << (bits - 1)
    if len(node.input) > 3 and node.input[3]:
        zero_points = unpack(np.asarray(initializers.raw(node.input[3])).reshape(rows, -1), bits, blocks)
    return QuantizedNode(rows, columns, block, bits, values, scales, zero_points, signed=False)


def gather_block_quantized(node: onnx.NodeProto, initializers: Initializers) -> QuantizedNode:
    """GatherBlockQuantized(data, indices, scales[, zero_points]): a (rows, width) table of 4-bit values packed
    over the whole tensor, blocks along its width (quantize_axis 1); INT4 values are signed (zero point 0), UINT4
    ones read against 8 where there are no zero points."""
    attributes = attributes_of(node)
    data = initializers.tensors[node.input[0]]
    rows, columns = data.dims
    if attributes.get("quantize_axis", 1) != 1 or attributes.get("gather_axis", 0) != 0 or columns % 2:
        raise InputError(initializers.path, f"node {node.name}: a table layout this check does not read")
    signed = data.data_type == onnx.TensorProto.INT4
    scales = initializers.array(node.input[2], np.float32)
    zero_points = 0 if signed else 8
    if len(node.input) > 3 and node.input[3]:
        packed = np.asarray(initializers.raw(node.input[3]))
        zero_points = unpack(packed, 4, scales.size, signed).reshape(scales.shape)
    values = initializers.raw(node.input[0]).reshape(rows, columns // 2)
    return QuantizedNode(rows, columns, attributes["block_size"], 4, values, scales, zero_points, signed)


READERS = {"MatMulNBits": matmul_nbits, "GatherBlockQuantized": gather_block_quantized}


# --- the source, computed from the checkpoint as the export's fold computed it -------------------------------------


def evaluate(source: WeightSource, weights, opset: int) -> np.ndarray:
    """A WeightSource's value (float32), each op by ONNX's reference implementation."""
    if source.tensor is not None:
        return weights[source.tensor].load().numpy()
    if source.constant is not None:
        return np.array(source.constant, dtype=source.dtype).reshape(source.shape)
    from onnx.reference import ReferenceEvaluator

    inputs = {f"x{i}": evaluate(s, weights, opset) for i, s in enumerate(source.inputs) if s is not None}
    names = [f"x{i}" if s is not None else "" for i, s in enumerate(source.inputs)]
    node = onnx.helper.make_node(source.op, names, ["y"], **source.attributes)
    graph = onnx.helper.make_graph(
        [node],
        "fold",
        [onnx.helper.make_tensor_value_info(n, onnx.helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
         for n, v in inputs.items()],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.UNDEFINED, None)],
    )  # fmt: skip
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", opset)])
    return ReferenceEvaluator(model).run(None, inputs)[0]


def is_transposed_tensor(source: WeightSource) -> bool:
    """Transpose(checkpoint tensor) of a 2-D tensor: a Linear's weight as MatMul takes it."""
    return (
        source.op == "Transpose"
        and source.attributes.get("perm", [1, 0]) == [1, 0]
        and len(source.inputs) == 1
        and source.inputs[0] is not None
        and source.inputs[0].tensor is not None
    )


def source_rows(source: WeightSource, op: str, weights, opset: int, columns: int) -> Iterator[np.ndarray]:
    """The source in the quantized node's rows (MatMulNBits: B's columns, that is a Linear's weight rows; a table:
    its rows), a chunk of rows at a time, streamed from the checkpoint where it is a tensor read as it lies."""
    rows_per_chunk = max(1, CHUNK_BYTES // (4 * columns))
    tensor = source.inputs[0].tensor if op == "MatMulNBits" and is_transposed_tensor(source) else None
    if op == "GatherBlockQuantized" and source.tensor is not None:
        tensor = source.tensor
    if tensor is not None:
        for chunk in weights[tensor].chunks(rows_per_chunk * columns):
            yield chunk.numpy().reshape(-1, columns)
        return
    whole = evaluate(source, weights, opset)
    whole = whole.T if op == "MatMulNBits" else whole
    for first in range(0, len(whole), rows_per_chunk):
        yield np.ascontiguousarray(whole[first : first + rows_per_chunk], dtype=np.float32)


def worst_element(quantized: QuantizedNode, rows: np.ndarray, first: int) -> tuple[float, int, int, float, float]:
    """Rows [first, first + len(rows)) of the node against `rows` of its source: the largest error over its bound,
    and where, as (ratio, row, block, error, bound). Each block's half step bounds every element but those past the
    short side of a symmetric grid, whose blocks alone get `rounding_bound`'s element by element."""
    expected = in_blocks(rows, quantized.block)
    error = quantized.dequantize(first, first + len(rows))
    error -= expected
    np.abs(error, out=error)
    bound = np.broadcast_to(quantized.bound(expected), error.shape)
    ratio = error / np.maximum(bound, TINY)
    past = ratio.max(-1) > 1
    if quantized.short_side and past.any():
        bound = bound.copy()
        bound[past] = rounding_bound(expected[past], quantized.bits, symmetric=True)
        ratio[past] = error[past] / np.maximum(bound[past], TINY)
    at = np.unravel_index(int(np.argmax(ratio)), ratio.shape)
    return float(ratio[at]), first + int(at[0]), int(at[1]), float(error[at]), float(bound[at])


def check_node(graph: str, node: onnx.NodeProto, quantized: QuantizedNode, source: WeightSource, weights,
               opset: int, pool: ThreadPoolExecutor, advance) -> MatrixCheck:  # fmt: skip
    """Every element of the node's weight against its source's: a chunk of rows read at a time, compared a slice
    of it a core."""
    result = MatrixCheck(f"{graph}.onnx", node.name, node.op_type, source.describe(), quantized.rows,
                         quantized.columns, "block", 0.0, 0, 0, 0.0, 0.0)  # fmt: skip
    first, step = 0, max(1, SLICE_BYTES // (4 * quantized.columns))
    for rows in source_rows(source, node.op_type, weights, opset, quantized.columns):
        if rows.shape[1] != quantized.columns or first + len(rows) > quantized.rows:
            break
        slices = [(rows[i : i + step], first + i) for i in range(0, len(rows), step)]
        worst = max(pool.map(lambda part: worst_element(quantized, *part), slices))
        if worst[0] > result.worst_ratio:
            result.worst_ratio, result.row, result.block, result.error, result.bound = worst
        first += len(rows)
        advance(rows.nbytes, node.name)
    if first != quantized.rows:  # the source's shape is not the node's: not its matrix
        result.worst_ratio, result.error = float("inf"), float("inf")
    return result


def check_weights(folder: Path, checkpoint: Path, progress=quiet) -> WeightCheck:
    """Every quantized node of the export in `folder` against the checkpoint it was exported from."""
    from ..onnx_weights import checkpoint_weights

    manifest = OnnxManifest.read(folder, "an `onnx` export")
    quantization = manifest.quantization
    if quantization is None:
        raise InputError(folder, "is not a quantized export: its weights are the checkpoint's, cast (use verify)")
    report = WeightCheck(quantization.scheme, quantization.bits)
    if not quantization.sources:
        report.problems.append(
            f"{folder}: its manifest records no source of its quantized weights (exported by an earlier "
            "dattn-export): export it again"
        )
        return report
    source = open_source(checkpoint)
    source.raise_first_problem()
    weights = checkpoint_weights(source, torch.float32)
    graphs = {name: Initializers(folder / manifest.graphs[name].file) for name in QUANTIZED_GRAPHS}
    nodes = [(name, n) for name, g in graphs.items() for n in g.graph.node if n.op_type in READERS]
    total = sum(4 * attributes_of(n).get("N", 0) * attributes_of(n).get("K", 0) for _, n in nodes)
    total += sum(4 * math.prod(graphs[g].tensors[n.input[0]].dims) for g, n in nodes if n.op_type != "MatMulNBits")
    with (
        progress("checking quantized weights against the checkpoint", total) as advance,
        ThreadPoolExecutor(os.cpu_count()) as pool,
    ):
        checked = {}
        for graph, node in nodes:
            recorded, where = quantization.sources.get(graph, {}), f"{graph}.onnx node {node.name}"
            if node.name not in recorded:
                report.problems.append(f"{where}: not among the quantized nodes the manifest records")
            elif recorded[node.name] is None or not known(recorded[node.name], weights):
                report.problems.append(f"{where}: its source in the checkpoint is not recorded")
            else:
                # context_kv's layers read most of their weights from decoder.onnx.data: each range is checked once
                places = [graphs[graph].place(name) for name in node.input if name in graphs[graph].tensors]
                key = (node.op_type, repr(recorded[node.name]), tuple(places), repr(attributes_of(node)))
                if key in checked:
                    same = dataclasses.replace(checked[key], location=f"{graph}.onnx", node=node.name)
                    same.same_as = f"{checked[key].location} node {checked[key].node}"
                    report.matrices.append(same)
                    advance(4 * same.rows * same.columns, node.name)
                    continue
                quantized = READERS[node.op_type](node, graphs[graph])
                report.matrices.append(
                    check_node(graph, node, quantized, recorded[node.name], weights, manifest.opset, pool, advance)
                )
                checked[key] = report.matrices[-1]
    for graph in QUANTIZED_GRAPHS:
        found = {n.name for g, n in nodes if g == graph}
        missing = sorted(set(quantization.sources.get(graph, {})) - found)
        report.problems += [f"{graph}.onnx: has no node {name}, which the manifest records" for name in missing]
    return report


def check_compressed(folder: Path, manifest, source, progress=quiet) -> WeightCheck:
    """Every matrix of a folder `quantize` wrote (manifest.quantization) against its unquantized source (`source`: its
    folder opened), dequantized by compressed-tensors as vLLM and transformers read it."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors import safe_open

    from ..checkpoints.source import folder_config

    record = manifest.quantization
    config = QuantizationConfig.model_validate(folder_config(folder).quantization_config)
    (scheme,) = config.config_groups.values()
    compressor = BaseCompressor.load_from_registry(config.format)
    report = WeightCheck(record.scheme, scheme.weights.num_bits)
    stored: dict[str, dict[str, str]] = {}  # matrix -> its stored tensors' names -> their shard
    for name, entry in manifest.tensors.items():
        if entry.source_name in record.matrices:
            stored.setdefault(entry.source_name, {})[name] = entry.file
    total = sum(4 * math.prod(source.tensors[m].shape) for m in record.matrices if m in source.tensors)
    float_type = scheme.weights.type == "float"
    with progress("checking quantized matrices against the unquantized folder", total) as advance:
        for matrix in record.matrices:
            parts, module = stored.get(matrix, {}), matrix.removesuffix("weight")
            if matrix not in source.tensors or not parts:
                report.problems.append(f"{matrix}: not in {'the source' if parts else 'the folder'}")
                continue
            state = {}
            for name, shard in parts.items():
                with safe_open(folder / shard, framework="pt") as handle:
                    state[name.removeprefix(module)] = handle.get_tensor(name)
            scale_dtype = state["weight_scale"].dtype
            state["weight_scale"] = state["weight_scale"].float()  # as the kernels scale: in float32, not rounded
            dense = compressor.decompress(state, scheme)["weight"]
            slack = 1 + 2 * torch.finfo(scale_dtype).eps  # the scales rounded up into their dtype
            quantized = CompressedMatrix(dense, scheme.weights.group_size, scheme.weights.num_bits, float_type, slack)
            unit = "group" if scheme.weights.group_size else "channel"
            check = MatrixCheck(parts[module + "weight_scale"], matrix, record.format, matrix, quantized.rows,
                                quantized.columns, unit, 0.0, 0, 0, 0.0, 0.0)  # fmt: skip
            rows = source.tensors[matrix].load().float().numpy()
            if rows.shape != (quantized.rows, quantized.columns):
                check.worst_ratio = check.error = float("inf")
            else:
                check.worst_ratio, check.row, check.block, check.error, check.bound = worst_element(quantized, rows, 0)
            report.matrices.append(check)
            advance(rows.nbytes, matrix)
    return report


def known(source: WeightSource, weights) -> bool:
    """Every checkpoint tensor the source reads is in the checkpoint."""
    if source.tensor is not None:
        return source.tensor in weights
    return all(s is None or known(s, weights) for s in source.inputs)
