"""Lazy tensors: where a tensor's bytes lie in a file, read with pread only when needed.

Tensors are read with pread, or mapped one at a time (`mapped`) where their bytes are only looked at, never
whole files: mapped file pages count towards RSS for as long as they stay mapped, so converting a model needs
memory for one or two tensors, not one shard.

Two file formats are parsed here without loading their data:
  * safetensors: an 8-byte little-endian header length, a JSON header, raw little-endian data;
  * torch.save zip archives (.bin, .pt): `data.pkl` is unpickled by a restricted unpickler that knows only
    tensors (plain, Parameters, and tensors pickled with attributes, whose attributes are dropped), a few
    containers and dtypes, and DeepSpeed's own classes (as inert stand-ins that run nothing); any other
    global (os.system, ...) is refused before anything is called.
"""

from __future__ import annotations

import collections
import functools
import io
import json
import math
import mmap
import os
import pickle
import struct
import warnings
import zipfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import InputError

SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip
SAFETENSORS_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}

STORAGE_DTYPES = {
    "DoubleStorage": torch.float64, "FloatStorage": torch.float32, "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8, "BoolStorage": torch.bool,
}  # fmt: skip


class Sized:
    """numel and nbytes of anything with a `shape` and a `dtype`."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class LazyTensor(Sized):
    """`shape` elements of `dtype` at byte `offset` of `file` (with element `stride`, None = contiguous)."""

    file: Path
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...] | None = None

    def narrow(self, start: int, length: int) -> LazyTensor:
        """Elements [start, start + length) of a contiguous 1-D tensor."""
        return LazyTensor(self.file, self.offset + start * self.dtype.itemsize, self.dtype, (length,))

    def read_into(self, out: torch.Tensor) -> None:
        """Read a contiguous tensor's bytes straight into `out` (a uint8 view of the destination)."""
        with open(self.file, "rb") as f:
            view, done = memoryview(out.numpy()), 0
            while done < len(view):
                got = os.preadv(f.fileno(), [view[done:]], self.offset + done)
                if got == 0:
                    raise InputError(
                        self.file, f"ends before the tensor data at byte {self.offset + done} (truncated?)"
                    )
                done += got

    def mapped(self) -> torch.Tensor:
        """A contiguous tensor's bytes where they are, mapped from the page cache: checking and hashing them needs
        no copy. Private (copy-on-write) so the tensor is writable without ever writing the file."""
        start = self.offset - self.offset % mmap.ALLOCATIONGRANULARITY
        with open(self.file, "rb") as f:
            if os.fstat(f.fileno()).st_size < self.offset + self.nbytes:
                raise InputError(
                    self.file, f"ends before the tensor data at byte {self.offset + self.nbytes} (truncated?)"
                )
            region = mmap.mmap(f.fileno(), self.offset + self.nbytes - start, offset=start, access=mmap.ACCESS_COPY)
        region.madvise(mmap.MADV_SEQUENTIAL)
        data = torch.frombuffer(region, dtype=torch.uint8, count=self.nbytes, offset=self.offset - start)
        return data.view(self.dtype).view(self.shape)

    def mapped_pieces(self) -> Iterator[torch.Tensor]:
        """The elements in order, as 1-D mapped tensors (one here)."""
        yield self.mapped().view(-1)

    def load(self, buffer: torch.Tensor | None = None) -> torch.Tensor:
        """The tensor, read into `buffer` (uint8, at least nbytes) when given: reusing memory avoids the page
        faults of a fresh allocation, which cost more than the read itself."""
        if self.stride is None or self.stride == contiguous_stride(self.shape):
            out = _destination(buffer, self.numel, self.dtype)
            self.read_into(out.view(torch.uint8))
            return out.view(self.shape)
        flat = LazyTensor(self.file, self.offset, self.dtype, (storage_span(self.shape, self.stride),)).load()
        return flat.as_strided(self.shape, self.stride).clone()


@dataclass(frozen=True)
class GatheredTensor(Sized):
    """A tensor whose elements are the concatenation of `parts` (1-D), cut to `shape` (ZeRO partitions)."""

    parts: tuple[LazyTensor, ...]
    shape: tuple[int, ...]

    @property
    def dtype(self) -> torch.dtype:
        return self.parts[0].dtype

    @property
    def file(self) -> Path:
        return self.parts[0].file

    def mapped_pieces(self) -> Iterator[torch.Tensor]:
        """The elements in order, as 1-D mapped tensors, one per part, without the padding after the last."""
        remaining = self.numel
        for part in self.parts:
            if remaining and part.numel:
                piece = part.mapped()[:remaining]
                remaining -= piece.numel()
                yield piece

    def load(self, buffer: torch.Tensor | None = None) -> torch.Tensor:
        flat = _destination(buffer, sum(p.numel for p in self.parts), self.dtype)
        start = 0
        for part in self.parts:
            part.read_into(flat[start : start + part.numel].view(torch.uint8))
            start += part.numel
        return flat[: self.numel].view(self.shape)


