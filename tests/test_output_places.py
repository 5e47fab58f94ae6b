"""Where output goes: another filesystem than the checkpoint's (the kernel copy cannot cross it: an ordinary copy,
the same bytes and hashes), a disk too small (refused before writing, with the figures), a disk that fills up while
writing, a read-only one, no permission, and errors that are not the user's (a Hub that keeps failing, a bug of
ours), each with its exit code.

The other filesystems are real: a tmpfs mounted in a private mount namespace (`unshare --map-root-user --mount`,
util-linux; CI's machines allow user namespaces), so the test needs no privilege and leaves no mount behind."""

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.checks import assert_converted_equals
from helpers.cli import cli_command
from helpers.hub_server import start

from dattn_export.checkpoints.source import load_model, saved_state_dict
from dattn_export.demo_model import write_demo_checkpoint

UNSHARE = shutil.which("unshare")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_demo_checkpoint(tmp_path_factory.mktemp("places") / "checkpoint")


def on_tmpfs(mount: Path, size: str, command: list, read_only: bool = False, cwd: Path | None = None):
    """Run `command` with a fresh tmpfs of `size` at `mount` (read-only when asked), in a mount namespace of its own."""
    if UNSHARE is None:
        pytest.skip("util-linux's unshare is not installed: the test mounts its own tmpfs with it")
    mount.mkdir(parents=True, exist_ok=True)
    steps = [f"mount -t tmpfs -o size={size} tmpfs {shlex.quote(str(mount))}"]
    if read_only:
        steps.append(f"mount -o remount,ro {shlex.quote(str(mount))}")
    script = " && ".join([*steps, shlex.join(map(str, command))])
    return subprocess.run(
        [UNSHARE, "--map-root-user", "--mount", "sh", "-c", script],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**os.environ, "COLUMNS": "250"},  # the summary table's lines unwrapped
    )


def one_line(result, code: int) -> str:
    """The error's line: the last on stderr, the only one that is an error (progress lines of work done before a
    failure mid-way may precede it), no traceback."""
    lines = result.stderr.strip().splitlines()
    assert result.returncode == code, (result.returncode, result.stdout, result.stderr)
    assert [line for line in lines if line.startswith("Error: ")] == lines[-1:], result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    return lines[-1]


@pytest.mark.slow
def test_output_on_another_filesystem_converts_and_verifies(checkpoint, tmp_path):
    """The checkpoint on this disk, OUT on a tmpfs: copy_file_range answers EXDEV, the bytes are read and written
    instead, hashed the same way, and the folder verifies bit for bit against the checkpoint."""
    mount, out = tmp_path / "other-fs", tmp_path / "other-fs" / "converted"
    steps = [
        cli_command("convert", checkpoint, "-o", out),
        cli_command("verify", out, "--against", checkpoint),
        [sys.executable, "-c", CHECK_CONVERTED, out, checkpoint],  # the folder lives as long as the mount
    ]
    result = on_tmpfs(mount, "64m", ["sh", "-c", " && ".join(shlex.join(map(str, step)) for step in steps)])
    assert result.returncode == 0, result.stderr
    assert "read and written (copy_file_range: EXDEV, another filesystem)" in result.stdout, result.stdout
    assert "FAILED" not in result.stdout and "the converted tensors equal the checkpoint's" in result.stdout


CHECK_CONVERTED = f"""
import sys
from pathlib import Path
sys.path.insert(0, {str(Path(__file__).parent)!r})
from helpers.checks import assert_converted_equals
from helpers.cli import cli_command
from dattn_export.checkpoints.source import load_model, saved_state_dict
assert_converted_equals(Path(sys.argv[1]), saved_state_dict(load_model(sys.argv[2])))
print("the converted tensors equal the checkpoint's")
"""


def test_same_filesystem_copies_in_the_kernel(checkpoint, tmp_path):
    env = {**os.environ, "COLUMNS": "250"}
    result = subprocess.run(
        cli_command("convert", checkpoint, "-o", tmp_path / "out"), capture_output=True, text=True, env=env
    )
    assert result.returncode == 0 and "in the kernel (copy_file_range)" in result.stdout, result.stdout
    assert_converted_equals(tmp_path / "out", saved_state_dict(load_model(checkpoint)))


def test_disk_too_small_is_refused_before_writing(checkpoint, tmp_path):
    mount = tmp_path / "small"
    result = on_tmpfs(
        mount, "256k", cli_command("convert", checkpoint, "-o", mount / "out") + ["--max-shard-size", "100kB"]
    )
    line = one_line(result, 3)
    assert "needs about" in line and "for the output but its disk has" in line and "free" in line, line
    assert str(mount) in line


