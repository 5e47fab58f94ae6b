"""What `retrieve` answers: a benchmark's videos (each with its queries and its file, or why there is none) and each
query's answer as a backend gives it, turned into a predictions line."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ...answers import seconds_ranges
from ...errors import ENVIRONMENT, EnvironmentFailure, InputError, one_line
from ...modeling.media_files import MediaError
from ...retrieval import ANSWERED, FAILED, UNPARSED, Query, find_video, prediction


@dataclass
class Video:
    """A video of the benchmark and its queries (in the benchmark's order): its file, or why there is none."""

    name: str
    queries: list[Query]
    path: Path | None = None
    missing: str = ""


def videos_of(queries: list[Query], folder: Path) -> list[Video]:
    """The benchmark's videos in the order they first appear, each with its queries and its file in `folder`."""
    videos: dict[str, Video] = {}
    for query in queries:
        videos.setdefault(query.video, Video(query.video, [])).queries.append(query)
    for video in videos.values():
        video.path, video.missing = find_video(folder, video.name)
    return list(videos.values())


@dataclass
class Answered:
    """A query's answer as a backend gives it: the text, or the reason it failed (and whose failure: the exit code)."""

    query: Query
    text: str = ""
    file_duration: float | None = None  # the video file's, in seconds
    failure: str = ""
    code: int = 0


def line_of(answered: Answered, family, run: str) -> dict:
    """The predictions line of an answer: its ranges in seconds by the benchmark's duration, else the file's."""
    query = answered.query
    duration = query.duration or answered.file_duration
    if answered.failure:
        return prediction(query, duration, [], "", FAILED, run, answered.failure)
    ranges = seconds_ranges(answered.text, duration, family) if duration else []
    return prediction(query, duration, ranges, answered.text, ANSWERED if ranges else UNPARSED, run)


VIDEO_FAILURES = (InputError, MediaError, EnvironmentFailure, MemoryError, RuntimeError)


def video_failure(error: BaseException) -> tuple[str, int]:
    """A video's failure as its queries record it: the reason, and whose it is (input 2, environment 3)."""
    code, line = one_line(error)
    if isinstance(error, RuntimeError) and not isinstance(error, (InputError, EnvironmentFailure)):
        if "out of memory" not in str(error).lower():  # torch's OutOfMemoryError is one
            raise error
        code, line = ENVIRONMENT, f"out of memory: {' '.join(str(error).split())[:200]}"
    return line, code


def failed(video: Video, reason: str, code: int, duration: float | None = None) -> list[Answered]:
    return [Answered(query, failure=reason, code=code, file_duration=duration) for query in video.queries]