@dataclass(frozen=True, eq=False)
class LoadedTensor(Sized):
    """A tensor already in memory, behind the same interface (legacy torch files cannot be read lazily)."""

    tensor: torch.Tensor
    file: Path

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype

    def load(self, buffer: torch.Tensor | None = None) -> torch.Tensor:
        return self.tensor


def _destination(buffer: torch.Tensor | None, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A flat tensor of `numel` elements: a view of `buffer` when given, else a new allocation."""
    if buffer is None:
        return torch.empty(numel, dtype=dtype)
    return buffer[: numel * dtype.itemsize].view(dtype)


def storage_span(shape: tuple[int, ...], stride: tuple[int, ...]) -> int:
    """Elements of storage a strided tensor reaches, from its first element to its last."""
    return 1 + sum((n - 1) * s for n, s in zip(shape, stride)) if all(shape) else 0


def contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, step = [], 1
    for n in reversed(shape):
        stride.append(step)
        step *= max(n, 1)
    return tuple(reversed(stride))


def slice_flat(pieces: list[LazyTensor], start: int, length: int) -> list[LazyTensor]:
    """Elements [start, start + length) of the concatenation of contiguous 1-D `pieces`."""
    out, base = [], 0
    for piece in pieces:
        lo, hi = max(start, base), min(start + length, base + piece.numel)
        if lo < hi:
            out.append(piece.narrow(lo - base, hi - lo))
        base += piece.numel
    if sum(p.numel for p in out) != length:
        raise ValueError(f"elements [{start}, {start + length}) lie beyond the {base} stored")
    return out


# --- safetensors ----------------------------------------------------------------------------------

MAX_HEADER_BYTES = 100_000_000  # the safetensors library refuses larger headers


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _unique_keys(pairs: list) -> dict:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"key {next(k for k in keys if keys.count(k) > 1)!r} appears twice")
    return dict(pairs)


def _naturals(value, count: int | None = None) -> tuple[int, ...] | None:
    """`value` as a tuple of non-negative JSON integers (`count` of them), or None: what the safetensors library
    accepts for shapes and offsets (no booleans, floats or negative numbers)."""
    if not isinstance(value, list) or (count is not None and len(value) != count):
        return None
    if not all(type(n) is int and n >= 0 for n in value):
        return None
    return tuple(value)


def read_safetensors(file: Path) -> dict[str, LazyTensor]:
    """The tensors of a safetensors file, its header validated as the safetensors library validates it before a
    byte is used: known dtypes, non-negative integer shapes and offsets, each tensor's bytes sized by its dtype and
    shape, the byte ranges in order without gap or overlap, covering the data exactly. No data is read."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise InputError(file, f"not a safetensors file: {size} bytes, shorter than the 8-byte header length")
        header_len = struct.unpack("<Q", prefix)[0]
        if header_len > size - 8:
            raise InputError(file, f"safetensors header length {header_len} is larger than the file ({size} bytes)")
        if header_len > MAX_HEADER_BYTES:
            raise InputError(file, f"safetensors header of {header_len} bytes: the format allows {MAX_HEADER_BYTES}")
        raw = f.read(header_len)
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_keys, parse_constant=_refuse_constant)
    except (UnicodeDecodeError, ValueError) as e:
        raise InputError(file, f"safetensors header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise InputError(file, "safetensors header is not a JSON object")
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise InputError(file, "safetensors __metadata__ is not a map of strings to strings")
    data_bytes, tensors, ranges = size - 8 - header_len, {}, []
    for name, info in header.items():
        entry = info if isinstance(info, dict) else {}
        dtype = SAFETENSORS_DTYPES.get(entry.get("dtype")) if isinstance(entry.get("dtype"), str) else None
        shape, offsets = _naturals(entry.get("shape")), _naturals(entry.get("data_offsets"), 2)
        if dtype is None or shape is None or offsets is None or offsets[0] > offsets[1]:
            raise InputError(file, f"tensor {name}: malformed safetensors header entry {info!r}"[:300])
        begin, end = offsets
        tensor = LazyTensor(file, 8 + header_len + begin, dtype, shape)
        if end - begin != tensor.nbytes:
            raise InputError(
                file, f"tensor {name}: {end - begin} bytes stored for shape {list(shape)} {entry['dtype']}"
            )
        if end > data_bytes:
            raise InputError(file, f"tensor {name} extends past the end of the file ({size} bytes): truncated?")
        tensors[name] = tensor
        ranges.append((begin, end, name))
    covered = 0
    for begin, end, name in sorted(ranges):  # the bytes of the tensors, one after another, as the format requires
        if begin != covered:
            relation = (
                "overlaps the bytes of another tensor" if begin < covered else f"leaves bytes {covered}-{begin} unused"
            )
            raise InputError(file, f"tensor {name}: data_offsets [{begin}, {end}] {relation}")
        covered = end
    if covered != data_bytes:
        raise InputError(file, f"{data_bytes - covered} bytes after the last tensor belong to none (not safetensors)")
    return tensors


# --- torch.save archives ---------------------------------------------------------------------------


class UnsafePickle(Exception):
    pass


class InertObject:
    """Stands in for a DeepSpeed class (loss scaler, ZeRO stage enum, config): keeps its data, runs nothing."""

    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs

    def __setstate__(self, state):
        self.state = state

    def __int__(self):  # enums (ZeroStageEnum) are pickled as their class called with the value
        return int(self.args[0])


@functools.cache
def inert_class(module: str, name: str) -> type:
    return type(name, (InertObject,), {"__module__": module, "__qualname__": name})


@dataclass(frozen=True)
class _Storage:
    file: Path
    offset: int
    dtype: torch.dtype
    numel: int


def _ints(value, what: str) -> tuple[int, ...]:
    """A pickle's sizes, strides and offsets: non-negative ints, whatever the pickle claims them to be."""
    values = tuple(value) if isinstance(value, (tuple, list, torch.Size)) else (value,)
    if not all(type(v) is int and v >= 0 for v in values):
        raise UnsafePickle(f"a tensor's {what} {value!r} is not made of non-negative integers")
    return values


def _rebuild_tensor(storage, storage_offset, size, stride, *_ignored) -> LazyTensor:
    if not isinstance(storage, _Storage):
        raise UnsafePickle(f"a tensor is rebuilt from a {type(storage).__name__}, not from a storage of the archive")
    (storage_offset,), size, stride = _ints(storage_offset, "offset"), _ints(size, "size"), _ints(stride, "stride")
    if len(size) != len(stride):
        raise UnsafePickle(f"a tensor of size {list(size)} has strides {list(stride)}")
    span = storage_span(size, stride)
    if storage_offset + span > storage.numel:
        raise UnsafePickle(f"a tensor reaches past its storage ({storage_offset + span} > {storage.numel} elements)")
    return LazyTensor(
        storage.file, storage.offset + storage_offset * storage.dtype.itemsize, storage.dtype, size, stride
    )


def _rebuild_parameter(data, requires_grad=False, backward_hooks=None, *_ignored):
    if not isinstance(data, LazyTensor):
        raise UnsafePickle(f"a Parameter wraps a {type(data).__name__}, not a tensor")
    return data


class TensorType:
    """A tensor class a pickle names (`torch.Tensor`, `Parameter`) only to say what to rebuild: never called."""

    def __init__(self, name: str):
        self.name = name

    def __call__(self, *args, **kwargs):
        raise UnsafePickle(f"it calls {self.name}, which only a tensor rebuild may name")


TENSOR_TYPES = {
    ("torch", "Tensor"): TensorType("torch.Tensor"),
    ("torch._tensor", "Tensor"): TensorType("torch.Tensor"),
    ("torch.nn.parameter", "Parameter"): TensorType("torch.nn.parameter.Parameter"),
}


def _rebuild_from_type(func, new_type, args, state) -> LazyTensor:
    """A tensor pickled with Python attributes (DeepSpeed ZeRO-3 partitions carry `ds_id`): read as the plain
    tensor; the attributes are checked to be a plain dict and then dropped, never set on anything."""
    if func is not _rebuild_tensor or not isinstance(args, tuple):
        raise UnsafePickle(f"_rebuild_from_type_v2 rebuilds with {getattr(func, '__name__', func)!r}, not a tensor")
    if not any(new_type is t for t in TENSOR_TYPES.values()):
        raise UnsafePickle(f"_rebuild_from_type_v2 makes a {new_type!r}, not a plain tensor or Parameter")
    if type(state) is not dict or not all(type(k) is str for k in state):
        raise UnsafePickle(f"_rebuild_from_type_v2 sets attributes from a {type(state).__name__}, not a plain dict")
    return func(*args)


SAFE_GLOBALS = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type,
    **TENSOR_TYPES,
    ("torch", "Size"): torch.Size,
    ("builtins", "set"): set,
    ("__builtin__", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("__builtin__", "frozenset"): frozenset,
}


class _LazyUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, file: Path, storages: dict[str, tuple[int, int]]):
        super().__init__(io.BytesIO(data))
        self.file, self.storages = file, storages  # key -> (byte offset, bytes) of each storage

    def find_class(self, module: str, name: str):
        if (module, name) in SAFE_GLOBALS:
            return SAFE_GLOBALS[module, name]
        if module == "torch" and name in STORAGE_DTYPES:
            return STORAGE_DTYPES[name]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module.split(".")[0] == "deepspeed":
            return inert_class(module, name)
        raise UnsafePickle(f"it references {module}.{name}, which is not a tensor or a known checkpoint class")

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5):
            raise UnsafePickle(f"unexpected storage reference {pid!r}"[:200])
        kind, dtype, key, _location, numel = pid
        if kind != "storage" or not isinstance(dtype, torch.dtype) or key not in self.storages:
            raise UnsafePickle(f"unexpected storage reference {pid!r}"[:200])
        (numel,), (offset, stored) = _ints(numel, "storage size"), self.storages[key]
        if numel * dtype.itemsize > stored:
            raise UnsafePickle(f"storage {key} claims {numel * dtype.itemsize} bytes, the archive holds {stored}")
        return _Storage(self.file, offset, dtype, numel)


