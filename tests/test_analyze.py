"""analyze: its numbers against attention weights materialised explicitly, and its plots."""

import json
import math
import wave

import numpy as np
import pytest
import torch
from helpers.builders import build_model, checkpoint_of, picture_pixels
from PIL import Image

from dattn_export.checkpoints.source import load_model
from dattn_export.demo_model import demo_image, write_demo_checkpoint
from dattn_export.media import decode_media, encode_media
from dattn_export.media_options import Media
from dattn_export.modeling.attention import dattn_op
from dattn_export.plugins.contract import using_op
from dattn_export.processing import load_processor, load_tokenizer
from dattn_export.stages.analyze import PLOT_SIZE, analyze

PROMPT = "USER: Look at this <image> and describe the picture in detail.\nASSISTANT:"


def materialised_masses(model, ids, streams, image_after):
    """Per layer: the full softmax over [context keys ; text keys] of every head, written out literally; mass on
    visual keys, (on a video model's audio keys,) on text before the image and after it, averaged over heads ->
    (L, 3 or 4, T). `streams`: the forward's context K/V and masks (every key real)."""
    config = model.config
    calls = []

    def recording_op(q, k, v, key_mask, q_vis, k_vis, v_vis, context_mask, **keywords):
        calls.append(dict(q=q, k=k, q_vis=q_vis, k_vis=k_vis, segments=context_mask[0]))
        return dattn_op(q, k, v, key_mask, q_vis, k_vis, v_vis, context_mask, **keywords)

    with using_op(model, recording_op):
        model(ids, **streams)
    out = []
    for a, call in zip([layer.self_attn for layer in model.model.layers], calls, strict=True):
        groups = config.num_attention_heads // config.num_key_value_heads
        k_vis, k = (call[name].repeat_interleave(groups, 1) for name in ("k_vis", "k"))
        logits = torch.cat([call["q_vis"] @ k_vis.transpose(-1, -2), call["q"] @ k.transpose(-1, -2)], -1)
        logits = logits.double() * a.scale
        if a.softcap:
            logits = a.softcap * torch.tanh(logits / a.softcap)
        num_context, tokens = k_vis.shape[2], k.shape[2]
        for i in range(tokens):
            for j in range(tokens):
                window_ok = a.window is None or i - j < a.window
                if j > i or not window_ok:
                    logits[..., i, num_context + j] = -math.inf
        weights = torch.softmax(logits, dim=-1)[0]  # (heads, T, contexts + T)
        context = weights[..., :num_context]
        parts = [context[..., call["segments"] == index].sum(-1) for index in range(1, a.num_contexts + 1)]
        parts += [weights[..., num_context : num_context + image_after].sum(-1)]
        parts += [weights[..., num_context + image_after :].sum(-1)]
        out.append(torch.stack(parts).mean(1))
    return torch.stack(out)


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_analyze_matches_materialised_softmax(tmp_path, family):
    model = build_model(family, attn_logit_softcapping=3.0) if family == "gemma2" else build_model(family)
    checkpoint = checkpoint_of(model, tmp_path / "ckpt")
    demo_image().save(tmp_path / "image.png")
    report = analyze(checkpoint, Media(images=[tmp_path / "image.png"]), PROMPT, tmp_path / "report")

    pixels = picture_pixels(tmp_path / "image.png", model.config, checkpoint)
    tokenizer = load_tokenizer(checkpoint, model.config)
    ids = torch.tensor([tokenizer.convert_tokens_to_ids(report.tokens)])
    with torch.no_grad():
        streams = dict(context_key_values=model.model.encode_context(model.model.embed_images(pixels)))
        expected = materialised_masses(model, ids, streams, report.image_after_token).numpy()  # (L, 3, T)
    np.testing.assert_allclose(np.array(report.visual_mass), expected[:, 0], atol=1e-5, rtol=0)
    after = expected[:, :, report.image_after_token :].mean(-1)
    for i, part in enumerate(("image", "before", "after")):
        np.testing.assert_allclose(report.laws[part], after[:, i], atol=1e-5, rtol=0)
    expected_shift = 1 - np.corrcoef(after[:, 1], after[:, 2])[0, 1]
    assert report.attention_shift == pytest.approx(expected_shift, abs=1e-5)
    assert 0.01 < np.mean(report.visual_mass) < 0.99  # the visual stream really takes part of the attention

    written = json.loads((tmp_path / "report" / "report.json").read_text())
    assert written["visual_mass"] == report.visual_mass and len(written["tokens"]) == len(report.tokens)
    for name, size in PLOT_SIZE.items():
        with Image.open(tmp_path / "report" / name) as picture:
            assert picture.format == "PNG" and picture.size == size
            assert np.asarray(picture.convert("L")).std() > 10  # not a blank canvas


def test_analyze_a_video_model_matches_materialised_softmax(tmp_path):
    """A video model: the mass on its frames and on its audio, each against one softmax over every key written out."""
    folder = write_demo_checkpoint(tmp_path / "video", "gemma2", video=True)
    (tmp_path / "frames").mkdir()
    for i in range(3):
        Image.new("RGB", (40, 40), (70 * i, 200 - 50 * i, 90)).save(tmp_path / "frames" / f"{i}.png")
    samples = (np.sin(np.arange(16000 * 5) / 5.0) * 9000).astype(np.int16)
    with wave.open(str(tmp_path / "speech.wav"), "wb") as wav:
        wav.setnchannels(1), wav.setsampwidth(2), wav.setframerate(16000), wav.writeframes(samples.tobytes())
    media = Media(frames=tmp_path / "frames", audio=tmp_path / "speech.wav")
    report = analyze(folder, media, PROMPT, tmp_path / "report")

    model = load_model(folder)
    tokenizer = load_tokenizer(folder, model.config)
    ids = torch.tensor([tokenizer.convert_tokens_to_ids(report.tokens)])
    with torch.no_grad():
        processor = load_processor(folder, model.config)
        streams = encode_media(model, processor, decode_media(media, processor), {})
        expected = materialised_masses(model, ids, streams, report.image_after_token).numpy()  # (L, 4, T)
    np.testing.assert_allclose(np.array(report.visual_mass), expected[:, 0], atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.array(report.audio_mass), expected[:, 1], atol=1e-5, rtol=0)
    after = expected[:, :, report.image_after_token :].mean(-1)
    for i, part in enumerate(("image", "audio", "before", "after")):
        np.testing.assert_allclose(report.laws[part], after[:, i], atol=1e-5, rtol=0)
    assert 0.01 < np.mean(report.audio_mass) < 0.99
