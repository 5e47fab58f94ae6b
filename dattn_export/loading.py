"""Build the reference model from a checkpoint folder with Hugging Face-standard (released) names."""

from __future__ import annotations

from pathlib import Path

import torch
from huggingface_hub.errors import StrictDataclassError

from .configuration_dattn import CONFIG_CLASSES
from .converters import open_checkpoint
from .converters.hf import read_json
from .errors import InputError
from .modeling_dattn import MODEL_CLASSES, DAttnForCausalLM
from .names import canonical_name


def config_from_dict(fields: dict, source: Path):
    """A D-Attn config from config.json's fields; errors name the file and the key."""
    model_type = fields.get("model_type")
    if model_type not in CONFIG_CLASSES:
        raise InputError(source, f"model_type {model_type!r} is not a D-Attn model (expected one of {sorted(CONFIG_CLASSES)})")
    try:
        config = CONFIG_CLASSES[model_type](**{k: v for k, v in fields.items() if k != "model_type"})
        config.vision_tower_config  # noqa: B018  (raises when vision_config is missing)
    except (StrictDataclassError, ValueError, TypeError) as e:
        raise InputError(source, " ".join(str(e).split())) from None
    return config


def read_config(folder: str | Path):
    path = Path(folder) / "config.json"
    if not Path(folder).exists():
        raise InputError(folder, "does not exist")
    if not path.is_file():
        raise InputError(folder, "has no config.json")
    return config_from_dict(read_json(path), path)


def tied_names(model: DAttnForCausalLM) -> set[str]:
    """Names stored once because they share their tensor with another (lm_head tied to embed_tokens)."""
    return set(model._tied_weights_keys) if model.config.tie_word_embeddings else set()


def saved_state_dict(model: DAttnForCausalLM) -> dict[str, torch.Tensor]:
    """The model's tensors as a checkpoint stores them: canonical names, tied tensors once."""
    return {name: t for name, t in model.state_dict().items() if name not in tied_names(model)}


def load_model(folder: str | Path, dtype: torch.dtype = torch.float32) -> DAttnForCausalLM:
    """The reference model with the checkpoint's weights. Every tensor must be known, present and of
    the shape config.json implies."""
    folder = Path(folder)
    config = read_config(folder)
    checkpoint = open_checkpoint(folder)
    model = MODEL_CLASSES[config.model_type](config).to(dtype).eval()
    expected = model.state_dict()
    loaded: dict[str, torch.Tensor] = {}
    for stored in checkpoint.names():
        name = canonical_name(stored)
        if name not in expected:
            raise InputError(checkpoint.file_of(stored), f"unexpected tensor {stored} (not part of a {config.model_type} model)")
        shape, want = checkpoint.shape(stored), tuple(expected[name].shape)
        if shape != want:
            raise InputError(
                checkpoint.file_of(stored), f"tensor {stored} has shape {list(shape)} but config.json implies {list(want)}"
            )
        loaded[name] = checkpoint.load(stored)
    missing = sorted(set(expected) - set(loaded) - tied_names(model))
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise InputError(folder, f"missing tensor {missing[0]}{more}")
    model.load_state_dict(loaded, strict=False)
    return model
