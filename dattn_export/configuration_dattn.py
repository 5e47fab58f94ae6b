"""D-Attn configs: a Mistral or Gemma 2 config plus the released `mm_*` keys and a full `vision_config`.

Only torch and transformers are imported here so the file can ship inside a Hub repo as-is.
"""

from __future__ import annotations

import dataclasses

from huggingface_hub.dataclasses import strict
from transformers import CLIPVisionConfig, Gemma2Config, MistralConfig, SiglipVisionConfig

ATTENTION_MODES = ("dattn", "dattn-sum", "sattn", "mmca")
VISION_CONFIG_CLASSES = {"siglip_vision_model": SiglipVisionConfig, "clip_vision_model": CLIPVisionConfig}


@dataclasses.dataclass(repr=False, eq=False)
class DAttnFields:
    """The keys released D-Attn configs add to the LLM's config, and this project's attention switches."""

    vision_config: dict | None = None  # the tower's full config: checkpoints only name it in mm_vision_tower
    mm_vision_tower: str | None = None
    mm_vision_select_layer: int = -2
    mm_projector_type: str = "mlp2x_gelu"
    mm_image_aspect_ratio: str = "pad"
    mm_image_grid_points: list | None = None
    mm_input_type: str = "image"
    mm_splits: int = 1
    mm_std: float = 1.0
    mm_pos_feature_dim: int = 64  # width of the sinusoidal row/column features fed to mm_rand_pos_h/_w
    dattn_mode: str = "dattn"  # one of ATTENTION_MODES (mmca: DeepSpeed-VisualChat's multi-modal causal attention)
    dattn_diagonal: bool = True  # V2V: each visual token attends only to itself
    dattn_debias: bool = True  # T2V: no rotary embedding on text queries or visual keys

    def validate_dattn(self) -> None:
        if self.dattn_mode not in ATTENTION_MODES:
            raise ValueError(f"dattn_mode must be one of {ATTENTION_MODES}, got {self.dattn_mode!r}")
        if self.mm_projector_type != "mlp2x_gelu":
            raise ValueError(f"mm_projector_type {self.mm_projector_type!r} is not supported (only 'mlp2x_gelu')")
        if self.vision_config is not None and self.vision_config.get("model_type") not in VISION_CONFIG_CLASSES:
            raise ValueError(
                f"vision_config.model_type {self.vision_config.get('model_type')!r} is not one of "
                f"{sorted(VISION_CONFIG_CLASSES)}"
            )

    @property
    def vision_tower_config(self) -> SiglipVisionConfig | CLIPVisionConfig:
        if self.vision_config is None:
            raise ValueError("vision_config is missing: the vision tower's own config must be carried")
        return VISION_CONFIG_CLASSES[self.vision_config["model_type"]](**self.vision_config)

    @property
    def use_diagonal(self) -> bool:
        """sattn is conventional attention: full causal V2V; mmca: full attention within each image."""
        return self.dattn_diagonal and self.dattn_mode not in ("sattn", "mmca")

    @property
    def v2v_per_image(self) -> bool:
        """MMCA: visual tokens attend (both ways) only to the tokens of their own image."""
        return self.dattn_mode == "mmca"

    @property
    def use_debias(self) -> bool:
        """sattn is conventional attention: RoPE on T2V, visual tokens take the first positions."""
        return self.dattn_debias and self.dattn_mode != "sattn"

    @property
    def merge(self) -> str:
        """How the visual and text segments of the text attention are merged."""
        return "sum" if self.dattn_mode in ("dattn-sum", "mmca") else "alpha"

    @property
    def patch_grid(self) -> int:
        """Patches along each side of one image: the visual tokens of an image form a grid x grid square."""
        return self.vision_config["image_size"] // self.vision_config["patch_size"]

    @property
    def tokens_per_image(self) -> int:
        return self.patch_grid**2


@strict
class DAttnMistralConfig(MistralConfig, DAttnFields):
    model_type = "dattn_mistral"

    def sliding_window_of(self, layer_idx: int) -> int | None:
        return self.sliding_window


@strict
class DAttnGemma2Config(Gemma2Config, DAttnFields):
    model_type = "dattn_gemma2"

    def sliding_window_of(self, layer_idx: int) -> int | None:
        return self.sliding_window if self.layer_types[layer_idx] == "sliding_attention" else None


CONFIG_CLASSES = {cls.model_type: cls for cls in (DAttnMistralConfig, DAttnGemma2Config)}
