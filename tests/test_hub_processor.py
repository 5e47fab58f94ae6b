"""A converted folder is used as any vision-language model on the Hub is: `AutoProcessor` (the shipped
processing_dattn.py), its chat template with image, video and audio parts, `generate(**inputs)` and the
image-text-to-text pipeline. The processor's pixels are the released `process_images`' under every aspect rule, its
frames and samples the released decoders' (decord, the ffmpeg command line) on real files, its log-mels the released
`process_audio`'s; what the processor gives makes the context and the tokens `dattn-export generate` makes."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers.builders import GRID_POINTS, demo_folders
from helpers.released_images import open_picture, process_images, with_output_size
from PIL import Image

from dattn_export.checkpoints.source import folder_config, load_model
from dattn_export.demo_model import DEMO_QUESTIONS, write_demo_checkpoint, write_video
from dattn_export.media import decode_media, encode_media
from dattn_export.media_options import Media
from dattn_export.modeling.processing_dattn import DAttnProcessor, audio_features, default_audio_processor
from dattn_export.modeling.sound_decoding import load_audio
from dattn_export.processing import load_audio_processor, load_processor
from dattn_export.prompts import Prompt
from dattn_export.stages.convert import convert
from dattn_export.stages.generate import run_prompt

QUESTION = "What happens here?"
COLORS = [(20 * i, 255 - 20 * i, 90) for i in range(12)]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(family, kind) -> a converted folder, made once a module."""
    return demo_folders(tmp_path_factory.mktemp("hub_processor"))


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    """A wide RGBA picture, and a 3 s video (4 fps) with 40 s of sound."""
    root = tmp_path_factory.mktemp("media")
    rgba = np.random.default_rng(0).integers(0, 256, (64, 80, 4), dtype=np.uint8)
    Image.fromarray(rgba, "RGBA").save(root / "wide.png")
    samples = (np.sin(np.arange(16000 * 40) / 7.0) * 8000).astype(np.int16)
    frames = [np.random.default_rng(i).integers(0, 256, (48, 64, 3), np.uint8) for i in range(12)]
    write_video(root / "clip.mov", frames, 4, samples)
    return SimpleNamespace(picture=root / "wide.png", video=root / "clip.mov")


def processor_of(folder: Path) -> DAttnProcessor:
    return DAttnProcessor.from_pretrained(folder, trust_remote_code=True)


def messages(kind: str, media) -> list[dict]:
    """One user turn asking QUESTION about the kind's medium, as a Hub user writes it."""
    parts = {
        "image": {"type": "image", "path": str(media.picture)},
        "video": {"type": "video", "path": str(media.video)},
    }
    medium = parts["video" if kind == "video" else "image"] if kind != "text" else None
    return [{"role": "user", "content": [*([medium] if medium else []), {"type": "text", "text": QUESTION}]}]


def cli_media(kind: str, media) -> Media:
    return {"image": Media(images=[media.picture]), "anyres": Media(images=[media.picture]),
            "video": Media(video=media.video), "text": Media()}[kind]  # fmt: skip


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
@pytest.mark.parametrize("kind", ["image", "anyres", "video", "text"])
def test_the_processor_s_inputs_are_generate_s(folders, media, family, kind):
    """apply_chat_template(tokenize=True) + generate(**inputs): the prompt's ids, the context's every K/V and the
    tokens of `dattn-export generate` (torch) asked the same question about the same file."""
    folder = folders(family, "image" if kind == "text" else kind)
    processor, model = processor_of(folder), load_model(folder)
    inputs = processor.apply_chat_template(
        messages(kind, media), add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    )
    tokens = model.generate(**inputs, max_new_tokens=6)
    expected = run_prompt(folder, Prompt(QUESTION), cli_media(kind, media), max_new_tokens=6)
    assert inputs["input_ids"][0].tolist() == expected.prompt_ids
    assert tokens[0, len(expected.prompt_ids) :].tolist() == expected.generated_ids

    given = {key: value for key, value in inputs.items() if key not in ("input_ids", "attention_mask")}
    context, segments = model.model.encode_inputs(**given)
    cli = load_processor(folder, model.config)
    reference = encode_media(model, cli, decode_media(cli_media(kind, media), cli), {})
    if kind == "text":
        assert context is None and reference == {}
        return
    assert torch.equal(segments.long(), reference["context_mask"].long())
    pairs = [(a, b) for ours, theirs in zip(context, reference["context_key_values"]) for a, b in zip(ours, theirs)]
    assert len(pairs) == 2 * model.config.num_hidden_layers and all(torch.equal(a, b) for a, b in pairs)


