"""The one table of tensor names: every accepted spelling maps to the canonical (released) name.

Canonical names are those of released D-Attn checkpoints: the LLM under its Hugging Face names, the vision
tower under `model.mm_vis.vision_model.*` (transformers 4.x), the adapter and norms under `model.mm_rand_*`.
"""

from __future__ import annotations

import math
import re

RENAMES: list[tuple[re.Pattern, str]] = [
    # transformers 5.x vision towers have no `vision_model` wrapper: their keys start at `embeddings.`
    (re.compile(r"^model\.mm_vis\.(?!vision_model\.)"), "model.mm_vis.vision_model."),
    # DeepSpeed engines and DDP wrap the model: their names may carry the wrapper's prefix
    (re.compile(r"^(module\.)+"), ""),
    # LLaVA-style adapter saves name the projector mm_projector.{0,2}
    (re.compile(r"^model\.mm_projector\.(\d+)\."), r"model.mm_rand_projector.model.\1."),
]


def canonical_name(name: str) -> str:
    for pattern, replacement in RENAMES:
        name = pattern.sub(replacement, name)
    return name


# where each stack of layers lives: (what it is, its layer count in the config, the tensors that hold its layers)
LAYER_STACKS = (
    ("decoder layers", lambda c: c.num_hidden_layers, re.compile(r"^model\.layers\.(\d+)\.")),
    (
        "vision tower layers",
        lambda c: c.vision_config["num_hidden_layers"],
        re.compile(r"^model\.mm_vis\.vision_model\.encoder\.layers\.(\d+)\."),
    ),
    (
        "audio tower layers",
        lambda c: c.audio_config["encoder_layers"] if c.audio_config else 0,
        re.compile(r"^model\.mm_aud\.encoder\.layers\.(\d+)\."),
    ),
)


def stored_layers(names, pattern: re.Pattern) -> int:
    """How many layers of a stack the tensor names hold (1 + the highest index)."""
    return 1 + max((int(m.group(1)) for n in names if (m := pattern.match(n))), default=-1)


COMPONENTS = ("vision tower", "adapter", "LLM")  # every model has these; some also "audio tower", "WINGS learners"
AUDIO_TOWER_NOT_RUN = "carried in the checkpoint, not run: image prompts do not use it"


def audio_tower_role(config) -> str:
    runs = any(stream.tower == "mm_aud" for stream in config.streams)
    return "runs the audio stream (a video model)" if runs else AUDIO_TOWER_NOT_RUN


WINGS_MODULE = re.compile(r"^model\.layers\.\d+\.wings_")


def component_of(name: str) -> str:
    """Which part of the model a canonical tensor name belongs to."""
    if name.startswith("model.mm_vis."):
        return "vision tower"
    if name.startswith("model.mm_aud."):
        return "audio tower"  # carried; image prompts do not run it
    if name.startswith("model.mm_rand_"):
        return "adapter"  # projector, norms, position embeddings
    if WINGS_MODULE.match(name):
        return "WINGS learners"  # visual and text learners, router
    return "LLM"


def parameter_counts(shapes: dict[str, tuple[int, ...]]) -> dict[str, int]:
    """Parameters per component (vision tower, adapter, LLM[, WINGS learners]) from canonical names and shapes."""
    counts = dict.fromkeys(COMPONENTS, 0)
    for name, shape in shapes.items():
        component = component_of(name)
        counts[component] = counts.get(component, 0) + math.prod(shape)
    return counts
