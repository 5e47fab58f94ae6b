"""H.264 and HEVC syntax, as much as cutting a stream at IDR pictures needs: where a NAL unit's type sits, which
types are IDR pictures, in length-prefixed (avcC / hvcC) and Annex B streams."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from .media_files import av

SKIPPABLE_CODECS = {"h264", "hevc"}  # their non-reference frames are marked, and skipped by skip_frame=NONREF


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
