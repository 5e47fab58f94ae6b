"""The released task's files: a benchmark (VUE-TR's ground truth as released, or a plain JSONL of queries), each
query's video found in a folder, and the predictions file that `retrieve` writes and `score` reads (the released
scorer, `qa_eval.py`, reads it unchanged). Light: the CLI checks a benchmark with it before torch is imported."""

from __future__ import annotations

import glob
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from .errors import InputError
from .folders import MEDIA_SUFFIXES

TASK = "temporal_retrieval"  # VUE-TR's `task` field
# VUE-TR's attributes and their values, in the order the released scorer prints them
ATTRIBUTES = {
    "duration_category": ("ultra-short", "short", "medium", "long", "ultra-long"),
    "query_format": ("keyword", "phrase", "sentence"),
    "query_modality": ("audio", "vision", "vision+audio"),
}
VIDEO_SUFFIXES = MEDIA_SUFFIXES["--video"]


@dataclass(frozen=True)
class Query:
    """One query of a benchmark: its id (as the file gives it, an int or a string), the video it is about (VUE-TR's
    `video_id`, or a plain file's `video`: a name or a path), the query's text, the video's length where the file
    gives it (the scorer's clock), the true ranges in seconds where known, and its attributes."""

    query_id: int | str
    video: str
    query: str
    duration: float | None = None
    truth: list[list[float]] | None = None
    attributes: dict[str, str] = field(default_factory=dict)


