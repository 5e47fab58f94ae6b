"""Tiny configs for tests and the demo (hidden size <= 256), and a random initialisation that makes
every weight matter (O(1) logits, non-uniform attention) so that comparisons can fail."""

from __future__ import annotations

import torch
from torch import nn

from .modeling.configuration_dattn import CONFIG_CLASSES
from .modeling.context import MMRMSNorm
from .modeling.families import DEFAULT_FAMILY, FAMILIES
from .modeling.modeling_dattn import FAMILY_MODULES

TINY_VISION = {
    "siglip": dict(
        model_type="siglip_vision_model", hidden_size=48, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, image_size=32, patch_size=8, num_channels=3,
    ),
    "clip": dict(
        model_type="clip_vision_model", hidden_size=48, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, image_size=32, patch_size=8, num_channels=3, projection_dim=48,
    ),
}  # fmt: skip

TINY_AUDIO = dict(
    model_type="whisper", d_model=32, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64,
    num_mel_bins=16, max_source_positions=30, activation_function="gelu", scale_embedding=False,
)  # fmt: skip

# a released video model in miniature: 7 x 7 patches a frame, pooled by 2; audio pooled by 2
TINY_VIDEO = dict(
    mm_input_type="video", dattn_mode="dattn-sum", mm_image_pool_size=2, mm_audio_pool_size=2, mm_time_interval=8,
)  # fmt: skip


def tiny_config(
    family: str = DEFAULT_FAMILY, *, vision: str = "siglip", audio: bool = False, video: bool = False, **overrides
):
    """A tiny D-Attn config of `family` (families.FAMILIES) with a tiny `vision` tower (siglip | clip) and, with
    `audio`, the tiny Whisper encoder the released models carry; `video`: a video model (frames and audio) that
    pools as the family's released model does."""
    spec = FAMILIES[family]
    fields = {**spec.tiny, "mm_vision_tower": f"dattn-export/tiny-{vision}"}
    if video:
        fields |= {**TINY_VIDEO, "mm_pool_rule": spec.released_pool_rule}
        fields["vision_config"] = {**TINY_VISION[vision], "image_size": 28, "patch_size": 4}
        audio = True
    fields |= overrides
    fields.setdefault("vision_config", dict(TINY_VISION[vision]))
    if audio:
        fields["mm_audio_tower"] = "dattn-export/tiny-whisper"
        fields.setdefault("audio_config", dict(TINY_AUDIO))
    return CONFIG_CLASSES[spec.model_type](**fields)


@torch.no_grad()
def randomize_weights(model: nn.Module, seed: int = 0) -> nn.Module:
    """Matrices ~ N(0, 1/fan_in); norm weights around their neutral value (+-10%); biases ~ N(0, 0.1)."""
    family = model.config.family
    llm_norm = FAMILY_MODULES[family.name].rms_norm
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=generator)
        if param.ndim >= 2:
            param.copy_(noise * param[0].numel() ** -0.5)
            continue
        owner = model.get_submodule(name.rpartition(".")[0])
        is_norm = isinstance(owner, nn.LayerNorm) or "RMSNorm" in type(owner).__name__
        if not (is_norm and name.endswith("weight")):
            param.copy_(0.1 * noise)  # biases, class embeddings
        elif isinstance(owner, MMRMSNorm):
            param.copy_(owner.initial * (1 + 0.1 * noise))
        else:  # the LLM's norms scale by (its family's norm_offset + weight); the towers' by weight
            offset = family.norm_offset if isinstance(owner, llm_norm) else 0.0
            param.copy_(1.0 - offset + 0.1 * noise)
    return model
