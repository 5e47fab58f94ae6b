"""D-Attn configs: the LLM family's config (`families.py`) plus the released `mm_*` keys (those ByteDance's Vidi code
writes) and the full configs of the towers they name (`vision_config`, `audio_config`).

Only torch and transformers are imported here so the file can ship inside a Hub repo as-is.
"""

from __future__ import annotations

import dataclasses

import transformers
from huggingface_hub.dataclasses import strict
from transformers import CLIPVisionConfig, SiglipVisionConfig, WhisperConfig

from .families import BY_MODEL_TYPE, FAMILIES, Family
from .streams import STREAMS, ContextStream, frame_tokens, streams_of

ATTENTION_MODES = ("dattn", "dattn-sum", "sattn", "mmca")
# how many text keys a sliding window of w shows a query: transformers' masks show w (itself and w - 1 before);
# flash-attn's window_size=(w, w), which the released models were trained with, shows w + 1
WINDOW_RULES = {"transformers": 0, "flash_attn": 1}
VISION_CONFIG_CLASSES = {"siglip_vision_model": SiglipVisionConfig, "clip_vision_model": CLIPVisionConfig}
INPUT_TYPES = tuple(STREAMS)  # mm_input_type: image | video
# how a picture becomes the tower's input (images.py): the released img_utils.process_images' rules
ASPECT_RATIOS = ("resize", "pad", "crop", "anyres")


LLM_SIZES = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "max_position_embeddings",
)  # fmt: skip
TOWER_SIZES = {
    "vision_config": ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "image_size",
                      "patch_size", "num_channels"),
    "audio_config": ("d_model", "encoder_layers", "encoder_attention_heads", "encoder_ffn_dim", "num_mel_bins",
                     "max_source_positions"),
}  # fmt: skip
FLOAT_DTYPES = ("float32", "float16", "bfloat16", "float64")


MAX_SIZE = 1 << 24  # a tensor dimension larger than this is a damaged config (real vocabularies: ~2^18)


def positive(key: str, value, optional: bool = False, most: int | None = MAX_SIZE) -> None:
    if value is None and optional:
        return
    if type(value) is not int or value <= 0 or (most is not None and value > most):
        raise ValueError(f"{key} must be a positive integer of at most {most}, got {value!r}")


