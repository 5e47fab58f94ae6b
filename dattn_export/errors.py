"""What goes wrong, whose problem it is, and the one line the CLI prints for it.

Every failure a user can meet ends as one line and an exit code that says whose it is (`EXIT_CODES`):
  2  the input: a file, a folder or an option the user gave (`InputError`);
  3  the environment: the Hub or the network, the disk, memory, a missing dependency or device (`EnvironmentFailure`);
  1  a bug of ours: any other exception, with a line asking for the traceback (`DATTN_DEBUG=1` shows it).
"""

from __future__ import annotations

import errno
from pathlib import Path

INPUT, ENVIRONMENT, BUG = 2, 3, 1
INTERRUPTED = 130  # the shell's code for Ctrl-C


class DattnError(Exception):
    """One line: `path: problem`."""

    exit_code = BUG

    def __init__(self, path: str | Path, problem: str):
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


class InputError(DattnError):
    """The user's input is unusable: `path` names the file, folder or option, `problem` says what is wrong."""

    exit_code = INPUT


class EnvironmentFailure(DattnError):
    """Not the input: a service (the Hub, the network), the machine (disk space, memory, permissions of the output's
    place), or a dependency or device this command needs."""

    exit_code = ENVIRONMENT


# OSErrors about where output goes: the machine's, not the input's (the path is named in the line)
OUTPUT_ERRNOS = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
}
# OSErrors about a path the user chose: theirs
PATH_ERRNOS = {
    errno.ENOTDIR: "a part of this path is a file, not a folder",
    errno.EEXIST: "already exists",
    errno.ENAMETOOLONG: "the name is too long",
    errno.ELOOP: "a symbolic link loop",
    errno.ENOENT: "does not exist",
    errno.EISDIR: "is a folder, not a file",
}


def from_os_error(error: OSError, fallback: str | Path = "") -> DattnError:
    """An OSError as one line naming its path: a path the user chose is an input error, the rest the environment's."""
    path = error.filename or fallback
    if error.errno in PATH_ERRNOS:
        return InputError(path, PATH_ERRNOS[error.errno])
    reason = OUTPUT_ERRNOS.get(error.errno) or (error.strerror or str(error)).strip()
    return EnvironmentFailure(path or "I/O", reason)


def one_line(error: BaseException) -> tuple[int, str]:
    """The exit code and the line for any exception (the one table the CLI uses)."""
    from .modeling.media_files import MediaError  # the decoders a Hub repo ships raise it: a file of the user's

    if isinstance(error, DattnError):
        return error.exit_code, str(error)
    if isinstance(error, MediaError):
        return INPUT, str(error)
    if isinstance(error, KeyboardInterrupt):
        return INTERRUPTED, "interrupted: nothing was left half-written"
    if isinstance(error, MemoryError):
        return ENVIRONMENT, "out of memory: the machine has too little free memory for this command (see `info`)"
    if isinstance(error, OSError):
        return one_line(from_os_error(error))
    detail = " ".join(str(error).split())[:300]
    return BUG, (
        f"internal error ({type(error).__name__}: {detail}): a bug in dattn-export; rerun with DATTN_DEBUG=1 and "
        "report the traceback"
    )
