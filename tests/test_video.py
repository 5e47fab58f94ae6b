"""Video models as the released code (ByteDance's Vidi) runs them: frames and audio, each a context stream of its
own, held to `helpers.vidi_literal` (the released forward written out from reading it), both families."""

import json
import os
import shutil
import subprocess
import sys
import wave

import numpy as np
import pytest
import torch
from helpers.builders import released_model
from helpers.cli import run_cli
from helpers.vidi_literal import audio_stream, pool_frames, released_answer_ranges, video_stream, vidi_logits
from PIL import Image
from safetensors import safe_open
from transformers import WhisperFeatureExtractor

from dattn_export.answers import time_ranges
from dattn_export.checkpoints.source import load_model
from dattn_export.demo_model import write_demo_checkpoint, write_video
from dattn_export.errors import InputError
from dattn_export.media import decode_media
from dattn_export.media_options import Media
from dattn_export.modeling import context
from dattn_export.modeling import streams as stream_specs
from dattn_export.modeling.families import FAMILIES
from dattn_export.modeling.images import PreparedFrames, prepare_pictures
from dattn_export.modeling.streams import AUDIO, FRAMES
from dattn_export.processing import load_image_processor, load_processor, load_tokenizer
from dattn_export.runtime.ort import OrtModel
from dattn_export.stages.generate import run_prompt
from dattn_export.stages.info import describe
from dattn_export.stages.onnx_export import export_onnx
from dattn_export.stages.push import usage_snippet
from dattn_export.stages.verify import probe_logits


def video_model(family: str, seed: int = 0):
    return released_model(family, seed, video=True)