@dataclasses.dataclass(repr=False, eq=False)
class DAttnFields:
    """The keys released D-Attn configs add to the LLM's config, and this project's attention switches."""

    vision_config: dict | None = None  # the tower's full config: checkpoints only name it in mm_vision_tower
    audio_config: dict | None = None  # the Whisper encoder's config (mm_audio_tower); None: no audio tower
    mm_vision_tower: str | None = None
    mm_audio_tower: str | None = None
    mm_vision_select_layer: int = -2
    mm_projector_type: str = "mlp2x_gelu"
    mm_image_aspect_ratio: str = "resize"
    mm_image_grid_points: list | None = None  # anyres tilings [columns, rows] (widths, heights in tiles)
    mm_input_type: str = "image"
    mm_splits: int = 1
    mm_image_pool_size: int | None = None
    mm_audio_pool_size: int | None = None
    mm_time_interval: int | None = None
    mm_std: float = 1.0  # the initial weight of mm_rand_llm_norm
    mm_pool_rule: str = "space-to-depth"  # video models: one of streams.POOL_RULES
    dattn_mode: str = "dattn"  # one of ATTENTION_MODES (mmca: DeepSpeed-VisualChat's multi-modal causal attention)
    window_rule: str = "transformers"  # one of WINDOW_RULES
    mm_scale_streams: bool = False  # the context streams times sqrt(hidden), as some families scale their text
    mm_mask_empty_images: bool = False  # released: an all-zero image is "no image", masked out of T2V
    dattn_inferred: dict | None = None  # the fields a released config lacked: {field: where its value came from}
    dattn_diagonal: bool = True  # V2V: each visual token attends only to itself
    dattn_debias: bool = True  # T2V: no rotary embedding on text queries or visual keys
    wings_rank: int = 0  # WINGS learners' low rank (0: none)
    wings_layers: list | None = None  # the layers that have WINGS learners (None: all, when wings_rank > 0)

    def validate_sizes(self) -> None:
        """Sizes the model is built from: positive integers that fit together, checked before any tensor is."""
        for key in LLM_SIZES:  # positions are not a tensor's dimension: any count may be configured
            positive(
                key,
                getattr(self, key, None),
                optional=key == "head_dim",
                most=None if key == "max_position_embeddings" else MAX_SIZE,
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of num_key_value_heads "
                f"{self.num_key_value_heads}"
            )
        if self.text_window is not None:
            positive("sliding_window", self.text_window)
        for config_key, keys in TOWER_SIZES.items():
            tower = getattr(self, config_key)
            if tower is None:
                continue
            if not isinstance(tower, dict):
                raise ValueError(f"{config_key} must be an object (the tower's config), got {type(tower).__name__}")
            for key in keys:
                positive(f"{config_key}.{key}", tower.get(key), optional=True)
        vision = self.vision_config or {}
        if vision.get("hidden_size", 1) % vision.get("num_attention_heads", 1):
            raise ValueError("vision_config.hidden_size is not a multiple of vision_config.num_attention_heads")
        if vision.get("image_size", 1) < vision.get("patch_size", 1):
            raise ValueError("vision_config.image_size is smaller than one patch (vision_config.patch_size)")
        layers = vision.get("num_hidden_layers")
        if layers and not -layers - 1 <= self.mm_vision_select_layer <= layers:
            raise ValueError(
                f"mm_vision_select_layer {self.mm_vision_select_layer} is not a layer of a {layers}-layer vision tower"
            )
        dtype = getattr(self, "dtype", None)
        if dtype is not None and str(dtype).removeprefix("torch.") not in FLOAT_DTYPES:
            raise ValueError(f"dtype {dtype!r} is not one of {', '.join(FLOAT_DTYPES)}")

    def validate_dattn(self) -> None:
        if self.dattn_mode not in ATTENTION_MODES:
            raise ValueError(f"dattn_mode must be one of {ATTENTION_MODES}, got {self.dattn_mode!r}")
        if self.window_rule not in WINDOW_RULES:
            raise ValueError(f"window_rule must be one of {sorted(WINDOW_RULES)}, got {self.window_rule!r}")
        if self.mm_input_type not in INPUT_TYPES:
            raise ValueError(f"mm_input_type must be one of {INPUT_TYPES}, got {self.mm_input_type!r}")
        if self.mm_image_aspect_ratio not in ASPECT_RATIOS:
            raise ValueError(
                f"mm_image_aspect_ratio {self.mm_image_aspect_ratio!r} is not one of {ASPECT_RATIOS} (how the released "
                "code prepares a picture)"
            )
        for stream in self.streams:
            stream.check(self)
        if self.mm_projector_type != "mlp2x_gelu":
            raise ValueError(f"mm_projector_type {self.mm_projector_type!r} is not supported (only 'mlp2x_gelu')")
        if self.vision_config is not None and self.vision_config.get("model_type") not in VISION_CONFIG_CLASSES:
            raise ValueError(
                f"vision_config.model_type {self.vision_config.get('model_type')!r} is not one of "
                f"{sorted(VISION_CONFIG_CLASSES)}"
            )
        if self.wings_rank < 0:
            raise ValueError(f"wings_rank must be >= 0, got {self.wings_rank}")
        if self.wings_rank and self.hidden_size % self.head_dim:
            raise ValueError(
                f"WINGS learners split hidden_size {self.hidden_size} into heads of head_dim {self.head_dim}: "
                "it must divide it"
            )
        if self.wings_layers is not None and not set(self.wings_layers) <= set(range(self.num_hidden_layers)):
            raise ValueError(
                f"wings_layers {self.wings_layers} are not all layers of a {self.num_hidden_layers}-layer model"
            )

    @property
    def mel_frames_per_audio_token(self) -> int:
        """A video model's log-mel frames per audio token: Whisper's encoder halves them (3000 a 30 s chunk -> 1500
        positions), then mm_audio_pool_size positions pool into one token."""
        return 2 * self.mm_audio_pool_size

    @property
    def streams(self) -> tuple[ContextStream, ...]:
        """The context streams text attends to (`streams.py`): frames and audio for a video model, images (or an
        anyres model's tiled picture) otherwise."""
        return streams_of(self.mm_input_type, self.mm_image_aspect_ratio)

    @property
    def modality(self) -> str:
        """What a prompt gives the model: image | video."""
        return self.streams[0].modality

    @property
    def num_contexts(self) -> int:
        """The context segments, each under its own softmax with the sum merge."""
        return len(self.streams)

    @property
    def vision_tower_config(self) -> SiglipVisionConfig | CLIPVisionConfig:
        if self.vision_config is None:
            raise ValueError("vision_config is missing: the vision tower's own config must be carried")
        return VISION_CONFIG_CLASSES[self.vision_config["model_type"]](**self.vision_config)

    @property
    def tower_layers_run(self) -> int:
        """The vision tower's layers its features need: hidden state k (mm_vision_select_layer, -1 the last) is the
        output of the first k layers; those after it never reach the features."""
        select, layers = self.mm_vision_select_layer, self.vision_config["num_hidden_layers"]
        return select if select >= 0 else layers + 1 + select

    @property
    def audio_tower_config(self) -> WhisperConfig | None:
        return None if self.audio_config is None else WhisperConfig(**self.audio_config)

    def window_keys(self, window: int | None) -> int | None:
        """The text keys a query sees under a sliding window of `window` (None: no window), by `window_rule`."""
        return None if window is None else window + WINDOW_RULES[self.window_rule]

    def sliding_window_of(self, layer_idx: int) -> int | None:
        """How many text keys (itself included) a query of this layer sees; None: all earlier ones."""
        if self.family.window_per_layer and self.layer_types[layer_idx] != "sliding_attention":
            return None
        return self.window_keys(self.text_window)

    @property
    def text_window(self) -> int | None:
        """The sliding window as configured (None: none, or a family whose config has no such field)."""
        return getattr(self, "sliding_window", None)

    # the family's attention and head settings, with the defaults of the families whose configs lack them
    @property
    def family(self) -> Family:
        return BY_MODEL_TYPE[self.model_type]

    @property
    def activation(self) -> str:
        return getattr(self, self.family.activation_key)

    @property
    def attention_scale(self) -> float:
        return getattr(self, "query_pre_attn_scalar", self.head_dim) ** -0.5

    @property
    def attention_softcap(self) -> float | None:
        return getattr(self, "attn_logit_softcapping", None)

    @property
    def logits_softcap(self) -> float | None:
        return getattr(self, "final_logit_softcapping", None)

    def has_bias(self, projection: str) -> bool:
        """Whether the attention's `projection` (q_proj, k_proj, v_proj or o_proj) has a bias (families.py)."""
        return self.family.projection_has_bias(projection, getattr(self, "attention_bias", False))

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

    @property
    def tokens_per_frame(self) -> int:
        """A video model's visual tokens per frame (space-to-depth: until the frames pass the resize budget)."""
        return self.frame_tokens(1)

    def frame_tokens(self, total_frames: int) -> int:
        """A video model's visual tokens per frame in a video of `total_frames` frames (streams.frame_tokens)."""
        return frame_tokens(self.mm_pool_rule, self.mm_image_pool_size, self.patch_grid, total_frames)

    @property
    def wings_layer_indices(self) -> list[int]:
        """The layers with WINGS learners."""
        if not self.wings_rank:
            return []
        return sorted(self.wings_layers) if self.wings_layers is not None else list(range(self.num_hidden_layers))

    def has_wings(self, layer_idx: int) -> bool:
        return layer_idx in self.wings_layer_indices

    @property
    def wings_heads(self) -> int:
        """A WINGS learner's heads: its q/k/v keep the hidden size (x + low-rank update), in heads of head_dim."""
        return self.hidden_size // self.head_dim

    def cache_parts(self, layer_idx: int) -> tuple[str, ...]:
        """What one layer caches per token, text and visual alike: the attention's key and value, and the WINGS
        learner's when the layer has one. Graph inputs/outputs are named `{prefix}.{layer}.{part}`."""
        return ("key", "value", "wings_key", "wings_value") if self.has_wings(layer_idx) else ("key", "value")


class HeadSize:
    """head_dim where the family's config may omit it (Qwen2's has no such field): hidden_size / heads, as
    transformers' own attention takes it."""

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        if getattr(self, "head_dim", None) is None:
            self.head_dim = self.hidden_size // self.num_attention_heads


def config_class(family: Family) -> type:
    """The family's transformers config with the D-Attn fields (named `family.config_class_name`)."""
    base = getattr(transformers, f"{family.prefix}Config")
    namespace = {"model_type": family.model_type, "__module__": __name__}
    return strict(type(family.config_class_name, (HeadSize, base, DAttnFields), namespace))


# one per family, by the name its entry gives (Family.config_class_name): a Hub repo's auto_map imports it by that name
DAttnMistralConfig = config_class(FAMILIES["mistral"])
DAttnGemma2Config = config_class(FAMILIES["gemma2"])
DAttnQwen2Config = config_class(FAMILIES["qwen2"])
CONFIG_CLASSES = {cls.model_type: cls for cls in (DAttnMistralConfig, DAttnGemma2Config, DAttnQwen2Config)}
