"""The one table of tensor names: every accepted spelling maps to the canonical (released) name.

Canonical names are those of released D-Attn checkpoints: the LLM under its Hugging Face names, the vision
tower under `model.mm_vis.vision_model.*` (transformers 4.x), the adapter and norms under `model.mm_rand_*`.
"""

from __future__ import annotations

import re

RENAMES: list[tuple[re.Pattern, str]] = [
    # transformers 5.x vision towers have no `vision_model` wrapper: their keys start at `embeddings.`
    (re.compile(r"^model\.mm_vis\.(?!vision_model\.)"), "model.mm_vis.vision_model."),
]


def canonical_name(name: str) -> str:
    for pattern, replacement in RENAMES:
        name = pattern.sub(replacement, name)
    return name
