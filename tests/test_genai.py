"""onnxruntime-genai drives our decoder.onnx with the genai_config.json `onnx` writes, the context bound once."""

import json

import numpy as np
import pytest
import torch
from helpers.builders import picture_pixels
from helpers.cli import run_cli

from dattn_export.checkpoints.source import load_model
from dattn_export.demo_model import DEMO_QUESTIONS, write_demo_checkpoint, write_video
from dattn_export.media import decode_media, encode_media, graph_context
from dattn_export.media_options import Media
from dattn_export.modeling.families import DEFAULT_FAMILY
from dattn_export.processing import load_processor, load_tokenizer
from dattn_export.runtime.genai import GenaiRuntime
from dattn_export.stages.onnx_export import export_onnx

pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed (pip install '.[test]')")

# finished prompts, tokenized whole: the numbers do not depend on how a prompt was made
PROMPTS = [
    "USER: <image>\nDescribe the image in one sentence.\nASSISTANT:",
    "USER: How many objects are there?\nASSISTANT:",
]
VIDEO_PROMPT = "USER: <image>\nWhat happens in the video, and what do you hear?\nASSISTANT:"


@pytest.mark.slow
def test_genai_generates_the_reference_tokens(pipeline, tmp_path, family):
    """20 greedy tokens, each from logits equal to the reference's on the same tokens (<= 1e-4), for two prompts
    over one image whose K/V our graphs computed once (the default family: getting started's export)."""
    if family == DEFAULT_FAMILY:
        checkpoint, onnx = pipeline / "dattn-demo" / "checkpoint", pipeline / "onnx"
    else:
        checkpoint, onnx = write_demo_checkpoint(tmp_path / "ckpt", family), tmp_path / "onnx"
        export_onnx(checkpoint, onnx)
    config = json.loads((onnx / "genai_config.json").read_text())
    assert config["model"]["type"] == family and config["model"]["eos_token_id"] == 2
    runtime, model = GenaiRuntime(onnx), load_model(checkpoint)
    tokenizer = load_tokenizer(checkpoint, model.config)
    pixels = picture_pixels(checkpoint / "demo.png", model.config, checkpoint)
    context = runtime.graphs.encode_images(pixels.numpy())
    with torch.no_grad():
        visual, context_mask = model.model.encode_images(pixels)
        for prompt in PROMPTS:
            ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
            tokens, logits = runtime.generate(ids.numpy(), context, 20)
            full = torch.cat([ids, torch.tensor([tokens])], dim=1)[:, :-1]
            expected = model(full, context_key_values=visual, context_mask=context_mask).logits[0, ids.shape[1] - 1 :]
            assert len(tokens) == 20 and tokens == expected.argmax(-1).tolist()
            assert np.abs(np.stack(logits) - expected.numpy()).max() <= 1e-4
            reference = model.greedy(ids, max_new_tokens=20, context_key_values=visual, context_mask=context_mask)
            assert tokens == reference[0].tolist()


@pytest.mark.slow
def test_genai_answers_about_a_video_as_the_reference(tmp_path):
    """A video model (frames and sound track, a softmax per stream): over the context our graphs computed from a
    video file, genai's greedy tokens and their logits equal the reference's on the same file (<= 1e-4), two
    prompts, each asked twice (genai once read a freed array now and then, and answered otherwise)."""
    checkpoint = write_demo_checkpoint(tmp_path / "ckpt", "gemma2", video=True)
    export_onnx(checkpoint, tmp_path / "onnx")
    rng = np.random.default_rng(0)
    frames = [rng.integers(0, 256, (48, 64, 3), np.uint8) for _ in range(16)]
    write_video(tmp_path / "clip.mov", frames, 2, (rng.standard_normal(16000 * 8) * 3000).astype(np.int16))
    runtime, model = GenaiRuntime(tmp_path / "onnx"), load_model(checkpoint)
    processor = load_processor(checkpoint, model.config)
    decoded = decode_media(Media(video=tmp_path / "clip.mov"), processor)
    context = graph_context(runtime.graphs, load_processor(tmp_path / "onnx", model.config), decoded)
    tokenizer = processor.tokenizer
    with torch.no_grad():
        streams = encode_media(model, processor, decoded, {})
        for prompt in [VIDEO_PROMPT, PROMPTS[1]] * 2:
            ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
            tokens, logits = runtime.generate(ids.numpy(), context, 12)
            full = torch.cat([ids, torch.tensor([tokens])], dim=1)[:, :-1]
            expected = model(full, **streams).logits[0, ids.shape[1] - 1 :]
            assert tokens == expected.argmax(-1).tolist()
            assert np.abs(np.stack(logits) - expected.numpy()).max() <= 1e-4


@pytest.mark.slow
def test_generate_backend_genai_and_what_genai_cannot_drive(pipeline, tmp_path):
    """`generate --backend genai` on an export (getting started's) gives the reference's tokens, as `--backend ort`
    (our decoder graph on ONNX Runtime) does; a WINGS model's export says in its manifest why genai cannot drive it,
    and generate says so in one line."""
    checkpoint = pipeline / "dattn-demo" / "checkpoint"
    args = ("--image", checkpoint / "demo.png", "--prompt", DEMO_QUESTIONS["image"], "--max-new-tokens", "8")
    torch_ = run_cli("generate", checkpoint, *args)
    expected = [line for line in torch_.stdout.splitlines() if line.startswith("generated ids")]
    assert expected, torch_.stderr
    for backend in ("genai", "ort"):
        run = run_cli("generate", pipeline / "onnx", "--backend", backend, *args)
        assert run.returncode == 0, run.stderr
        assert [line for line in run.stdout.splitlines() if line.startswith("generated ids")] == expected, backend

    wings = write_demo_checkpoint(tmp_path / "wings", wings_rank=8)
    export_onnx(wings, tmp_path / "wings-onnx")
    manifest = json.loads((tmp_path / "wings-onnx" / "onnx_manifest.json").read_text())
    assert "WINGS" in manifest["genai"] and not (tmp_path / "wings-onnx" / "genai_config.json").exists()
    refused = run_cli("generate", tmp_path / "wings-onnx", "--backend", "genai", *args)
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 2 and len(lines) == 1 and "genai cannot drive it" in lines[0], refused.stderr
