"""The Hugging Face Hub, both ways: repo ids given where a folder is read (`NS/NAME[@REVISION]`, downloaded through
huggingface_hub's cache with its token and offline mode), and the retries and one-line failures that `push` and
the downloads share. Imports nothing heavy until a repo is contacted."""

from __future__ import annotations

import importlib
import re
import time
from pathlib import Path

from .errors import EnvironmentFailure, InputError

ATTEMPTS = 4
BACKOFF_SECONDS = 0.5  # doubles each attempt; a 429's Retry-After is honoured up to RETRY_AFTER_CAP
RETRY_AFTER_CAP = 30.0
# namespace/name, then an optional @revision (a branch, a tag, a commit, refs/pr/N): as `vllm serve` and
# optimum-cli take models. Checked only where no local path of that name exists.
REPO_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+))?")


def parse_repo_id(text: str) -> tuple[str, str | None] | None:
    """(repo id, revision) when `text` reads as a Hub repo id, else None."""
    match = REPO_ID.fullmatch(text)
    if match is None or ".." in text or text.endswith((".", "-")):
        return None
    return match["repo"], match["revision"]


def download(text: str) -> Path:
    """The local snapshot of the Hub repo `text` names (downloaded into huggingface_hub's cache when not there).

    HF_TOKEN or the stored login reads private repos; HF_HUB_OFFLINE=1 answers from the cache alone. Failures are
    one line: a repo or revision that is not there is the input's (exit 2), an unreachable Hub the environment's."""
    repo_id, revision = parse_repo_id(text)  # the caller has seen that it reads as one
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    def snapshot() -> str:
        try:
            return snapshot_download(repo_id, revision=revision)
        except LocalEntryNotFoundError as e:  # the Hub failed and the cache lacks it: retry what may pass
            if e.__cause__ is None or isinstance(e.__cause__, OfflineModeIsEnabled):
                raise
            raise e.__cause__ from None

    try:
        explained = (RevisionNotFoundError, RepositoryNotFoundError, LocalEntryNotFoundError)
        return Path(retrying("download", snapshot, text, explained, done="downloaded"))
    except RevisionNotFoundError:
        raise InputError(text, f"the Hub repo {repo_id} has no revision {revision!r}") from None
    except RepositoryNotFoundError:
        raise InputError(
            text, "is neither a local path nor a Hub repo this token can read (private? set HF_TOKEN, `hf auth login`)"
        ) from None
    except LocalEntryNotFoundError:
        raise EnvironmentFailure(
            text, "is no local path; as a Hub repo id it is not in the local cache, and HF_HUB_OFFLINE=1 is set"
        ) from None


def network_errors() -> tuple[type[BaseException], ...]:
    """Connection refused, reset, timed out: OSError and the Hub client's transport errors."""
    errors: list[type[BaseException]] = [OSError]
    for module in ("httpx2", "httpx"):  # huggingface_hub 2.x uses httpx2, 1.x httpx
        try:
            errors.append(importlib.import_module(module).TransportError)
        except (ImportError, AttributeError):
            pass
    return tuple(errors)


def retrying(what: str, call, location: str, explained: tuple[type[BaseException], ...] = (), done: str = "published"):
    """Run `call`, retrying transient failures (5xx, 429, network) with backoff; other errors at once, as one
    line saying nothing was `done`, except the `explained` ones, which the caller turns into its own line."""
    from huggingface_hub.errors import HfHubHTTPError

    transient = network_errors()
    for attempt in range(1, ATTEMPTS + 1):
        wait = BACKOFF_SECONDS * 2 ** (attempt - 1)
        try:
            return call()
        except explained:
            raise
        except HfHubHTTPError as e:
            status = e.response.status_code if e.response is not None else None
            if status is None or (status < 500 and status != 429) or attempt == ATTEMPTS:
                # the Hub refused what we sent (a 4xx) is the input's; a server that keeps failing, the Hub's
                failure = InputError if status is not None and status < 500 and status != 429 else EnvironmentFailure
                raise failure(location, describe_http_error(what, status, e, attempt, done)) from None
            retry_after = e.response.headers.get("Retry-After", "") if status == 429 else ""
            wait = min(float(retry_after), RETRY_AFTER_CAP) if retry_after.isdigit() else wait
        except transient as e:
            if attempt == ATTEMPTS:
                raise EnvironmentFailure(
                    location,
                    f"{what}: network error after {attempt} attempts ({type(e).__name__}); "
                    f"is the Hub reachable? nothing was {done}",
                ) from None
        time.sleep(wait)


def describe_http_error(what: str, status: int | None, error, attempts: int, done: str) -> str:
    server = (getattr(error, "server_message", None) or "").strip().splitlines()
    detail = f": {server[0][:200]}" if server else ""
    explanations = {
        401: "authentication failed: the token is missing, invalid or expired (pass --token or set HF_TOKEN)",
        403: "forbidden: this token may not do this here (is the namespace yours? is the token read-only?)",
        404: "not found: the repo does not exist or this token cannot see it",
        409: "conflict: the repo or branch exists in a state that refuses this",
        429: f"rate limited by the Hub, still after {attempts} attempts: try again later",
    }
    if status is not None and status >= 500:
        return (
            f"{what}: the Hub answered {status} (server error) {attempts} times: nothing was {done}; "
            f"try again later{detail}"
        )
    return f"{what}: {status} {explanations.get(status, 'the Hub refused the request')}{detail}"
