"""Video models as the released code (ByteDance's Vidi) runs them: frames and audio, each a context stream of its
own, held to `helpers.vidi_literal` (the released forward written out from reading it), both families."""

import json

import pytest
import torch
from helpers.builders import released_model
from helpers.cli import run_cli
from helpers.vidi_literal import audio_stream, pool_frames, video_stream, vidi_logits
from safetensors import safe_open

from dattn_export.stages.demo import write_demo_checkpoint
from dattn_export.stages.info import describe


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
        streams, kwargs = [], {}
        if use_video:
            streams.append(video_stream(model, frames))
            kwargs["visual_key_values"], kwargs["visual_mask"] = model.model.encode_video(frames)
        if use_audio:
            streams.append(audio_stream(model, mels, mel_frames))
            kwargs["audio_key_values"], kwargs["audio_mask"] = model.model.encode_audio(mels, mel_frames)
        expected = vidi_logits(model, ids, streams)
        got = model(ids, **kwargs).logits
    ours = [kwargs[key] for key in ("visual_mask", "audio_mask") if key in kwargs]
    assert all(torch.equal(mask, theirs) for mask, (_, theirs) in zip(ours, streams, strict=True))
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


def test_long_videos_are_resized_before_pooling():
    """Vidi1.5_9B: past 60000 x pool^2 padded tokens over all frames, the padded grid is resized (utils.py)."""
    model = video_model("gemma2")
    features = torch.randn(3751, 48, 7, 7)  # 3751 x 8 x 8 > 240000
    with torch.no_grad():
        got = model.model.mm_rand_img_pool(features)
    expected = pool_frames(model, features)
    assert got.shape == expected.shape == (3751, 192, 5, 5)  # side 8 x sqrt(240000 / 240064) -> 7 -> 10 (the floor)
    torch.testing.assert_close(got, expected, atol=0, rtol=0)


def test_incremental_decoding_and_cached_streams(family):
    """Decoding token by token with the text cache equals the full forward; the frames' and audio's K/V computed
    once serve a second prompt as if computed afresh."""
    model = video_model(family)
    ids, frames, mels, mel_frames = inputs()
    with torch.no_grad():
        visual, visual_mask = model.model.encode_video(frames)
        audio, audio_mask = model.model.encode_audio(mels, mel_frames)
        streams = dict(visual_key_values=visual, visual_mask=visual_mask, audio_key_values=audio, audio_mask=audio_mask)
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
        fresh_visual, _ = model.model.encode_video(frames)
        fresh_audio, _ = model.model.encode_audio(mels, mel_frames)
        fresh = dict(streams, visual_key_values=fresh_visual, audio_key_values=fresh_audio)
        torch.testing.assert_close(model(second, **streams).logits, model(second, **fresh).logits, atol=0, rtol=0)


def test_released_video_folder_through_the_commands(tmp_path, family):
    """A folder as the released code saves a video model converts untouched and verifies; the commands that run
    image models only say so in one line."""
    folder = write_demo_checkpoint(tmp_path / "video", family, video=True)
    saved = json.loads((folder / "config.json").read_text())
    assert saved["mm_input_type"] == "video" and not {"mm_pool_rule", "vision_config", "dattn_mode"} & set(saved)
    assert run_cli("info", folder).returncode == 0
    architecture = describe(folder).architecture
    assert architecture["input"] == "video" and "runs the audio stream" in architecture["audio_tower"]
    assert architecture["visual_tokens_per_frame"] == (4 if family == "mistral" else 16)
    assert architecture["audio_tokens_per_chunk"] == 15  # 30 encoder positions / mm_audio_pool_size 2
    converted = tmp_path / "converted"
    assert run_cli("convert", folder, "-o", converted).returncode == 0
    pool = "model.mm_rand_img_pool.conv.weight"  # Vidi_7B's conv; Vidi1.5_9B's pool has no weights
    names = {name for shard in converted.glob("*.safetensors") for name in safe_open(shard, "pt").keys()}
    assert (pool in names) == (family == "mistral") and "model.mm_rand_aud_pool.weight" in names
    verified = run_cli("verify", converted, "--against", folder)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    for command in (["onnx", converted, "-o", tmp_path / "onnx"], ["generate", converted, "--prompt", "hi"]):
        refused = run_cli(*command)
        lines = refused.stderr.strip().splitlines()
        assert refused.returncode == 2 and len(lines) == 1 and "is a video model" in lines[0], refused.stderr
    assert not (tmp_path / "onnx").exists()


def test_long_streams_run_in_chunks(monkeypatch, family):
    """Frames, audio chunks and context tokens go through in chunks (memory beyond the caches stays one chunk's):
    the same K/V as all at once."""
    model = video_model(family)
    _, frames, mels, mel_frames = inputs()
    with torch.no_grad():
        whole = model.model.encode_video(frames), model.model.encode_audio(mels, mel_frames)
        monkeypatch.setattr(type(model.model), "FRAME_CHUNK", 2)
        monkeypatch.setattr(type(model.model), "STREAM_CHUNK", 7)
        chunked = model.model.encode_video(frames), model.model.encode_audio(mels, mel_frames)
    for (caches, mask), (chunk_caches, chunk_mask) in zip(whole, chunked):
        assert torch.equal(mask, chunk_mask)
        for kv, chunk_kv in zip(caches, chunk_caches, strict=True):
            for t, c in zip(kv, chunk_kv, strict=True):
                torch.testing.assert_close(c, t, atol=1e-5, rtol=0)  # matmuls of other sizes round apart