def test_disk_filling_up_while_writing(checkpoint, tmp_path):
    """analyze's plots have no size known in advance: the disk fills while writing them."""
    mount = tmp_path / "tiny"
    command = cli_command(
        "analyze", checkpoint, "--image", checkpoint / "demo.png", "--raw-prompt", "a <image> b", "-o"
    )
    result = on_tmpfs(mount, "24k", command + [mount / "report"])
    line = one_line(result, 3)
    assert "the disk filled up while writing" in line and str(mount / "report") in line, line
    assert ".partial-" not in line


def test_read_only_output(checkpoint, tmp_path):
    mount = tmp_path / "ro"
    result = on_tmpfs(mount, "8m", cli_command("convert", checkpoint, "-o", mount / "out"), read_only=True)
    line = one_line(result, 3)
    assert "read-only file system" in line and str(mount) in line, line


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere: the permission check needs another user")
def test_output_without_permission(checkpoint, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    result = subprocess.run(cli_command("convert", checkpoint, "-o", locked / "out"), capture_output=True, text=True)
    assert "permission denied" in one_line(result, 3)


def test_permission_denied_as_another_user(checkpoint, tmp_path):
    """As root (CI), the same check as user `nobody`: the folder is not writable for them."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and util-linux's setpriv to run as another user")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    tmp_path.chmod(0o755)
    for parent in tmp_path.parents:  # pytest's folders are private to root: let nobody reach the checkpoint
        if parent.stat().st_mode & 0o005 != 0o005 and str(parent).startswith(("/tmp", "/var")):
            parent.chmod(parent.stat().st_mode | 0o005)
    write_demo_checkpoint(tmp_path / "ckpt")  # its tower folders beside it, in tmp_path/towers
    env = {**os.environ, "HOME": str(tmp_path), "HF_HOME": str(tmp_path / "hf")}
    command = [
        "setpriv",
        "--reuid=nobody",
        "--regid=nogroup",
        "--clear-groups",
        *cli_command("info", tmp_path / "ckpt"),
    ]
    probe = subprocess.run(command, capture_output=True, text=True, env=env)
    if probe.returncode != 0:
        pytest.skip(f"user nobody cannot run this environment here ({probe.stderr.strip()[-200:]})")
    command[-2:] = ["convert", str(tmp_path / "ckpt"), "-o", str(locked / "out")]
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    line = one_line(result, 3)
    assert "permission denied" in line and str(locked) in line, line


def test_a_bug_of_ours_is_exit_1_with_a_line_asking_for_the_traceback(checkpoint):
    """Any exception that is neither the input's nor the environment's: exit 1, one line naming it and asking for
    the traceback, which DATTN_DEBUG=1 shows."""
    script = (
        "import sys\nfrom dattn_export.stages import info\n"
        "info.describe = lambda *a, **k: {}['no such key']\n"
        "from dattn_export.__main__ import run\nsys.argv = ['dattn-export', 'info', sys.argv[1]]\nrun()"
    )
    result = subprocess.run([sys.executable, "-c", script, checkpoint], capture_output=True, text=True)
    line = one_line(result, 1)
    assert "internal error (KeyError: 'no such key')" in line and "DATTN_DEBUG=1" in line, line
    debug = subprocess.run(
        [sys.executable, "-c", script, checkpoint],
        capture_output=True,
        text=True,
        env={**os.environ, "DATTN_DEBUG": "1"},
    )
    assert debug.returncode != 0 and "Traceback" in debug.stderr and "KeyError" in debug.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    "fault, token, code, expected",
    [
        (500, "hf_token", 3, "server error"),  # a Hub that keeps failing: the environment's
        (503, "hf_token", 3, "server error"),
        ("drop", "hf_token", 3, "network error"),
        (None, "hf_wrong", 2, "401 authentication failed"),  # a wrong token: the input's
    ],
)
def test_hub_failures_say_whose_they_are(checkpoint, tmp_path, fault, token, code, expected):
    """After the retries, a Hub that keeps answering 5xx or drops the connection is exit 3, a refused token exit 2;
    nothing is published either way."""
    from dattn_export.stages.convert import convert

    convert(checkpoint, tmp_path / "converted")
    server, state, endpoint = start({"hf_token": "alice"})
    try:
        if fault is not None:
            state.fail("POST", r"/api/repos/create", fault, times=-1)
        env = {**os.environ, "HF_ENDPOINT": endpoint, "HF_HUB_DISABLE_XET": "1", "HF_TOKEN": token}
        env["HF_HOME"] = str(tmp_path / "hf")
        result = subprocess.run(
            cli_command("push", tmp_path / "converted", "--repo-id", "alice/x"), capture_output=True, text=True, env=env
        )
    finally:
        server.shutdown()
    line = one_line(result, code)
    assert expected in line and "hf_token" not in line, line
    assert not state.repos, "something was published"
