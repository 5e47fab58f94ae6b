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

WEIGHTS = Path(__file__).parent / "demo_weights"  # {family}.safetensors: what the tool trained, its names released
DEMO_CLIP = SPLITS["held-out"]  # the held-out clip the demo asks about: the seed of demo.mov
HELD_OUT_CLIPS = 20  # the held-out split the tool and the demo score on
ANSWER_TOKENS = 24  # retrieve's new tokens: a truth holds two ranges at most, "0.31-0.53, 0.84-0.99" and EOS in 22


def trained_weights(family: str) -> Path:
    return WEIGHTS / f"{family}.safetensors"


def write_retrieval_checkpoint(out: Path, family: str, weights: Path | None = None) -> Path:
    """The family's demo video checkpoint (released layout) with a tokenizer that knows the benchmark's words and its
    family's task prompt, as a real model's does; `weights`: a safetensors file of its tensors (released names) in
    place of the random ones. Its demo.mov is the held-out clip DEMO_CLIP."""
    out = write_demo_checkpoint(out, family, video=True, tokenizer_texts=CORPUS + tokenizer_texts(FAMILIES[family]))
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
