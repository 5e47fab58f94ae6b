"""Ways to damage checkpoint files as disks, interrupted copies and hostile authors do: the malformed-input tests
apply them to copies of real folders."""

import json
import pickle
import struct
import zipfile
from pathlib import Path


def read_header(shard: Path) -> tuple[dict, bytes]:
    """A safetensors file's header (parsed) and its data bytes."""
    raw = shard.read_bytes()
    length = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8 : 8 + length]), raw[8 + length :]


def write_header(shard: Path, header: dict | bytes, data: bytes) -> None:
    """A safetensors file from a header (a dict, or raw JSON bytes) and data bytes, the header padded to 8 bytes."""
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    shard.write_bytes(struct.pack("<Q", len(text)) + text + data)


def edit_header(shard: Path, edit) -> Path:
    """Rewrite a shard's header with `edit(header)` (in place, or returning a new header); the data is kept."""
    header, data = read_header(shard)
    header = edit(header) or header
    write_header(shard, header, data)
    return shard


def tensors_by_offset(header: dict) -> list[str]:
    return sorted((n for n in header if n != "__metadata__"), key=lambda n: header[n]["data_offsets"])


def overlapping_offsets(header: dict) -> None:
    """The second tensor's bytes start inside the first's: one tensor would become the other's bytes."""
    first, second = tensors_by_offset(header)[:2]
    begin, end = header[second]["data_offsets"]
    header[second]["data_offsets"] = [begin - 4, end - 4]


def negative_offsets(header: dict) -> None:
    name = tensors_by_offset(header)[0]
    begin, end = header[name]["data_offsets"]
    header[name]["data_offsets"] = [begin - 8, end - 8]


def gap_between_tensors(header: dict) -> None:
    """The first tensor claims fewer elements, leaving bytes that belong to no tensor."""
    name = tensors_by_offset(header)[0]
    begin, end = header[name]["data_offsets"]
    size = (end - begin) // header[name]["shape"][-1]
    header[name]["shape"][-1] -= 1
    header[name]["data_offsets"] = [begin, end - size]


def bad_zip_member(file: Path) -> Path:
    """A torch.save zip whose data.pkl is deflated, then corrupted: the entry fails to inflate."""
    with zipfile.ZipFile(file, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("archive/data.pkl", pickle.dumps({"x": 1}, protocol=2) * 50)
    raw = bytearray(file.read_bytes())
    start = raw.index(b"archive/data.pkl") + len("archive/data.pkl")
    raw[start + 10 : start + 40] = b"\xff" * 30
    file.write_bytes(bytes(raw))
    return file


def cut(file: Path, keep: float = 0.5) -> Path:
    """An interrupted copy: the first part of the file only."""
    data = file.read_bytes()
    file.write_bytes(data[: int(len(data) * keep)])
    return file


def png_claiming_pixels(file: Path, width: int, height: int) -> Path:
    """A PNG whose header claims width x height pixels (Pillow's decompression-bomb check reads it first)."""
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    file.write_bytes(
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0")) + chunk(b"IEND", b"")
    )
    return file
