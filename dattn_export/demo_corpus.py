"""A synthetic temporal-retrieval benchmark made here, of real video files: shapes of several colours come and go and
tones and noise play at known seconds, asked about in VUE-TR's three modalities and three query formats, with the
ground truth in VUE-TR's fields (`retrieve` and `score` read it as they read the released benchmark).
`tools/train_demo_retrieval.py` trains the demo's tiny video model on its train split and scores it on its held-out
one. Every clip is a function of its seed alone."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from .demo_model import write_video
from .modeling.sound_decoding import AUDIO_RATE
from .prompts import task_prompt

COLOURS = {"red": (225, 35, 35), "green": (40, 190, 60), "blue": (50, 90, 240), "yellow": (235, 215, 40)}
SHAPES = ("circle", "square", "triangle")
SOUNDS = {"low tone": 330.0, "high tone": 2400.0, "burst of noise": None}  # a tone's Hz; None: white noise
FRAME_SIDE = 64  # pixels: the tiny towers see 28 x 28
FILE_FPS = 2  # the file's rate; the released decoder keeps one frame a second
SPLITS = {"train": 0, "held-out": 1_000_000}  # a split's clips are seeds from here on
LENGTHS = (8, 24)  # a clip's seconds, inclusive


@dataclass(frozen=True)
class Event:
    """Something seen (a colour's shape, in one of four places) or heard, over whole seconds [start, end)."""

    what: str  # "red circle", or a sound's name
    ranges: tuple[tuple[int, int], ...]
    place: int = 0  # a shape's quarter of the frame: 0 top left, 1 top right, 2 bottom left, 3 bottom right

    @property
    def seen(self) -> bool:
        return self.what not in SOUNDS

    def on(self, second: int) -> bool:
        return any(start <= second < end for start, end in self.ranges)


@dataclass(frozen=True)
class Clip:
    seed: int
    seconds: int
    background: tuple[int, int, int]
    events: tuple[Event, ...]

    @property
    def name(self) -> str:
        return f"clip{self.seed:07d}"


def free_ranges(rng: np.random.Generator, seconds: int, count: int) -> tuple[tuple[int, int], ...]:
    """`count` ranges of 2 to 8 s inside the clip, at least a second apart."""
    while True:
        lengths = rng.integers(2, min(8, seconds // (2 * count)) + 1, size=count)
        gaps = seconds - lengths.sum() - (count - 1)
        if gaps >= 0:
            cuts = np.sort(rng.integers(0, gaps + 1, size=count))
            starts = cuts + np.concatenate([[0], np.cumsum(lengths[:-1] + 1)])
            return tuple((int(s), int(s + n)) for s, n in zip(starts, lengths))


def make_clip(seed: int) -> Clip:
    """Two or three shapes of different colours, each seen once or twice in a place of its own, and one or two sounds;
    where a sound plays exactly while a shape is seen, the pair is a vision+audio event."""
    rng = np.random.default_rng(seed)
    seconds = int(rng.integers(LENGTHS[0], LENGTHS[1] + 1))
    colours = rng.choice(list(COLOURS), size=int(rng.integers(2, 4)), replace=False)  # a colour a shape
    places = rng.permutation(4)
    events = []
    for colour, place in zip(colours, places):
        shape = rng.choice(SHAPES)
        count = int(rng.integers(1, 3)) if seconds >= 16 else 1
        events.append(Event(f"{colour} {shape}", free_ranges(rng, seconds, count), int(place)))
    sounds = rng.choice(list(SOUNDS), size=int(rng.integers(1, 3)), replace=False)
    events.append(Event(str(sounds[0]), (events[0].ranges[-1],)))  # heard while the first shape is seen
    if len(sounds) > 1:
        events.append(Event(str(sounds[1]), free_ranges(rng, seconds, 1)))
    background = tuple(int(v) for v in rng.integers(0, 70, size=3))
    return Clip(seed, seconds, background, tuple(events))


def frame(clip: Clip, second: int) -> np.ndarray:
    image = Image.new("RGB", (FRAME_SIDE, FRAME_SIDE), clip.background)
    draw, half, margin = ImageDraw.Draw(image), FRAME_SIDE // 2, 3
    for event in clip.events:
        if event.seen and event.on(second):
            colour, shape = event.what.split()
            x, y = (event.place % 2) * half, (event.place // 2) * half
            box = [x + margin, y + margin, x + half - margin, y + half - margin]
            if shape == "circle":
                draw.ellipse(box, fill=COLOURS[colour])
            elif shape == "square":
                draw.rectangle(box, fill=COLOURS[colour])
            else:
                draw.polygon(
                    [(box[0], box[3]), (box[2], box[3]), ((box[0] + box[2]) / 2, box[1])], fill=COLOURS[colour]
                )
    return np.asarray(image)


def sound_track(clip: Clip) -> np.ndarray:
    """16-bit mono samples: each sound over its seconds, silence between."""
    rng = np.random.default_rng(clip.seed)
    samples = np.zeros(clip.seconds * AUDIO_RATE, np.float64)
    for event in clip.events:
        if event.seen:
            continue
        for start, end in event.ranges:
            span = slice(start * AUDIO_RATE, end * AUDIO_RATE)
            t = np.arange(span.stop - span.start) / AUDIO_RATE
            hz = SOUNDS[event.what]
            samples[span] += 0.3 * (np.sin(2 * np.pi * hz * t) if hz else rng.uniform(-1, 1, len(t)))
    return (samples * 32767).astype(np.int16)


def write_clip(clip: Clip, path: Path) -> Path:
    frames = [frame(clip, s) for s in range(clip.seconds) for _ in range(FILE_FPS)]
    write_video(path, frames, FILE_FPS, sound_track(clip))
    return path


def overlap(a, b) -> list[tuple[int, int]]:
    """The seconds two sorted lists of ranges share, as sorted ranges: a shape's ranges lie a second apart or more, so
    these never touch and need no merging."""
    return [(max(s, t), min(e, f)) for s, e in a for t, f in b if max(s, t) < min(e, f)]


# a query's three formats (VUE-TR's query_format) for a shape, a sound, and both at once
FORMATS = {
    "vision": ("{what}", "a {what} appears", "A {what} is shown on the screen."),
    "audio": ("{what}", "a {what} plays", "You can hear a {what}."),
    "vision+audio": ("{what}, {heard}", "a {what} with a {heard}", "A {what} is shown while a {heard} plays."),
}
QUERY_FORMATS = ("keyword", "phrase", "sentence")


def queries(clip: Clip, rng: np.random.Generator) -> list[dict]:
    """The clip's queries in VUE-TR's fields (without query_id): a query of every shape and sound in a format drawn
    by `rng`, and one of each seen-and-heard pair."""
    out = []

    def add(modality: str, truth, **words):
        style = int(rng.integers(len(QUERY_FORMATS)))
        out.append({
            "video_id": clip.name,
            "duration": float(clip.seconds),
            "query": FORMATS[modality][style].format(**words),
            "gt": [[float(s), float(e)] for s, e in truth],
            "duration_category": "ultra-short",
            "query_format": QUERY_FORMATS[style],
            "query_modality": modality,
        })  # fmt: skip

    for event in clip.events:
        add("vision" if event.seen else "audio", event.ranges, what=event.what)
    for seen in (e for e in clip.events if e.seen):
        for heard in (e for e in clip.events if not e.seen):
            if both := overlap(seen.ranges, heard.ranges):
                add("vision+audio", both, what=seen.what, heard=heard.what)
    return out


def tokenizer_texts(family) -> list[str]:
    """What a retrieval model's tokenizer learns its words from: every query of every format in the family's released
    task prompt (a real model's tokenizer knows these words whole; the answers' digits stay a token each)."""
    seen = [f"{colour} {shape}" for colour in COLOURS for shape in SHAPES]
    asked = [f.format(what=what) for what in seen for f in FORMATS["vision"]]
    asked += [f.format(what=what) for what in SOUNDS for f in FORMATS["audio"]]
    asked += [f.format(what=what, heard=heard) for what in seen for heard in SOUNDS for f in FORMATS["vision+audio"]]
    return [task_prompt(family, query, seconds) for query in asked for seconds in (8.0, 17.0)]


def answer(truth: list[list[float]], seconds: float) -> str:
    """The ranges as the released models answer: fractions of the video to two places. Each end is written at the
    middle of the whole second it falls in (a range's first second, its last), so the released scorer's floor of a
    start and ceiling of an end give the truth's seconds back with half a second to spare either way: an answer a
    little early or late still scores whole, where an end written at the edge of its second loses the second."""
    parts = []
    for start, end in truth:
        parts.append(f"{(start + 0.5) / seconds:.2f}-{(end - 0.5) / seconds:.2f}")
    return ", ".join(parts)


def written_clip(seed: int, folder: Path) -> list[dict]:
    """Clip `seed` written to `folder/{its name}.mov`; its queries (VUE-TR's fields, without query_id)."""
    clip = make_clip(seed)
    write_clip(clip, Path(folder) / f"{clip.name}.mov")
    return queries(clip, np.random.default_rng(seed))


def write_benchmark(folder: Path, split: str, clips: int) -> Path:
    """`clips` clips of `split` written to `folder/videos/`, their queries to `folder/{split}.json` (VUE-TR's ground
    truth format); returns the benchmark's path."""
    folder, base = Path(folder), SPLITS[split]
    (folder / "videos").mkdir(parents=True, exist_ok=True)
    records = []
    for seed in range(base, base + clips):
        records += written_clip(seed, folder / "videos")
    records = [{"query_id": n, **record} for n, record in enumerate(records)]
    path = folder / f"{split}.json"
    path.write_text(json.dumps(records, indent=1) + "\n")
    return path
