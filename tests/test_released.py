"""Checkpoints saved by the released D-Attn code (ByteDance's Vidi, GitHub bytedance/vidi) hold the numbers that
code computes: our model against `helpers.vidi_literal`, the released forward written out from reading it."""

import json

import numpy as np
import pytest
import torch
from helpers.builders import checkpoint_of, images, released_model
from helpers.cli import run_cli
from helpers.vidi_literal import anyres_stream, image_stream, select_best_resolution, vidi_logits
from PIL import Image

from dattn_export.checkpoints.released import is_released
from dattn_export.checkpoints.source import load_model
from dattn_export.demo_model import write_demo_checkpoint
from dattn_export.media_options import Media
from dattn_export.modeling.images import anyres_grid
from dattn_export.modeling.modeling_dattn import MODEL_CLASSES
from dattn_export.presets import randomize_weights, tiny_config
from dattn_export.processing import load_image_processor, load_tokenizer
from dattn_export.runtime.ort import OrtModel
from dattn_export.stages.generate import run_prompt
from dattn_export.stages.onnx_export import export_onnx


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
        expected = vidi_logits(model, ids, [] if prompt == "text only" else [image_stream(model, pixels)])
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
        expected = vidi_logits(model, ids, [image_stream(model, pixels[:, 0])])
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


@pytest.mark.slow
def test_onnx_runtime_equals_released_forward(tmp_path, family):
    model = released_model(family)
    export_onnx(checkpoint_of(model, tmp_path / "ckpt"), tmp_path / "onnx")
    runtime = OrtModel(tmp_path / "onnx")
    ids, pixels = prompts()
    visual, context_mask = runtime.encode_images(pixels.numpy())
    assert context_mask.tolist() == [[1] * 16, [0] * 16]
    logits, _ = runtime.decode(ids.numpy(), np.ones_like(ids.numpy()), runtime.empty_kv(2), visual, context_mask)
    with torch.no_grad():
        expected = vidi_logits(model, ids, [image_stream(model, pixels[:, 0])]).numpy()
    np.testing.assert_allclose(logits, expected, atol=1e-4, rtol=0)


# --- the released folder layout ------------------------------------------------------------------------------------

RELEASED_KEYS = {  # what the released trainer's config.json adds to the LLM's (train.py, multimodal.py, gemma.py)
    "mm_vision_tower", "mm_vision_select_layer", "mm_image_pool_size", "mm_image_aspect_ratio", "mm_image_grid_points",
    "mm_image_grid_res", "mm_audio_tower", "mm_audio_pool_size", "mm_input_type", "mm_splits", "mm_std",
    "mm_time_interval", "loss_thres", "train_rand", "train_vis", "train_aud", "train_llm",
}  # fmt: skip


def test_demo_writes_the_released_layout(tmp_path, family):
    """The demo's folder is what the released code saves: its keys, Whisper tensors, towers named by folders."""
    from dattn_export.demo_model import write_demo_checkpoint

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
    from dattn_export.demo_model import write_demo_checkpoint

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


# --- anyres images ---------------------------------------------------------------------------------------------

GRID_POINTS = [[1, 2], [2, 1], [2, 2]]  # (columns, rows) of 32-pixel tiles


def anyres_inputs(seed=0):
    """A wide image (2 x 1 tiles) and a tall one (1 x 2), each a thumbnail plus its tiles, and their sizes."""
    generator = torch.Generator().manual_seed(seed)
    tiles = [torch.randn(3, 3, 32, 32, generator=generator), torch.randn(3, 3, 32, 32, generator=generator)]
    return tiles, [(70, 30), (30, 66)]


