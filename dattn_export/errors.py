"""Errors the CLI reports as one line naming the file, with exit code 2 and no traceback."""

from __future__ import annotations

from pathlib import Path


class InputError(Exception):
    """The user's input is unusable: `path` names the file or folder, `problem` says what is wrong."""

    def __init__(self, path: str | Path, problem: str):
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")