@pytest.mark.parametrize("rule", ["resize", "pad", "crop", "anyres"])
def test_pixels_are_the_released_process_images_under_every_rule(folders, media, rule):
    """From a path, a PIL picture (RGBA: made RGB as the released loader does) and an array alike."""
    processor = processor_of(folders("gemma2", "image"))
    config = processor.model_config
    config.mm_image_aspect_ratio, config.mm_image_grid_points = rule, GRID_POINTS
    released = with_output_size(processor.image_processor)
    side = released.output_size
    cfg = SimpleNamespace(mm_image_aspect_ratio=rule, mm_image_grid_res=[[c * side, r * side] for c, r in GRID_POINTS])
    expected = process_images([open_picture(media.picture)], released, cfg)  # (1, 3, H, W); anyres: [(tiles, ...)]
    expected = expected[0] if rule == "anyres" else expected
    rgb = Image.open(media.picture).convert("RGB")
    for picture in (str(media.picture), Image.open(media.picture), np.asarray(rgb)):
        got = processor(text="<image>\nq", images=picture, return_tensors="pt")
        pixels = got["pixel_values"][0]
        assert torch.equal(pixels[: len(expected)], expected), (rule, type(picture))
        if rule == "anyres":
            assert got["image_sizes"].tolist() == [list(rgb.size)]


@pytest.mark.parametrize("rotation", [None, "rotate 90"])
def test_frames_and_log_mels_are_the_released_decoders_and_process_audio_s(folders, tmp_path, rotation):
    """A real file (H.264 + AAC, a phone's rotation in its display matrix): frames as decord gives them then
    prepared as the released video models prepare them (resize), log-mel chunks and their length as the released
    process_audio makes them of the ffmpeg command line's samples."""
    released = pytest.importorskip("helpers.released_media")
    path = released.make(tmp_path, "mp4, h264 + stereo AAC 44.1 kHz")
    if rotation:
        path, stored = tmp_path / "turned.mp4", path
        released.ffmpeg(*released.ROTATIONS[rotation], "-i", stored, "-c", "copy", path)
    processor = processor_of(folders("mistral", "video"))
    got = processor(text="<image>\nq", videos=str(path), return_tensors="pt")

    frames = [Image.fromarray(frame) for frame in released.released_frames(path)]
    cfg = SimpleNamespace(mm_image_aspect_ratio="resize", mm_image_grid_res=None)
    expected = process_images(frames, with_output_size(processor.image_processor), cfg)
    assert got["video_frames"].tolist() == [len(frames)] == [5]
    assert torch.equal(got["pixel_values_videos"][0], expected)
    mels, length = released.released_process_audio(released.released_samples(path), processor.feature_extractor)
    assert torch.equal(got["input_features"][0], mels) and got["audio_mel_frames"].tolist() == [length]


def test_the_audio_tower_s_own_feature_extractor_prepares_sound_for_hub_users_and_the_cli_alike(tmp_path, media):
    """A tower whose preprocessor is not Whisper's defaults (n_fft 256): `convert` carries it into the folder's
    processor, and the Hub processor and the CLI's loader both prepare sound with it."""
    checkpoint = write_demo_checkpoint(tmp_path / "checkpoint", "mistral", video=True)
    tower = tmp_path / "towers" / "tiny-whisper" / "preprocessor_config.json"
    tower.write_text(json.dumps(json.loads(tower.read_text()) | {"n_fft": 256}))
    folder = convert(checkpoint, tmp_path / "converted").out
    processor, cli = processor_of(folder), load_audio_processor(folder, folder_config(folder))
    assert processor.feature_extractor.n_fft == cli.n_fft == 256
    got = processor(text="<image>\nq", videos=str(media.video), return_tensors="pt")["input_features"][0]
    samples = load_audio(media.video)
    assert torch.equal(got, audio_features(samples, cli)[0])
    assert not torch.equal(
        got, audio_features(samples, default_audio_processor(processor.model_config.audio_config))[0]
    )


def test_frames_given_as_pictures_or_an_array_are_prepared_alike(folders, media):
    processor = processor_of(folders("gemma2", "video"))
    frames = [np.random.default_rng(i).integers(0, 256, (48, 64, 3), np.uint8) for i in range(3)]
    as_pictures = processor(text="<image>\nq", videos=[[Image.fromarray(f) for f in frames]], return_tensors="pt")
    as_array = processor(text="<image>\nq", videos=np.stack(frames), return_tensors="pt")
    assert torch.equal(as_pictures["pixel_values_videos"], as_array["pixel_values_videos"])
    assert as_pictures["video_frames"].tolist() == [3] and "input_features" not in as_pictures  # no sound given


