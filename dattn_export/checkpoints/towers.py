"""The vision tower's config: checkpoints name the tower (`mm_vision_tower`) but do not carry its config.

Resolution order: config.json's `vision_config`; else this table of known towers; else inference from the
tensor shapes, with the attention head count given by the user (shapes cannot tell it).
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from ..errors import InputError

TOWER_PREFIX = "model.mm_vis.vision_model."

KNOWN_TOWERS = {
    "google/siglip-so400m-patch14-384": dict(
        model_type="siglip_vision_model", hidden_size=1152, intermediate_size=4304, num_hidden_layers=27,
        num_attention_heads=16, image_size=384, patch_size=14),
    "google/siglip-so400m-patch14-224": dict(
        model_type="siglip_vision_model", hidden_size=1152, intermediate_size=4304, num_hidden_layers=27,
        num_attention_heads=16, image_size=224, patch_size=14),
    "google/siglip-base-patch16-224": dict(
        model_type="siglip_vision_model", hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
        num_attention_heads=12, image_size=224, patch_size=16),
    "google/siglip-large-patch16-384": dict(
        model_type="siglip_vision_model", hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
        num_attention_heads=16, image_size=384, patch_size=16),
    "openai/clip-vit-large-patch14-336": dict(
        model_type="clip_vision_model", hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
        num_attention_heads=16, image_size=336, patch_size=14, projection_dim=768),
    "openai/clip-vit-large-patch14": dict(
        model_type="clip_vision_model", hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
        num_attention_heads=16, image_size=224, patch_size=14, projection_dim=768),
}  # fmt: skip


def infer_from_shapes(shapes: dict[str, tuple[int, ...]], heads: int, source: Path) -> dict:
    """A tower config from its tensor shapes (canonical names) and the head count."""

    def shape(suffix: str) -> tuple[int, ...]:
        if TOWER_PREFIX + suffix not in shapes:
            raise InputError(source, f"cannot infer the vision tower: tensor {TOWER_PREFIX + suffix} is missing")
        return shapes[TOWER_PREFIX + suffix]

    hidden, channels, patch, _ = shape("embeddings.patch_embedding.weight")
    positions = shape("embeddings.position_embedding.weight")[0]
    is_clip = TOWER_PREFIX + "embeddings.class_embedding" in shapes
    grid = math.isqrt(positions - is_clip)
    layers = 1 + max(
        int(m.group(1)) for n in shapes if (m := re.match(re.escape(TOWER_PREFIX) + r"encoder\.layers\.(\d+)\.", n))
    )
    if hidden % heads:
        raise InputError(source, f"--vision-heads {heads} does not divide the tower's hidden size {hidden}")
    config = dict(
        model_type="clip_vision_model" if is_clip else "siglip_vision_model",
        hidden_size=hidden,
        intermediate_size=shape("encoder.layers.0.mlp.fc1.weight")[0],
        num_hidden_layers=layers,
        num_attention_heads=heads,
        image_size=grid * patch,
        patch_size=patch,
        num_channels=channels,
    )
    if is_clip:
        config["projection_dim"] = hidden
    return config


def resolve_vision_config(
    fields: dict, shapes: dict[str, tuple[int, ...]], heads: int | None, source: Path
) -> tuple[dict, str]:
    """(vision_config, where it came from). `shapes` maps canonical tensor names to shapes."""
    if isinstance(fields.get("vision_config"), dict):
        config, origin = dict(fields["vision_config"]), "config.json vision_config"
    elif fields.get("mm_vision_tower") in KNOWN_TOWERS:
        config, origin = dict(KNOWN_TOWERS[fields["mm_vision_tower"]]), f"known tower {fields['mm_vision_tower']}"
    elif heads is not None:
        config, origin = infer_from_shapes(shapes, heads, source), f"inferred from tensor shapes, {heads} heads"
    else:
        raise InputError(
            source,
            f"has no vision_config and mm_vision_tower {fields.get('mm_vision_tower')!r} is not a known tower "
            f"({', '.join(KNOWN_TOWERS)}); pass --vision-heads N to infer the tower from its tensor shapes",
        )
    if config.get("model_type") == "siglip_vision_model" and "vision_use_head" not in config:
        # LLaVA-style towers are often saved without SigLIP's pooling head, which D-Attn never uses
        config["vision_use_head"] = any(n.startswith(TOWER_PREFIX + "head.") for n in shapes)
    return config, origin
