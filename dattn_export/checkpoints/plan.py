"""The per-tensor plan shared by `convert` and by building the reference model: every value is checked (no NaN/Inf;
within fp16's range when cast to fp16) and cast on its way out, and bytes that need no cast are copied as they lie."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import torch

from ..errors import InputError
from .lazy import GatheredTensor, LazyTensor, contiguous_stride
from .registry import Lazy
from .safetensors_writer import PlannedTensor

FP16_MAX = torch.finfo(torch.float16).max


def check_values(stored_name: str, file: Path, tensor: torch.Tensor, dtype: torch.dtype) -> None:
    """Refuse NaN/Inf, and values beyond fp16's range when casting to fp16."""
    if not tensor.is_floating_point() or not tensor.numel():
        return
    low, high = torch.aminmax(tensor)  # one pass, no temporary; NaN and Inf surface here
    if not (torch.isfinite(low) and torch.isfinite(high)):
        bad = int((~torch.isfinite(tensor)).sum())
        raise InputError(file, f"tensor {stored_name} has {bad} NaN/Inf value(s)")
    peak = max(-low.item(), high.item())
    if dtype == torch.float16 and tensor.dtype != torch.float16 and peak > FP16_MAX:
        raise InputError(
            file,
            f"tensor {stored_name} has max |value| {peak:.6g}, beyond fp16's {FP16_MAX:.0f}: use --dtype bf16 or fp32",
        )


def needs_cast(lazy: Lazy, dtype: torch.dtype) -> bool:
    """Floating-point tensors take `dtype`; others keep theirs."""
    return lazy.dtype.is_floating_point and lazy.dtype != dtype


def cast_scratch(tensors, dtype: torch.dtype) -> Callable[[], torch.Tensor]:
    """A uint8 buffer for the largest of `tensors` that `checked_cast` reads in its own dtype before casting, one per
    thread (shards are written in parallel), made when a thread first asks for it."""
    size, local = max((t.nbytes for t in tensors if needs_cast(t, dtype)), default=0), threading.local()

    def scratch() -> torch.Tensor:
        if not hasattr(local, "buffer"):
            local.buffer = torch.empty(size, dtype=torch.uint8)
        return local.buffer

    return scratch


def checked_cast(
    stored_name: str,
    lazy: Lazy,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
    scratch: torch.Tensor | None = None,
) -> torch.Tensor:
    """Load one tensor, refuse NaN/Inf and values the target dtype cannot hold, cast. With buffers (uint8),
    the result lands in `out` and a tensor that needs a cast is read into `scratch` first."""
    casting = needs_cast(lazy, dtype)
    tensor = lazy.load(scratch if casting else out)
    check_values(stored_name, lazy.file, tensor, dtype)
    if not casting:
        return tensor
    if out is None:
        return tensor.to(dtype)
    return out[: tensor.numel() * dtype.itemsize].view(dtype).view(tensor.shape).copy_(tensor)


def lazy_is_contiguous(lazy: Lazy) -> bool:
    """Its bytes lie in one run of its file, in order: they can be copied as they are."""
    return isinstance(lazy, LazyTensor) and lazy.stride in (None, contiguous_stride(lazy.shape))


def mappable(lazy: Lazy) -> bool:
    """Its elements can be read in order, mapped where they lie (`mapped_pieces`)."""
    return bool(lazy.nbytes) and (isinstance(lazy, GatheredTensor) or lazy_is_contiguous(lazy))


def checked_chunks(stored_name: str, lazy: Lazy, dtype: torch.dtype, elements: int) -> Iterator[torch.Tensor]:
    """The tensor's elements in order, `elements` at a time (1-D, the last one shorter), each checked and cast on
    its own from where it lies: a table of any size needs the memory of one chunk."""
    if not mappable(lazy):
        yield from checked_cast(stored_name, lazy, dtype).view(-1).split(elements)
        return
    pending, held = [], 0
    for piece in lazy.mapped_pieces():
        while piece.numel():
            taken = piece[: elements - held]
            pending.append(taken)
            held, piece = held + taken.numel(), piece[taken.numel() :]
            if held == elements:
                yield _checked_chunk(stored_name, lazy, dtype, pending)
                pending, held = [], 0
    if pending:
        yield _checked_chunk(stored_name, lazy, dtype, pending)


def _checked_chunk(stored_name: str, lazy: Lazy, dtype: torch.dtype, pieces: list[torch.Tensor]) -> torch.Tensor:
    chunk = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
    check_values(stored_name, lazy.file, chunk, dtype)
    return chunk.to(dtype if needs_cast(lazy, dtype) else lazy.dtype, copy=True)  # never a view of the mapped file


def checked_in_place(stored_name: str, lazy: LazyTensor) -> torch.Tensor:
    """A tensor the output stores as it is: checked where it lies in its file (mapped, never copied to memory)."""
    tensor = lazy.mapped()
    check_values(stored_name, lazy.file, tensor, lazy.dtype)
    return tensor


def checked_cast_mapped(
    stored_name: str,
    lazy: LazyTensor | GatheredTensor,
    dtype: torch.dtype,
    out: torch.Tensor,
    start: int = 0,
    stop: int | None = None,
) -> torch.Tensor:
    """A tensor that needs a cast, or elements [start, stop) of it flattened (1-D): checked and cast piece by piece
    from where they lie (mapped) into `out`."""
    stop = lazy.numel if stop is None else stop
    cast, at = out[: (stop - start) * dtype.itemsize].view(dtype), 0
    for piece in lazy.mapped_pieces():
        low, high = max(start, at), min(stop, at + piece.numel())
        if low < high:
            check_values(stored_name, lazy.file, piece[low - at : high - at], dtype)
            cast[low - start : high - start].copy_(piece[low - at : high - at])
        at += piece.numel()
        if at >= stop:
            break
    return cast.view(lazy.shape) if (start, stop) == (0, lazy.numel) else cast


def plan_tensors(tensors: dict[str, Lazy], stored_names: dict[str, str], target: torch.dtype) -> list[PlannedTensor]:
    """How each tensor reaches the output in `target` (floating-point tensors; others keep their dtype): bytes that
    need no cast are copied in the kernel and checked where they lie; casts read mapped pieces (a range at a time
    when large, `PIECE_BYTES`), or (strided or in-memory tensors) are loaded through a scratch buffer."""
    scratch = cast_scratch([t for t in tensors.values() if not mappable(t)], target)  # one per producer thread
    planned = []
    for name, lazy in tensors.items():
        stored_name = stored_names[name]
        casting = needs_cast(lazy, target)
        out_dtype = target if casting else lazy.dtype
        produce_range = None
        if not casting and lazy_is_contiguous(lazy) and lazy.nbytes:  # the bytes as they are
            produce, copy_from = lambda _, n=stored_name, t=lazy: checked_in_place(n, t), (lazy.file, lazy.offset)
        elif casting and mappable(lazy):  # the whole tensor, or a range of it (`start`, `stop`)
            produce = produce_range = partial(checked_cast_mapped, stored_name, lazy, out_dtype)
            copy_from = None
        else:
            produce, copy_from = (
                lambda out, n=stored_name, t=lazy, d=out_dtype: checked_cast(n, t, d, out, scratch()),
                None,
            )
        planned.append(PlannedTensor(name, out_dtype, tuple(lazy.shape), produce, copy_from, produce_range))
    return planned
