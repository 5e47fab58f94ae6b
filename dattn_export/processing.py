"""Tokenizer, image, video-frame and audio preprocessing for a checkpoint folder, offline. Video and audio follow
the released code (bytedance/vidi `dataset/vid_utils.py`, `img_utils.py`); files are decoded with PyAV."""

from __future__ import annotations

import io
import os
import re
from bisect import bisect_left, insort
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import av
import numpy as np
import torch
from PIL import Image
from transformers import AutoTokenizer, CLIPImageProcessorPil, SiglipImageProcessorPil, WhisperFeatureExtractor

from .checkpoints.towers import tower_folder
from .errors import InputError
from .modeling.images import anyres_tiles, prepare_pictures, squared, tower_side
from .sidefiles import read_json, reading

PROCESSOR_FILE = "preprocessor_config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

IMAGE_PROCESSORS = {"siglip_vision_model": SiglipImageProcessorPil, "clip_vision_model": CLIPImageProcessorPil}


def load_tokenizer(folder: Path, config):
    names = [name for name in TOKENIZER_FILES if (Path(folder) / name).is_file()]
    if not names:
        raise InputError(folder, "has no tokenizer (tokenizer.json / tokenizer_config.json)")
    for name in names:  # a cut file is named, not the library's parse error
        if name.endswith(".json"):
            read_json(Path(folder) / name, name)
    with reading(Path(folder) / names[0], "tokenizer"):
        return AutoTokenizer.from_pretrained(str(folder), config=config, local_files_only=True)


MEDIA_MARKERS = ("<image>", "<video>")  # where a prompt says its picture or video sits: text, cut out of the ids


def prompt_ids(tokenizer, prompt: str) -> list[int]:
    """The prompt's token ids as the released code makes them (Vidi's `tokenizer_image_token`, then its model's
    multimodal input preparation): the text before the media marker with the tokenizer's special tokens, each piece
    after one without, and the marker itself, which stands for the media's own stream, cut out. The released models
    were trained on `<image>` and a newline before the question (Vidi's one marker, for a picture or a video;
    `<video>` reads the same here)."""
    first, *rest = re.split("|".join(map(re.escape, MEDIA_MARKERS)), prompt)
    ids = tokenizer(first)["input_ids"]
    for piece in rest:
        ids += tokenizer(piece, add_special_tokens=False)["input_ids"]
    return ids


BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte tokens (Llama, Mistral, Gemma)


def answer_text(tokenizer, ids: list[int]) -> str:
    """The tokens' text; where their bytes are no UTF-8 (a random model's answer, or one cut inside a character),
    each such byte as a \\xNN escape instead of the replacement character, which would hide what was generated."""
    text = tokenizer.decode(ids, skip_special_tokens=True)
    if "\ufffd" not in text:
        return text
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_level = {char: byte for byte, char in bytes_to_unicode().items()}  # GPT-2's byte-level BPE alphabet

    def token_bytes(token: str) -> bytes:
        if match := BYTE_FALLBACK.fullmatch(token):
            return bytes([int(match.group(1), 16)])
        if all(char in byte_level for char in token):
            return bytes(byte_level[char] for char in token)
        return token.replace("\u2581", " ").encode()  # SentencePiece's word start

    tokens = tokenizer.convert_ids_to_tokens(ids, skip_special_tokens=True)  # None: past the vocabulary, no text
    return b"".join(token_bytes(t) for t in tokens if t is not None).decode("utf-8", errors="backslashreplace")


def processor_folder(folder: Path, config) -> Path | None:
    """Where the image preprocessor is: the checkpoint's preprocessor_config.json, else the vision tower folder's
    (released checkpoints name the tower and load its processor from there)."""
    for candidate in (Path(folder), tower_folder(config.mm_vision_tower, folder)):
        if candidate is not None and (candidate / PROCESSOR_FILE).is_file():
            return candidate
    return None


