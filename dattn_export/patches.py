"""Where dattn-export changes what another library does, each patch in one place with why:

LazyFolding, lazy_folding  onnxscript's constant folding (which torch's ONNX export runs) keeps a fold of the
                           checkpoint's weights lazy, computed when the graph is written: a 9 B model's folded
                           weights would otherwise all sit in memory until the save (stages/onnx_export.py)
errors_only                a logger's warnings silenced for a call: torch's exporter logs a line per torchvision op
                           it cannot register when torchvision is absent, burying a one-line error
kept_root_logger           ONNX Runtime's quantizer's import calls logging.basicConfig(level=INFO): the root logger
                           is put back, else every later pass's INFO line reaches the user's terminal"""

from __future__ import annotations

import contextlib
import logging
import math

import onnx_ir as ir
from onnxscript.optimizer import _constant_folding

from .onnx_weights import FoldedWeight, StreamedWeight, TransposedWeight, fold_source


class LazyFolding(_constant_folding.FoldConstantsPass):
    """onnxscript's constant folding, except that a fold of a bound weight stays lazy: computed from the checkpoint
    when the graph is written. A weight-only node that makes nothing larger (a Transpose, the GQA group sum of a
    Reshape and a ReduceSum) is folded whatever its size, without being computed here: onnxscript leaves large ones
    in the graph, where no quantizer sees a constant matrix. Other folds are computed once to decide on them. Without
    it every folded weight of a 9 B model would sit in memory until the save."""

    def process_node(self, node: ir.Node, is_function: bool):
        weights = [x for x in node.inputs if x is not None and isinstance(x.const_value, ir.LazyTensor)]
        constant = all(x is None or x.const_value is not None for x in node.inputs)
        shape = self.folded_shape(node)
        if is_function or not weights or not constant or node.domain != "" or shape is None:
            return super().process_node(node, is_function)
        if (
            _constant_folding._reference_evaluator.get_evaluator(node.domain, node.op_type, self._opset_imports[""])
            is None
        ):
            return None  # an op onnxscript cannot compute (Gelu from opset 20): it stays a node, its weights lazy
        if any(len(w.uses()) != 1 for w in weights):  # as onnxscript decides: a weight used elsewhere too stays
            return None if node.op_type == "Transpose" else super().process_node(node, is_function)
        if math.prod(shape.numpy()) > sum(w.const_value.size for w in weights):
            return super().process_node(node, is_function)
        name = node.outputs[0].name
        folded = self.later(node, shape, name)
        value = ir.Value(name=name, type=ir.TensorType(folded.dtype), shape=shape, const_value=folded)
        node.graph.register_initializer(value)
        return _constant_folding.Replacement([value], [])

    @staticmethod
    def folded_shape(node: ir.Node) -> ir.Shape | None:
        """The one output's static shape, known without computing it (a Transpose's from its perm)."""
        if len(node.outputs) != 1:
            return None
        if node.op_type == "Transpose" and len(node.inputs) == 1:
            weight = node.inputs[0]
            perm = node.attributes.get_ints("perm", None) or list(reversed(range(len(weight.shape))))
            return ir.Shape([weight.shape[axis] for axis in perm])
        shape = node.outputs[0].shape
        return shape if shape is not None and shape.is_static() else None

    def new_initializer(self, node: ir.Node, array):
        value = super().new_initializer(node, array)
        if value is not None and any(isinstance(x.const_value, ir.LazyTensor) for x in node.inputs if x is not None):
            value.const_value = self.later(node, value.shape, value.name)
        return value

    def later(self, node: ir.Node, shape: ir.Shape, name: str) -> ir.LazyTensor:
        """The node's output, computed from its (lazy) inputs when it is written."""
        inputs = [None if x is None else x.const_value for x in node.inputs]
        op = (node.domain, node.op_type, self._opset_imports[node.domain])
        attributes = {
            key: ir.serde.serialize_tensor(a.value) if a.type == ir.AttributeType.TENSOR else a.value
            for key, a in node.attributes.items()
        }

        def fold() -> ir.Tensor:
            arrays = [None if t is None else t.numpy() for t in inputs]
            result = _constant_folding._reference_evaluator.evaluate(*op, *arrays, **attributes)
            if result is None:  # process_node folds only what the evaluator computes: a bug if it comes here
                raise RuntimeError(f"{name}: {op[1]} could not be computed from its weights")
            return ir.tensor(result)

        dtype = node.outputs[0].dtype or next(t.dtype for t in inputs if t is not None)
        weight, source = inputs[0], fold_source(node, inputs)
        swaps_axes = len(shape) == 2 and list(node.attributes.get_ints("perm", [1, 0])) == [1, 0]  # not [0, 1]
        if node.op_type == "Transpose" and isinstance(weight, StreamedWeight) and swaps_axes:
            return TransposedWeight(fold, dtype, shape, name, source, weight.weight)
        return FoldedWeight(fold, dtype, shape, name, source)


@contextlib.contextmanager
def lazy_folding():
    """torch's optimisation of an exported graph (onnxscript's optimize_ir and fusions, the same passes in the same
    order, so the graph and its data are what a plain torch.onnx.export writes) with `LazyFolding`."""
    plain = _constant_folding.FoldConstantsPass
    _constant_folding.FoldConstantsPass = LazyFolding
    try:
        yield
    finally:
        _constant_folding.FoldConstantsPass = plain


@contextlib.contextmanager
def errors_only(logger: str):
    """A logger's warnings silenced: torch's exporter logs a line per torchvision op it cannot register when
    torchvision is absent, which would bury a one-line error (we export no torchvision op)."""
    log = logging.getLogger(logger)
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


@contextlib.contextmanager
def kept_root_logger():
    """The root logger's handlers and level as they were before the block."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        yield
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
