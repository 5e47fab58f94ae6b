"""A user's picture becomes the pixels the released code makes of it (`img_utils.process_images`, written out in
`helpers/released_images.py`), for every `mm_image_aspect_ratio` (resize, pad, crop, anyres), CLIP and SigLIP
processors (tiny and at their released sizes), square, wide, tall and odd-sized pictures, RGBA and greyscale files:
bit for bit, in the preparation itself and through `generate`, `validate --image` and the processor every command and
the pushed repo prepare pictures with (`test_push.py` runs it in a fresh process, `test_vllm.py` through vLLM)."""

import json
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers.checks import released_question_ids
from helpers.cli import run_cli
from helpers.released_images import open_picture, process_images, with_output_size
from PIL import Image
from transformers import CLIPImageProcessorPil, SiglipImageProcessorPil

from dattn_export.checkpoints.source import load_model
from dattn_export.demo_model import DEMO_QUESTIONS, build_tokenizer, write_demo_checkpoint
from dattn_export.media import decode_media, open_image
from dattn_export.media_options import Media
from dattn_export.modeling.images import anyres_tiles, prepare_pictures
from dattn_export.modeling.processing_dattn import DAttnProcessor, default_audio_processor
from dattn_export.processing import load_image_processor, load_processor, load_tokenizer, normalize_pixels
from dattn_export.runtime.ort import OrtModel
from dattn_export.stages.onnx_export import export_onnx
from dattn_export.stages.validate import ValidationReport, context_check_image

PROCESSORS = {  # as the towers' Hub folders configure them
    "clip-32": lambda: CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}),
    "siglip-32": lambda: SiglipImageProcessorPil(size={"height": 32, "width": 32}),
    "clip-vit-large-patch14-336": lambda: CLIPImageProcessorPil(
        size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336}
    ),
    "siglip-so400m-patch14-384": lambda: SiglipImageProcessorPil(
        size={"height": 384, "width": 384}, image_mean=[0.5] * 3, image_std=[0.5] * 3
    ),
}
SIZES = {"square": (40, 40), "wide": (80, 64), "tall": (47, 81), "odd": (33, 7), "large": (640, 360)}
MODES = ("RGB", "RGBA", "L")
GRID_POINTS = [[1, 2], [2, 1], [2, 2], [1, 3], [3, 1]]


def picture_file(tmp_path, size: tuple[int, int], mode: str):
    """A picture of noise and gradients saved as PNG in `mode` (alpha varies: RGB conversion must drop it)."""
    rng = np.random.default_rng(sum(size))
    width, height = size
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    data = rng.integers(0, 256, (height, width, channels), dtype=np.uint8)
    data[..., 0] = np.linspace(0, 255, width, dtype=np.uint8)[None]
    path = tmp_path / f"{width}x{height}-{mode}.png"
    Image.fromarray(data.squeeze(-1) if channels == 1 else data, mode).save(path)
    return path


def released_config(rule: str, side: int):
    """What process_images reads of the model's config: the rule and, for anyres, the tilings in pixels."""
    return SimpleNamespace(mm_image_aspect_ratio=rule, mm_image_grid_res=[[c * side, r * side] for c, r in GRID_POINTS])


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(512)


@pytest.mark.parametrize("processor", list(PROCESSORS))
@pytest.mark.parametrize("rule", ["resize", "pad", "crop", "anyres"])
def test_pictures_become_the_released_pixels(tmp_path, processor, rule, tokenizer):
    made = PROCESSORS[processor]()
    released = with_output_size(PROCESSORS[processor]())
    side = released.output_size
    ours_processor = DAttnProcessor(made, default_audio_processor(None), tokenizer)  # vLLM's requests carry its bytes
    ours_processor.model_config = SimpleNamespace(mm_image_aspect_ratio=rule, mm_image_grid_points=GRID_POINTS)
    for name, size in SIZES.items():
        for mode in MODES:
            path = picture_file(tmp_path, size, mode)
            ours, theirs = open_image(path), open_picture(path)
            assert ours.mode == "RGB" and np.array_equal(np.asarray(ours), np.asarray(theirs))
            expected = process_images([theirs], released, released_config(rule, side))
            if rule == "anyres":
                got, (columns, rows) = anyres_tiles(ours, made, GRID_POINTS)
                assert got.shape[0] == 1 + columns * rows
                expected = expected[0]
                as_bytes, tiling = ours_processor.anyres_bytes(ours)
                assert tiling == (columns, rows)
            else:
                got = prepare_pictures([ours], rule, made)
                as_bytes = ours_processor.picture_bytes([ours])
            assert got.shape == expected.shape and torch.equal(got, expected), (name, mode, rule)
            # vLLM's pictures and frames travel as bytes and are normalized on the workers: the same pixels, bit for
            # bit
            assert as_bytes.dtype == torch.uint8
            assert torch.equal(normalize_pixels(as_bytes, made), expected), (name, mode, rule)