def inputs(seed: int = 0):
    """Two 9-token prompts; 3 and 2 frames; 2 and 1 log-mel chunks of 60 frames, 100 and 41 of them real."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 512, (2, 9), generator=generator)
    frames = [torch.randn(n, 3, 28, 28, generator=generator) for n in (3, 2)]
    mels = [torch.randn(n, 16, 60, generator=generator) for n in (2, 1)]
    return ids, frames, mels, [100, 41]


CASES = ["video and audio", "video only", "audio only", "second sample without audio", "second without video"]


@pytest.mark.parametrize("case", CASES)
def test_model_equals_released_forward(family, case):
    model = video_model(family)
    ids, frames, mels, mel_frames = inputs()
    if case == "second sample without audio":
        mels[1] = torch.zeros_like(mels[1])
    if case == "second without video":
        frames[1] = torch.zeros_like(frames[1])
    use_video, use_audio = case != "audio only", case != "video only"
    with torch.no_grad():
        streams, contexts = [], []
        if use_video:
            streams.append(video_stream(model, frames))
            contexts.append(model.model.encode_video(frames))
        if use_audio:
            streams.append(audio_stream(model, mels, mel_frames))
            contexts.append(model.model.encode_audio(mels, mel_frames))
        expected = vidi_logits(model, ids, streams)
        context, segments = model.model.join_contexts(*contexts)
        got = model(ids, context_key_values=context, context_mask=segments).logits
    stream_order = [stream for stream, used in ((FRAMES, use_video), (AUDIO, use_audio)) if used]
    released = torch.cat([mask.long() * stream.segment for (_, mask), stream in zip(streams, stream_order)], 1)
    assert torch.equal(segments, released)  # each key's stream, where the released masks place them
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_stream_shapes_follow_the_pool_rules(family):
    """Vidi_7B pools a frame to pool x pool tokens; Vidi1.5_9B to ((patches + 1) / pool)^2. Audio: 1500 encoder
    positions per 3000 mel frames (here 30 per 60), then / mm_audio_pool_size."""
    model = video_model(family)
    _, frames, mels, mel_frames = inputs()
    with torch.no_grad():
        video, video_mask = model.model.embed_video(frames)
        audio, audio_mask = model.model.embed_audio(mels, mel_frames)
    per_frame = 4 if family == "mistral" else 16
    assert video.shape == (2, 3 * per_frame, 64) and video_mask.sum(-1).tolist() == [3 * per_frame, 2 * per_frame]
    assert audio.shape == (2, 25, 64) and audio_mask.sum(-1).tolist() == [25, 10]  # 100 -> 50 -> 25; 41 -> 20 -> 10


def test_audio_parts_pool_as_the_whole_sample_where_the_pool_does_not_divide_a_chunk(monkeypatch):
    """mm_audio_pool_size 4 over a chunk's 30 encoder positions: a pooling window spans two chunks, so the parts
    (one chunk a run asked) hold two chunks each; the part by part stream is the released whole-sample one."""
    model = released_model("mistral", video=True, mm_audio_pool_size=4)
    monkeypatch.setattr(AUDIO, "parts_per_run", 1)
    generator = torch.Generator().manual_seed(1)
    mels, mel_frames = [torch.randn(n, 16, 60, generator=generator) for n in (3, 1)], [170, 41]
    with torch.no_grad():
        got, got_mask = model.model.embed_audio(mels, mel_frames)
        expected, expected_mask = audio_stream(model, mels, mel_frames)
    assert model.model.audio_chunks_per_run() == 2 and got_mask.sum(-1).tolist() == [21, 5]  # 85 // 4, 20 // 4
    assert torch.equal(got_mask, expected_mask)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_long_videos_are_resized_before_pooling():
    """Vidi1.5_9B: past 60000 x pool^2 padded tokens over all frames, the padded grid is resized (utils.py)."""
    model = video_model("gemma2")
    features = torch.randn(3751, 48, 7, 7)  # 3751 x 8 x 8 > 240000
    with torch.no_grad():
        got = model.model.mm_rand_img_pool(features, model.model.resized_side(len(features)))
    expected = pool_frames(model, features)
    assert got.shape == expected.shape == (3751, 192, 5, 5)  # side 8 x sqrt(240000 / 240064) -> 7 -> 10 (the floor)
    torch.testing.assert_close(got, expected, atol=0, rtol=0)


def test_incremental_decoding_and_cached_streams(family):
    """Decoding token by token with the text cache equals the full forward; the frames' and audio's K/V computed
    once serve a second prompt as if computed afresh."""
    model = video_model(family)
    ids, frames, mels, mel_frames = inputs()
    with torch.no_grad():
        context, segments = model.model.join_contexts(
            model.model.encode_video(frames), model.model.encode_audio(mels, mel_frames)
        )
        streams = dict(context_key_values=context, context_mask=segments)
        full = model(ids, **streams).logits
        out, pieces = model(ids[:, :5], **streams), []
        pieces.append(out.logits)
        mask = torch.ones(2, 5, dtype=torch.long)
        for t in range(5, 9):
            mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)
            out = model(ids[:, t : t + 1], attention_mask=mask, past_key_values=out.past_key_values, **streams)
            pieces.append(out.logits)
        torch.testing.assert_close(torch.cat(pieces, 1), full, atol=1e-5, rtol=0)
        second = ids.flip(1)
        fresh, _ = model.model.join_contexts(
            model.model.encode_video(frames), model.model.encode_audio(mels, mel_frames)
        )
        fresh = dict(streams, context_key_values=fresh)
        torch.testing.assert_close(model(second, **streams).logits, model(second, **fresh).logits, atol=0, rtol=0)


@pytest.mark.slow
def test_released_video_folder_through_the_commands(tmp_path, family):
    """A folder as the released code saves a video model converts untouched, verifies, exports to ONNX and validates
    on ONNX Runtime with the demo video file."""
    folder = write_demo_checkpoint(tmp_path / "video", family, video=True)
    saved = json.loads((folder / "config.json").read_text())
    assert saved["mm_input_type"] == "video" and not {"mm_pool_rule", "vision_config", "dattn_mode"} & set(saved)
    assert run_cli("info", folder).returncode == 0
    architecture = describe(folder).architecture
    assert architecture["input"] == "video" and "runs the audio stream" in architecture["audio_tower"]
    assert architecture["tokens_per_frame"] == (4 if family == "mistral" else 16)
    assert architecture["audio_tokens_per_chunk"] == 15  # 30 encoder positions / mm_audio_pool_size 2
    converted = tmp_path / "converted"
    assert run_cli("convert", folder, "-o", converted).returncode == 0
    pool = "model.mm_rand_img_pool.conv.weight"  # Vidi_7B's conv; Vidi1.5_9B's pool has no weights
    names = {name for shard in converted.glob("*.safetensors") for name in safe_open(shard, "pt").keys()}
    assert (pool in names) == (family == "mistral") and "model.mm_rand_aud_pool.weight" in names
    verified = run_cli("verify", converted, "--against", folder)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert run_cli("onnx", converted, "-o", tmp_path / "onnx").returncode == 0
    validated = run_cli("validate", tmp_path / "onnx", "--video", folder / "demo.mov", "--max-new-tokens", "6")
    assert validated.returncode == 0, validated.stdout + validated.stderr
    report = json.loads((tmp_path / "onnx" / "validation_report.json").read_text())
    assert report["passed"] and report["visual_tokens"] == 6 * architecture["tokens_per_frame"]
    assert report["audio_tokens"] == 3  # 6 s of sound: 300 of the 60-frame chunk's mel frames / 2 / pool 2 / 25
    streams = {c["output"]: c["max_abs"] for c in report["comparisons"] if c["output"].endswith(" K/V")}
    assert set(streams) == {"frames K/V", "audio K/V"} and max(streams.values()) < 1e-4  # each stream's K/V checked
    graphs = json.loads((tmp_path / "onnx" / "onnx_manifest.json").read_text())["graphs"]
    assert set(graphs) == {"vision", "audio", "context_kv", "decoder"}
    assert graphs["decoder"]["fused_attention_nodes"] == 3  # one per layer, over both context streams


@pytest.fixture
def exported_video(tmp_path, family):
    folder = write_demo_checkpoint(tmp_path / "video", family, video=True)
    export_onnx(folder, tmp_path / "onnx")
    return load_model(folder), OrtModel(tmp_path / "onnx")


@pytest.mark.slow
def test_onnx_runtime_equals_released_forward(exported_video, monkeypatch):
    """The four graphs on ONNX Runtime against the released forward written out (fp32, <= 1e-4): each sample's
    frames and audio built part by part (2 frames, 1 audio chunk a run), a batch whose second sample has no audio,
    incremental decoding equal to the full forward, and the context caches reused for a second prompt."""
    model, runtime = exported_video
    monkeypatch.setattr(FRAMES, "parts_per_run", 2)
    monkeypatch.setattr(AUDIO, "parts_per_run", 1)
    ids, frames, mels, mel_frames = inputs()
    mels[1] = torch.zeros_like(mels[1])
    contexts = [
        runtime.encode_streams({"frames": frames[0].numpy(), "audio": (mels[0].numpy(), mel_frames[0])}),
        runtime.encode_streams({"frames": frames[1].numpy()}),
    ]
    caches, mask = runtime.batch_contexts(contexts)
    with torch.no_grad():
        literal = [video_stream(model, frames), audio_stream(model, mels, mel_frames)]
        expected = [vidi_logits(model, prompt, literal).numpy() for prompt in (ids, ids.flip(1))]
    ones = np.ones(ids.shape, np.int64)
    full, _ = runtime.decode(ids.numpy(), ones, runtime.empty_kv(2), caches, mask)
    assert np.abs(full - expected[0]).max() <= 1e-4
    logits, past = runtime.decode(ids[:, :5].numpy(), ones[:, :5], runtime.empty_kv(2), caches, mask)
    pieces = [logits]
    for t in range(5, 9):
        logits, past = runtime.decode(ids[:, t : t + 1].numpy(), ones[:, : t + 1], past, caches, mask)
        pieces.append(logits)
    assert np.abs(np.concatenate(pieces, 1) - full).max() <= 1e-5
    second, _ = runtime.decode(ids.flip(1).numpy(), ones, runtime.empty_kv(2), caches, mask)
    assert np.abs(second - expected[1]).max() <= 1e-4

    # past the released resize budget, lowered so that each video's frames (3 and 2 of 8 x 8 padded tokens) pass
    # 20 x pool^2: Vidi1.5 resizes each grid (to 10 x 10, its floor: 5 x 5 tokens), Vidi_7B's pool is as before
    monkeypatch.setattr(stream_specs, "RESIZE_TOKENS", 20)
    for sample in range(2):
        caches, mask = runtime.encode_streams({"frames": frames[sample].numpy()})
        assert mask.shape[1] == len(frames[sample]) * (4 if model.config.mm_pool_rule == "conv-interpolate" else 25)
        prompt = ids[sample : sample + 1]
        with torch.no_grad():
            expected = vidi_logits(model, prompt, [video_stream(model, frames[sample : sample + 1], 20)]).numpy()
        resized, _ = runtime.decode(prompt.numpy(), ones[:1], runtime.empty_kv(1), caches, mask)
        assert np.abs(resized - expected).max() <= 1e-4
    with pytest.raises(InputError, match=r"of shape \[2, 3, 20, 20\]: vision.onnx takes \[frames, 3, 28, 28\]"):
        runtime.encode_streams({"frames": np.zeros((2, 3, 20, 20), np.float32)})


# --- generate with video and audio files -------------------------------------------------------------------------

COLORS = [(20 * i, 255 - 20 * i, 90) for i in range(12)]  # one colour a frame


def write_test_video(path, fps=4, audio_seconds=40):
    """12 frames at `fps`, one colour each, and `audio_seconds` of 16 kHz audio; returns the samples as floats."""
    samples = (np.sin(np.arange(16000 * audio_seconds) / 7.0) * 8000).astype(np.int16)
    write_video(path, [np.full((48, 64, 3), color, np.uint8) for color in COLORS], fps, samples)
    return samples.astype(np.float32) / 32768


def test_generate_reads_a_video_file(tmp_path, family):
    """generate --video: one frame a second from the first (here every 4th of 12 at 4 fps), each resized to the
    tower's square and preprocessed; the audio track in 30 s chunks of log-mel; the same tokens as the model
    given exactly those inputs."""
    folder = write_demo_checkpoint(tmp_path / "video", family, video=True)
    samples = write_test_video(tmp_path / "clip.mov")
    result = run_prompt(folder, "what happens", Media(video=tmp_path / "clip.mov"), max_new_tokens=6)

    model = load_model(folder)
    kept = [Image.new("RGB", (64, 48), COLORS[i]) for i in (0, 4, 8)]
    processor = load_image_processor(folder, model.config)
    pixels = processor([f.resize((28, 28), Image.BICUBIC) for f in kept], return_tensors="pt")["pixel_values"]
    extractor = WhisperFeatureExtractor.from_pretrained(str(folder.parent / "towers" / "tiny-whisper"))
    chunks = [samples[:480000], samples[480000:]]  # 30 s and 10 s
    mels = extractor(chunks, sampling_rate=16000, return_tensors="pt").input_features
    mel_frames = 480000 // 8000 + 160000 // 8000  # a mel frame per hop of the chunk's real samples: 60 + 20
    with torch.no_grad():
        context, segments = model.model.join_contexts(
            model.model.encode_video([pixels]), model.model.encode_audio([mels], [mel_frames])
        )
        prompt = load_tokenizer(folder, model.config)("what happens", return_tensors="pt")
        expected = model.greedy(
            prompt["input_ids"], max_new_tokens=6, context_key_values=context, context_mask=segments, eos_token_id=2
        )
    assert result.generated_ids == expected[0].tolist()
    assert result.visual_tokens == 3 * (4 if family == "mistral" else 16) and result.audio_tokens == 20  # 80 / 2 / 2


def test_generate_reads_frames_and_a_wav(tmp_path):
    folder = write_demo_checkpoint(tmp_path / "video", "gemma2", video=True)
    (tmp_path / "frames").mkdir()
    for i, color in enumerate(COLORS[:3]):
        Image.new("RGB", (40, 40), color).save(tmp_path / "frames" / f"{i:03d}.png")
    samples = (np.sin(np.arange(16000 * 5) / 5.0) * 9000).astype(np.int16)
    with wave.open(str(tmp_path / "speech.wav"), "wb") as wav:
        wav.setnchannels(1), wav.setsampwidth(2), wav.setframerate(16000), wav.writeframes(samples.tobytes())
    media = Media(frames=tmp_path / "frames", audio=tmp_path / "speech.wav")
    result = run_prompt(folder, "what happens", media, max_new_tokens=3)
    assert result.visual_tokens == 3 * 16 and result.audio_tokens == 2  # 5 s: 10 mel frames -> 5 -> 2


def test_frames_are_held_at_the_tower_s_square_from_decoding_on(tmp_path):
    """Reported: `generate --video` held every frame at full size (an hour of 1080p: killed at 22.7 GiB). Frames are
    resized as decoded (video and frame folders alike), to the pixels the preparation would make of full-size ones."""
    folder = write_demo_checkpoint(tmp_path / "video", "gemma2", video=True)
    config, square = load_model(folder).config, 28  # the demo video tower's square
    full = [np.random.default_rng(i).integers(0, 256, (180, 320, 3), np.uint8) for i in range(3)]
    write_video(tmp_path / "clip.mov", full, 1, None)
    (tmp_path / "frames").mkdir()
    for i, frame in enumerate(full):
        Image.fromarray(frame).save(tmp_path / "frames" / f"{i:03d}.png")
    processor = load_image_processor(folder, config)
    expected = prepare_pictures([Image.fromarray(f) for f in full], "resize", processor)
    for media in (Media(video=tmp_path / "clip.mov"), Media(frames=tmp_path / "frames")):
        frames = decode_media(media, load_processor(folder, config)).frames
        assert [frame.size for frame in frames] == [(square, square)] * 3  # 2.4 KB a frame held, not 173 KB
        assert torch.equal(prepare_pictures(frames, "resize", processor), expected)


def damaged_inputs(tmp_path):
    (tmp_path / "broken.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42" + bytes(range(256)) * 4)
    with wave.open(str(tmp_path / "empty.wav"), "wb") as wav:
        wav.setnchannels(1), wav.setsampwidth(2), wav.setframerate(16000)
    (tmp_path / "no-frames").mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / "photo.png")


BAD_MEDIA = {  # option, file, what the one-line error says
    "undecodable video": ("--video", "broken.mp4", "cannot be decoded"),
    "empty WAV": ("--audio", "empty.wav", "holds no audio samples"),
    "folder without frames": ("--frames", "no-frames", "holds no frame images"),
    "an image for a video model": ("--image", "photo.png", "is an image, but the model is a video model"),
}


@pytest.mark.parametrize("case", list(BAD_MEDIA))
def test_bad_media_is_one_line(tmp_path, case):
    folder = write_demo_checkpoint(tmp_path / "video", "mistral", video=True)
    damaged_inputs(tmp_path)
    option, name, expected = BAD_MEDIA[case]
    result = run_cli("generate", folder, "--prompt", "hi", option, tmp_path / name)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert expected in lines[0] and str(tmp_path / name) in lines[0], lines[0]


def test_video_for_an_image_model_is_one_line(tmp_path):
    folder = write_demo_checkpoint(tmp_path / "image", "mistral")
    write_test_video(tmp_path / "clip.mov", audio_seconds=1)
    result = run_cli("generate", folder, "--prompt", "hi", "--video", tmp_path / "clip.mov")
    assert result.returncode == 2 and "is video or audio, but the model is an image model" in result.stderr


def test_frames_are_prepared_a_part_at_a_time(tmp_path, monkeypatch):
    """The tower reads a video's float pixels one part of frames at a time (an hour of 384 px squares is 6.4 GB of
    them at once): the processor never sees more than a part, and the K/V are those of every frame prepared at once."""
    folder = write_demo_checkpoint(tmp_path / "video", "gemma2", video=True)
    model = load_model(folder)
    processor = load_image_processor(folder, model.config)
    pictures = [Image.new("RGB", (28, 28), color) for color in COLORS[:5]]
    seen = []

    class Recording:  # the real processor, its batch sizes written down
        size = processor.size

        def __call__(self, images, **kwargs):
            seen.append(len(images))
            return processor(images, **kwargs)

    monkeypatch.setattr(FRAMES, "parts_per_run", 2)
    with torch.no_grad():
        got = model.model.encode_video([PreparedFrames(pictures, "resize", Recording())])
        expected = model.model.encode_video([prepare_pictures(pictures, "resize", processor)])
    assert max(seen) == 2 and sum(seen) == 5
    assert torch.equal(got[1], expected[1])
    for kv, expected_kv in zip(got[0], expected[0], strict=True):
        for t, e in zip(kv, expected_kv, strict=True):
            torch.testing.assert_close(t, e, atol=1e-5, rtol=0)


def test_long_streams_run_in_chunks(monkeypatch, family):
    """Frames, audio chunks and context tokens go through in chunks (memory beyond the caches stays one chunk's):
    the same K/V as all at once."""
    model = video_model(family)
    _, frames, mels, mel_frames = inputs()
    with torch.no_grad():
        whole = model.model.encode_video(frames), model.model.encode_audio(mels, mel_frames)
        monkeypatch.setattr(FRAMES, "parts_per_run", 2)
        monkeypatch.setattr(AUDIO, "parts_per_run", 1)
        monkeypatch.setattr(context, "CONTEXT_CHUNK", 7)
        chunked = model.model.encode_video(frames), model.model.encode_audio(mels, mel_frames)
    for (caches, mask), (chunk_caches, chunk_mask) in zip(whole, chunked):
        assert torch.equal(mask, chunk_mask)
        for kv, chunk_kv in zip(caches, chunk_caches, strict=True):
            for t, c in zip(kv, chunk_kv, strict=True):
                torch.testing.assert_close(c, t, atol=1e-5, rtol=0)  # matmuls of other sizes round apart


def test_video_checkpoint_without_its_audio_tower_config_is_one_line(tmp_path):
    folder = write_demo_checkpoint(tmp_path / "video", "gemma2", video=True)
    shutil.rmtree(tmp_path / "towers" / "tiny-whisper")  # the folder mm_audio_tower names
    result = run_cli("convert", folder, "-o", tmp_path / "out")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and str(folder / "config.json") in lines[0], result.stderr
    assert "the audio tower's config cannot be found" in lines[0] and not (tmp_path / "out").exists()


REMOTE_CODE = """
import sys
import numpy as np
import torch
from dattn_export.stages.verify import probe_logits  # the inputs only: the model is the shipped code's

snippet, out = sys.argv[1:]
exec(open(snippet).read())  # the model card's video usage, as written (it loads the model as `model`)
assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
with torch.no_grad():
    np.save(out, probe_logits(model).numpy())
"""


@pytest.mark.slow
def test_shipped_code_runs_video_and_audio_with_transformers_alone(tmp_path, family):
    """A converted video folder loads through transformers' remote code (the files push uploads) in a fresh
    process; the model card's video usage runs as written, on a video file with its sound; its logits equal the
    reference's."""
    folder = write_demo_checkpoint(tmp_path / "video", family, video=True)
    assert run_cli("convert", folder, "-o", tmp_path / "converted").returncode == 0
    write_test_video(tmp_path / "video.mp4")  # the file the usage names
    snippet = usage_snippet(str(tmp_path / "converted"), "what happens", "video")
    (tmp_path / "snippet.py").write_text(snippet.removeprefix("```python\n").removesuffix("```"))
    (tmp_path / "remote.py").write_text(REMOTE_CODE)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules")}
    args = [sys.executable, tmp_path / "remote.py", tmp_path / "snippet.py", tmp_path / "x.npy"]
    done = subprocess.run(args, capture_output=True, text=True, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    with torch.no_grad():
        expected = probe_logits(load_model(tmp_path / "converted")).numpy()
    np.testing.assert_array_equal(np.load(tmp_path / "x.npy"), expected)


def test_frames_of_the_wrong_size_are_refused_by_name():
    model = video_model("mistral")
    with pytest.raises(ValueError, match=r"frames of shape \[3, 32, 32\]: the tower takes \[3, 28, 28\]"):
        model.model.encode_video([torch.zeros(2, 3, 32, 32)])


# answer: where Vidi_7B's script stops (its pattern takes "0.99." at a sentence's end, and float() raises), the part
# before what it cannot read; ours skips that range
ANSWERS = {"0.12-0.15": None, "0.0-0.5, 0.25-1.0": None, "from 0.333-0.4 and 0.9-0.99.": "from 0.333-0.4",
           "none here": None, "10-20 and 0.5-0.75": None}  # fmt: skip


@pytest.mark.parametrize("answer", list(ANSWERS))
@pytest.mark.parametrize("length", [5.02, 3884.0, 7201.5])
def test_time_ranges_are_the_released_inference_script_s(family, answer, length):
    """The released scripts' hh:mm:ss ranges (Vidi_7B writes 5 seconds as 5.00, Vidi1.5 as 05; Vidi_7B's pattern
    also takes whole numbers), for videos of 5 s, the README's 3884 s and 2 hours."""
    ranges = ", ".join(time_ranges(answer, length, FAMILIES[family]))
    if family == "mistral" and ANSWERS[answer]:
        with pytest.raises(ValueError):
            released_answer_ranges(answer, length, family)
        assert ranges == released_answer_ranges(ANSWERS[answer], length, family)
    else:
        assert ranges == released_answer_ranges(answer, length, family)


def test_generate_prints_a_video_s_answer_as_time_ranges(tmp_path, family, monkeypatch):
    """generate --video prints the answer's ranges as the released script does, with the file's duration (here 3 s),
    beside the text and in --json; an answer about a folder of frames (no duration) has none."""
    from click.testing import CliRunner

    from dattn_export import cli
    from dattn_export.stages import generate

    folder = write_demo_checkpoint(tmp_path / "video", family, video=True)
    write_test_video(tmp_path / "clip.mov", audio_seconds=3)  # 3 s of frames and of sound
    answer = "0.25-0.5 and 0.9-1.0"  # the random demo model's own text holds no ranges: its decoding answers this

    class Answering:
        def __init__(self, tokenizer):
            self.tokenizer = tokenizer

        def __call__(self, *args, **kwargs):
            return self.tokenizer(*args, **kwargs)

        def __getattr__(self, name):  # the chat template and the rest: the tokenizer's
            return getattr(self.tokenizer, name)

        def decode(self, *args, **kwargs):
            return answer

    monkeypatch.setattr(generate.Asker, "tokenizer", property(lambda asker: Answering(asker.processor.tokenizer)))
    expected = released_answer_ranges(answer, 3.0, family)
    args = ["generate", str(folder), "--prompt", "when", "--video", str(tmp_path / "clip.mov"), "--max-new-tokens", "2"]
    printed = CliRunner().invoke(cli.main, args)
    assert printed.exit_code == 0, printed.output
    assert f"time ranges: {expected}" in printed.output
    reported = CliRunner().invoke(cli.main, [*args, "--json"])
    (result,) = json.loads(reported.stdout)["answers"]
    assert result["prompt"] == "when" and ", ".join(result["time_ranges"]) == expected
    assert expected == ("00:00:0.00-00:00:1.00, 00:00:2.00-00:00:3.00" if family == "mistral" else
                        "00:00:00-00:00:01, 00:00:02-00:00:03")  # fmt: skip
    frames = tmp_path / "frames"
    frames.mkdir()
    Image.new("RGB", (40, 40), "red").save(frames / "0.png")
    reported = CliRunner().invoke(cli.main, [*args[:4], "--frames", str(frames), "--json"])
    assert json.loads(reported.stdout)["answers"][0]["time_ranges"] is None
