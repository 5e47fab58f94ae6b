"""Checkpoints saved by the released D-Attn code (ByteDance's Vidi, GitHub bytedance/vidi) hold the numbers that
code computes. `vidi_logits` is the released forward written out literally from reading `lmm/dattn/gemma.py`,
`lmm/dattn/mistral.py`, `lmm/dattn/xattn.py`, `lmm/dattn/multimodal.py`, `mm_vision/pos.py` and `mm_layer/norm.py`:
its own masks, softmaxes, position features and norms; only the projections, the LLM's norms and MLPs and the
rotary tables are the model's modules."""

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers.builders import checkpoint_of, images
from helpers.cli import run_cli

from dattn_export.checkpoints.released import is_released, released_config, released_fields
from dattn_export.checkpoints.source import config_from_dict
from dattn_export.modeling.modeling_dattn import MODEL_CLASSES, apply_rope
from dattn_export.presets import randomize_weights, tiny_config
from dattn_export.runtime.ort import OrtModel
from dattn_export.stages.onnx_export import export_onnx

WINDOW = 6  # shorter than every prompt below


def released_model(family: str, seed: int = 0):
    """A tiny model whose config went through what a released config.json says (the released semantics)."""
    config = tiny_config(family, audio=True, sliding_window=WINDOW, mm_std=0.5)
    fields = released_config(config, "towers/tiny-siglip", "towers/tiny-whisper")
    fields |= {"vision_config": config.vision_config, "audio_config": config.audio_config}
    released = config_from_dict(released_fields(fields, "config.json"), "config.json")
    return randomize_weights(MODEL_CLASSES[released.model_type](released), seed).eval()


def rms(x, eps=1e-5):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def position_embedding(module, length, num_positions):
    """mm_vision/pos.py: fractional positions, sin on even channels and cos on odd, Linear-GELU-Linear."""
    d = module.mlp[0].in_features
    p = torch.arange(length, dtype=torch.float) / (length - 1) * (num_positions - 1)
    div_term = torch.exp(torch.arange(0, d, 2, dtype=torch.float) * -(math.log(10000.0) / d))
    pe = torch.zeros(length, d)
    pe[:, 0::2], pe[:, 1::2] = torch.sin(p[:, None] * div_term), torch.cos(p[:, None] * div_term)
    return module.mlp(pe)


def image_stream(model, pixels):
    """multimodal.py encode_images (one image per sample): features, embeddings and image_attention_mask."""
    m, grid = model.model, model.config.patch_grid
    features = m.mm_vis.vision_model(pixels, output_hidden_states=True).hidden_states[-2]
    features = features[:, 1:] if m.mm_vis.is_clip else features  # mm_vision/clip.py: the patches, not the class
    x = m.mm_rand_norm.weight * rms(m.mm_rand_projector(features.reshape(len(pixels), grid, grid, -1)))
    x = x + rms(position_embedding(m.mm_rand_pos_h, grid, grid))[None, :, None]
    x = x + rms(position_embedding(m.mm_rand_pos_w, grid, grid))[None, None, :]
    x = m.mm_rand_llm_norm.weight * rms(x.flatten(1, 2))
    present = torch.stack([x.abs().sum() for x in pixels]) != 0
    return x, present[:, None].expand(-1, x.shape[1])


