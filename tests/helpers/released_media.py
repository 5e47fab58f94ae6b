"""Video files made by the ffmpeg command line (the static build of imageio-ffmpeg) in the containers, codecs, rates and
layouts that cameras, phones and editors write, and the released code's decoders of them (bytedance/vidi
`vid_utils.load_video`, `load_audio`, `process_audio`), written out from its source."""

import re
import subprocess

import numpy as np
import pytest

from dattn_export.modeling.sound_decoding import AUDIO_RATE

decord = pytest.importorskip("decord", reason="decord, the released decoder, is in the test extra")
imageio_ffmpeg = pytest.importorskip("imageio_ffmpeg", reason="the ffmpeg command line is in the test extra")

SOURCE = ["-f", "lavfi", "-i", "testsrc2=size=160x90:rate={rate}"]
SOUND = ["-f", "lavfi", "-i", "sine=frequency=440:sample_rate={hz}", "-ac", "{channels}"]
H264 = ["-c:v", "libx264", "-pix_fmt", "yuv420p"]
VP9 = ["-c:v", "libvpx-vp9", "-deadline", "realtime"]
BT709 = ["-colorspace", "bt709", "-color_primaries", "bt709", "-color_trc", "bt709"]

# name: (file, what ffmpeg is given, frame rate, sound: (rate, channels) or None)
FILES = {
    "mp4, h264 + stereo AAC 44.1 kHz": ("a.mp4", [*H264, "-c:a", "aac"], "30", (44100, 2)),
    "29.97 fps (NTSC), AAC 48 kHz": ("ntsc.mp4", [*H264, "-c:a", "aac"], "30000/1001", (48000, 2)),
    "webm, vp9 + opus": ("a.webm", [*VP9, "-c:a", "libopus"], "25", (48000, 2)),
    "mkv, h264 + flac": ("a.mkv", [*H264, "-c:a", "flac"], "24", (44100, 1)),
    "avi, mpeg4 + mp3": ("a.avi", ["-c:v", "mpeg4", "-c:a", "libmp3lame"], "25", (44100, 2)),
    "mov, no sound track": ("a.mov", H264, "30", None),
    "HD bt709": ("hd.mp4", [*H264, *BT709], "30", None),
    # the first 2 s at 30 fps, then frames 2/30 s apart: an average rate (20.3) that is no frame's own
    "variable frame rate": (
        "vfr.mp4",
        [*H264, "-vf", "setpts='if(lt(N,60),N,60+2*(N-60))/30/TB'", "-fps_mode", "vfr", "-c:a", "aac"],
        "30",
        (44100, 1),
    ),
}  # fmt: skip
# a phone's portrait video: stored landscape, with a display matrix that turns it (the metadata alone is rewritten)
ROTATIONS = {
    "rotate 90": ["-display_rotation", "90"],
    "rotate -90": ["-display_rotation", "-90"],
    "rotate 180": ["-display_rotation", "180"],
    "rotate 90, mirrored": ["-display_rotation", "90", "-display_hflip"],
}


def ffmpeg(*args) -> bytes:
    command = [imageio_ffmpeg.get_ffmpeg_exe(), "-nostdin", "-v", "error", "-y", *map(str, args)]
    return subprocess.run(command, capture_output=True, check=True).stdout


def make(folder, name: str):
    file, codecs, rate, sound = FILES[name]
    inputs = [arg.format(rate=rate) for arg in SOURCE]
    if sound:
        inputs += [arg.format(hz=sound[0], channels=sound[1]) for arg in SOUND]
    ffmpeg(*inputs, "-t", 5, *codecs, folder / file)
    return folder / file


def released_frames(path) -> np.ndarray:
    """bytedance/vidi `vid_utils.load_video(file)` at fps 1, before its PIL conversion (an RGB no-op)."""
    reader = decord.VideoReader(str(path), ctx=decord.cpu(0), num_threads=0)
    return reader.get_batch(list(range(0, len(reader), round(reader.get_avg_fps() / 1.0)))).asnumpy()


def released_samples(path) -> np.ndarray:
    """bytedance/vidi `vid_utils.load_audio(file)`: the ffmpeg command line's 16-bit mono at 16 kHz, / 32768."""
    out = ffmpeg("-threads", 0, "-i", path, "-f", "s16le", "-ac", 1, "-acodec", "pcm_s16le", "-ar", AUDIO_RATE, "-")
    return np.frombuffer(out, np.int16).astype(np.float32) / 32768.0


def ffprobe_duration(path) -> float:
    """The container's duration as the ffmpeg command line reports it (ffprobe's format=duration, to 1/100 s)."""
    run = subprocess.run([imageio_ffmpeg.get_ffmpeg_exe(), "-i", str(path)], capture_output=True, text=True)
    hours, minutes, seconds = re.search(r"Duration: (\d+):(\d+):([\d.]+)", run.stderr).groups()
    return int(hours) * 3600 + int(minutes) * 60 + float(seconds)


def released_process_audio(audio, audio_processor):
    """bytedance/vidi `vid_utils.process_audio`: 30 s chunks through Whisper's extractor, and the mel frames in all
    (its `num_frames`, which transformers 4.x returned with return_token_timestamps: a chunk's samples // hop)."""
    audios = [audio[i : i + audio_processor.n_samples] for i in range(0, len(audio), audio_processor.n_samples)]
    features = audio_processor(audios, sampling_rate=audio_processor.sampling_rate, return_tensors="pt")
    return features.input_features, sum(len(chunk) // audio_processor.hop_length for chunk in audios)
