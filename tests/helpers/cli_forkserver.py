"""A process that has imported torch, transformers and the CLI once and forks a child for each command the tests run.

A command started fresh spends about 3.5 s of its time importing torch and transformers (most of a failing command's
time); forked from here it starts at once. The child is still a process of its own, as `python -m dattn_export`
is: its own exit code, stdout and stderr (files), working folder and the same `run()` (which ends it with `os._exit`).
What a fork cannot give is what a module reads from the environment when it is imported: `helpers.cli` forks only
for a command whose environment is this server's but for the names read as a command runs (the request's "env", set in
the child), and this server serves nothing if the imports printed anything.

Protocol (a line of JSON each way): a request {"argv", "cwd", "stdout", "stderr", "env"} on stdin; the replies
{"pid"}, then {"status"} (os.waitpid's), on the stdout this process had when it started (its fds 1 and 2 are the file
named by its first argument: what the imports print)."""

import importlib
import json
import os
import pkgutil
import sys


def preload() -> None:
    """What the commands import: the model code (torch, transformers), the CLI and every stage module."""
    import dattn_export.__main__  # noqa: F401
    import dattn_export.modeling.modeling_dattn  # noqa: F401
    import dattn_export.stages as stages

    for module in pkgutil.iter_modules(stages.__path__):
        importlib.import_module(f"{stages.__name__}.{module.name}")


def child(request: dict, channel: int) -> None:
    """Become the command: its files on fds 0-2, its folder, its argv, then `run()`, which never returns."""
    from dattn_export.__main__ import run

    os.close(channel)
    for fd, path, mode in (
        (0, os.devnull, os.O_RDONLY),
        (1, request["stdout"], os.O_WRONLY),
        (2, request["stderr"], os.O_WRONLY),
    ):
        opened = os.open(path, mode)
        os.dup2(opened, fd)
        os.close(opened)
    os.chdir(request["cwd"])
    for name, value in request["env"].items():  # what the command reads as it runs (helpers.cli.READ_WHEN_RUN)
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    # as `python -m dattn_export` has them (Click names the program from both)
    sys.modules["__main__"] = sys.modules["dattn_export.__main__"]
    sys.argv = [sys.modules["__main__"].__file__, *request["argv"]]
    try:
        run()
    except BaseException:  # an exception out of run() ends a fresh process with its traceback and 1
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
    os._exit(1)


def serve() -> None:
    channel = os.dup(1)
    imports_log = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(imports_log, 1)
    os.dup2(imports_log, 2)
    preload()
    sys.stdout.flush()
    sys.stderr.flush()
    reply = lambda message: os.write(channel, (json.dumps(message) + "\n").encode())
    reply({"ready": True})
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            child(request, channel)
        reply({"pid": pid})
        reply({"status": os.waitpid(pid, 0)[1]})


if __name__ == "__main__":
    serve()
