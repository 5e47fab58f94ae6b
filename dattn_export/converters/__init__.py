"""Checkpoint readers (one registry of layouts) and writers."""

from . import hf  # noqa: F401  (registers the Hugging Face layouts)
from .registry import READERS, CheckpointReader, open_checkpoint

__all__ = ["READERS", "CheckpointReader", "open_checkpoint"]
