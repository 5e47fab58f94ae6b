"""Tiny configs for tests and the demo (hidden size <= 256), and a random initialisation that makes
every weight matter (O(1) logits, non-uniform attention) so that comparisons can fail."""

from __future__ import annotations

import torch
from torch import nn

from .modeling.configuration_dattn import CONFIG_CLASSES, RELEASED_POOL_RULES
from .modeling.modeling_dattn import Gemma2RMSNorm, MMRMSNorm

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

TINY_TEXT = {
    "mistral": dict(
        model_type="dattn_mistral", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=None,
        max_position_embeddings=2048, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    ),
    "gemma2": dict(
        model_type="dattn_gemma2", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=24,
        sliding_window=8, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
        max_position_embeddings=2048, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    ),
}  # fmt: skip


# a released video model in miniature: 7 x 7 patches a frame, pooled by 2; audio pooled by 2
TINY_VIDEO = dict(
    mm_input_type="video", dattn_mode="dattn-sum", mm_image_pool_size=2, mm_audio_pool_size=2, mm_time_interval=8,
)  # fmt: skip


def tiny_config(
    family: str = "mistral", *, vision: str = "siglip", audio: bool = False, video: bool = False, **overrides
):
    """A tiny D-Attn config of `family` (mistral | gemma2) with a tiny `vision` tower (siglip | clip) and, with
    `audio`, the tiny Whisper encoder the released models carry; `video`: a video model (frames and audio) that
    pools as the family's released model does."""
    fields = {**TINY_TEXT[family], "mm_vision_tower": f"dattn-export/tiny-{vision}"}
    if video:
        model_type = fields["model_type"]
        fields |= {**TINY_VIDEO, "mm_pool_rule": RELEASED_POOL_RULES[model_type]}
        fields["vision_config"] = {**TINY_VISION[vision], "image_size": 28, "patch_size": 4}
        audio = True
    fields |= overrides
    fields.setdefault("vision_config", dict(TINY_VISION[vision]))
    if audio:
        fields |= {"mm_audio_tower": "dattn-export/tiny-whisper", "audio_config": dict(TINY_AUDIO)}
    return CONFIG_CLASSES[fields.pop("model_type")](**fields)


@torch.no_grad()
def randomize_weights(model: nn.Module, seed: int = 0) -> nn.Module:
    """Matrices ~ N(0, 1/fan_in); norm weights around their neutral value (+-10%); biases ~ N(0, 0.1)."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=generator)
        if param.ndim >= 2:
            param.copy_(noise * param[0].numel() ** -0.5)
            continue
        owner = model.get_submodule(name.rpartition(".")[0])
        is_norm = isinstance(owner, nn.LayerNorm) or "RMSNorm" in type(owner).__name__
        if not (is_norm and name.endswith("weight")) or isinstance(owner, Gemma2RMSNorm):
            param.copy_(0.1 * noise)  # biases, class embeddings, Gemma 2 norms (which scale by 1 + weight)
        else:
            neutral = owner.initial if isinstance(owner, MMRMSNorm) else 1.0
            param.copy_(neutral * (1 + 0.1 * noise))
    return model