def test_the_rules_make_different_pixels(tmp_path):
    """The rules differ on a wide picture (a rule mixed up would be caught); on a square one, resize and pad agree."""
    processor = PROCESSORS["clip-32"]()
    wide, square = (open_image(picture_file(tmp_path, size, "RGB")) for size in ((80, 64), (40, 40)))
    pixels = {rule: prepare_pictures([wide], rule, processor) for rule in ("resize", "pad", "crop")}
    assert all(
        not torch.equal(pixels[a], pixels[b]) for a, b in (("resize", "pad"), ("resize", "crop"), ("pad", "crop"))
    )
    assert torch.equal(prepare_pictures([square], "resize", processor), prepare_pictures([square], "pad", processor))


@pytest.fixture(scope="module", params=["resize", "pad", "crop"])
def clip_model(request, tmp_path_factory):
    """A checkpoint with a CLIP tower (the released classes' default tower) under one rule, saved as the released
    code saves it, and its ONNX export."""
    root = tmp_path_factory.mktemp(f"clip-{request.param}")
    checkpoint = write_demo_checkpoint(root / "checkpoint", vision="clip", mm_image_aspect_ratio=request.param)
    export_onnx(checkpoint, root / "onnx")
    return request.param, checkpoint, root / "onnx"


def released_pixels(checkpoint, rule: str, path):
    """The picture file through the released path: opened as RGB, process_images with the tower's processor."""
    processor = with_output_size(load_image_processor(checkpoint, load_model(checkpoint).config))
    return process_images([open_picture(path)], processor, released_config(rule, processor.output_size))[None]


@pytest.mark.slow
def test_generate_sees_the_released_pixels(clip_model, tmp_path):
    """`generate --image`: its tokens are those of the reference model given the released path's pixels."""
    rule, checkpoint, _ = clip_model
    path = picture_file(tmp_path, (80, 64), "RGBA")
    question = DEMO_QUESTIONS["image"]
    result = run_cli("generate", checkpoint, "--prompt", question, "--image", path, "--max-new-tokens", "6")
    assert result.returncode == 0, result.stderr
    generated = json.loads(re.search(r"generated ids \(\d+\): (\[.*\])", result.stdout).group(1))
    model = load_model(checkpoint)
    tokenizer = load_tokenizer(checkpoint, model.config)
    ids = torch.tensor([released_question_ids(tokenizer, model.config.family.name, question)])
    with torch.no_grad():
        expected = model.greedy(
            ids, released_pixels(checkpoint, rule, path), torch.ones_like(ids), max_new_tokens=6, eos_token_id=2
        )
    assert generated == expected[0].tolist()


@pytest.mark.slow
def test_validate_and_the_model_see_the_released_pixels(clip_model, tmp_path):
    """`validate --image`'s context (the reference's and ONNX Runtime's) and the processor's pictures (every
    command's and the pushed repo's) give the K/V of the released pixels."""
    rule, checkpoint, exported = clip_model
    path = picture_file(tmp_path, (47, 81), "L")
    model = load_model(checkpoint)
    with torch.no_grad():
        expected, _ = model.model.encode_images(released_pixels(checkpoint, rule, path))
        mine, _ = model.model.encode_inputs(**load_processor(checkpoint, model.config).pictures([[open_image(path)]]))
    report = ValidationReport("", "", "ort", "float32", 1e-4, 0, 0)
    processor = load_processor(exported, model.config)
    decoded = decode_media(Media(images=[path]), processor)
    streams, got_kv, _ = context_check_image(OrtModel(exported), model, processor, decoded, report)
    flat = [t for layer in expected for t in layer]
    assert all(torch.equal(a, b) for a, b in zip([t for kv in streams["context_key_values"] for t in kv], flat))
    assert all(torch.equal(a, b) for a, b in zip([t for kv in mine for t in kv], flat))
    assert max(np.abs(g - e.numpy()).max() for g, e in zip(got_kv, flat)) < 1e-4  # ONNX Runtime, the same pixels


def test_convert_records_the_rule(tmp_path):
    """A released config.json without mm_image_aspect_ratio: the released classes' default (resize), made explicit
    in the converted config with where it comes from."""
    checkpoint = write_demo_checkpoint(tmp_path / "checkpoint")
    config = json.loads((checkpoint / "config.json").read_text())
    config.pop("mm_image_aspect_ratio")
    (checkpoint / "config.json").write_text(json.dumps(config))
    assert run_cli("convert", checkpoint, "-o", tmp_path / "out").returncode == 0
    converted = json.loads((tmp_path / "out" / "config.json").read_text())
    assert converted["mm_image_aspect_ratio"] == "resize"
    assert "DattnMistralConfig default" in converted["dattn_inferred"]["mm_image_aspect_ratio"]


def test_an_unknown_rule_is_refused(tmp_path):
    checkpoint = write_demo_checkpoint(tmp_path / "checkpoint")
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**config, "mm_image_aspect_ratio": "letterbox"}))
    result = run_cli("generate", checkpoint, "--prompt", "hi", "--image", checkpoint / "demo.png")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert "mm_image_aspect_ratio 'letterbox' is not one of" in lines[0] and "config.json" in lines[0]
