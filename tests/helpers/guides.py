"""The documentation's command blocks, run as a user runs them: the README's set-up line, its quickstart and getting
started's blocks once per test run on a fresh clone (shared by the xdist workers), and each guide's blocks in a copy
of the folder they leave."""

import os
import re
import shutil
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


def runnable_with_output(page: Path) -> list[tuple[str, str | None]]:
    """The page's runnable blocks, each with what it prints where the page shows it: a ```text block right after."""
    fences = re.findall(r"```(bash|text)\n(.*?)```", page.read_text(), re.S)
    pairs = []
    for number, (kind, block) in enumerate(fences):
        if kind == "bash" and not block.startswith(NOT_RUN):
            shown = fences[number + 1] if number + 1 < len(fences) else ("", "")
            pairs.append((block, shown[1] if shown[0] == "text" else None))
    return pairs


def assert_printed(shown: str, printed: str) -> None:
    """Each line a page shows is a line the command printed ("..." standing for what the page leaves out)."""
    lines = printed.splitlines()
    for line in filter(str.strip, shown.splitlines()):
        pattern = re.compile(".*".join(map(re.escape, line.split("..."))))
        assert any(pattern.fullmatch(got) for got in lines), f"not printed: {line!r}\n{printed[-3000:]}"


def readme_blocks() -> dict[str, str]:
    """The README's command blocks by what they are: its set-up line and test command (the two commands on a fresh
    machine), its quickstart."""
    readme = (ROOT / "README.md").read_text()
    fresh, quickstart = readme.split("## Two commands on a fresh machine")[1], readme.split("## Quickstart")[1]
    setup, tests = re.findall(r"```bash\n(.*?)```", fresh, re.S)[:2]
    return {"setup": setup, "tests": tests, "quickstart": re.search(r"```bash\n(.*?)```", quickstart, re.S).group(1)}


def run_block(
    block: str, cwd: Path, log: Path | None = None, bin_dir: Path | None = None, environment: dict | None = None
) -> subprocess.CompletedProcess:
    """One block through `bash -e` in `environment` (default: this process's), `bin_dir` (default: this
    environment's commands) first on PATH; with `log`, each command's output kept there (COMMAND_NUMBER.out / .err)."""
    bin_dir, environment = bin_dir or Path(sys.executable).parent, environment or dict(os.environ)
    env = {**environment, "PATH": f"{bin_dir}{os.pathsep}{environment['PATH']}"}
    run = dict(cwd=cwd, capture_output=True, text=True, env=env, timeout=BLOCK_TIMEOUT_S)
    if log is None:
        result = subprocess.run(["bash", "-e", "-c", block], **run)
        assert result.returncode == 0, f"{block}\n{result.stdout[-3000:]}{result.stderr[-3000:]}"
        return result
    log.mkdir(parents=True, exist_ok=True)
    commands = [line for line in joined_lines(block) if line.strip() and not line.startswith("#")]
    for number, command in enumerate(commands):
        result = subprocess.run(["bash", "-e", "-c", command], **run)
        (log / f"{number}.out").write_text(result.stdout)
        (log / f"{number}.err").write_text(result.stderr)
        assert result.returncode == 0, f"{command}\n{result.stdout[-3000:]}{result.stderr[-3000:]}"
    return result


def joined_lines(block: str) -> list[str]:
    """A block's commands, a line ending in a backslash joined with the next."""
    return block.replace("\\\n", " ").splitlines()


def fresh_clone(work: Path, environment: dict | None = None) -> None:
    """The repository's files as a clean clone of this working tree holds them: tracked, and new files that git does
    not ignore (CI runs on a clean clone, where the two are the same)."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True,
                            env=environment)  # fmt: skip
    for name in filter(None, listed.stdout.decode().split("\0")):
        if (ROOT / name).is_file():  # not one deleted in the working tree
            (work / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, work / name)


def run_the_docs_pipeline(shared_root: Path, environment: dict | None = None) -> Path:
    """On a fresh clone, as a new user runs them, by the first worker that asks: the README's set-up line as written
    (a venv of the clone's own, the install, the demo), its quickstart, then every block of getting started that
    runs here, with the clone's venv first on PATH as the set-up line leaves a shell; the commands in `environment`
    (default: this process's). Each command's output is kept in commands/setup, commands/quickstart and
    commands/getting-started-N. Returns the clone."""
    work = shared_root / "pipeline"
    with FileLock(f"{work}.lock"):
        if not (work / "done").is_file():
            shutil.rmtree(work, ignore_errors=True)
            work.mkdir()
            fresh_clone(work, environment)
            blocks = readme_blocks()
            run_block(blocks["setup"], work, log=work / "commands" / "setup", environment=environment)
            venv = work / ".venv" / "bin"
            run_block(blocks["quickstart"], work, log=work / "commands" / "quickstart", bin_dir=venv,
                      environment=environment)  # fmt: skip
            for number, block in enumerate(runnable(ROOT / "docs" / "getting-started.md")):
                log = work / "commands" / f"getting-started-{number}"
                run_block(block, work, log=log, bin_dir=venv, environment=environment)
            (work / "done").touch()
    return work
