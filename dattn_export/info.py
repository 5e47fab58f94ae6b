"""`info`: what a checkpoint is, without reading its tensor data."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from .converters import open_checkpoint
from .errors import InputError
from .loading import audit
from .names import canonical_name, parameter_counts


def describe(path: Path, base: Path | None = None, vision_heads: int | None = None) -> dict:
    reader = open_checkpoint(path, base)
    tensors = reader.tensors
    report = {
        "path": str(path),
        "layout": reader.layout,
        "notes": reader.notes,
        "tensors": len(tensors),
        "bytes": sum(t.nbytes for t in tensors.values()),
        "dtypes": dict(Counter(str(t.dtype).removeprefix("torch.") for t in tensors.values()).most_common()),
        "parameters": parameter_counts({canonical_name(n): tuple(t.shape) for n, t in tensors.items()}),
        "architecture": None,
        "problems": [],
    }
    try:
        source = audit(reader, vision_heads)
    except InputError as e:
        report["problems"].append(str(e))
        return report
    c = source.config
    report["architecture"] = {
        "model_type": c.model_type, "dattn_mode": c.dattn_mode, "diagonal": c.use_diagonal, "debias": c.use_debias,
        "merge": c.merge, "layers": c.num_hidden_layers, "hidden_size": c.hidden_size, "heads": c.num_attention_heads,
        "kv_heads": c.num_key_value_heads, "head_dim": c.head_dim, "vocab_size": c.vocab_size,
        "vision_tower": c.mm_vision_tower, "vision_config": f"{c.vision_config['model_type']} "
        f"{c.vision_config['hidden_size']}x{c.vision_config['num_hidden_layers']} layers, "
        f"{c.vision_config['image_size']}px / patch {c.vision_config['patch_size']} ({source.vision_origin})",
        "visual_tokens_per_image": c.tokens_per_image,
        "wings": f"rank {c.wings_rank} learners in layers {c.wings_layer_indices}" if c.wings_rank else "none",
    }  # fmt: skip
    report["problems"] = [str(p) for p in source.problems]
    return report
