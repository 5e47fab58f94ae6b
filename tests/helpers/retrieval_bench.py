"""A small retrieval benchmark of real video files made by the ffmpeg command line (several lengths, containers and
codecs, one without a sound track) in VUE-TR's fields, with a query about a video that is not there."""

import json
from pathlib import Path

from helpers.released_media import ffmpeg

# video id: (file, seconds, what ffmpeg is given)
VIDEOS = {
    "coPfnSFOXj0": ("coPfnSFOXj0.mp4", 7, ["-c:v", "libx264", "-pix_fmt", "yuv420p", "-c:a", "aac"]),
    "zz_webm": ("zz_webm.webm", 12, ["-c:v", "libvpx-vp9", "-deadline", "realtime", "-c:a", "libopus"]),
    "avi-3": ("avi-3.avi", 4, ["-c:v", "mpeg4", "-c:a", "libmp3lame"]),
    "silent": ("silent.mkv", 5, ["-c:v", "libx264", "-pix_fmt", "yuv420p", "-an"]),
}
QUERIES = [  # (video id, query, true ranges in seconds)
    ("coPfnSFOXj0", "a red circle appears", [[1.0, 3.5]]),
    ("zz_webm", "the colour bars scroll", [[0.0, 4.0], [8.0, 12.0]]),
    ("coPfnSFOXj0", "a tone plays.", [[0.0, 7.0]]),
    ("gone", "anything at all", [[1.0, 2.0]]),  # its file is missing
    ("avi-3", "a loud beep", [[2.0, 3.0]]),
    ("silent", "nothing moves", [[0.5, 1.5]]),
    ("zz_webm", "a counter shows 5", [[5.0, 6.0]]),
]
ATTRIBUTES = [("ultra-short", "keyword", "vision"), ("ultra-short", "phrase", "audio"),
              ("ultra-short", "sentence", "vision+audio")]  # fmt: skip


def write_library(folder: Path) -> tuple[Path, Path]:
    """The videos (in `folder`/videos) and a VUE-TR ground truth of QUERIES (`folder`/benchmark.json)."""
    videos = folder / "videos"
    videos.mkdir(parents=True, exist_ok=True)
    for file, seconds, codecs in VIDEOS.values():
        sound = (
            [] if "-an" in codecs else ["-f", "lavfi", "-i", f"sine=frequency=600:sample_rate=44100:duration={seconds}"]
        )
        ffmpeg("-f", "lavfi", "-i", f"testsrc2=size=96x64:rate=10:duration={seconds}", *sound, "-t", seconds,
               *codecs, videos / file)  # fmt: skip
    entries = []
    for number, (video, query, truth) in enumerate(QUERIES):
        category, form, modality = ATTRIBUTES[number % 3]
        seconds = VIDEOS[video][1] if video in VIDEOS else 9
        entries.append({"query_id": 100 + number, "video_id": video, "duration": float(seconds), "query": query,
                        "gt": truth, "task": "temporal_retrieval", "duration_category": category,
                        "query_format": form, "query_modality": modality})  # fmt: skip
    (folder / "benchmark.json").write_text(json.dumps(entries, indent=1))
    return videos, folder / "benchmark.json"