def test_a_batch_of_prompts_is_left_padded_and_answers_as_each_alone(folders, media):
    folder = folders("gemma2", "image")
    processor, model = processor_of(folder), load_model(folder)
    texts = ["<image>\nWhat is it?", "<image>\nDescribe the picture in a few words, please."]
    pictures = [Image.open(media.picture), Image.new("RGB", (40, 30), (10, 200, 30))]
    batch = processor(text=texts, images=pictures, return_tensors="pt")
    assert batch["attention_mask"][0, 0] == 0 and batch["attention_mask"][:, -1].tolist() == [1, 1]
    together = model.generate(**batch, max_new_tokens=5)[:, batch["input_ids"].shape[1] :]
    for row, (text, picture) in enumerate(zip(texts, pictures)):
        alone = processor(text=text, images=picture, return_tensors="pt")
        assert (
            together[row].tolist()
            == model.generate(**alone, max_new_tokens=5)[0, alone["input_ids"].shape[1] :].tolist()
        )


def test_a_context_encoded_once_serves_several_questions(folders, media):
    folder = folders("mistral", "video")
    processor, model = processor_of(folder), load_model(folder)
    inputs = processor(text="<image>\nWhat happens?", videos=str(media.video), return_tensors="pt")
    media_inputs = {key: value for key, value in inputs.items() if key not in ("input_ids", "attention_mask")}
    context, segments = model.model.encode_inputs(**media_inputs)
    for question in ("<image>\nWhat happens?", "<image>\nWho speaks?"):
        asked = processor(text=question, videos=str(media.video), return_tensors="pt")
        text = {"input_ids": asked["input_ids"], "attention_mask": asked["attention_mask"]}
        reused = model.generate(**text, context_key_values=context, context_mask=segments, max_new_tokens=4)
        assert reused.tolist() == model.generate(**asked, max_new_tokens=4).tolist()


@pytest.mark.parametrize(
    ("kind", "given", "message"),
    [
        ("image", {"audio": np.zeros(16000, np.float32)}, "audio: this model .* has no audio tower"),
        ("image", {"videos": [[Image.new("RGB", (8, 8))] * 2]}, "videos: this model .* takes pictures, not videos"),
        ("video", {"images": Image.new("RGB", (8, 8))}, "images: this model .* takes videos and their sound"),
        ("anyres", {"images": [Image.new("RGB", (8, 8))] * 2}, "takes 1 picture a prompt"),
    ],
)
def test_media_the_model_cannot_take_is_a_value_error_naming_it(folders, kind, given, message):
    with pytest.raises(ValueError, match=message):
        processor_of(folders("gemma2", kind))(text="<image>\nq", **given)


def test_media_without_a_marker_and_a_marker_without_media_are_refused(folders):
    processor = processor_of(folders("gemma2", "image"))
    with pytest.raises(ValueError, match="holds no <image> marker.*apply_chat_template"):
        processor(text="What is it?", images=Image.new("RGB", (8, 8)))
    with pytest.raises(ValueError, match="holds <image> but no picture"):
        processor(text="<image>\nWhat is it?")


def test_what_the_model_cannot_give_is_refused_not_ignored(folders):
    """transformers' generate takes every setting it has (tests/test_transformers_generate.py); what this model
    cannot give, attentions and a static cache (its window needs every key), is a ValueError, not a silent no-op."""
    folder = folders("gemma2", "image")
    inputs, model = processor_of(folder)(text="hello", return_tensors="pt"), load_model(folder)
    with pytest.raises(ValueError, match="returns no attentions or hidden states"):
        model.generate(**inputs, max_new_tokens=2, output_attentions=True, return_dict_in_generate=True)
    with pytest.raises(ValueError, match="cache_implementation='static'"):
        model.generate(**inputs, max_new_tokens=2, cache_implementation="static")


# --- published: a fresh process that cannot import dattn_export --------------------------------------------------

