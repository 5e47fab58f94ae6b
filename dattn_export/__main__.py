"""The process around the CLI: `dattn-export` and `python -m dattn_export`."""

import atexit
import os
import sys

from . import memory
from .cli import main


def run() -> None:
    """The console entry point: freed memory given back at once (`memory.return_freed_blocks`), `main`, then a quick
    exit. Tearing down torch's and transformers' modules takes over a second and does nothing for a finished command,
    so after the exit handlers and a flush of the output streams the process ends without it."""
    code = 0
    memory.return_freed_blocks()
    try:
        main()
    except SystemExit as e:
        code = e.code
    if not isinstance(code, int):  # None: success; a string is printed, as sys.exit does
        if code is not None:
            print(code, file=sys.stderr)
        code = 0 if code is None else 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run()
