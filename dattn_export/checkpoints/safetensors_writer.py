"""Hugging Face sharded safetensors, written as a stream: one tensor in memory at a time.

`model-0000k-of-0000n.safetensors` + `model.safetensors.index.json` (or a single `model.safetensors`).
The header is known before any data (names, dtypes, shapes come from the plan), so each shard is written
front to back and hashed as it is written. The safetensors library reads the result back in `verify`.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from functools import partial
from itertools import accumulate
from pathlib import Path

import torch

from .lazy import SAFETENSORS_NAMES

INDEX_NAME = "model.safetensors.index.json"
HASH_LAG = 128 << 20  # bytes of mapped tensors that hashing may fall behind the writing
# a tensor that can be produced a piece at a time goes through the buffers in pieces of at most this size: a shard
# writer holds two buffers, and a 9B model's 256000 x 3584 embedding in bf16 is 1.8 GB
PIECE_BYTES = 16 << 20


@dataclass
class PlannedTensor:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    produce: Callable[[torch.Tensor], torch.Tensor]  # loads (and casts) the tensor into a uint8 buffer
    # (file, byte offset) already holding exactly the output bytes: copied in the kernel, and `produce` gives them
    # without the buffer (mapped) for checking and hashing
    copy_from: tuple[Path, int] | None = None
    # loads (and casts) elements [start, stop) of the flattened tensor into a uint8 buffer: then it goes through the
    # buffers PIECE_BYTES at a time
    produce_range: Callable[[torch.Tensor, int, int], torch.Tensor] | None = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass
class Part:
    """What the writer produces and writes in one go: a whole tensor, or a piece of one (1-D)."""

    planned: PlannedTensor
    produce: Callable[[torch.Tensor], torch.Tensor]
    shape: tuple[int, ...]
    last: bool  # the tensor's last part

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.planned.dtype.itemsize


def parts_of(planned: PlannedTensor) -> list[Part]:
    """The tensor whole, or (with `produce_range`, when larger than PIECE_BYTES) its elements a piece at a time."""
    if planned.produce_range is None or planned.nbytes <= PIECE_BYTES:
        return [Part(planned, planned.produce, planned.shape, True)]
    numel, step = math.prod(planned.shape), PIECE_BYTES // planned.dtype.itemsize
    bounds = [(start, min(start + step, numel)) for start in range(0, numel, step)]
    return [Part(planned, partial(planned.produce_range, start=a, stop=b), (b - a,), b == numel) for a, b in bounds]


@dataclass
class WrittenFile:
    size: int
    sha256: str


def plan_shards(tensors: list[PlannedTensor], max_shard_bytes: int) -> list[list[PlannedTensor]]:
    """Group tensors in order into shards of at most `max_shard_bytes` (a larger tensor gets its own)."""
    shards: list[list[PlannedTensor]] = [[]]
    used = 0
    for tensor in tensors:
        if shards[-1] and used + tensor.nbytes > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(tensor)
        used += tensor.nbytes
    return shards


def shard_names(count: int) -> list[str]:
    return (
        ["model.safetensors"]
        if count == 1
        else [f"model-{k:05d}-of-{count:05d}.safetensors" for k in range(1, count + 1)]
    )


def _header(tensors: list[PlannedTensor], metadata: dict[str, str]) -> bytes:
    entries, offset = {"__metadata__": {"format": "pt", **metadata}}, 0
    for t in tensors:
        entries[t.name] = {
            "dtype": SAFETENSORS_NAMES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + t.nbytes],
        }
        offset += t.nbytes
    header = json.dumps(entries, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)  # data starts 8-byte aligned
    return len(header).to_bytes(8, "little") + header


def write_safetensors(
    file: Path,
    tensors: list[PlannedTensor],
    metadata: dict[str, str] | None = None,
    on_written: Callable[[PlannedTensor], None] | None = None,
    copier: RangeCopier | None = None,
) -> WrittenFile:
    """Stream `tensors` into one safetensors file. Three stages overlap (all release the GIL): the next
    tensor is produced (read, checked, cast) while the current one is written, and hashing runs behind the
    writing. sha256 is sequential and the slowest stage, so it must never wait: it may fall behind by up to
    HASH_LAG bytes of mapped tensors (tensors copied as they are need no buffer: they are mapped from their
    file). Produced tensors go into two buffers used in turn; a buffer is reused once its tensor is hashed; a large
    tensor with `produce_range` goes through them a piece at a time (`parts_of`). Leaving the `with` waits for the
    last hashes."""
    header = _header(tensors, metadata or {})
    digest, size = hashlib.sha256(header), len(header)
    copier = copier or RangeCopier()
    parts = [part for planned in tensors for part in parts_of(planned)]
    buffered = [part.planned.copy_from is None for part in parts]
    largest = max((part.nbytes for part, b in zip(parts, buffered) if b), default=0)
    ring = [torch.empty(largest, dtype=torch.uint8) for _ in range(2)]
    with ExitStack() as stack:
        f = stack.enter_context(open(file, "wb", buffering=0))
        producer, hasher = stack.enter_context(ThreadPoolExecutor(1)), stack.enter_context(ThreadPoolExecutor(1))
        sources: dict[Path, int] = {}
        f.write(header)
        hashing: deque[tuple[Future, int]] = deque()  # (hash of a written mapped tensor, its bytes), oldest first
        behind = 0  # their bytes
        # produced parts take the two buffers in turn (the k-th produced one buffer k % 2)
        buffer_of = [k % 2 for k in accumulate(buffered, initial=0)]
        ring_hashed: list[Future | None] = [None, None]  # the hash of the part each buffer last held
        no_buffer = torch.empty(0, dtype=torch.uint8)

        def produce(k: int) -> Future:
            part, previous = parts[k], ring_hashed[buffer_of[k]]
            if not buffered[k]:
                return producer.submit(part.produce, no_buffer)

            def into_free_buffer():
                if previous is not None:
                    previous.result()  # the buffer's previous part is written and hashed
                return part.produce(ring[buffer_of[k]])

            return producer.submit(into_free_buffer)

        upcoming = produce(0) if parts else None
        for i, part in enumerate(parts):
            tensor, planned = upcoming.result(), part.planned
            if tensor.dtype != planned.dtype or tuple(tensor.shape) != part.shape:
                raise ValueError(
                    f"{planned.name}: produced {tensor.dtype} {list(tensor.shape)}, planned "
                    f"{planned.dtype} {list(part.shape)}"
                )
            data = memoryview(tensor.contiguous().view(-1).view(torch.uint8).numpy())
            del tensor  # the hash holds the bytes (and their mapping) while it needs them
            hashed = hasher.submit(digest.update, data)
            if i + 1 < len(parts):  # a produced part i + 1 takes the other buffer than part i's
                upcoming = produce(i + 1)
            if buffered[i]:
                ring_hashed[buffer_of[i]] = hashed
                f.write(data)
            else:  # the same bytes, copied inside the kernel: several times faster than write() here
                hashing.append((hashed, len(data)))
                behind += len(data)
                source, offset = planned.copy_from
                if source not in sources:
                    sources[source] = stack.enter_context(open(source, "rb", buffering=0)).fileno()
                copier.copy(sources[source], f.fileno(), offset, len(data))
            size += len(data)
            data = None
            while behind > HASH_LAG:
                oldest, nbytes = hashing.popleft()
                oldest.result()
                behind -= nbytes
            if on_written and part.last:
                on_written(planned)
    return WrittenFile(size, digest.hexdigest())


# why a kernel may refuse copy_file_range: another filesystem, a filesystem or kernel without it, a special file
KERNEL_COPY_REFUSALS = {
    errno.EXDEV: "another filesystem",
    errno.EOPNOTSUPP: "not supported by this filesystem",
    errno.ENOSYS: "not in this kernel",
    errno.EINVAL: "refused for these files",
}
ORDINARY_COPY_CHUNK = 16 << 20


class RangeCopier:
    """Copies byte ranges between files inside the kernel (copy_file_range: no pass through user memory)
    until the kernel refuses (`KERNEL_COPY_REFUSALS`), then with ordinary reads and writes. `method` says which ran;
    hashing is done on the source bytes either way."""

    def __init__(self):
        self.refused: str | None = None  # why the kernel copy was refused, once it was

    @property
    def method(self) -> str:
        if self.refused is None:
            return "in the kernel (copy_file_range)"
        return f"read and written (copy_file_range: {self.refused})"

    def copy(self, source: int, destination: int, offset: int, count: int) -> None:
        while count and self.refused is None:
            try:
                done = os.copy_file_range(source, destination, count, offset)
            except OSError as e:
                if e.errno not in KERNEL_COPY_REFUSALS:
                    raise
                self.refused = f"{errno.errorcode[e.errno]}, {KERNEL_COPY_REFUSALS[e.errno]}"
                break
            if done == 0:
                raise OSError(errno.EIO, f"the source ended {count} bytes early")
            offset, count = offset + done, count - done
        while count:
            data = os.pread(source, min(count, ORDINARY_COPY_CHUNK), offset)
            if not data:
                raise OSError(errno.EIO, f"the source ended {count} bytes early")
            view = memoryview(data)
            while view:
                view = view[os.write(destination, view) :]
            offset, count = offset + len(data), count - len(data)


def write_shards(
    shards: list[list[PlannedTensor]],
    out_dir: Path,
    on_written: Callable[[PlannedTensor], None] | None = None,
    copier: RangeCopier | None = None,
) -> dict[str, WrittenFile]:
    """Write every shard and, when there are several, the index; returns each file written. `copier` (its `method`
    says how bytes stored as they are were copied) is shared by the shards. Shards are written one per core at a
    time: each shard's sha256 is sequential, the slowest stage, and the shards' hashes are independent."""
    out_dir = Path(out_dir)
    copier = copier or RangeCopier()
    names = shard_names(len(shards))
    with ThreadPoolExecutor(max(1, min(os.cpu_count() or 1, len(shards)))) as pool:
        written = [
            pool.submit(write_safetensors, out_dir / name, tensors, on_written=on_written, copier=copier)
            for name, tensors in zip(names, shards)
        ]
        files = {name: future.result() for name, future in zip(names, written)}
    if len(shards) > 1:
        weight_map = {t.name: name for name, tensors in zip(names, shards) for t in tensors}
        total = sum(t.nbytes for tensors in shards for t in tensors)
        index = json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n"
        (out_dir / INDEX_NAME).write_text(index)
        files[INDEX_NAME] = WrittenFile(len(index.encode()), hashlib.sha256(index.encode()).hexdigest())
    return files
