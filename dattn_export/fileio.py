"""Atomic output folders: everything is written next to the target and renamed into place at the end."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .errors import InputError


@contextmanager
def atomic_dir(final: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield an empty temporary folder beside `final`; on success it replaces `final`, on any failure
    (exception, Ctrl-C) it is removed. A run killed outright leaves only a hidden `.NAME.partial-*`
    folder, which the next run for the same target removes."""
    final = Path(final).absolute()
    if final.exists() and not overwrite:
        raise InputError(final, "already exists (pass --force to replace it)")
    final.parent.mkdir(parents=True, exist_ok=True)
    for stale in final.parent.glob(f".{final.name}.partial-*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.partial-", dir=final.parent))
    try:
        yield tmp
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
