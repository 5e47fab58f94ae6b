"""Checkpoint readers (one registry of layouts, detected in priority order) and the safetensors writer."""

from . import adapter, deepspeed, hf  # noqa: F401  (each module registers its layouts)
from .registry import READERS, CheckpointReader, open_checkpoint

__all__ = ["READERS", "CheckpointReader", "open_checkpoint"]
