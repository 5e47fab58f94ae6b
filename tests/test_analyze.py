"""analyze: its numbers against attention weights materialised explicitly, and its plots."""

import json
import math

import numpy as np
import pytest
import torch
from helpers.builders import build_model, checkpoint_of
from PIL import Image

from dattn_export.modeling.attention import dattn_op
from dattn_export.plugins.contract import using_op
from dattn_export.processing import load_image_processor, load_images, load_tokenizer
from dattn_export.stages.analyze import PLOT_SIZE, analyze
from dattn_export.stages.demo import demo_image

PROMPT = "USER: Look at this <image> and describe the picture in detail.\nASSISTANT:"


def materialised_masses(model, ids, pixels, image_after):
    """Per layer: the full softmax over [visual keys ; text keys] of every head, written out literally;
    mass on visual keys, on text before the image and after it, averaged over heads -> (L, 3, T)."""
    config = model.config
    visual_kv = model.model.encode_visual(model.model.embed_images(pixels))
    calls = []

    def recording_op(q, k, v, key_mask, q_vis, k_vis, v_vis, visual_mask, **keywords):
        calls.append(dict(q=q, k=k, q_vis=q_vis, k_vis=k_vis))
        return dattn_op(q, k, v, key_mask, q_vis, k_vis, v_vis, visual_mask, **keywords)

    with using_op(model, recording_op):
        model(ids, visual_key_values=visual_kv)
    out = []
    for a, call in zip([layer.self_attn for layer in model.model.layers], calls, strict=True):
        groups = config.num_attention_heads // config.num_key_value_heads
        k_vis, k = call["k_vis"].repeat_interleave(groups, 1), call["k"].repeat_interleave(groups, 1)
        logits = (
            torch.cat([call["q_vis"] @ k_vis.transpose(-1, -2), call["q"] @ k.transpose(-1, -2)], -1).double() * a.scale
        )
        if a.softcap:
            logits = a.softcap * torch.tanh(logits / a.softcap)
        num_visual, tokens = k_vis.shape[2], k.shape[2]
        for i in range(tokens):
            for j in range(tokens):
                window_ok = a.window is None or i - j < a.window
                if j > i or not window_ok:
                    logits[..., i, num_visual + j] = -math.inf
        weights = torch.softmax(logits, dim=-1)[0]  # (heads, T, V + T)
        out.append(
            torch.stack(
                [
                    weights[..., :num_visual].sum(-1),
                    weights[..., num_visual : num_visual + image_after].sum(-1),
                    weights[..., num_visual + image_after :].sum(-1),
                ]
            ).mean(1)
        )
    return torch.stack(out)


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_analyze_matches_materialised_softmax(tmp_path, family):
    model = build_model(family, attn_logit_softcapping=3.0) if family == "gemma2" else build_model(family)
    checkpoint = checkpoint_of(model, tmp_path / "ckpt")
    demo_image().save(tmp_path / "image.png")
    report = analyze(checkpoint, tmp_path / "image.png", PROMPT, tmp_path / "report")

    pixels = load_images([tmp_path / "image.png"], load_image_processor(checkpoint, model.config))
    tokenizer = load_tokenizer(checkpoint, model.config)
    ids = torch.tensor([tokenizer.convert_tokens_to_ids(report.tokens)])
    with torch.no_grad():
        expected = materialised_masses(model, ids, pixels, report.image_after_token).numpy()  # (L, 3, T)
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
