"""The synthetic retrieval benchmark (demo_corpus.py): its ground truth held to what the written files hold when the
released decoder's path reads them back (a colour's pixels in a quarter of a frame, a tone's energy in a second of
the sound), its answers held to the released scorer's rules (the truth written in a family's format and read back
with its released pattern scores exactly as the truth itself), its files a function of the seed alone."""

import json

import numpy as np
import pytest

from dattn_export.answers import seconds_ranges
from dattn_export.demo_corpus import (
    COLOURS,
    FILE_FPS,
    FRAME_SIDE,
    SOUNDS,
    SPLITS,
    answer,
    make_clip,
    queries,
    write_benchmark,
    write_clip,
)
from dattn_export.modeling.families import FAMILIES
from dattn_export.modeling.sound_decoding import AUDIO_RATE
from dattn_export.modeling.video_decoding import load_video
from dattn_export.stages.score import score

RELEASED = [name for name, family in FAMILIES.items() if family.released_task]


def seen_seconds(frames, colour: str, place: int) -> set[int]:
    """The seconds whose frame shows `colour` over most of the quarter `place`."""
    half, seconds = FRAME_SIDE // 2, set()
    for second, frame in enumerate(frames):
        pixels = np.asarray(frame)
        quarter = pixels[(place // 2) * half : (place // 2 + 1) * half, (place % 2) * half : (place % 2 + 1) * half]
        if (np.abs(quarter.astype(int) - COLOURS[colour]).sum(-1) == 0).mean() > 0.2:
            seconds.add(second)
    return seconds


def heard_seconds(samples: np.ndarray, sound: str) -> set[int]:
    """The seconds whose spectrum peaks at the tone's frequency above its neighbours, beside any other sound (noise:
    spreads over the top half of the band)."""
    seconds = set()
    for second in range(len(samples) // AUDIO_RATE):
        spectrum = np.abs(np.fft.rfft(samples[second * AUDIO_RATE : (second + 1) * AUDIO_RATE]))
        if spectrum.max() < 1.0:
            continue  # silence
        if SOUNDS[sound] is None:
            if spectrum[AUDIO_RATE // 4 :].sum() > 0.25 * spectrum.sum():
                seconds.add(second)
            continue
        hz = int(SOUNDS[sound])  # a tone of whole Hz: one bin of a 1 s window
        if spectrum[hz] > 20 * np.r_[spectrum[hz - 50 : hz], spectrum[hz + 1 : hz + 51]].mean():
            seconds.add(second)
    return seconds


def truth_seconds(truth) -> set[int]:
    return {second for start, end in truth for second in range(int(start), int(end))}


@pytest.mark.parametrize("seed", [0, 3, 7, 11, SPLITS["held-out"] + 1, SPLITS["held-out"] + 4])
def test_the_truth_is_what_the_file_shows_and_plays(tmp_path, seed):
    """Every query's true seconds, read back from the file as the released decoder reads it (one frame a second and
    the whole sound track): a shape's colour fills its quarter exactly then, a tone peaks at its pitch exactly then,
    and a seen-and-heard query's seconds are both at once."""
    clip = make_clip(seed)
    frames, samples = load_video(write_clip(clip, tmp_path / "clip.mov"))
    assert len(frames) == clip.seconds and len(samples) == clip.seconds * AUDIO_RATE
    shown = {e.what: seen_seconds(frames, e.what.split()[0], e.place) for e in clip.events if e.seen}
    heard = {e.what: heard_seconds(samples, e.what) for e in clip.events if not e.seen}
    for query in queries(clip, np.random.default_rng(seed)):
        seconds = truth_seconds(query["gt"])
        named = [what for what in {**shown, **heard} if what in query["query"]]
        expected = set.intersection(*({**shown, **heard}[what] for what in named))
        assert seconds == expected, query
        assert query["query_modality"] == "+".join(
            kind for kind, table in (("vision", shown), ("audio", heard)) if any(w in table for w in named)
        )


def test_the_split_asks_every_modality_and_format(tmp_path):
    records = json.loads(write_benchmark(tmp_path, "held-out", 6).read_text())
    assert {r["query_modality"] for r in records} == {"vision", "audio", "vision+audio"}
    assert {r["query_format"] for r in records} == {"keyword", "phrase", "sentence"}
    assert any(len(r["gt"]) > 1 for r in records)
    assert [r["query_id"] for r in records] == list(range(len(records)))
    assert all(r["video_id"].startswith("clip1") for r in records)  # held-out seeds: 1,000,000 on


@pytest.mark.parametrize("family", RELEASED)
def test_the_truth_in_the_family_s_answer_scores_as_the_truth(tmp_path, family):
    """The truth written as the family's model answers (fractions to two places) and read back as `retrieve` reads an
    answer (the family's released pattern, times the benchmark's duration) scores as the truth itself does under the
    released scorer's rules: its floor and ceiling give back every true second."""
    records = [{"query_id": n, **q} for n, q in enumerate(
        q for seed in range(40) for q in queries(make_clip(seed), np.random.default_rng(seed)))]  # fmt: skip
    truth = tmp_path / "truth.json"
    truth.write_text(json.dumps(records))
    answered = [
        {
            "query_id": r["query_id"],
            "answer": seconds_ranges(answer(r["gt"], r["duration"]), r["duration"], FAMILIES[family]),
        }
        for r in records
    ]
    (tmp_path / "answered.json").write_text(json.dumps(answered))
    (tmp_path / "itself.json").write_text(json.dumps([{"query_id": r["query_id"], "answer": r["gt"]} for r in records]))
    ours, itself = score(tmp_path / "answered.json", truth), score(tmp_path / "itself.json", truth)
    for metric in ("precision", "recall", "iou"):  # VUE-TR's, on whole seconds (lmms-eval's read raw seconds)
        assert getattr(ours.overall, metric) == getattr(itself.overall, metric) > 0.99
    for got, record in zip(answered, records):
        assert [[np.floor(s), np.ceil(e)] for s, e in got["answer"]] == record["gt"]


def test_a_split_is_a_function_of_its_seeds(tmp_path):
    first, second = (write_benchmark(tmp_path / name, "train", 2) for name in ("a", "b"))
    assert first.read_bytes() == second.read_bytes()
    for video in sorted((tmp_path / "a" / "videos").iterdir()):
        assert video.read_bytes() == (tmp_path / "b" / "videos" / video.name).read_bytes()
    assert FILE_FPS > 1  # the decoder keeps one frame a second of a file written faster