def load_image_processor(folder: Path, config):
    """The checkpoint's or its vision tower's preprocessor, else the tower's defaults at its image size."""
    processor_class = IMAGE_PROCESSORS[config.vision_config["model_type"]]
    if found := processor_folder(folder, config):
        return processor_class.from_pretrained(str(found), local_files_only=True)
    size = config.vision_config["image_size"]
    return processor_class(size={"height": size, "width": size}, do_center_crop=False)


def load_images(paths: list[Path], config, image_processor) -> torch.Tensor:
    """Image files -> (1, images, 3, H, W) pixel values, each prepared as the released code prepares a picture
    (`modeling/images.py`, by mm_image_aspect_ratio; not anyres, whose pictures become tiles)."""
    return prepare_pictures([open_image(path) for path in paths], config.mm_image_aspect_ratio, image_processor)[None]


UNSCALED = {"do_rescale": False, "do_normalize": False}  # a processor's call that stops at the pixels' bytes


def picture_bytes(pictures: list[Image.Image], rule: str, image_processor) -> torch.Tensor:
    """(N, 3, H, W) uint8: the pictures as `prepare_pictures` prepares them, before the processor rescales and
    normalizes them (`normalize_pixels`): a quarter of the bytes, for many frames held or sent at once."""
    pixels = image_processor(squared(pictures, rule, image_processor), return_tensors="pt", **UNSCALED)
    return as_bytes(pixels["pixel_values"])


def tiles_bytes(picture: Image.Image, image_processor, grid_points: list) -> tuple[torch.Tensor, tuple[int, int]]:
    """`anyres_tiles`' thumbnail and tiles as uint8, before the processor rescales and normalizes them, and the
    tiling."""
    pixels, tiling = anyres_tiles(picture, image_processor, grid_points, **UNSCALED)
    return as_bytes(pixels), tiling


def as_bytes(pixels: torch.Tensor) -> torch.Tensor:
    """A processor's pixel values that it neither rescaled nor normalized (whole numbers 0-255) as uint8."""
    return pixels.round().to(torch.uint8) if pixels.is_floating_point() else pixels.to(torch.uint8)


def normalize_pixels(pixels: torch.Tensor, image_processor) -> torch.Tensor:
    """`picture_bytes`' pixels as `prepare_pictures` gives them, float32: rescaled (in float64, then float32) and
    normalized, as the processor computes them (tests/test_vllm.py compares the two)."""
    scale = image_processor.rescale_factor if image_processor.do_rescale else 1.0
    x = (pixels.double() * scale).float()
    if not image_processor.do_normalize:
        return x
    mean, std = (torch.tensor(v, dtype=torch.float32, device=x.device)[:, None, None] for v in (
        image_processor.image_mean, image_processor.image_std
    ))  # fmt: skip
    return (x - mean) / std


# --- video models -----------------------------------------------------------------------------------------------

VIDEO_FPS = 1.0  # frames kept per second of video (load_video's default)
PREPARING_AHEAD = 4  # decoded frames waiting for their conversion to RGB and resize, at most
REORDER_DEPTH = 16  # frames a decoder may hold back to put them in presentation order (H.264's and HEVC's most)
SKIPPABLE_CODECS = {"h264", "hevc"}  # their non-reference frames are marked, and skipped by skip_frame=NONREF
AUDIO_RATE = 16000  # Hz, one channel (load_audio, as Whisper)
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".webp"}


@dataclass(frozen=True, repr=False)
class FileBytes:
    """A media file's bytes in memory (a served request's video), named in errors by `name`: each reader opens them
    anew, so that they decode in pieces as the file on disk would."""

    data: bytes
    name: str = "<bytes>"

    def __str__(self) -> str:
        return self.name

    __repr__ = __str__


def open_media(path: Path | FileBytes):
    """A media file, or its bytes."""
    try:
        return av.open(io.BytesIO(path.data) if isinstance(path, FileBytes) else str(path))
    except (av.FFmpegError, OSError) as e:
        raise InputError(path, f"cannot be decoded ({str(e).strip()})") from None


