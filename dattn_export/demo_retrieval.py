"""The demo's video model: the tiny D-Attn video model of a released family trained on the synthetic retrieval
benchmark (demo_corpus.py) by `tools/train_demo_retrieval.py`, its weights kept beside this file, and how well it
finds the seconds of the held-out clips beside the same model untrained."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .demo_corpus import SPLITS, make_clip, queries, tokenizer_texts, write_clip
from .demo_model import CORPUS, write_demo_checkpoint
from .modeling.families import FAMILIES
from .presets import TINY_AUDIO

WEIGHTS = Path(__file__).parent / "demo_weights"  # {family}.safetensors: what the tool trained, its names released
DEMO_CLIP = SPLITS["held-out"]  # the held-out clip the demo asks about: the seed of demo.mov
HELD_OUT_CLIPS = 20  # the held-out split the tool and the demo score on
# What the retrieval model changes in the tiny video config, towards the released models' time resolution. Their
# towers hear 10 tokens a second (Whisper's 50 positions pooled by 5), the tests' tiny Whisper one every 2 s (30
# positions a 30 s chunk, pooled by 2), so a sound that starts or ends on an odd second fell inside a token: here 10
# positions a second, a token every 0.2 s. Their time embedding spreads a video over 10000 positions, the tiny
# config's over 8 (neighbouring frames 0.3 radians apart at its finest frequency): here 32, more than a clip's frames.
RETRIEVAL_CONFIG = {"audio_config": {**TINY_AUDIO, "max_source_positions": 300}, "mm_time_interval": 32}
ANSWER_TOKENS = 24  # retrieve's new tokens: a truth holds two ranges at most, "0.31-0.53, 0.84-0.99" and EOS in 22


def trained_weights(family: str) -> Path:
    return WEIGHTS / f"{family}.safetensors"


def write_retrieval_checkpoint(out: Path, family: str, weights: Path | None = None) -> Path:
    """The family's demo video checkpoint (released layout) with a tokenizer that knows the benchmark's words and its
    family's task prompt, as a real model's does; `weights`: a safetensors file of its tensors (released names) in
    place of the random ones. Its demo.mov is the held-out clip DEMO_CLIP."""
    texts = CORPUS + tokenizer_texts(FAMILIES[family])
    out = write_demo_checkpoint(out, family, video=True, tokenizer_texts=texts, **RETRIEVAL_CONFIG)
    if weights is not None:
        for shard in out.glob("model*.safetensors*"):
            shard.unlink()
        shutil.copyfile(weights, out / "model.safetensors")
    write_clip(make_clip(DEMO_CLIP), out / "demo.mov")
    return out


@dataclass(frozen=True)
class DemoQuery:
    """What the demo asks about demo.mov, and the truth."""

    query: str
    truth: list[list[float]]  # seconds
    duration: float


def demo_queries() -> list[DemoQuery]:
    """demo.mov's queries (DEMO_CLIP's, as the held-out split asks them)."""
    asked = queries(make_clip(DEMO_CLIP), np.random.default_rng(DEMO_CLIP))
    return [DemoQuery(q["query"], q["gt"], q["duration"]) for q in asked]
