"""The towers' configs: checkpoints name the vision and audio towers (`mm_vision_tower`, `mm_audio_tower`: a folder
or a Hub id, as the released training code loads them) but do not carry their configs.

Resolution order, per tower: config.json's `vision_config` / `audio_config`; else the named folder's config.json
(as given, or relative to the checkpoint); else the Hub id's config.json in the local Hugging Face cache; else a
table of known towers; else inference from the tensor shapes (the vision tower's attention head count must then be
given: shapes cannot tell it; Whisper's heads are always 64 wide).
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from huggingface_hub import try_to_load_from_cache
from transformers import CLIPVisionConfig, SiglipVisionConfig, WhisperConfig

from ..errors import InputError
from ..sidefiles import read_json

TOWER_PREFIX = "model.mm_vis.vision_model."
AUDIO_PREFIX = "model.mm_aud.encoder."
VISION_CONFIGS = {"siglip": SiglipVisionConfig, "clip": CLIPVisionConfig}  # a tower folder's model_type family
AUDIO_FIELDS = (  # what the Whisper encoder's shapes and forward depend on
    "d_model", "encoder_layers", "encoder_attention_heads", "encoder_ffn_dim", "num_mel_bins",
    "max_source_positions", "activation_function", "scale_embedding",
)  # fmt: skip
WHISPER_HEAD_DIM = 64  # every Whisper size: tiny 384/6 ... large 1280/20

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

KNOWN_AUDIO_TOWERS = {
    "openai/whisper-large-v3": dict(d_model=1280, encoder_layers=32, encoder_ffn_dim=5120, num_mel_bins=128),
    "openai/whisper-large-v2": dict(d_model=1280, encoder_layers=32, encoder_ffn_dim=5120, num_mel_bins=80),
    "openai/whisper-medium": dict(d_model=1024, encoder_layers=24, encoder_ffn_dim=4096, num_mel_bins=80),
    "openai/whisper-small": dict(d_model=768, encoder_layers=12, encoder_ffn_dim=3072, num_mel_bins=80),
    "openai/whisper-base": dict(d_model=512, encoder_layers=6, encoder_ffn_dim=2048, num_mel_bins=80),
    "openai/whisper-tiny": dict(d_model=384, encoder_layers=4, encoder_ffn_dim=1536, num_mel_bins=80),
}


def tower_folder(name: str | None, checkpoint_dir: Path) -> Path | None:
    """The folder a tower name refers to, as the training code would load it (a path as given, else relative to
    the checkpoint), or the Hub id's snapshot in the local Hugging Face cache; None when there is none."""
    if not name:
        return None
    for candidate in (Path(name).expanduser(), Path(checkpoint_dir) / name):
        if (candidate / "config.json").is_file():
            return candidate
    if name.count("/") == 1 and isinstance(cached := try_to_load_from_cache(name, "config.json"), str):
        return Path(cached).parent
    return None


def folder_vision_config(folder: Path) -> dict:
    """A tower folder's vision config (a full SigLIP/CLIP config's vision part, or a vision config)."""
    fields = read_config(folder)
    model_type = str(fields.get("model_type", ""))
    family = next((f for f in VISION_CONFIGS if model_type.startswith(f)), None)
    if family is None:
        raise InputError(folder / "config.json", f"model_type {model_type!r} is not a SigLIP or CLIP vision tower")
    config = VISION_CONFIGS[family](**fields.get("vision_config", fields)).to_diff_dict()
    config.pop("transformers_version", None)
    return config


def folder_audio_config(folder: Path) -> dict:
    fields = read_config(folder)
    if fields.get("model_type") != "whisper":
        raise InputError(folder / "config.json", f"model_type {fields.get('model_type')!r} is not a Whisper model")
    return whisper_config(fields)


def read_config(folder: Path) -> dict:
    return read_json(folder / "config.json", "tower config.json")


