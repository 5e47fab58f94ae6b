"""The export's weights, never all in memory: each initializer of a traced graph bound to its checkpoint tensor
(`bind_weights`), read, checked and cast when the graph is written, a chunk at a time; a fold of weights
(onnxscript's constant folding, made lazy by `patches.LazyFolding`) computed when written too, with the recipe of
how it comes from the checkpoint (`WeightSource`), which the quantized weights' check recomputes."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import onnx_ir as ir
import torch
from torch import nn

from .artifacts import WeightSource
from .checkpoints.plan import checked_cast, checked_chunks
from .checkpoints.registry import Lazy
from .checkpoints.weights import is_stand_in
from .modeling.modeling_dattn import MODEL_CLASSES

WRITE_CHUNK_BYTES = 64 << 20  # a weight is cast and written this much at a time
TRANSPOSE_BLOCK_BYTES = 256 << 20  # a transposed weight is written this much at a time, a pass over it each


@dataclasses.dataclass(frozen=True)
class CheckpointWeight:
    """One weight as the export writes it: read from the checkpoint (mapped), checked and cast on the way."""

    stored_name: str
    lazy: Lazy
    dtype: torch.dtype

    def load(self) -> torch.Tensor:
        return checked_cast(self.stored_name, self.lazy, self.dtype)

    def chunks(self, elements: int) -> Iterator[torch.Tensor]:
        return checked_chunks(self.stored_name, self.lazy, self.dtype, elements)


Weights = dict[str, CheckpointWeight]  # canonical name -> the weight


def checkpoint_weights(source, dtype: torch.dtype) -> Weights:
    """Each weight of the checkpoint; tied weights (lm_head) are their target's."""
    weights = {name: CheckpointWeight(source.stored_names[name], lazy, dtype) for name, lazy in source.tensors.items()}
    if source.config.tie_word_embeddings:
        for name, target in MODEL_CLASSES[source.config.model_type]._tied_weights_keys.items():
            weights.setdefault(name, weights[target])
    return weights


def ir_tensor(tensor: torch.Tensor) -> ir.Tensor:
    """A torch tensor as the ONNX IR holds it (numpy has no bfloat16: the IR's own stands in)."""
    if tensor.dtype == torch.bfloat16:
        return ir.Tensor(tensor.view(torch.uint16).numpy().view(ir.DataType.BFLOAT16.numpy()))
    return ir.Tensor(tensor.numpy())


class StreamedWeight(ir.LazyTensor):
    """A bound weight: computed whole only where a pass folds it; written to the .data file a chunk at a time, so
    that writing a 3.7 GB embedding table needs 64 MiB. `source`: its checkpoint tensor, by canonical name."""

    def __init__(self, weight: CheckpointWeight, dtype: ir.DataType, shape: ir.Shape, name: str, canonical: str):
        super().__init__(lambda: ir_tensor(weight.load()), dtype, shape, name=name)
        self.weight, self.source = weight, WeightSource(tensor=canonical)

    def tofile(self, file) -> None:
        for chunk in self.weight.chunks(max(1, WRITE_CHUNK_BYTES // self.weight.dtype.itemsize)):
            file.write(chunk.view(torch.uint8).numpy())


class FoldedWeight(ir.LazyTensor):
    """A fold of bound weights, computed when it is written; `source` says how from the checkpoint (None: from a
    weight whose source is unknown), for the quantized weights' check."""

    def __init__(self, fold: Callable, dtype: ir.DataType, shape: ir.Shape, name: str, source: WeightSource | None):
        super().__init__(fold, dtype, shape, name=name)
        self.source = source


class TransposedWeight(FoldedWeight):
    """A folded Transpose of a 2-D bound weight (a Linear's, as MatMul takes it): computed whole only where a pass
    needs it (a quantizer); written a block of its rows at a time, each block the same columns of every chunk of the
    checkpoint's rows. Writing a tied 3.7 GB head (256000 rows) then holds one block, not the weight twice, for a few
    passes over the mapped weight."""

    def __init__(self, fold: Callable, dtype: ir.DataType, shape: ir.Shape, name: str, source: WeightSource,
                 weight: CheckpointWeight):  # fmt: skip
        super().__init__(fold, dtype, shape, name, source)
        self.weight = weight

    def tofile(self, file) -> None:
        columns, rows = self.shape.numpy()  # the checkpoint's weight is (rows, columns)
        itemsize = self.weight.dtype.itemsize
        block = max(1, TRANSPOSE_BLOCK_BYTES // (rows * itemsize))
        rows_per_chunk = max(1, WRITE_CHUNK_BYTES // (columns * itemsize))
        for first in range(0, columns, block):
            out = torch.empty(min(block, columns - first), rows, dtype=self.weight.dtype)
            row = 0
            for chunk in self.weight.chunks(rows_per_chunk * columns):
                piece = chunk.view(-1, columns)
                out[:, row : row + len(piece)] = piece[:, first : first + block].T
                row += len(piece)
            file.write(out.view(torch.uint8).numpy())


def bind_weights(graph: ir.Graph, module: nn.Module, weights: Weights) -> None:
    """Every stand-in initializer of a traced graph bound to its checkpoint tensor, read when the graph is written.
    The graph names a parameter by its path in the traced module: the graph module's `model.` and then the
    canonical name."""
    canonical = {name: name.removeprefix("model.") for name, _ in module.named_parameters(remove_duplicate=False)}
    for name, value in graph.initializers.items():
        held = value.const_value
        if is_stand_in(held.raw):
            value.const_value = StreamedWeight(weights[canonical[name]], held.dtype, held.shape, name, canonical[name])


SMALL_CONSTANT = 64  # elements: a shape, axes or a scalar, which a fold's source records by value


def fold_source(node: ir.Node, inputs: list) -> WeightSource | None:
    """How a fold computes its value from the checkpoint: the node's op over its inputs' sources (None where one is
    unknown: a large constant, an attribute that is no plain number, string or list of numbers)."""
    sources = []
    for tensor in inputs:
        if tensor is None or isinstance(tensor, ir.LazyTensor):
            sources.append(None if tensor is None else getattr(tensor, "source", None))
            if tensor is not None and sources[-1] is None:
                return None
        elif tensor.size <= SMALL_CONSTANT:
            array = tensor.numpy()
            sources.append(
                WeightSource(constant=array.ravel().tolist(), dtype=str(array.dtype), shape=list(array.shape))
            )
        else:
            return None
    attributes = {key: a.value for key, a in node.attributes.items()}
    for key, value in attributes.items():
        if isinstance(value, (list, tuple)) and all(isinstance(x, (int, float)) for x in value):
            attributes[key] = list(value)
        elif not isinstance(value, (int, float, str)):
            return None
    return WeightSource(op=node.op_type, attributes=attributes, inputs=sources)