def load_video(
    path: Path | FileBytes,
    fps: float = VIDEO_FPS,
    limit: int | None = None,
    square: int | None = None,
    sound: bool = True,
) -> tuple[list[Image.Image], np.ndarray | None]:
    """A video file's frames and sound track, as the ffmpeg command line decodes them, in one pass over the file
    however long the video (or one a piece, below):
    - frames: every round(average rate / fps)-th from the first, RGB, turned upright as the stream's display matrix
      says (decord's `VideoReader.get_batch` at load_video's frame indices); with `square`, each resized to the
      tower's square as it is decoded (`tower_square`), so that an hour never holds its full-size frames;
    - the sound track (with `sound`): `load_audio`'s samples of its first audio stream, None without one.
    Where a file's index lists every frame, the stream is cut at IDR pictures into a piece a core, each decoded on a
    thread of its own (`video_pieces`; the first piece's pass reads on to the end for the sound track). Decoding
    stops at `limit` frames (the caller then refuses the video; the sound track ends there)."""
    prepare = upright if square is None else lambda frame: tower_square(upright(frame), square)
    # kept frames are converted and resized on a thread of their own while decoding goes on (both release the GIL),
    # at most PREPARING_AHEAD of them waiting a piece, so that a video whose every frame is kept holds few at full size
    with ThreadPoolExecutor(1) as preparing:
        decode = partial(decode_video, path, fps, limit, prepare, preparing)
        pieces = video_pieces(path, fps, limit)
        passes = [lambda: decode_pieces(decode, pieces, sound)] if len(pieces) > 1 else []
        passes += [lambda: [decode(sound, ranked=True)], lambda: [decode(sound, ranked=False)]]
        for attempt in passes[:-1]:
            try:
                decoded = attempt()
                break
            except FrameOrderUnknown:  # rare files; read again in one pass, at last counting frames as they come out
                continue
        else:
            decoded = passes[-1]()
        frames = [frame.result() for pending, _ in decoded for frame in pending]
    if not frames:
        raise InputError(path, "holds no video frames")
    return frames, decoded[0][1]


