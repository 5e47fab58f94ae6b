"""A video's frames as the released code samples them (one a second: every `round(average rate / fps)`-th frame from
the first, as decord gives them, turned upright), decoded without the frames no kept frame is decoded from, and an
MP4 or MOV H.264 / HEVC stream cut at IDR pictures into a piece a core, each decoded on a thread of its own."""

from __future__ import annotations

import os
from bisect import bisect_left, insort
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
from PIL import Image

from .media_files import FileBytes, MediaError, av, import_av, open_media, resized_to_tower
from .nal_units import SKIPPABLE_CODECS, IdrFinder
from .sound_decoding import SoundTrack

VIDEO_FPS = 1.0  # frames kept per second of video (load_video's default)


PREPARING_AHEAD = 4  # decoded frames waiting for their conversion to RGB and resize, at most


REORDER_DEPTH = 16  # frames a decoder may hold back to put them in presentation order (H.264's and HEVC's most)


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
      tower's square as it is decoded (`resized_to_tower`), so that an hour never holds its full-size frames;
    - the sound track (with `sound`): `load_audio`'s samples of its first audio stream, None without one.
    Where a file's index lists every frame, the stream is cut at IDR pictures into a piece a core, each decoded on a
    thread of its own (`video_pieces`; the first piece's pass reads on to the end for the sound track). Decoding
    stops at `limit` frames (the caller then refuses the video; the sound track ends there)."""
    import_av()
    prepare = upright if square is None else lambda frame: resized_to_tower(upright(frame), square)
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
        raise MediaError(path, "holds no video frames")
    return frames, decoded[0][1]


def decode_pieces(decode, pieces: list[Piece], sound: bool) -> list[tuple[list, np.ndarray | None]]:
    """Each piece decoded on a thread of its own, with the cores shared among their decoders; the first piece's
    pass reads the sound track."""
    threads = max(1, usable_cores() // len(pieces))
    with ThreadPoolExecutor(len(pieces)) as decoding:
        run = lambda piece: decode(sound and piece.start == 0, ranked=True, piece=piece, threads=threads)
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
    decoder's threads wait on each other row by row; decoders of their own on pieces do not (docs/benchmarks.md).
    One piece (the whole stream) otherwise: a single core, a stream past `limit` frames (decoded in one pass up to
    it). A file's bytes in memory (`FileBytes`) are cut as the file is."""
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
            raise MediaError(path, "has no video stream")
        video = container.streams.video[0]
        if not video.average_rate:
            raise MediaError(path, "has no frame rate: cannot sample frames per second")
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
                raise MediaError(path, f"cannot be decoded as {kind} ({str(e).strip()})") from None
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
