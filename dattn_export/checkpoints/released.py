"""Configs saved by the released D-Attn training code (ByteDance's Vidi, GitHub bytedance/vidi: one released model
per family, `families.py`). They carry the `mm_*` keys and the tower names but none of this project's attention
switches, because that code has one behaviour; this module states it as those switches, each with the place in
the released code that decides it, and records them in the config as `dattn_inferred`."""

from __future__ import annotations

import ast
from pathlib import Path

from ..errors import InputError
from ..modeling.families import BY_MODEL_TYPE

CODE = "bytedance/vidi lmm/dattn"


def is_released(fields: dict) -> bool:
    """Released configs name D-Attn's model types but none of our switches (ours always write dattn_mode); only
    families with a released model have them."""
    family = BY_MODEL_TYPE.get(fields.get("model_type"))
    return family is not None and family.released_model is not None and "dattn_mode" not in fields


def released_fields(fields: dict, source: Path) -> dict:
    """config.json's fields with the released behaviour made explicit; `source` names the file in errors."""
    family = BY_MODEL_TYPE[fields["model_type"]]
    scales = family.released_scales_streams
    inferred = {
        "dattn_mode": ("dattn-sum", f"{CODE}: text, visual and audio attentions each softmaxed, outputs summed"),
        "window_rule": ("flash_attn", f"{CODE}: flash-attn window_size=(w, w), a query sees w + 1 text keys"),
        "mm_scale_streams": (
            scales,
            f"{CODE}: {family.released_model}'s visual and audio streams "
            + ("times sqrt(hidden)" if scales else "unscaled"),
        ),
        "mm_mask_empty_images": (True, f"{CODE}/multimodal.py: image_masks, an all-zero image is masked"),
    }
    if fields.get("mm_input_type") == "video":
        origin = f"{family.released_model} mm_vision/pool.py, multimodal.py"
        inferred["mm_pool_rule"] = (family.released_pool_rule, origin)
    if "mm_image_aspect_ratio" not in fields:  # the released config classes' attribute, when config.json has none
        released_class = family.released_architecture.replace("ForCausalLM", "Config")
        inferred["mm_image_aspect_ratio"] = ("resize", f"{CODE}: {released_class} default")
    if fields.get("mm_std") is None:  # its norm is initialised from it; the checkpoint holds the trained weights
        inferred["mm_std"] = (1.0, "config.json mm_std is null")
    mapped = {**fields, **{key: value for key, (value, _) in inferred.items()}}
    mapped["architectures"] = [family.model_class_name]
    points = mapped.get("mm_image_grid_points")
    if isinstance(points, str):  # the training script takes it as a string; its model evaluates it
        try:
            mapped["mm_image_grid_points"] = ast.literal_eval(points)
        except (ValueError, SyntaxError):
            raise InputError(source, f"mm_image_grid_points {points!r} is not a list of [rows, columns]") from None
    mapped["dattn_inferred"] = {key: origin for key, (_, origin) in inferred.items()}
    return mapped


# this project's keys, which released configs do not have
OWN_KEYS = (
    "vision_config", "audio_config", "dattn_mode", "dattn_diagonal", "dattn_debias", "window_rule",
    "mm_scale_streams", "mm_mask_empty_images", "mm_pool_rule", "dattn_inferred", "wings_rank", "wings_layers",
    "layer_types", "use_bidirectional_attention",
)  # fmt: skip


def released_config(config, vision_tower: str, audio_tower: str) -> dict:
    """config.json as the released training code saves a model of `config` (transformers 4.44 / 4.50 key names,
    the towers named by `vision_tower` / `audio_tower`): the inverse of `released_fields`."""
    fields = {k: v for k, v in config.to_dict().items() if k not in OWN_KEYS}
    fields["torch_dtype"] = fields.pop("dtype", None)
    fields["rope_theta"] = fields.pop("rope_parameters")["rope_theta"]
    size = config.vision_config["image_size"]
    fields |= dict(
        architectures=[config.family.released_architecture],
        mm_vision_tower=vision_tower,
        mm_audio_tower=audio_tower,
        mm_image_grid_res=[[rows * size, cols * size] for rows, cols in config.mm_image_grid_points or []],
        loss_thres=None,
        train_rand=True,
        train_vis=False,
        train_aud=False,
        train_llm=True,
    )
    return fields | config.family.released_extra_fields