ZIP_LOCAL_HEADER = b"PK\x03\x04"


def _member_data(raw, info: zipfile.ZipInfo, size: int) -> tuple[int, int]:
    """Where a stored (uncompressed) member's bytes lie, after its local file header: (offset, length), checked to
    be inside the file."""
    raw.seek(info.header_offset)
    local = raw.read(30)
    if len(local) < 30 or local[:4] != ZIP_LOCAL_HEADER:
        raise UnsafePickle(f"the archive's entry {info.filename} has no local header where its directory says")
    name_len, extra_len = struct.unpack("<HH", local[26:30])
    offset = info.header_offset + 30 + name_len + extra_len
    if offset + info.file_size > size:
        raise UnsafePickle(f"the archive's entry {info.filename} ends past the end of the file (truncated?)")
    return offset, info.file_size


LEGACY_MAGIC = 0x1950A86A20F9469CFC6C  # first pickle of a pre-1.6 torch.save file


def read_torch_file(file: Path):
    """Unpickle a torch.save file with tensors as LazyTensor; refuses anything but data and known classes."""
    try:
        with open(file, "rb") as raw:
            if not zipfile.is_zipfile(raw):
                return _read_non_zip(file, raw)
            size = os.fstat(raw.fileno()).st_size
            with zipfile.ZipFile(raw) as archive:
                pickles = [i for i in archive.infolist() if i.filename.endswith("data.pkl")]
                if not pickles:
                    raise InputError(file, "is a zip archive without data.pkl: not a torch.save file")
                prefix = pickles[0].filename[: -len("data.pkl")]
                storages = {}
                for info in archive.infolist():
                    if info.filename.startswith(prefix + "data/"):
                        if info.compress_type != zipfile.ZIP_STORED:
                            raise InputError(file, f"{info.filename} is compressed: not a torch.save file")
                        storages[info.filename[len(prefix) + 5 :]] = _member_data(raw, info, size)
                return _LazyUnpickler(archive.read(pickles[0]), file, storages).load()
    except UnsafePickle as e:
        raise InputError(file, f"refused to unpickle: {e}") from None
    except (zipfile.BadZipFile, zlib.error) as e:
        raise InputError(file, f"is a damaged zip archive ({e})") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, RuntimeError, IndexError, KeyError) as e:
        raise InputError(file, f"not a readable PyTorch file ({type(e).__name__}: {first_line(e)})") from None


def first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [""])[0][:200]


def _read_non_zip(file: Path, raw):
    """A plain pickle goes through the restricted unpickler (which refuses code); a legacy (pre-1.6) torch
    file, recognised by its magic number, through torch's own weights-only loader, eagerly."""
    raw.seek(0)
    if raw.read(4) == ZIP_LOCAL_HEADER:  # a zip archive whose central directory, at its end, is gone
        raise InputError(file, "is a zip archive without its end (truncated?): not a readable torch.save file")
    raw.seek(0)
    first = _LazyUnpickler(raw.read(), file, {}).load()
    if first != LEGACY_MAGIC:
        raise InputError(file, "is a plain pickle without tensors, not a torch.save file")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            state = torch.load(file, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:  # torch's message advises weights_only=False: we never do that
            reason = next((line for line in str(e).splitlines() if "Unsupported" in line), first_line(e))
            reason = reason.split("WeightsUnpickler error:")[-1].strip().split(" was not an allowed")[0]
            raise InputError(file, f"refused to unpickle a legacy (pre-1.6) torch file: {reason}") from None
    if isinstance(state, dict):
        state = {k: LoadedTensor(v, file) if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    return state