FRESH_PROCESS = textwrap.dedent("""
    import contextlib, io, json, sys
    sys.modules["dattn_export"] = None  # this process must not be able to use the package
    import torch
    from huggingface_hub import snapshot_download
    from transformers import AutoModelForImageTextToText, AutoProcessor, pipeline

    asks, cards, out = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
    answers = {}
    for name, (repo, path) in cards.items():  # each model card's usage, as written, asked about the file at `path`
        readme = open(snapshot_download(repo) + "/README.md").read()
        snippet = readme.split("```python")[1].split("```")[0].replace("max_new_tokens=64", "max_new_tokens=6")
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(snippet.replace("picture.jpg", path).replace("video.mp4", path), {})
        answers[name + " card"] = printed.getvalue()[:-1]  # print's newline
    for name, (repo, conversation) in asks.items():
        processor = AutoProcessor.from_pretrained(repo, trust_remote_code=True)
        model = AutoModelForImageTextToText.from_pretrained(repo, trust_remote_code=True, dtype=torch.float32)
        inputs = processor.apply_chat_template(
            conversation, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
        )
        tokens = model.generate(**inputs, max_new_tokens=6)
        answers[name] = tokens[0, inputs["input_ids"].shape[1]:].tolist()
        if name.endswith("image"):
            pipe = pipeline("image-text-to-text", model=repo, trust_remote_code=True, dtype=torch.float32)
            said = pipe(text=conversation, max_new_tokens=6, return_full_text=False)[0]["generated_text"]
            answers[name + " pipeline"] = said
    json.dump(answers, open(out, "w"))
""")


@pytest.mark.slow  # pushes six repos and loads each back in a fresh process: about a minute
def test_published_repos_answer_through_auto_classes_the_pipeline_and_their_cards(folders, media, tmp_path):
    """After `push` to the loopback Hub, in a process that cannot import dattn_export: AutoProcessor, the chat
    template and AutoModelForImageTextToText.generate give `dattn-export generate`'s tokens for a picture, an anyres
    picture, a video file with sound and text alone, both families; the pipeline and each model card's usage, run as
    written, its answers."""
    from helpers.hub_server import client_env, push_with_cli, start

    server, _, endpoint = start({"hf_token_a": "alice"})
    try:
        asks, cards, expected = {}, {}, {}
        for family in ("mistral", "gemma2"):
            for kind in ("image", "anyres", "video"):
                repo = f"alice/{family}-{kind}"
                push_with_cli(folders(family, kind), repo, client_env(tmp_path, endpoint, "hf_token_a"))
                path = media.video if kind == "video" else media.picture
                cards[f"{family} {kind}"] = (repo, str(path))
                decode = processor_of(folders(family, kind)).tokenizer.decode  # the card's decode, as it prints
                question = Prompt(DEMO_QUESTIONS["video" if kind == "video" else "image"])
                card = run_prompt(folders(family, kind), question, cli_media(kind, media), 6)
                expected[f"{family} {kind} card"] = decode(card.generated_ids, skip_special_tokens=True)
                asked = ["text", kind] if kind == "image" else [kind]
                for what in asked:
                    asks[f"{family} {what}"] = (repo, messages(what, media))
                    result = run_prompt(folders(family, kind), Prompt(QUESTION), cli_media(what, media), 6)
                    expected[f"{family} {what}"] = result.generated_ids
                    if what == "image":
                        expected[f"{family} image pipeline"] = decode(result.generated_ids, skip_special_tokens=True)
        script = tmp_path / "fresh.py"
        script.write_text(FRESH_PROCESS)
        run = subprocess.run(
            [sys.executable, str(script), json.dumps(asks), json.dumps(cards), str(tmp_path / "answers.json")],
            capture_output=True, text=True, timeout=600, env=client_env(tmp_path, endpoint, None), cwd=tmp_path,
        )  # fmt: skip
    finally:
        server.shutdown()
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads((tmp_path / "answers.json").read_text()) == expected


def test_remote_code_needs_only_torch_transformers_numpy_pil_and_pyav_for_files(folders, media):
    """transformers refuses remote code whose imports are missing (`check_imports`): the shipped modules import only
    the standard library, torch, transformers (and its huggingface_hub), numpy and PIL; PyAV where a file is decoded,
    so that a process without it asks about pictures, and a video file is an ImportError naming it."""
    from transformers.dynamic_module_utils import get_imports

    from dattn_export.artifacts import MODELING_DIR, REMOTE_CODE

    allowed = {"torch", "transformers", "huggingface_hub", "numpy", "PIL", *sys.stdlib_module_names}
    assert {name: extra for name in REMOTE_CODE if (extra := set(get_imports(MODELING_DIR / name)) - allowed)} == {}
    script = textwrap.dedent("""
        import sys
        sys.modules["av"] = None  # PyAV not installed
        from PIL import Image
        from transformers import AutoProcessor
        processor = AutoProcessor.from_pretrained(sys.argv[1], trust_remote_code=True)
        processor(text="<image>\\nq", videos=[[Image.new("RGB", (8, 8))]])  # frames need no decoder
        try:
            processor(text="<image>\\nq", videos=sys.argv[2])
        except ImportError as e:
            print(e)
    """)
    video_model = folders("gemma2", "video")
    run = subprocess.run([sys.executable, "-c", script, str(video_model), str(media.video)],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().endswith("needs PyAV, the decoder transformers uses: pip install av")
