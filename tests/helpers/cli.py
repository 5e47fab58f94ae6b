"""The CLI as a user runs it: a real subprocess."""

import re
import subprocess
import sys


def run_cli(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "dattn_export", *map(str, args)], capture_output=True, text=True, cwd=cwd, timeout=300
    )


# what a command prints on stderr in a log besides its error: a line for each step, graph or engine done
PROGRESS = re.compile(r"(done .* \([\d.]+ s\)|[\w ,()'-]+: [\d.,]+ [\w ]*?of [\d.,]+ .*\(\d+%\).*)")


def error_line(stderr: str) -> str:
    """A failed command's error: one line, its last on stderr, with nothing before it but the progress lines of the
    steps it had done (a log has them; a terminal's progress is transient), no traceback and no other error."""
    lines = stderr.strip().splitlines()
    assert lines and lines[-1].startswith("Error: ") and "Traceback" not in stderr, stderr
    assert all(PROGRESS.fullmatch(line) for line in lines[:-1]), stderr
    return lines[-1]
