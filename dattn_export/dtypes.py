"""The float types' names, without importing torch: the short name every option takes (fp32, fp16, bf16), and the
other spellings users bring (torch's, vLLM's) and manifests record (torch's). `artifacts.DTYPES` holds the types
themselves under the same short names."""

from __future__ import annotations

TORCH_NAMES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}  # short name -> torch's, as manifests say
ALIASES = {**{torch: short for short, torch in TORCH_NAMES.items()}, "float": "fp32", "half": "fp16"}


def short_name(name: str) -> str:
    """fp32 | fp16 | bf16 (or `name` itself, when it is none of their spellings)."""
    return ALIASES.get(name.lower(), name)
