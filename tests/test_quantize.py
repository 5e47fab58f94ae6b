"""onnx --quantize int4|int8 (ONNX Runtime's MatMulNBits) and validate's accuracy gate.

A random model's next-token distributions are nearly flat, so their top-5 order is noise and any gate on them
means nothing. The gate is held here on a tiny model trained first: 150 AdamW steps on the demo corpus with the demo
image, until it predicts the corpus' answers with confidence, as a trained model predicts its domain. The gate
prompts are that corpus' questions. The same gate then fails for graphs of a model that was not trained the same
way, so passing is not automatic."""

import json

import numpy as np
import onnx
import pytest
import torch
from helpers.builders import checkpoint_of
from helpers.cli import run_cli

from dattn_export.checkpoints.source import load_model
from dattn_export.processing import load_image_processor, load_images, load_tokenizer
from dattn_export.stages.demo import CORPUS, write_demo_checkpoint
from dattn_export.stages.onnx_export import export_onnx
from dattn_export.stages.quantize import GATES, gate
from dattn_export.stages.validate import validate


def train(folder, steps: int = 150, seed: int = 0):
    """The demo checkpoint's model trained on the corpus (the image as context); returns it."""
    torch.manual_seed(seed)
    model = load_model(folder).train()
    tokenizer = load_tokenizer(folder, model.config)
    pixels = load_images([folder / "demo.png"], load_image_processor(folder, model.config))
    batch = tokenizer(CORPUS[:3], return_tensors="pt", padding=True)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(steps):
        logits = model(ids, pixels.expand(len(ids), -1, -1, -1, -1), mask).logits[:, :-1]
        labels = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.1, loss.item()  # the corpus' answers are predicted with confidence
    return model.eval()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    work = tmp_path_factory.mktemp("quantize")
    base = write_demo_checkpoint(work / "base")
    return checkpoint_of(train(base), work / "trained"), work


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_decoder_passes_the_gate(trained, scheme):
    checkpoint, work = trained
    out = work / scheme
    assert run_cli("onnx", checkpoint, "-o", out, "--quantize", scheme).returncode == 0
    manifest = json.loads((out / "onnx_manifest.json").read_text())
    assert manifest["quantization"]["scheme"] == scheme and manifest["quantization"]["matmuls"] == 21  # 3 layers x 7
    graph = onnx.load(out / "decoder.onnx")
    ops = [n.op_type for n in graph.graph.node]
    assert ops.count("MatMulNBits") == 21 and ops.count("DecomposedAttention") == 3
    assert any(n.op_type == "MatMul" for n in graph.graph.node)  # the lm_head, kept fp32 by default
    report = validate(out, checkpoint, steps=12)
    assert report.passed, report.gate
    assert report.gate["positions"] == 48 and report.gate["thresholds"] == GATES[scheme].__dict__
    refused = run_cli("trt", out, "-o", work / f"{scheme}-engines")  # TensorRT's parser has no MatMulNBits
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 2 and len(lines) == 1 and "MatMulNBits" in lines[0], refused.stderr


def test_quantized_embedding_passes_the_gate(trained):
    """--quantize-embedding: the table's Gather becomes GatherBlockQuantized (4 bits). On a hidden size of 64 it
    passes the int4 gate with blocks of 16, not of 32 (two blocks a row): why the embedding is not quantized by
    default."""
    checkpoint, work = trained
    out = work / "int4-embedding"
    export = ("onnx", checkpoint, "-o", out, "--quantize", "int4", "--quantize-embedding", "--block-size", "16")
    assert run_cli(*export).returncode == 0
    assert json.loads((out / "onnx_manifest.json").read_text())["quantization"]["embedding"] is True
    ops = [n.op_type for n in onnx.load(out / "decoder.onnx").graph.node]
    assert ops.count("GatherBlockQuantized") == 1 and "Gather" not in ops
    report = validate(out, checkpoint, steps=12)
    assert report.passed, report.gate


def test_the_gate_fails_for_graphs_of_another_model(trained):
    """Graphs of the base (untrained) model validated against the trained one: the same gate fails."""
    checkpoint, work = trained
    export_onnx(work / "base", work / "other", quantize="int8")
    report = validate(work / "other", checkpoint, steps=12)
    assert not report.passed and report.gate["agreement"] < GATES["int8"].agreement


def test_gate_metrics_are_literal():
    """Agreement, top-5 overlap and KL(reference || quantized), computed by hand on two positions."""
    reference = [np.log(np.array([[0.7, 0.1, 0.1, 0.05, 0.03, 0.02], [0.1, 0.6, 0.1, 0.1, 0.05, 0.05]]))]
    quantized = [np.log(np.array([[0.6, 0.2, 0.1, 0.05, 0.03, 0.02], [0.5, 0.2, 0.1, 0.1, 0.05, 0.05]]))]
    result = gate("int4", reference, quantized)
    p, q = np.exp(reference[0]), np.exp(quantized[0])
    kl = (p * np.log(p / q)).sum(-1)
    assert result.agreement == 0.5 and result.top5_overlap == 1.0  # the same five tokens lead each row
    assert result.mean_kl == pytest.approx(kl.mean()) and result.max_kl == pytest.approx(kl.max())
