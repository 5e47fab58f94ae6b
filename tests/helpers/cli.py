"""The CLI as a user runs it: a real subprocess."""

import subprocess
import sys


def run_cli(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "dattn_export", *map(str, args)], capture_output=True, text=True, cwd=cwd, timeout=300
    )
