"""vLLM's log kept to what a reader acts on. Its lines that repeat once per engine step or per weight and say nothing
new after the first (`REPEATED`) are shown once in every process that loads the plugin (`show_repeated_once`, from
`register`); an engine this package starts (`validate --backend vllm`, `retrieve --backend vllm`, `serve`) logs
vLLM's warnings and errors, not its info lines, unless asked for them (`QUIET_ENVIRONMENT`)."""

from __future__ import annotations

import logging

# the start of each message (its template, before arguments) shown once a process: a warning vLLM's CPU worker logs
# each time anything sets torch's threads (its multimodal processing does, a request at a time, where the engine runs
# in the caller's process); the one a checkpoint's dtype gives every weight it loads into another dtype
REPEATED = (
    "CPU backend doesn't allow to use `torch.set_num_threads`",
    "Attempted to load weight",
)
# for an engine this package starts, set before vLLM is imported (a process's own values win): vLLM's warnings and
# errors, not its info lines (`--verbose` keeps them)
QUIET_ENVIRONMENT = {"VLLM_LOGGING_LEVEL": "WARNING"}


class RepeatedOnce(logging.Filter):
    """Passes every record but the second and later of each REPEATED message."""

    def __init__(self):
        super().__init__()
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        template = str(record.msg)
        repeated = next((start for start in REPEATED if template.startswith(start)), None)
        if repeated is None:
            return True
        if repeated in self.seen:
            return False
        self.seen.add(repeated)
        return True


def show_repeated_once() -> None:
    """RepeatedOnce on the handlers of vLLM's logger (its records from every module reach them), once a process."""
    for handler in logging.getLogger("vllm").handlers:
        if not any(isinstance(f, RepeatedOnce) for f in handler.filters):
            handler.addFilter(RepeatedOnce())
