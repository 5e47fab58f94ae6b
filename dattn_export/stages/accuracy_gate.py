"""The accuracy gate: a quantized decoder (an int4 / int8 ONNX export on ONNX Runtime, a compressed-tensors folder
served by vLLM) against its reference, position by position over the gate's prompts: how much of the reference's
probability its choices keep. `validate` applies it instead of the fp32 tolerance; the thresholds were measured on
healthy and broken quantizations (bench/quantize_gate.py, bench/vllm_quantize_gate.py)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..prompts import asked_texts

# asked after the user's prompt about the same media, as the checkpoint is asked (its chat template), so that a gate
# never rests on one prompt
GATE_QUESTIONS = ("What is in the picture?", "How many objects are there?", "Describe the colours, one by one.")


def gate_texts(prompt: str, tokenizer, family) -> list[str]:
    """The texts the gate asks about one medium: the user's prompt (its text), then GATE_QUESTIONS as the checkpoint
    is asked them."""
    return [prompt, *asked_texts(GATE_QUESTIONS, tokenizer, family)]


@dataclass(frozen=True)
class Thresholds:
    """What a quantized decoder must keep, over the gate's prompts, teacher-forced on the reference's greedy
    continuation, each judged by the reference's own probabilities so that near-ties (flat positions) count for
    little and decisive positions for much:
      greedy_mass  the mean of p_ref(the quantized model's greedy token) / p_ref(the reference's greedy token);
      top5_mass    the mean of p_ref(the quantized top 5) / p_ref(the reference's top 5);
      mean_kl      the mean KL(reference || quantized) of the next-token distributions (nats).
    Measured (`bench/quantize_gate.py`, tiny models trained on two sets of questions through the chat template, two
    seeds each; 80 positions each): healthy int4 exports 0.980-0.994 / 0.9926-0.9981 / 0.013-0.026, healthy int8
    >= 0.999 / >= 0.9999 / <= 0.0003; broken int4 exports (one matrix's scales shifted a row, every matrix's, two
    layers swapped) <= 0.882 / <= 0.889 / >= 0.61. The plain agreement and top-5 overlap judged noise: healthy int4
    exports gave as low as 0.81 and 0.82."""

    greedy_mass: float
    top5_mass: float
    mean_kl: float


GATES = {
    "int8": Thresholds(greedy_mass=0.98, top5_mass=0.99, mean_kl=0.01),
    "int4": Thresholds(greedy_mass=0.90, top5_mass=0.95, mean_kl=0.25),
    # compressed-tensors' w4a16 served by vLLM against its 16-bit folder served alike (`validate --backend vllm`),
    # measured by bench/vllm_quantize_gate.py (both families, two seeds): healthy >= 0.975 / >= 0.9963 / <= 0.018;
    # every matrix's scales a row off <= 0.989 / <= 0.9985 / >= 0.089, which int4's row (16-bit activations here, where
    # the ONNX decoders compute with int8 ones) lets pass; every matrix of two layers swapped <= 0.801 / <= 0.9726 /
    # >= 0.72. w8a8 and fp8 folders keep int8's row: healthy >= 0.997 / >= 0.9991 / <= 0.0039.
    "w4a16": Thresholds(greedy_mass=0.90, top5_mass=0.98, mean_kl=0.08),
}


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
