"""The documentation's command blocks, run as a user runs them: getting started's pipeline once per test run (shared
by the xdist workers), and each guide's blocks in a copy of the folder it leaves."""

import os
import re
import subprocess
import sys
from pathlib import Path

from filelock import FileLock

ROOT = Path(__file__).resolve().parents[2]
NOT_RUN = ("# needs ", "# run by ")  # a block's first line that says why the tests do not run it
BLOCK_TIMEOUT_S = 600  # a block that does not end (a server started without "# needs ...") fails, not hangs the run


def bash_blocks(page: Path) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", page.read_text(), re.S)


def runnable(page: Path) -> list[str]:
    """The page's blocks that the tests run; the others say why not on their first line."""
    return [block for block in bash_blocks(page) if not block.startswith(NOT_RUN)]


def run_block(block: str, cwd: Path, log: Path | None = None) -> subprocess.CompletedProcess:
    """One block through `bash -e`, this environment's commands first on PATH; with `log`, each command's output kept
    there (COMMAND_NUMBER.out / .err)."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    run = dict(cwd=cwd, capture_output=True, text=True, env=env, timeout=BLOCK_TIMEOUT_S)
    if log is None:
        result = subprocess.run(["bash", "-e", "-c", block], **run)
        assert result.returncode == 0, f"{block}\n{result.stdout[-3000:]}{result.stderr[-3000:]}"
        return result
    log.mkdir(parents=True, exist_ok=True)
    commands = [line for line in block.splitlines() if line.strip() and not line.startswith("#")]
    for number, command in enumerate(commands):
        result = subprocess.run(["bash", "-e", "-c", command], **run)
        (log / f"{number}.out").write_text(result.stdout)
        (log / f"{number}.err").write_text(result.stderr)
        assert result.returncode == 0, f"{command}\n{result.stdout[-3000:]}{result.stderr[-3000:]}"
    return result


def run_getting_started(shared_root: Path) -> Path:
    """The pipeline block of docs/getting-started.md (its first block installs: this environment is installed), run
    by the first worker that asks, in `shared_root`/pipeline."""
    work = shared_root / "pipeline"
    with FileLock(f"{work}.lock"):
        if not (work / "done").is_file():
            install, pipeline = runnable(ROOT / "docs" / "getting-started.md")[:2]
            assert install.startswith("python3 -m venv") and "pip install torch==2.13.0 -e ." in install
            work.mkdir(exist_ok=True)
            run_block(pipeline, work, log=work / "commands")
            (work / "done").touch()
    return work