def whisper_config(fields: dict) -> dict:
    """The encoder's fields of a Whisper config (heads 64 wide when not given)."""
    full = WhisperConfig(**{"encoder_attention_heads": fields["d_model"] // WHISPER_HEAD_DIM, **fields}).to_dict()
    return {"model_type": "whisper", **{k: full[k] for k in AUDIO_FIELDS}}


def tower_shape(shapes: dict[str, tuple[int, ...]], name: str, tower: str, source: Path) -> tuple[int, ...]:
    if name not in shapes:
        raise InputError(source, f"cannot infer the {tower}: tensor {name} is missing")
    return shapes[name]


def layer_count(shapes: dict[str, tuple[int, ...]], layers_prefix: str) -> int:
    """1 + the highest N of the tensors named `{layers_prefix}N.*`."""
    pattern = re.compile(re.escape(layers_prefix) + r"(\d+)\.")
    return 1 + max(int(m.group(1)) for n in shapes if (m := pattern.match(n)))


def infer_from_shapes(shapes: dict[str, tuple[int, ...]], heads: int, source: Path) -> dict:
    """A tower config from its tensor shapes (canonical names) and the head count."""
    shape = lambda suffix: tower_shape(shapes, TOWER_PREFIX + suffix, "vision tower", source)
    hidden, channels, patch, _ = shape("embeddings.patch_embedding.weight")
    positions = shape("embeddings.position_embedding.weight")[0]
    is_clip = TOWER_PREFIX + "embeddings.class_embedding" in shapes
    grid = math.isqrt(positions - is_clip)
    if hidden % heads:
        raise InputError(source, f"--vision-heads {heads} does not divide the tower's hidden size {hidden}")
    config = dict(
        model_type="clip_vision_model" if is_clip else "siglip_vision_model",
        hidden_size=hidden,
        intermediate_size=shape("encoder.layers.0.mlp.fc1.weight")[0],
        num_hidden_layers=layer_count(shapes, TOWER_PREFIX + "encoder.layers."),
        num_attention_heads=heads,
        image_size=grid * patch,
        patch_size=patch,
        num_channels=channels,
    )
    if is_clip:
        config["projection_dim"] = hidden
    return config


def infer_audio_from_shapes(shapes: dict[str, tuple[int, ...]], source: Path) -> dict:
    shape = lambda suffix: tower_shape(shapes, AUDIO_PREFIX + suffix, "audio tower", source)
    d_model, mel_bins, _ = shape("conv1.weight")
    if d_model % WHISPER_HEAD_DIM:
        raise InputError(
            source,
            f"the audio tower's config cannot be found (mm_audio_tower names no folder here or in the Hugging Face "
            f"cache, and no known tower), and its width {d_model} is not Whisper's {WHISPER_HEAD_DIM}-wide heads: "
            "put the tower's folder where mm_audio_tower says",
        )
    return whisper_config(
        dict(
            d_model=d_model,
            num_mel_bins=mel_bins,
            encoder_layers=layer_count(shapes, AUDIO_PREFIX + "layers."),
            encoder_ffn_dim=shape("layers.0.fc1.weight")[0],
            max_source_positions=shape("embed_positions.weight")[0],
        )
    )


def resolve_audio_config(
    fields: dict, shapes: dict[str, tuple[int, ...]], source: Path
) -> tuple[dict | None, str | None]:
    """(audio_config, where it came from), or (None, None) for a checkpoint without an audio tower. `source` is the
    checkpoint's config.json."""
    if isinstance(fields.get("audio_config"), dict):
        return dict(fields["audio_config"]), "config.json audio_config"
    if AUDIO_PREFIX + "conv1.weight" not in shapes:
        return None, None
    name = fields.get("mm_audio_tower")
    if folder := tower_folder(name, source.parent):
        return folder_audio_config(folder), f"tower folder {folder}"
    if name in KNOWN_AUDIO_TOWERS:
        return whisper_config(KNOWN_AUDIO_TOWERS[name]), f"known tower {name}"
    return infer_audio_from_shapes(shapes, source), f"inferred from tensor shapes ({WHISPER_HEAD_DIM}-wide heads)"


def resolve_vision_config(
    fields: dict, shapes: dict[str, tuple[int, ...]], heads: int | None, source: Path
) -> tuple[dict, str]:
    """(vision_config, where it came from). `shapes` maps canonical tensor names to shapes; `source` is the
    checkpoint's config.json."""
    if isinstance(fields.get("vision_config"), dict):
        config, origin = dict(fields["vision_config"]), "config.json vision_config"
    elif folder := tower_folder(fields.get("mm_vision_tower"), source.parent):
        config, origin = folder_vision_config(folder), f"tower folder {folder}"
    elif fields.get("mm_vision_tower") in KNOWN_TOWERS:
        config, origin = dict(KNOWN_TOWERS[fields["mm_vision_tower"]]), f"known tower {fields['mm_vision_tower']}"
    elif heads is not None:
        config, origin = infer_from_shapes(shapes, heads, source), f"inferred from tensor shapes, {heads} heads"
    else:
        raise InputError(
            source,
            f"has no vision_config and mm_vision_tower {fields.get('mm_vision_tower')!r} is neither a folder, a "
            f"cached Hub model nor a known tower ({', '.join(KNOWN_TOWERS)}); pass --vision-heads N to infer the "
            "tower from its tensor shapes",
        )
    if config.get("model_type") == "siglip_vision_model" and "vision_use_head" not in config:
        # LLaVA-style towers are often saved without SigLIP's pooling head, which D-Attn never uses
        config["vision_use_head"] = any(n.startswith(TOWER_PREFIX + "head.") for n in shapes)
    return config, origin