def attention(q, k, v, scale, softcap, mask):
    """Softmax attention of (B, H, T, D) queries over (B, Hkv, S, D) keys (repeated as repeat_kv does)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = q @ k.transpose(-1, -2) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    return torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1) @ v


def vidi_logits(model, ids, pixels=None):
    """The released forward: ids (B, T) without the image token (its embedding is dropped), pixels (B, 3, H, W)."""
    config, m = model.config, model.model
    gemma = config.model_type == "dattn_gemma2"
    heads = lambda proj, x: proj(x).unflatten(-1, (-1, config.head_dim)).transpose(1, 2)  # noqa: E731
    normalizer = torch.tensor(config.hidden_size**0.5) if gemma else torch.tensor(1.0)
    h = F.embedding(ids, m.embed_tokens.weight) * normalizer
    image = None
    if pixels is not None:
        image, image_mask = image_stream(model, pixels)
        image = image * normalizer
    batch, length = ids.shape
    rope = m.rotary_emb(h, torch.arange(length).expand(batch, -1))
    i, j = torch.arange(length)[:, None], torch.arange(length)[None, :]
    for n, layer in enumerate(m.layers):
        attn = layer.self_attn
        scale = (config.query_pre_attn_scalar if gemma else config.head_dim) ** -0.5
        softcap = config.attn_logit_softcapping if gemma else None
        sliding = config.layer_types[n] == "sliding_attention" if gemma else config.sliding_window is not None
        causal = (j <= i) & ((i - j <= config.sliding_window) if sliding else True)  # flash-attn window (w, w)
        x = layer.input_layernorm(h)
        q = heads(attn.q_proj, x)
        k, v = apply_rope(heads(attn.k_proj, x), *rope), heads(attn.v_proj, x)
        out = attn.o_proj(attention(apply_rope(q, *rope), k, v, scale, softcap, causal).transpose(1, 2).flatten(2))
        if image is not None:  # T2V: unrotated query, no mask inside an image, zero for a sample without one
            xi = layer.input_layernorm(image)
            ki, vi = heads(attn.k_proj, xi), heads(attn.v_proj, xi)
            has_image = image_mask.any(-1)[:, None, None]  # xattn: a sample without one sees every key, times 0
            t2v = attention(q, ki, vi, scale, softcap, image_mask[:, None, None, :] | ~has_image[..., None])
            out = out + attn.o_proj(t2v.transpose(1, 2).flatten(2)) * has_image
            v2v = attn.o_proj(vi.repeat_interleave(q.shape[1] // vi.shape[1], 1).transpose(1, 2).flatten(2))
            image = feed_forward(layer, image + (layer.post_attention_layernorm(v2v) if gemma else v2v), gemma)
        h = feed_forward(layer, h + (layer.post_attention_layernorm(out) if gemma else out), gemma)
    logits = model.lm_head(m.norm(h))
    return config.final_logit_softcapping * torch.tanh(logits / config.final_logit_softcapping) if gemma else logits


def feed_forward(layer, x, gemma):
    if gemma:
        return x + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(x)))
    return x + layer.mlp(layer.post_attention_layernorm(x))


def prompts(vocab=512, seed=0):
    """Two 11-token prompts and two images, the second all zeros (a sample without an image)."""
    ids = torch.randint(3, vocab, (2, 11), generator=torch.Generator().manual_seed(seed))
    pixels = images(2, seed=seed)
    pixels[1] = 0
    return ids, pixels


@pytest.mark.parametrize("prompt", ["image", "text only", "batch with an all-zero image"])
def test_model_equals_released_forward(family, prompt):
    model = released_model(family)
    ids, pixels = prompts()
    ids, pixels = (ids[:1], pixels[:1, 0]) if prompt == "image" else (ids, pixels[:, 0])
    with torch.no_grad():
        expected = vidi_logits(model, ids, None if prompt == "text only" else pixels)
        got = model(ids, None if prompt == "text only" else pixels[:, None]).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("vision", ["siglip", "clip"])
def test_image_stream_equals_released_formula(vision):
    model = randomize_weights(MODEL_CLASSES["dattn_mistral"](tiny_config("mistral", vision=vision, mm_std=0.7)))
    pixels = images(2)[:, 0]
    with torch.no_grad():
        expected, _ = image_stream(model, pixels)
        got = model.model.embed_images(pixels[:, None])
    assert got.shape == (2, 16, 64)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


EARLIER_CHOICES = [  # (family, switch, this project's earlier choice)
    *((f, "dattn_mode", "dattn") for f in ("mistral", "gemma2")),  # one softmax over [visual ; text]
    *((f, "window_rule", "transformers") for f in ("mistral", "gemma2")),  # a window of w shows w keys
    *((f, "mm_mask_empty_images", False) for f in ("mistral", "gemma2")),  # an all-zero image is attended to
    ("gemma2", "mm_scale_streams", False),  # the visual stream not scaled by sqrt(hidden) (only Gemma 2 scales)
]


@pytest.mark.parametrize("family_name, key, value", EARLIER_CHOICES, ids=lambda v: str(v))
def test_each_released_rule_matters(family_name, key, value):
    """Each rule the released code decides, put back to this project's earlier choice, moves the logits: the
    literal test above would fail on the old behaviour."""
    model = released_model(family_name)
    ids, pixels = prompts()
    with torch.no_grad():
        expected = vidi_logits(model, ids, pixels[:, 0])
        setattr(model.config, key, value)
        changed = MODEL_CLASSES[model.config.model_type](model.config).eval()
        changed.load_state_dict(model.state_dict())
        got = changed(ids, pixels).logits
    assert (got - expected).abs().max() > 1e-3


def test_new_adapter_norms_start_as_released():
    """mm_rand_norm starts at 1 and mm_rand_llm_norm at mm_std (mm_layer/norm.py RMSNorm(std=...))."""
    model = MODEL_CLASSES["dattn_mistral"](tiny_config("mistral", mm_std=0.3))
    assert torch.equal(model.model.mm_rand_norm.weight, torch.ones(64))
    assert torch.equal(model.model.mm_rand_llm_norm.weight, torch.full((64,), 0.3))


def test_onnx_runtime_equals_released_forward(tmp_path, family):
    model = released_model(family)
    export_onnx(checkpoint_of(model, tmp_path / "ckpt"), tmp_path / "onnx")
    runtime = OrtModel(tmp_path / "onnx")
    ids, pixels = prompts()
    visual, visual_mask = runtime.encode_images(pixels.numpy())
    assert visual_mask.tolist() == [[1] * 16, [0] * 16]
    logits, _ = runtime.decode(ids.numpy(), np.ones_like(ids.numpy()), runtime.empty_kv(2), visual, visual_mask)
    with torch.no_grad():
        expected = vidi_logits(model, ids, pixels[:, 0]).numpy()
    np.testing.assert_allclose(logits, expected, atol=1e-4, rtol=0)


# --- the released folder layout ------------------------------------------------------------------------------------

RELEASED_KEYS = {  # what the released trainer's config.json adds to the LLM's (train.py, multimodal.py, gemma.py)
    "mm_vision_tower", "mm_vision_select_layer", "mm_image_pool_size", "mm_image_aspect_ratio", "mm_image_grid_points",
    "mm_image_grid_res", "mm_audio_tower", "mm_audio_pool_size", "mm_input_type", "mm_splits", "mm_std",
    "mm_time_interval", "loss_thres", "train_rand", "train_vis", "train_aud", "train_llm",
}  # fmt: skip


def test_demo_writes_the_released_layout(tmp_path, family):
    """The demo's folder is what the released code saves: its keys, Whisper tensors, towers named by folders."""
    from dattn_export.stages.demo import write_demo_checkpoint

    folder = write_demo_checkpoint(tmp_path / "ckpt", family)
    config = json.loads((folder / "config.json").read_text())
    assert is_released(config) and RELEASED_KEYS <= set(config)
    architecture = {"mistral": "DattnMistralForCausalLM", "gemma2": "DattnGemma2ForCausalLM"}[family]
    assert config["architectures"] == [architecture]
    assert "vision_config" not in config and "dattn_mode" not in config and "torch_dtype" in config
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    assert any(name.startswith("model.mm_aud.encoder.layers.") for name in index)
    assert json.loads((tmp_path / "towers/tiny-siglip/config.json").read_text())["model_type"] == "siglip_vision_model"


