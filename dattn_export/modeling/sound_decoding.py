"""A media file's sound track as the released code reads it: one channel of 16 kHz samples, the ffmpeg command line's
(`ffmpeg -i FILE -f s16le -ac 1 -ar 16000 -`) to the bit, through PyAV's filter graph."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .media_files import FileBytes, MediaError, av, import_av, open_media

AUDIO_RATE = 16000  # Hz, one channel (load_audio, as Whisper)


def load_audio(path: Path | FileBytes, missing_ok: bool = False) -> np.ndarray | None:
    """A media file's sound track (its first audio stream): `SoundTrack`'s samples. None for a file without one
    when `missing_ok`."""
    import_av()
    with open_media(path) as container:
        if not container.streams.audio:
            if missing_ok:
                return None
            raise MediaError(path, "has no audio stream")
        track = SoundTrack(container.streams.audio[0])
        try:
            for frame in container.decode(track.stream):
                track.push(frame)
        except av.FFmpegError as e:
            raise MediaError(path, f"cannot be decoded as audio ({str(e).strip()})") from None
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
            raise MediaError(path, "holds no audio samples")
        # one array made, scaled in place: fresh memory is slow to touch on some machines
        samples = np.concatenate(self.pieces, dtype=np.float32)
        samples *= 1 / 32768  # a power of two: exact, as the division
        return samples