@pytest.mark.parametrize("case", ["wide and tall", "second sample without an image"])
def test_anyres_equals_released_forward(family, case):
    model = released_model(family, mm_image_aspect_ratio="anyres", mm_image_grid_points=GRID_POINTS)
    ids, _ = prompts()
    tiles, sizes = anyres_inputs()
    if case == "second sample without an image":
        tiles[1] = torch.zeros_like(tiles[1])
    with torch.no_grad():
        stream = anyres_stream(model, tiles, sizes)
        expected = vidi_logits(model, ids, [stream])
        visual, context_mask = model.model.encode_anyres(tiles, sizes)
        got = model(ids, context_key_values=visual, context_mask=context_mask).logits
    assert torch.equal(context_mask, stream[1]) and context_mask.sum(-1).tolist()[0] == 16 + 2 * 16
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_anyres_tiling_choice_equals_released():
    """Our tiling choice against img_utils.select_best_resolution on 500 random image sizes (with 14-pixel tiles
    and the released tilings, where ties and truncation matter)."""
    points = [[1, 2], [2, 1], [2, 2], [1, 3], [3, 1], [3, 3], [2, 3]]
    generator = torch.Generator().manual_seed(0)
    for width, height in torch.randint(1, 3000, (500, 2), generator=generator).tolist():
        best = select_best_resolution((width, height), [[a * 14, b * 14] for a, b in points])
        assert anyres_grid((width, height), points, 14) == (best[0] // 14, best[1] // 14), (width, height)


@pytest.mark.slow
def test_generate_tiles_an_image_for_anyres_models(tmp_path):
    """generate --image on an anyres checkpoint: a thumbnail and the best tiling's tiles (process_anyres_image:
    resize to the tiling's resolution, cut row by row), the same tokens as the model given exactly those tiles;
    onnx exports it and validate passes on that image."""
    folder = write_demo_checkpoint(
        tmp_path / "anyres", "gemma2", mm_image_aspect_ratio="anyres", mm_image_grid_points=GRID_POINTS
    )
    pixels = (np.arange(50 * 90 * 3).reshape(50, 90, 3) % 251).astype(np.uint8)
    Image.fromarray(pixels).save(tmp_path / "wide.png")
    result = run_prompt(folder, "what is this", Media(images=[tmp_path / "wide.png"]), max_new_tokens=5)

    model = load_model(folder)
    image = Image.open(tmp_path / "wide.png").convert("RGB")
    width, height = select_best_resolution(image.size, [[a * 32, b * 32] for a, b in GRID_POINTS])
    resized = image.resize((width, height), resample=Image.BICUBIC)
    patches = [resized.crop((j, i, j + 32, i + 32)) for i in range(0, height, 32) for j in range(0, width, 32)]
    processor = load_image_processor(folder, model.config)
    tiles = processor([image.resize((32, 32), resample=Image.BICUBIC), *patches], return_tensors="pt")
    with torch.no_grad():
        visual, context_mask = model.model.encode_anyres([tiles["pixel_values"]], [image.size])
        ids = load_tokenizer(folder, model.config)("what is this", return_tensors="pt")["input_ids"]
        expected = model.greedy(
            ids, max_new_tokens=5, context_key_values=visual, context_mask=context_mask, eos_token_id=2
        )
    assert (width, height) == (64, 64) and result.visual_tokens == 16 + 64  # 90 x 50 keeps most in 2 x 2 tiles
    assert result.generated_ids == expected[0].tolist()
    assert run_cli("onnx", folder, "-o", tmp_path / "onnx").returncode == 0
    validated = run_cli("validate", tmp_path / "onnx", "--image", tmp_path / "wide.png", "--max-new-tokens", "5")
    assert validated.returncode == 0, validated.stdout
    report = json.loads((tmp_path / "onnx" / "validation_report.json").read_text())
    assert report["passed"] and report["visual_tokens"] == 16 + 64
    assert any(c["output"] == "visual K/V (2 x 2 tiles)" for c in report["comparisons"])
    # one picture a prompt (the tiled stream's limit): a second is refused in one line, naming it
    two = run_cli(
        "generate", folder, "--prompt", "hi", "--image", tmp_path / "wide.png", "--image", folder / "demo.png"
    )
    assert (
        two.returncode == 2
        and two.stderr.strip() == f"Error: {folder / 'demo.png'}: is image 2, but the model takes 1 a prompt"
    )


@pytest.mark.slow
def test_anyres_onnx_equals_released_forward(tmp_path, family):
    """The anyres vision graph (thumbnail, tiles as rows x columns) and the decoder on ONNX Runtime against the
    released forward written out (fp32, <= 1e-4): a wide image and a tall one, batched."""
    folder = write_demo_checkpoint(
        tmp_path / "anyres", family, mm_image_aspect_ratio="anyres", mm_image_grid_points=GRID_POINTS
    )
    export_onnx(folder, tmp_path / "onnx")
    model, runtime = load_model(folder), OrtModel(tmp_path / "onnx")
    ids, _ = prompts()
    tiles, sizes = anyres_inputs()
    grids = [anyres_grid(size, GRID_POINTS, 32) for size in sizes]
    assert grids == [(2, 1), (1, 2)]
    caches, mask = runtime.batch_contexts([runtime.encode_anyres(t.numpy(), *g) for t, g in zip(tiles, grids)])
    with torch.no_grad():
        expected = vidi_logits(model, ids, [anyres_stream(model, tiles, sizes)]).numpy()
    logits, _ = runtime.decode(ids.numpy(), np.ones(ids.shape, np.int64), runtime.empty_kv(len(ids)), caches, mask)
    assert np.abs(logits - expected).max() <= 1e-4