def decode_pieces(decode, pieces: list[Piece], sound: bool) -> list[tuple[list, np.ndarray | None]]:
    """Each piece decoded on a thread of its own, with the cores shared among their decoders; the first piece's
    pass reads the sound track."""
    threads = max(1, usable_cores() // len(pieces))
    with ThreadPoolExecutor(len(pieces)) as decoding:
        run = lambda piece: decode(sound and piece.start == 0, ranked=True, piece=piece, threads=threads)  # noqa: E731
        return list(decoding.map(run, pieces))


@dataclass(frozen=True)
class Piece:
    """A video stream's packets from index entry `start` (an IDR picture, or the stream's first packet) to the next
    piece's first: what one decoder decodes. The dts of both (None: the stream's start, its end)."""

    start: int = 0
    start_dts: int | None = None
    end: int | None = None
    end_dts: int | None = None

    def packets(self, packets: Iterable[av.Packet], video, idr: IdrFinder | None, others: bool):
        """`packets` with the video stream's cut to the piece: its first checked to be the piece's IDR picture, a
        packet flushing the decoder in place of the next piece's first, and no video packet after it; the other
        streams' go on where there are `others` (the first piece reads the whole sound track)."""
        starting, ended = self.start_dts is not None, False
        for packet in packets:
            if packet.stream is video and packet.size:
                if ended or (starting and packet.dts is not None and packet.dts < self.start_dts):
                    continue  # a seek by presentation time lands on an earlier key frame where frames are reordered
                if starting:
                    starting = False
                    if not starts_at(packet, self.start_dts, idr):
                        raise FrameOrderUnknown
                if self.end_dts is not None and packet.dts == self.end_dts:
                    ended = True
                    packet = av.Packet()
                    packet.stream = video
                    yield packet
                    if not others:
                        return
                    continue
            elif packet.stream is video and ended:  # the stream's own flushing packet, the decoder flushed already
                continue
            yield packet

    def check(self, count: int) -> None:
        """The piece held as many packets as the index says (else its frames' places are not the file's)."""
        if self.end is not None and count != self.end - self.start:
            raise FrameOrderUnknown


def starts_at(packet: av.Packet, dts: int, idr: IdrFinder) -> bool:
    """Whether `packet`, the first at or after `dts` in decode order, is the IDR picture a piece starts with."""
    return packet.dts == dts and idr.starts(packet)


def frame_step(video, fps: float) -> int:
    """Every how many frames one is kept: round(average rate / fps), the released load_video's indices."""
    return max(1, round(float(video.average_rate) / fps))


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def video_pieces(path: Path | FileBytes, fps: float, limit: int | None) -> list[Piece]:
    """The pieces a video file's stream is cut into, one a core, at the IDR pictures nearest to equal parts: where
    its index lists every packet in decode order (MP4, MOV: each piece's first frame's place is then its entry's
    number) and it is H.264 or HEVC (no frame after an IDR picture is decoded from one before it). A frame-threaded
    decoder's threads wait on each other row by row; decoders of their own on pieces do not (600 s of 480p H.264
    without B-frames: 0.78x the ffmpeg command line's decode, against 1.14x in one pass, 2 cores). One piece (the
    whole stream) otherwise: a single core, a stream past `limit` frames (decoded in one pass up to it). A file's
    bytes in memory (`FileBytes`) are cut as the file is."""
    whole = [Piece()]
    if (cores := usable_cores()) < 2:
        return whole
    with open_media(path) as container:
        if not container.streams.video:
            return whole
        video = container.streams.video[0]
        entries = video.index_entries
        count = len(entries)
        if video.codec_context.name not in SKIPPABLE_CODECS or not video.average_rate or not count:
            return whole
        if count != video.frames or (limit is not None and -(-count // frame_step(video, fps)) > limit):
            return whole
        # the key frame at or before each equal part's first entry, where it is an IDR picture (each piece checks its
        # own first packet again)
        cuts = {entries.search_timestamp(entries[count * i // cores].timestamp) for i in range(1, cores)}
        idr = IdrFinder(video)
        starts = [
            0,
            *(cut for cut in sorted(cuts) if cut > 0 and idr_at(container, video, idr, entries[cut].timestamp)),
        ]
        bounds = [(start, entries[start].timestamp if start else None) for start in starts] + [(None, None)]
        return [Piece(a, a_dts, b, None if b is None else entries[b].timestamp) for (a, a_dts), (b, _) in
                zip(bounds, bounds[1:])]  # fmt: skip


def idr_at(container, video, idr: IdrFinder, dts: int) -> bool:
    """Whether the video packet at `dts` is an IDR picture (read by a seek: the packets before it are not)."""
    container.seek(dts, stream=video)
    packet = next((p for p in container.demux(video) if p.size and p.dts is not None and p.dts >= dts), None)
    return packet is not None and starts_at(packet, dts, idr)


def decode_video(
    path, fps, limit, prepare, preparing: ThreadPoolExecutor, sound: bool, ranked: bool, piece=Piece(), threads=0
) -> tuple[list, np.ndarray | None]:
    """One decoder's pass over a piece of the video stream (and the sound track, with `sound`) -> its kept frames
    (futures of `prepare` on `preparing`) and the samples; `ranked`: frames placed by their packets' pts, where the
    codec allows (FramePicker); `threads`: the decoder's (0: FFmpeg's choice)."""
    with open_media(path) as container:
        if not container.streams.video:
            raise InputError(path, "has no video stream")
        video = container.streams.video[0]
        if not video.average_rate:
            raise InputError(path, "has no frame rate: cannot sample frames per second")
        video.thread_type = "AUTO"  # frame and slice threads, as the ffmpeg command line decodes
        video.codec_context.thread_count = threads
        track = SoundTrack(container.streams.audio[0]) if sound and container.streams.audio else None
        if piece.start_dts is not None:
            container.seek(piece.start_dts, stream=video)
        picker = FramePicker(video, frame_step(video, fps), ranked, offset=piece.start)
        demuxed = piece.packets(
            container.demux(video, *([track.stream] if track else [])), video, picker.idr, bool(track)
        )
        pending = []
        for packet in picker.packets(demuxed):
            kind = packet.stream.type
            try:
                decoded = packet.decode()  # a last, empty packet per stream flushes its decoder
            except av.FFmpegError as e:
                raise InputError(path, f"cannot be decoded as {kind} ({str(e).strip()})") from None
            for frame in decoded:
                if kind == "audio":
                    track.push(frame)
                elif picker.keeps(frame):
                    pending.append(preparing.submit(prepare, frame))
                    if len(pending) > PREPARING_AHEAD:
                        pending[-PREPARING_AHEAD - 1].result()
                    if len(pending) == limit:
                        break
            if len(pending) == limit:
                break
        picker.check(limit)
        piece.check(len(picker.pts))
    return pending, None if track is None else track.samples(path)


class FrameOrderUnknown(Exception):
    """A file whose packets do not tell each frame's place (a packet without pts, two with one, frames the decoder
    drops): its frames are counted as they come out instead."""


@dataclass(frozen=True)
class NalSyntax:
    """What finding a codec's IDR pictures needs of its NAL units' syntax."""

    nal_type: Callable[[int], int]  # a unit's type, from its first byte
    idr_types: frozenset[int]
    length_size_at: int  # the avcC / hvcC record's byte whose low two bits are the length prefix's size - 1


NAL_SYNTAX = {  # by codec: SKIPPABLE_CODECS
    "h264": NalSyntax(lambda header: header & 0x1F, frozenset({5}), 4),  # IDR
    "hevc": NalSyntax(lambda header: (header >> 1) & 0x3F, frozenset({19, 20}), 21),  # IDR_W_RADL, IDR_N_LP
}


class IdrFinder:
    """Which packets of an H.264 or HEVC stream start with an IDR picture, from their NAL units' types: MP4's
    length-prefixed units (the size of the prefix from the stream's avcC / hvcC record), else Annex B's start codes
    (MPEG-TS, raw streams). Only a packet the container marks as a key frame is read; a recovery point that is not
    an IDR (an open GOP's I-frame, a CRA) is not one: frames after it may be decoded from frames before it."""

    def __init__(self, video: av.video.stream.VideoStream):
        codec, record = video.codec_context.name, video.codec_context.extradata or b""
        self.syntax = NAL_SYNTAX[codec]
        at = self.syntax.length_size_at
        # as FFmpeg's decoders tell them: a record that does not open with a start code is avcC / hvcC
        annex_b = len(record) <= at or record.startswith((b"\x00\x00\x01", b"\x00\x00\x00\x01"))
        self.length_size = None if annex_b else (record[at] & 3) + 1

    def starts(self, packet: av.Packet) -> bool:
        if not packet.is_keyframe:
            return False
        data = bytes(packet)
        return any(self.syntax.nal_type(header) in self.syntax.idr_types for header in self.nal_headers(data))

    def nal_headers(self, data: bytes) -> Iterator[int]:
        """Each NAL unit's first byte (its type's)."""
        if self.length_size is None:
            yield from (data[m.end()] for m in re.finditer(b"\x00\x00\x01", data) if m.end() < len(data))
            return
        at = 0
        while at + self.length_size < len(data):
            yield data[at + self.length_size]
            at += self.length_size + int.from_bytes(data[at : at + self.length_size], "big")


class FramePicker:
    """Which frames load_video keeps: every `step`-th from the first, in presentation order (decord's indices).

    For codecs with non-reference frames (SKIPPABLE_CODECS), a frame's place is its packet's pts's rank among the
    stream's, known REORDER_DEPTH packets after it is read, and frames that no kept frame needs are not decoded:
    - a non-reference frame (a B-frame, which no other frame is decoded from) that is not kept is skipped by the
      decoder (`skip_frame`): a 30 fps file with B-frames, sampled at 1 frame/s, skips about two frames in three;
    - a packet whose frame is not kept is held back until a kept frame follows it (then it goes to the decoder
      first: the kept frame may be decoded from it) or an IDR picture does (no frame after an IDR is decoded from
      one before it): then it is never decoded. So the frames between a GOP's last kept frame and the next IDR are
      dropped: in a 30 fps file with an IDR picture a second, as phones write them, each second's kept frame is its
      IDR, and the rest of the second is not decoded.
    The kept frames are the same, found sooner. Where a file does not allow it (`check`, FrameOrderUnknown) or
    without `ranked`, every frame is decoded and counted as it comes out."""

    def __init__(self, video: av.video.stream.VideoStream, step: int, ranked: bool, offset: int = 0):
        self.video, self.step, self.offset = video, step, offset
        self.ranked = ranked and video.codec_context.name in SKIPPABLE_CODECS
        self.idr = IdrFinder(video) if self.ranked else None
        self.pts: list[int] = []  # the video packets' pts read so far, in order
        self.kept: list[int] = []  # the kept frames' places
        self.held: list[av.Packet] = []  # packets whose frames are not kept, until a kept frame or an IDR follows
        self.count = 0  # frames out so far (unranked)
        self.skipping = False

    def packets(self, packets: Iterable[av.Packet]) -> Iterator[av.Packet]:
        """`packets` in demux order, each video packet that a kept frame needs once its frame's place is known, set
        to be decoded or not."""
        if not self.ranked:
            yield from packets
            return
        waiting: deque[av.Packet] = deque()
        for packet in packets:
            if packet.stream is not self.video:
                yield packet
            elif packet.size:
                if packet.pts is None or packet.is_discard:
                    raise FrameOrderUnknown
                insort(self.pts, packet.pts)
                waiting.append(packet)
                if len(waiting) > REORDER_DEPTH:
                    yield from self.placed(waiting.popleft())
            else:  # the stream's last, empty packet, which flushes its decoder
                while waiting:
                    yield from self.placed(waiting.popleft())
                yield packet
        while waiting:  # a demuxer that gave no flushing packet
            yield from self.placed(waiting.popleft())

    def placed(self, packet: av.Packet) -> Iterator[av.Packet]:
        """A packet whose place is known, and the packets held back before it that a kept frame needs."""
        if self.idr.starts(packet):
            self.held.clear()
        if self.place(packet.pts) % self.step:
            self.held.append(packet)
            return
        for held in self.held:
            yield self.marked(held, skip=True)
        self.held.clear()
        yield self.marked(packet, skip=False)

    def marked(self, packet: av.Packet, skip: bool) -> av.Packet:
        if skip != self.skipping:  # the decoder's threads take the setting with each packet
            self.video.codec_context.skip_frame = "NONREF" if skip else "DEFAULT"
            self.skipping = skip
        return packet

    def place(self, pts: int | None) -> int:
        place = bisect_left(self.pts, pts) if pts is not None else len(self.pts)
        if place == len(self.pts) or self.pts[place] != pts or self.pts[place + 1 : place + 2] == [pts]:
            raise FrameOrderUnknown
        return self.offset + place

    def keeps(self, frame: av.VideoFrame) -> bool:
        if self.ranked:
            place = self.place(frame.pts)
        else:
            place, self.count = self.count, self.count + 1
        if place % self.step:
            return False
        self.kept.append(place)
        return True

    def check(self, limit: int | None) -> None:
        """Ranked: every place to keep came out, in order (else the file is read again, counting)."""
        first = -(-self.offset // self.step) * self.step  # a piece's first place to keep
        if self.ranked and self.kept != list(range(first, self.offset + len(self.pts), self.step))[:limit]:
            raise FrameOrderUnknown


# a display matrix's counter-clockwise quarter turns; decord turns frames by the matrix's angle and ignores its flips
QUARTER_TURNS = {1: Image.Transpose.ROTATE_90, 2: Image.Transpose.ROTATE_180, 3: Image.Transpose.ROTATE_270}


def upright(frame: av.VideoFrame) -> Image.Image:
    """A decoded frame as RGB, turned as its display matrix says (a phone's portrait video is stored sideways)."""
    plane = frame.reformat(format="rgb24").planes[0]  # to_image() would copy it row by row first, holding the GIL
    image = Image.frombuffer("RGB", (plane.width, plane.height), plane, "raw", "RGB", plane.line_size, 1)
    turn = QUARTER_TURNS.get(round(frame.rotation / 90) % 4)
    return image if turn is None else image.transpose(turn)


def media_duration(path: Path | FileBytes) -> float:
    """A media file's duration in seconds as ffprobe's `format=duration` gives it (the container's)."""
    with open_media(path) as container:
        if container.duration is None:
            raise InputError(path, "states no duration")
        return container.duration / av.time_base


def time_ranges(text: str, duration: float, family) -> list[str]:
    """An answer's "0.12-0.15" ranges (fractions of the video) as hh:mm:ss-hh:mm:ss, as the family's released
    inference script writes them for a video of `duration` seconds; a match that is no number (its pattern allows
    "1.2.3") is skipped, where the script would stop."""
    ranges = []
    for match in re.findall(family.released_range_pattern, text):
        try:
            start, end = (float(fraction) * duration for fraction in match)
        except ValueError:
            continue
        ranges.append("-".join(clock(t, family.released_seconds_format) for t in (start, end)))
    return ranges


def clock(t: float, seconds_format: str) -> str:
    return f"{int(t / 3600):02d}:{(int(t) % 3600) // 60:02d}:" + seconds_format.format(int(t) % 60)


def load_frame_folder(folder: Path, square: int | None = None) -> list[Image.Image]:
    """A folder of frame images, in file-name order; with `square`, each resized to it as it is read."""
    files = sorted(f for f in Path(folder).iterdir() if f.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise InputError(folder, f"holds no frame images ({', '.join(sorted(IMAGE_SUFFIXES))})")
    return [open_image(f) if square is None else tower_square(open_image(f), square) for f in files]


def open_image(path: Path) -> Image.Image:
    """An image file as RGB (the released code's `.convert('RGB')`); a picture over Pillow's decompression-bomb
    limit (about 179 Mpixels) is refused before it is decoded."""
    with reading(path, "image"):
        with Image.open(path) as image:
            return image.convert("RGB")


def frame_square(folder: Path, config) -> int | None:
    """The side video frames are resized to before the tower (its square), when frames are prepared by `resize`
    (as the released video models' are): a frame can then be resized as it is decoded, and an hour of 1080p holds
    3600 squares, not 3600 x 6.2 MB of RGB. The preparation's own resize then leaves it as it is."""
    if config.modality != "video" or config.mm_image_aspect_ratio != "resize":
        return None
    return tower_side(load_image_processor(folder, config))


def tower_square(frame: Image.Image, size: int) -> Image.Image:
    """A frame resized to the tower's square (bicubic: the released `resize` preparation, which video models use); a
    frame already that size is left as it is (Pillow copies it)."""
    return frame.resize((size, size), resample=Image.BICUBIC)


def load_audio(path: Path | FileBytes, missing_ok: bool = False) -> np.ndarray | None:
    """A media file's sound track (its first audio stream): `SoundTrack`'s samples. None for a file without one
    when `missing_ok`."""
    with open_media(path) as container:
        if not container.streams.audio:
            if missing_ok:
                return None
            raise InputError(path, "has no audio stream")
        track = SoundTrack(container.streams.audio[0])
        try:
            for frame in container.decode(track.stream):
                track.push(frame)
        except av.FFmpegError as e:
            raise InputError(path, f"cannot be decoded as audio ({str(e).strip()})") from None
    return track.samples(path)


class SoundTrack:
    """An audio stream's decoded frames as one channel of float samples at AUDIO_RATE, through 16-bit: what
    load_audio's `ffmpeg -i FILE -f s16le -ac 1 -ar 16000 -` gives, / 32768. The same filters as that command (its
    end cut at the stream's duration, as an mp4's edit list says, then one conversion of layout, rate and format),
    so the samples are the command's to the bit. The filters give the samples out in pieces of PIECE_SAMPLES (not
    one piece per decoded frame: an hour of AAC is 170,000 frames, and each piece out costs a pull and an array)."""

    DRAIN_EVERY = 64
    PIECE_SAMPLES = 10 * AUDIO_RATE

    def __init__(self, stream: av.audio.stream.AudioStream):
        self.stream = stream
        self.graph = graph = av.filter.Graph()  # kept: its filters do not keep it alive
        self.chain = [graph.add_abuffer(template=stream)]
        if stream.duration:
            end = round(stream.duration * stream.time_base * stream.codec_context.sample_rate)
            self.chain.append(graph.add("atrim", f"end_sample={end}"))
        self.chain.append(graph.add("aformat", f"sample_fmts=s16:sample_rates={AUDIO_RATE}:channel_layouts=mono"))
        self.chain.append(graph.add("asetnsamples", f"n={self.PIECE_SAMPLES}:p=0"))  # p=0: the last not padded
        self.chain.append(graph.add("abuffersink"))
        for source, sink in zip(self.chain, self.chain[1:]):
            source.link_to(sink)
        graph.configure()
        self.pieces: list[np.ndarray] = []
        self.pushed = 0

    def push(self, frame: av.AudioFrame | None) -> None:
        """A decoded frame through the filters (None: the end of the stream). What they give out is drained every
        DRAIN_EVERY frames, not after each: a sink with nothing to give raises, and raising once a frame was a
        measurable part of the sound track's time."""
        self.chain[0].push(frame)
        self.pushed += 1
        if frame is None or self.pushed % self.DRAIN_EVERY == 0:
            while True:
                try:
                    self.pieces.append(self.chain[-1].pull().to_ndarray().reshape(-1))
                except (av.BlockingIOError, av.EOFError):
                    return

    def samples(self, path: Path | FileBytes) -> np.ndarray:
        self.push(None)
        if not sum(piece.size for piece in self.pieces):
            raise InputError(path, "holds no audio samples")
        # one array made, scaled in place: fresh memory is slow to touch on some machines (0.2 s for 10 minutes' here)
        samples = np.concatenate(self.pieces, dtype=np.float32)
        samples *= 1 / 32768  # a power of two: exact, as the division
        return samples


def load_audio_processor(folder: Path, config) -> WhisperFeatureExtractor:
    """The audio tower folder's feature extractor, else Whisper's at the tower's mel bins, its chunk the encoder's
    input (2 x max_source_positions mel frames: 3000 for Whisper)."""
    found = tower_folder(config.mm_audio_tower, folder)
    if found is not None and (found / PROCESSOR_FILE).is_file():
        return WhisperFeatureExtractor.from_pretrained(str(found), local_files_only=True)
    return default_audio_processor(config.audio_config)


def default_audio_processor(audio_config: dict) -> WhisperFeatureExtractor:
    hop = WhisperFeatureExtractor().n_samples // (2 * audio_config["max_source_positions"])
    return WhisperFeatureExtractor(feature_size=audio_config["num_mel_bins"], hop_length=hop)


def audio_features(samples: np.ndarray, extractor) -> tuple[torch.Tensor, int]:
    """(chunks, mel bins, chunk frames) log-mel features of 30 s chunks and the real mel frames in all
    (process_audio; its `num_frames`, which transformers 4.x returned: each chunk's samples // hop length)."""
    chunks = [samples[i : i + extractor.n_samples] for i in range(0, len(samples), extractor.n_samples)]
    features = extractor(chunks, sampling_rate=extractor.sampling_rate, return_tensors="pt")
    return features.input_features, sum(len(chunk) // extractor.hop_length for chunk in chunks)