def test_released_folder_converts_untouched(tmp_path):
    """No flag and no edit: the towers' configs come from their folders, the audio tower is carried, and the
    converted config records what it inferred and from where."""
    from dattn_export.stages.demo import write_demo_checkpoint

    folder = write_demo_checkpoint(tmp_path / "ckpt", "gemma2")
    info = run_cli("info", folder, "--json")
    assert info.returncode == 0, info.stderr
    report = json.loads(info.stdout)
    assert report["problems"] == [] and report["parameters"]["audio tower"] > 0
    result = run_cli("convert", folder, "-o", tmp_path / "out")
    assert result.returncode == 0, result.stderr
    assert "audio tower" in result.stdout and "inferred: window_rule" in result.stdout
    converted = json.loads((tmp_path / "out/config.json").read_text())
    assert converted["dattn_mode"] == "dattn-sum" and converted["window_rule"] == "flash_attn"
    assert converted["mm_scale_streams"] is True and converted["mm_mask_empty_images"] is True
    assert converted["dattn_inferred"]["vision_config"].startswith("tower folder")
    assert converted["audio_config"]["d_model"] == 32
    assert (tmp_path / "out/preprocessor_config.json").is_file()  # from the vision tower's folder
    verify = run_cli("verify", tmp_path / "out", "--against", folder)
    assert verify.returncode == 0, verify.stderr


def test_tower_named_relative_to_the_checkpoint_or_in_the_hub_cache(tmp_path, monkeypatch):
    from dattn_export.checkpoints.towers import tower_folder

    (tmp_path / "ckpt/towers/a").mkdir(parents=True)
    (tmp_path / "ckpt/towers/a/config.json").write_text("{}")
    assert tower_folder("towers/a", tmp_path / "ckpt") == tmp_path / "ckpt/towers/a"
    snapshot = tmp_path / "hub/models--org--tower/snapshots/abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (tmp_path / "hub/models--org--tower/refs").mkdir()
    (tmp_path / "hub/models--org--tower/refs/main").write_text("abc123")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    assert tower_folder("org/tower", tmp_path / "ckpt") == snapshot
    assert tower_folder("org/other", tmp_path / "ckpt") is None
