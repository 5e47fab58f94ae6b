"""vLLM plugin: registers the D-Attn architectures so that `vllm serve CONVERTED_DIR` runs a converted folder.

vLLM loads it through the `vllm.general_plugins` entry point, in the server and in every worker. The model is in
`model.py`; this module imports nothing from vLLM until vLLM calls `register`.
"""

from __future__ import annotations

from ..modeling.configuration_dattn import CONFIG_CLASSES
from ..modeling.families import FAMILIES, Family

ARCHITECTURES = tuple(family.model_class_name for family in FAMILIES.values())
VIDEO_BACKEND = "dattn"  # the name our video loader (`media.py`) has among vLLM's video backends
MEDIA_CONNECTOR = "dattn"  # and our media connector among vLLM's (VLLM_MEDIA_CONNECTOR)
# per rank, the contexts of media seen before (`context_cache.py`); the server's processed and decoded media as much
DEFAULT_CONTEXT_CACHE_GIB = 4.0


def unsupported(config) -> str | None:
    """Why the plugin cannot serve a model with this config, in one line; None when it can."""
    if config.merge != "sum":
        return (
            f"dattn_mode {config.dattn_mode!r} merges text and visual attention with one softmax (alpha), which needs "
            "each attention's log-sum-exp that vLLM's attention does not return; the sum merge (dattn-sum, the "
            "released models) is served"
        )
    if not config.use_debias or not config.use_diagonal:
        return "only D-Attn with debiased T2V and diagonal V2V is served (the visual stream as an encoder)"
    if config.wings_rank:
        return "WINGS learners are not served"
    quantization = getattr(config, "quantization_config", None)
    if quantization and quantization.get("quant_method") != "compressed-tensors":
        return "of quantized checkpoints, compressed-tensors' are served (dattn-export quantize writes them)"
    return None


class EncoderDecoder:
    """Our config as vLLM must see it: an encoder-decoder (the visual stream is the encoder's output, read by
    cross-attention), which only decides which of vLLM's paths runs the model. Module-level: vLLM pickles configs."""

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        self.is_encoder_decoder = True


def serving_config_name(family: Family) -> str:
    return family.config_class_name.replace("Config", "ServingConfig")  # DAttn{prefix}ServingConfig


def serving_config(family: Family) -> type:
    """The family's config as vLLM sees it, named `serving_config_name(family)`."""
    config_class = CONFIG_CLASSES[family.model_type]
    return type(serving_config_name(family), (EncoderDecoder, config_class), {"__module__": __name__})


# one per family, written out by name: vLLM pickles configs, so each is importable by its name
DAttnMistralServingConfig = serving_config(FAMILIES["mistral"])
DAttnGemma2ServingConfig = serving_config(FAMILIES["gemma2"])
DAttnQwen2ServingConfig = serving_config(FAMILIES["qwen2"])
SERVING_CONFIGS = (DAttnMistralServingConfig, DAttnGemma2ServingConfig, DAttnQwen2ServingConfig)


def register() -> None:
    from transformers import AutoConfig
    from vllm import ModelRegistry

    from . import media  # noqa: F401  (registers the `dattn` video loader and media connector)
    from .logs import show_repeated_once

    show_repeated_once()

    for config_class in SERVING_CONFIGS:
        AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
    for architecture in ARCHITECTURES:
        if architecture not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(architecture, "dattn_export.vllm_plugin.model:DAttnForCausalLM")
