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
    continuation, each judged by the reference's own probabilities so that near-ties (flat positions) count for
    little and decisive positions for much:
      greedy_mass  the mean of p_ref(the quantized model's greedy token) / p_ref(the reference's greedy token);
      top5_mass    the mean of p_ref(the quantized top 5) / p_ref(the reference's top 5);
      mean_kl      the mean KL(reference || quantized) of the next-token distributions (nats).
    Measured (`bench/quantize_gate.py`, tiny models trained on two corpora, two seeds each; 80 positions each):
    healthy int4 exports 0.918-0.988 / 0.9825-0.9937 / 0.034-0.092, healthy int8 >= 0.999 / >= 0.9999 / <= 0.0008;
    broken int4 exports (one matrix's scales shifted a row, every matrix's, two layers swapped) <= 0.722 / <= 0.808
    / >= 0.96. The plain agreement and top-5 overlap judged noise: healthy int4 exports gave 0.81 and 0.85."""

    greedy_mass: float
    top5_mass: float
    mean_kl: float


GATES = {
    "int8": Thresholds(greedy_mass=0.98, top5_mass=0.99, mean_kl=0.01),
    "int4": Thresholds(greedy_mass=0.85, top5_mass=0.95, mean_kl=0.25),
}


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
    greedy_mass: float
    top5_mass: float
    mean_kl: float
    max_kl: float
    agreement: float  # the plain share of positions whose greedy token agrees (shown, not judged: see Thresholds)
    thresholds: Thresholds

    @property
    def passed(self) -> bool:
        t = self.thresholds
        return self.greedy_mass >= t.greedy_mass and self.top5_mass >= t.top5_mass and self.mean_kl <= t.mean_kl


def gate(scheme: str, reference_logits: list[np.ndarray], quantized_logits: list[np.ndarray]) -> GateResult:
    """The accuracy gate over every prompt's positions: logits (positions, vocab) of the reference and the
    quantized decoder on the same tokens."""
    ref, got = np.concatenate(reference_logits).astype(np.float64), np.concatenate(quantized_logits).astype(np.float64)
    log_p = ref - np.logaddexp.reduce(ref, axis=-1, keepdims=True)
    log_q = got - np.logaddexp.reduce(got, axis=-1, keepdims=True)
    p, rows = np.exp(log_p), np.arange(len(ref))[:, None]
    kl = (p * (log_p - log_q)).sum(-1)
    top_ref, top_got = np.argsort(-ref, axis=-1)[:, :5], np.argsort(-got, axis=-1)[:, :5]
    greedy_mass = p[rows[:, 0], top_got[:, 0]] / p[rows[:, 0], top_ref[:, 0]]
    top5_mass = p[rows, top_got].sum(-1) / p[rows, top_ref].sum(-1)
    return GateResult(
        scheme,
        len(reference_logits),
        len(ref),
        float(greedy_mass.mean()),
        float(top5_mass.mean()),
        float(kl.mean()),
        float(kl.max()),
        float((top_ref[:, 0] == top_got[:, 0]).mean()),
        GATES[scheme],
    )
