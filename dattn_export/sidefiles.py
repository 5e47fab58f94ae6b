"""The files beside the weights (configs, indexes, manifests, tokenizers, generation and genai configs, images): one
guard for reading any of them, so that a cut, empty or foreign file is one line naming it and the problem. Imports
nothing heavy: commands check their inputs with it before torch is loaded."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .errors import OUTPUT_ERRNOS, PATH_ERRNOS, DattnError, InputError, from_os_error


@contextmanager
def reading(path: str | Path, what: str) -> Iterator[None]:
    """Whatever fails while `path` is read (parsed, decoded) becomes one line naming it: `what` says what the file
    should have been. Missing files and unreadable places keep their own line."""
    try:
        yield
    except (DattnError, MemoryError):
        raise
    except OSError as e:
        if e.errno in PATH_ERRNOS or e.errno in OUTPUT_ERRNOS:
            raise from_os_error(e, path) from None
        raise InputError(path, f"not a readable {what} ({first_line(e)})") from None
    except Exception as e:  # noqa: BLE001  (a parser's own exception types: whatever it raises, the file is bad)
        raise InputError(path, f"not a readable {what} ({type(e).__name__}: {first_line(e)})") from None


def first_line(error: BaseException) -> str:
    return " ".join((str(error).strip().splitlines() or [""])[0].split())[:200]


def read_json(path: str | Path, what: str = "JSON object") -> dict:
    """A JSON object from `path` (duplicate keys: the last one, as Python's json)."""
    path = Path(path)
    with reading(path, what):
        value = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(value, dict):
        raise InputError(path, f"is not a {what} (a JSON {type(value).__name__})")
    return value