def read_json_records(path: Path, what: str) -> list:
    """A `.json` list, or a `.jsonl` of one object a line (blank lines skipped): one InputError line naming the file
    and the entry for anything else."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise InputError(path, f"is not UTF-8 text: not {what}") from None
    except OSError as e:
        from .errors import from_os_error

        raise from_os_error(e, path) from None
    if path.suffix == ".jsonl":
        records = []
        for number, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise InputError(path, f"line {number} is not JSON ({e.msg}): not {what}") from None
    else:
        try:
            records = json.loads(text)
        except json.JSONDecodeError as e:
            raise InputError(path, f"is not JSON ({e.msg} at line {e.lineno}): not {what}") from None
        if not isinstance(records, list):
            raise InputError(path, f"holds a JSON {type(records).__name__}, not a list: not {what}")
    if not all(isinstance(record, dict) for record in records):
        where = next(n for n, record in enumerate(records, 1) if not isinstance(record, dict))
        raise InputError(path, f"entry {where} is not an object: not {what}")
    return records


def ranges(value, where: str, path: Path) -> list[list[float]]:
    """`[[start, end], ...]` in seconds (numbers, finite); `[]` and `[[]]` (the released files' "none") are none."""
    if value == [[]]:
        return []
    if not isinstance(value, list) or not all(
        isinstance(pair, list) and len(pair) == 2 and all(is_seconds(t) for t in pair) for pair in value
    ):
        raise InputError(path, f"{where} is {json.dumps(value)[:80]}, not a list of [start, end] pairs of seconds")
    return [[float(t) for t in pair] for pair in value]


def is_seconds(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def query_id_of(record: dict, default, where: str, path: Path):
    query_id = record.get("query_id", default)
    if isinstance(query_id, bool) or not isinstance(query_id, (int, str)):
        raise InputError(path, f"{where}'s query_id is {json.dumps(query_id)}: an integer or a string")
    return query_id


def read_benchmark(path: Path) -> list[Query]:
    """A benchmark's queries: VUE-TR's ground truth as released (a `.json` list of `query_id, video_id, duration,
    query, gt`, attributes), or a `.jsonl` of `{"video": ..., "query": ...}` (a `query_id`, `duration` and `gt` where
    known; VUE-TR's field names too). A malformed entry or a query id given twice is one InputError line."""
    path, queries, seen = Path(path), [], {}
    for number, record in enumerate(read_json_records(path, "a benchmark (VUE-TR's ground truth or a JSONL of "
                                                            "queries)"), 1):  # fmt: skip
        where = f"entry {number}"
        query_id = query_id_of(record, number - 1, where, path)  # a plain file's: its line's place, from 0
        if query_id in seen:
            raise InputError(path, f"query_id {json.dumps(query_id)} is given twice (entries {seen[query_id]} and "
                                   f"{number}): each query needs an id of its own")  # fmt: skip
        seen[query_id] = number
        video, text = record.get("video_id", record.get("video")), record.get("query")
        if not isinstance(video, str) or not video:
            raise InputError(path, f'{where} names no video (a "video_id" or "video" string)')
        if not isinstance(text, str) or not text.strip():
            raise InputError(path, f'{where} has no query (a "query" string)')
        duration = record.get("duration")
        if duration is not None and not (is_seconds(duration) and duration > 0):
            raise InputError(path, f"{where}'s duration is {json.dumps(duration)}: a number of seconds above 0")
        truth = ranges(record["gt"], f"{where}'s gt", path) if "gt" in record else None
        attributes = {name: record[name] for name in ATTRIBUTES if isinstance(record.get(name), str)}
        queries.append(Query(query_id, video, text, duration and float(duration), truth, attributes))
    if not queries:
        raise InputError(path, "holds no query")
    return queries


def find_video(folder: Path, video: str) -> tuple[Path | None, str]:
    """The file of `video` (a benchmark's `video_id`, or a name or path) in `folder`: the name as given, else
    `video.*` in a video container; (None, why) when there is none or more than one."""
    given = Path(video)
    for candidate in (given, Path(folder) / given) if given.is_absolute() else (Path(folder) / given,):
        if candidate.is_file():
            return candidate, ""
    found = sorted(
        p for p in Path(folder).glob(f"{glob.escape(video)}.*") if p.suffix.lower() in VIDEO_SUFFIXES and p.is_file()
    )
    if len(found) == 1:
        return found[0], ""
    if found:
        return None, f"several files are video {video}: {', '.join(p.name for p in found)}"
    return None, f"no video file {video}.* in {folder}"


# --- predictions: a line a query, as `retrieve` writes them and VUE-TR's scorer reads them ---------------------------

ANSWERED, UNPARSED, FAILED = "answered", "unparsed", "error"  # a prediction's status


def prediction(query: Query, duration: float | None, answer: list, text: str, status: str, run: str,
               reason: str = "") -> dict:  # fmt: skip
    """One predictions line: VUE-TR's fields (`answer` in float seconds), the answer's raw `text`, its `status`
    (answered, unparsed, or error with its `reason`), and the run's fingerprint (`run`)."""
    line = {
        "query_id": query.query_id,
        "video_id": query.video,
        "duration": duration,
        "query": query.query,
        "answer": answer,
        "task": TASK,
        "text": text,
        "status": status,
        "run": run,
    }
    return line | {"reason": reason} if reason else line


@dataclass(frozen=True)
class Predictions:
    """A predictions file read: each query id's answer (ranges in seconds), and the records as given."""

    answers: dict
    records: list[dict]


def read_predictions(path: Path) -> Predictions:
    """A `.json` list or `.jsonl` of `{query_id (or V2's id), answer: [[start, end], ...]}` in seconds, as VUE-TR's
    scorer reads one; a query answered twice or a malformed answer is one InputError line."""
    path, answers, records = Path(path), {}, read_json_records(path, "a predictions file")
    for number, record in enumerate(records, 1):
        where = f"entry {number}"
        if "query_id" not in record and "id" not in record:
            raise InputError(path, f"{where} has no query_id")
        query_id = query_id_of(record, record.get("id"), where, path)
        if query_id in answers:
            raise InputError(path, f"query_id {json.dumps(query_id)} is answered twice: each query once")
        if "answer" not in record:
            raise InputError(path, f"{where} (query_id {json.dumps(query_id)}) has no answer")
        answers[query_id] = ranges(record["answer"], f"{where}'s answer (query_id {json.dumps(query_id)})", path)
    return Predictions(answers, records)
