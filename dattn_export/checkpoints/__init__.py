"""Reading training output (a reader per layout, lazy tensors, one table of tensor names) and writing
safetensors. Importing the package registers every reader."""

from . import adapter, deepspeed, hf  # noqa: F401  (each module registers its layouts)
from .registry import READERS, CheckpointReader, open_checkpoint

__all__ = ["READERS", "CheckpointReader", "open_checkpoint"]
