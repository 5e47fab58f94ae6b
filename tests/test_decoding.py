"""Video files decode as the released code decodes them: frames as decord's `VideoReader` gives them at load_video's
indices (every round(average rate)-th frame), samples as the ffmpeg command line of its load_audio gives them
(`-f s16le -ac 1 -ar 16000`), to the pixel and to the bit. The files are made by the ffmpeg command line (the
static build of imageio-ffmpeg) in the containers, codecs, rates and layouts that cameras, phones and editors
write."""

import numpy as np
import pytest
from helpers import released_media as released
from helpers.released_media import FILES, H264, ROTATIONS, SOUND, SOURCE, ffmpeg, make

from dattn_export.modeling import video_decoding as decoding
from dattn_export.modeling.media_files import FileBytes, media_duration
from dattn_export.modeling.sound_decoding import AUDIO_RATE, load_audio
from dattn_export.modeling.video_decoding import load_video


def assert_frames_equal(path):
    expected = released.released_frames(path)
    ours = np.stack([np.asarray(frame) for frame in load_video(path)[0]])
    assert ours.shape == expected.shape and np.array_equal(ours, expected)
    return ours


@pytest.mark.parametrize("name", list(FILES))
def test_frames_and_samples_are_the_released_decoder_s(tmp_path, name):
    path = make(tmp_path, name)
    frames = assert_frames_equal(path)
    assert len(frames) == 5 and frames.std() > 10  # 5 s at 1 frame/s, and pictures, not a blank
    assert abs(media_duration(path) - released.ffprobe_duration(path)) <= 0.005  # the time ranges' length
    _, sound = load_video(path)  # the sound track in the frames' pass, and alone (as an --audio file is read)
    if FILES[name][3] is None:
        assert sound is None and load_audio(path, missing_ok=True) is None
        return
    expected = released.released_samples(path)
    assert len(expected) == 5 * AUDIO_RATE or name.startswith("avi")  # mp3's padding: the command keeps it too
    assert np.array_equal(sound, expected) and np.array_equal(load_audio(path), expected)


@pytest.mark.parametrize("rotation", list(ROTATIONS))
def test_a_phone_s_portrait_video_is_turned_as_decord_turns_it(tmp_path, rotation):
    stored = make(tmp_path, "mp4, h264 + stereo AAC 44.1 kHz")
    turned = tmp_path / "turned.mp4"
    ffmpeg(*ROTATIONS[rotation], "-i", stored, "-c", "copy", turned)
    frames = assert_frames_equal(turned)
    assert (frames.shape[1:3] == (160, 90)) == (rotation != "rotate 180")  # a quarter turn stands it upright
    assert not np.array_equal(frames, np.stack([np.asarray(frame) for frame in load_video(stored)[0]]))


@pytest.mark.parametrize("name", ["mp4, h264 + stereo AAC 44.1 kHz", "mkv, h264 + flac", "variable frame rate"])
def test_frames_neither_kept_nor_referenced_are_not_decoded(tmp_path, name, monkeypatch):
    """The decoder skips the B-frames that are not kept (no other frame is decoded from them): fewer frames come out
    of it than the file holds, in one pass, and the kept ones are decord's."""
    path = make(tmp_path, name)
    passes, decoded = [], []
    decode, keeps = decoding.decode_video, decoding.FramePicker.keeps
    monkeypatch.setattr(decoding, "decode_video", lambda *a, **k: passes.append(k["ranked"]) or decode(*a, **k))
    monkeypatch.setattr(decoding.FramePicker, "keeps", lambda self, f: decoded.append(f.pts) or keeps(self, f))
    assert_frames_equal(path)
    assert passes == [True] and len(decoded) < 0.6 * len(released.decord.VideoReader(str(path)))


# files whose GOPs start with an IDR picture a second (phones, cameras: -g 30 at 30 fps), and one whose key frames are
# recovery points instead (an open GOP: frames after one may be decoded from frames before it)
X265_IDR = ["-c:v", "libx265", "-pix_fmt", "yuv420p", "-x265-params", "keyint=30:open-gop=0:log-level=error"]
GOPS = {  # name: (file, what ffmpeg is given, frames decoded at most: the 5 kept; None: as many as before)
    "mp4, h264, B-frames": ("gop.mp4", [*H264, "-g", 30], 5),
    "mp4, h264, no B-frames": ("gop.mp4", [*H264, "-g", 30, "-bf", 0], 5),
    "mp4, HEVC": ("gop.mp4", X265_IDR, 5),
    "MPEG-TS (Annex B start codes)": ("gop.ts", [*H264, "-g", 30], 5),
    "mp4, h264, open GOPs": ("gop.mp4", [*H264, "-g", 30, "-x264-params", "open-gop=1"], None),
}


def command_line_frames(path, size: tuple[int, ...], step: int = 30) -> np.ndarray:
    """Every `step`-th frame of the ffmpeg command line's decode of the whole file, RGB, each of `size` (H, W, 3)."""
    out = ffmpeg("-i", path, "-vf", f"select=not(mod(n\\,{step}))", "-fps_mode", "passthrough", "-pix_fmt", "rgb24",
                 "-f", "rawvideo", "-")  # fmt: skip
    return np.frombuffer(out, np.uint8).reshape(-1, *size)


