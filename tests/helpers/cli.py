"""The CLI as a user runs it: a process of its own, `python -m dattn_export`; forked from a process that has
imported torch and transformers already (`cli_forkserver.py`) where the command's environment is the one the imports
saw (what the commands read only as they run, READ_WHEN_RUN, may differ: the child sets it), started fresh otherwise."""

import atexit
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from dattn_export.memory import MEMORY_ENV

FORKSERVER = Path(__file__).with_name("cli_forkserver.py")
PER_TEST = "PYTEST_CURRENT_TEST"  # pytest names the running test in the environment; nothing imported reads it
READ_WHEN_RUN = (MEMORY_ENV,)  # what the commands read from the environment as they run, never at import


def cli_command(*args) -> list[str]:
    """A command's line as a user's shell starts it: `python -m dattn_export ARGS`."""
    return [sys.executable, "-m", "dattn_export", *map(str, args)]


def imports_see(env) -> dict:
    return {name: value for name, value in env.items() if name != PER_TEST and name not in READ_WHEN_RUN}


class ForkServer:
    """One per test process, started at its first command; not `ready` (every command then starts fresh) if the
    server did not start or its imports printed anything."""

    def __init__(self):
        self.folder = Path(tempfile.mkdtemp(prefix="dattn-cli-"))
        self.env = imports_see(os.environ)
        imports_log = self.folder / "imports.log"
        self.process = subprocess.Popen(
            [sys.executable, str(FORKSERVER), str(imports_log)], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        atexit.register(shutil.rmtree, self.folder, ignore_errors=True)
        atexit.register(self.process.kill)
        self.ready = self.reply(timeout=120) == {"ready": True} and imports_log.read_bytes() == b""

    def reply(self, timeout: float) -> dict | None:
        if not select.select([self.process.stdout], [], [], timeout)[0]:
            return None
        line = self.process.stdout.readline()
        return json.loads(line) if line else None

    def run(self, args: list[str], cwd, env: dict, timeout: float) -> subprocess.CompletedProcess:
        out, err = (self.folder / "stdout", self.folder / "stderr")
        request = {"argv": args, "cwd": str(cwd or os.getcwd()), "stdout": str(out), "stderr": str(err)}
        request["env"] = {name: env.get(name) for name in READ_WHEN_RUN}  # unset (None) or the command's value
        out.write_bytes(b"")
        err.write_bytes(b"")
        self.process.stdin.write((json.dumps(request) + "\n").encode())
        self.process.stdin.flush()
        pid = self.reply(timeout=30)["pid"]
        status = self.reply(timeout)
        if status is None:
            os.kill(pid, signal.SIGKILL)
            self.reply(timeout=30)
            raise subprocess.TimeoutExpired(cli_command(*args), timeout)
        read = lambda path: path.read_text(errors="replace")  # as text=True decodes: universal newlines
        code = os.waitstatus_to_exitcode(status["status"])
        return subprocess.CompletedProcess(cli_command(*args), code, read(out), read(err))


_server: ForkServer | None = None


def fork_server() -> ForkServer:
    global _server
    if _server is None:
        _server = ForkServer()
    return _server


def run_cli(*args, cwd=None, env=None, timeout=300) -> subprocess.CompletedProcess:
    env, server = dict(os.environ if env is None else env), fork_server()
    if server.ready and imports_see(env) == server.env:
        return server.run(list(map(str, args)), cwd, env, timeout)
    return run_fresh(*args, cwd=cwd, env=env, timeout=timeout)


def run_fresh(*args, cwd=None, env=None, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run(cli_command(*args), capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout)


# what a command prints on stderr in a log besides its error: a line for each step, graph or engine done
PROGRESS = re.compile(r"(done .* \([\d.]+ s\)|[\w ,()'-]+: [\d.,]+ [\w ]*?of [\d.,]+ .*\(\d+%\).*)")


def error_line(stderr: str) -> str:
    """A failed command's error: one line, its last on stderr, with nothing before it but the progress lines of the
    steps it had done (a log has them; a terminal's progress is transient), no traceback and no other error."""
    lines = stderr.strip().splitlines()
    assert lines and lines[-1].startswith("Error: ") and "Traceback" not in stderr, stderr
    assert all(PROGRESS.fullmatch(line) for line in lines[:-1]), stderr
    return lines[-1]
