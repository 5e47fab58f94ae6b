"""`onnx --quantize int4|int8`: ONNX Runtime's own weight-only quantizer (MatMulNBits: block-wise integer weights
with a scale per block) on the decoder's MatMuls, and with --quantize-embedding on the embedding table's Gather
(GatherBlockQuantized, 4 bits whatever the scheme: blocks along the hidden axis, so a looked-up row is dequantized
alone). The fused attention
nodes and their function are kept as they are. A decode step reads every weight once, so on a CPU its time follows
the weights' bytes.

The quantized decoder is not held to the fp32 tolerance: `validate` applies the accuracy gate below instead."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

SCHEMES = {"int4": 4, "int8": 8}


@dataclass
class Quantization:
    scheme: str  # int4 | int8
    block_size: int
    symmetric: bool
    lm_head: bool  # quantized too (by default it stays fp32: the logits are what the gate judges)
    matmuls: int  # MatMuls turned into MatMulNBits
    embedding: bool  # the embedding table quantized too (GatherBlockQuantized; by default it stays fp32)
    accuracy_level: int  # MatMulNBits' compute: 4 = int8 activations (fast on CPUs with int8 dot products), 0 = fp32


@dataclass(frozen=True)
class Thresholds:
    """What a quantized decoder must keep, over the gate's prompts, teacher-forced on the reference's greedy
    continuation: the share of positions whose greedy token agrees, the mean overlap of the top 5 tokens, and the
    mean KL(reference || quantized) of the next-token distributions (nats)."""

    agreement: float
    top5_overlap: float
    mean_kl: float


GATES = {"int8": Thresholds(agreement=0.98, top5_overlap=0.95, mean_kl=0.005), "int4": Thresholds(0.9, 0.85, 0.05)}


def lm_head_node(model: onnx.ModelProto, hidden: int, vocab: int) -> str | None:
    """The MatMul that maps the hidden states to the vocabulary (an untied lm_head: its weight is a constant)."""
    shapes = {i.name: tuple(i.dims) for i in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "MatMul" and shapes.get(node.input[1]) == (hidden, vocab):
            return node.name
    return None


def quantize_decoder(
    path: Path,
    scheme: str,
    block_size: int,
    symmetric: bool,
    lm_head: bool,
    hidden: int,
    vocab: int,
    external: bool,
    accuracy_level: int = 4,
    embedding: bool = False,
) -> Quantization:
    """Quantize decoder.onnx in place (inside the export's temporary folder). The embedding Gather is the graph's
    only Gather of a constant table; the quantizer raises the opset to 21, which has the 4-bit types."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)
    model = onnx.load(path)
    head = None if lm_head else lm_head_node(model, hidden, vocab)
    before = sum(n.op_type == "MatMul" for n in model.graph.node)
    quantizer = MatMulNBitsQuantizer(
        model,
        bits=SCHEMES[scheme],
        block_size=block_size,
        is_symmetric=symmetric,
        nodes_to_exclude=[head] if head else [],
        accuracy_level=accuracy_level or None,
    )
    quantizer.process()
    quantized = quantizer.model.model
    if embedding:  # ORT's quantizer writes GatherBlockQuantized in 4 bits only, whatever the scheme
        quantizer = MatMulNBitsQuantizer(
            quantized, bits=4, block_size=block_size, is_symmetric=symmetric, op_types_to_quantize=("Gather",)
        )
        quantizer.process()
        quantized = quantizer.model.model
    data = path.with_name(path.name + ".data")
    data.unlink(missing_ok=True)  # onnx appends to an existing data file
    onnx.save(quantized, path, save_as_external_data=external, location=data.name)
    converted = before - sum(n.op_type == "MatMul" for n in quantized.graph.node)
    return Quantization(scheme, block_size, symmetric, lm_head, converted, embedding, accuracy_level)


@dataclass
class GateResult:
    scheme: str
    prompts: int
    positions: int
    agreement: float
    top5_overlap: float
    mean_kl: float
    max_kl: float
    thresholds: Thresholds

    @property
    def passed(self) -> bool:
        t = self.thresholds
        return self.agreement >= t.agreement and self.top5_overlap >= t.top5_overlap and self.mean_kl <= t.mean_kl


def gate(scheme: str, reference_logits: list[np.ndarray], quantized_logits: list[np.ndarray]) -> GateResult:
    """The accuracy gate over every prompt's positions: logits (positions, vocab) of the reference and the
    quantized decoder on the same tokens."""
    ref, got = np.concatenate(reference_logits).astype(np.float64), np.concatenate(quantized_logits).astype(np.float64)
    log_p = ref - np.logaddexp.reduce(ref, axis=-1, keepdims=True)
    log_q = got - np.logaddexp.reduce(got, axis=-1, keepdims=True)
    kl = (np.exp(log_p) * (log_p - log_q)).sum(-1)
    top_ref, top_got = np.argsort(-ref, axis=-1)[:, :5], np.argsort(-got, axis=-1)[:, :5]
    overlap = [len(set(a) & set(b)) / 5 for a, b in zip(top_ref, top_got)]
    return GateResult(
        scheme,
        len(reference_logits),
        len(ref),
        float((ref.argmax(-1) == got.argmax(-1)).mean()),
        float(np.mean(overlap)),
        float(kl.mean()),
        float(kl.max()),
        GATES[scheme],
    )