@pytest.mark.parametrize("name", list(GOPS))
def test_frames_after_a_gop_s_last_kept_frame_are_not_decoded(tmp_path, name, monkeypatch):
    """Where each second starts with an IDR picture, no frame after it is decoded from one before it: the frames
    between a kept frame and the next IDR are never decoded, so only the kept ones are (5 of 150), and they are the
    ffmpeg command line's frames, and decord's where decord reads the file right. Key frames that are not IDR
    pictures (an open GOP's) drop nothing."""
    file, codecs, most = GOPS[name]
    path = tmp_path / file
    ffmpeg(*[arg.format(rate=30) for arg in SOURCE], "-t", 5, *map(str, codecs), path)
    passes, decoded = [], []
    decode, keeps = decoding.decode_video, decoding.FramePicker.keeps
    monkeypatch.setattr(decoding, "decode_video", lambda *a, **k: passes.append(k["ranked"]) or decode(*a, **k))
    monkeypatch.setattr(decoding.FramePicker, "keeps", lambda self, f: decoded.append(f.pts) or keeps(self, f))
    ours = np.stack([np.asarray(frame) for frame in load_video(path)[0]])
    assert ours.shape[0] == 5 and np.array_equal(ours, command_line_frames(path, ours.shape[1:]))
    if file.endswith(".mp4"):  # decord's own frames, decoded in order (its seeks garble an open GOP's frames)
        reader = released.decord.VideoReader(str(path), ctx=released.decord.cpu(0), num_threads=0)
        assert np.array_equal(ours, reader.get_batch(list(range(len(reader)))).asnumpy()[::30])
    # one pass over each piece (a kept frame that did not come out would have made it read the file again), decoding
    # the kept frames only; with open GOPs (no IDR picture to cut at: one piece), all but the B-frames not kept
    pieces = decoding.video_pieces(path, 1.0, None)
    assert passes == [True] * len(pieces) and (len(pieces) == 1) == (not file.endswith(".mp4") or not most)
    assert len(decoded) <= most if most else 40 < len(decoded) < 90


# 5 s at 30 fps with an IDR picture a second and a sound track, in MP4, whose index lists every frame
PIECES = {
    "h264, B-frames": [*H264, "-g", 30],
    "h264, no B-frames": [*H264, "-g", 30, "-bf", 0],
    "HEVC": X265_IDR,
    "h264, B-frames, a phone's rotated 90": [*H264, "-g", 30],
}


@pytest.mark.parametrize("cores", [2, 3])
@pytest.mark.parametrize("name", list(PIECES))
def test_a_stream_cut_into_pieces_decodes_as_one_pass(tmp_path, name, cores, monkeypatch):
    """Where the index lists every frame, the stream is cut at IDR pictures into a piece a core, each decoded by a
    decoder of its own: each piece read once, and the frames and the sound track are decord's and the ffmpeg
    command line's, as in one pass; the same from the file's bytes in memory, as a served request's video comes."""
    path = tmp_path / "pieces.mp4"
    sound = [arg.format(hz=44100, channels=2) for arg in SOUND]
    ffmpeg(*[arg.format(rate=30) for arg in SOURCE], *sound, "-t", 5, *map(str, PIECES[name]), "-c:a", "aac", path)
    if "rotated" in name:
        path = path.rename(tmp_path / "stored.mp4").with_name("turned.mp4")
        ffmpeg(*ROTATIONS["rotate 90"], "-i", tmp_path / "stored.mp4", "-c", "copy", path)
    monkeypatch.setattr(decoding, "usable_cores", lambda: cores)
    pieces = decoding.video_pieces(path, 1.0, None)
    assert len(pieces) == cores and [piece.start % 30 for piece in pieces] == [0] * cores
    passes, decode = [], decoding.decode_video
    monkeypatch.setattr(decoding, "decode_video", lambda *a, **k: passes.append(k.get("piece")) or decode(*a, **k))
    expected_frames, expected_samples = released.released_frames(path), released.released_samples(path)
    for source in (path, FileBytes(path.read_bytes(), "the request's video")):  # a file, and its bytes (serve's)
        passes.clear()
        frames, samples = load_video(source)
        assert passes == pieces
        ours = np.stack([np.asarray(frame) for frame in frames])
        assert ours.shape[0] == 5 and np.array_equal(ours, expected_frames)
        assert np.array_equal(samples, expected_samples)


def test_a_kept_frame_that_did_not_come_out_is_read_again(tmp_path, monkeypatch):
    """Where the packets mislead (here: every packet set to skip its frame unless others are decoded from it), a
    kept frame that did not come out of the decoder makes the file read again, counting frames as they come out:
    still decord's frames."""
    path = make(tmp_path, "mp4, h264 + stereo AAC 44.1 kHz")
    passes, decode = [], decoding.decode_video

    def skipping_all(picker, packet, skip):
        picker.video.codec_context.skip_frame = "NONREF"
        return packet

    monkeypatch.setattr(decoding.FramePicker, "marked", skipping_all)
    monkeypatch.setattr(decoding, "decode_video", lambda *a, **k: passes.append(k["ranked"]) or decode(*a, **k))
    assert_frames_equal(path)
    assert passes == [True, False]
