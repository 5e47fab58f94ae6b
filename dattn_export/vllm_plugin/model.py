"""D-Attn on vLLM's encoder-decoder path (the one Whisper takes), so vLLM's scheduler, caches and parallel layers
serve it unchanged:
  * the encoder output is an image's visual stream (tower -> adapter -> LLM norm: `ImageStream.embed_images`),
    computed once per request by `embed_multimodal`;
  * each layer runs the visual stream pointwise (diagonal V2V: a token's output is its own value through o_proj,
    then the MLP) on the request's first step only, and writes the layer's unrotated visual K/V into a
    cross-attention cache (`visual_attn`) that later steps read;
  * text queries attend to the visual keys unrotated (debiased) through that cross-attention, and to the text keys
    with RoPE through vLLM's usual `Attention` (`text_attn`: causal, sliding window, soft-cap); each has its own
    softmax and the outputs are summed (the sum merge of the released models), then o_proj.
q/k/v, o_proj and the MLP are vLLM's tensor-parallel layers; the vision tower, adapter and norms are the reference
model's own modules, replicated on every rank.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from functools import cached_property
from pathlib import Path

import torch
from torch import nn
from transformers import BatchFeature
from vllm.config import VllmConfig
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.model_executor.layers.activation import GeluAndMul, SiluAndMul
from vllm.model_executor.layers.attention import Attention, CrossAttention
from vllm.model_executor.layers.attention.attention import get_attention_context
from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.interfaces import SupportsMultiModal
from vllm.multimodal import MULTIMODAL_REGISTRY
from vllm.multimodal.inputs import MultiModalFieldConfig
from vllm.multimodal.parse import ImageProcessorItems
from vllm.multimodal.processing import (
    BaseDummyInputsBuilder,
    BaseProcessingInfo,
    EncDecMultiModalProcessor,
    PromptReplacement,
)
from vllm.v1.attention.backend import AttentionType

from ..modeling import modeling_dattn
from ..modeling.modeling_dattn import (
    FAMILIES,
    LearnablePositionEmbedding,
    MLPProjector,
    MMRMSNorm,
    VisionTower,
    anyres_grid,
)
from ..processing import anyres_tiles, load_image_processor
from . import unsupported

MAX_IMAGE_PIXELS = 64 * 2**20  # a request's image may hold at most this many pixels (it is resized to the tower's)

# checkpoint name -> (vLLM parameter, shard): q/k/v and gate/up are stacked into one tensor-parallel matmul each
STACKED = {
    ".self_attn.q_proj.": (".self_attn.qkv_proj.", "q"),
    ".self_attn.k_proj.": (".self_attn.qkv_proj.", "k"),
    ".self_attn.v_proj.": (".self_attn.qkv_proj.", "v"),
    ".mlp.gate_proj.": (".mlp.gate_up_proj.", 0),
    ".mlp.up_proj.": (".mlp.gate_up_proj.", 1),
}
NOT_SERVED = ("model.mm_aud.",)  # the audio tower a released image checkpoint carries; the image path never runs it


class DAttnProcessingInfo(BaseProcessingInfo):
    def get_supported_mm_limits(self) -> Mapping[str, int | None]:
        return {"image": 1}

    @cached_property
    def image_processor(self):
        return load_image_processor(Path(self.ctx.model_config.model), self.get_hf_config())

    def tiling(self, width: int, height: int) -> tuple[int, int]:
        """An anyres image's tiling (columns, rows); (0, 0) for a resized image (no tiles)."""
        config = self.get_hf_config()
        if not config.is_anyres:
            return 0, 0
        return anyres_grid((width, height), config.mm_image_grid_points, config.vision_config["image_size"])

    def visual_tokens(self, width: int, height: int) -> int:
        """An image's visual tokens: its thumbnail's grid, then (anyres) its tiles'."""
        columns, rows = self.tiling(width, height)
        return self.get_hf_config().tokens_per_image * (1 + columns * rows)


class DAttnDummyInputsBuilder(BaseDummyInputsBuilder[DAttnProcessingInfo]):
    def get_dummy_text(self, mm_counts: Mapping[str, int]) -> str:
        return ""

    def get_dummy_mm_data(self, seq_len: int, mm_counts: Mapping[str, int], mm_options):
        """The largest image: an anyres model's widest tiling, filled exactly."""
        config = self.info.get_hf_config()
        size = config.vision_config["image_size"]
        columns, rows = max(config.mm_image_grid_points, key=lambda p: p[0] * p[1]) if config.is_anyres else (1, 1)
        images = self._get_dummy_images(
            width=columns * size,
            height=rows * size,
            num_images=mm_counts.get("image", 0),
            overrides=mm_options.get("image"),
        )
        return {"image": images}


class DAttnMultiModalProcessor(EncDecMultiModalProcessor[DAttnProcessingInfo]):
    skip_decoder_start_token = True  # the prompt is the tokenizer's, as the reference reads it: no BOS added

    def create_encoder_prompt(self, prompt: list[int], mm_items) -> list[int]:
        """One placeholder, which becomes one per visual token: the length of the request's cross-attention cache."""
        return [0]

    def _call_hf_processor(self, hf_data: Mapping[str, object], hf_kwargs: Mapping[str, object]) -> BatchFeature:
        images = hf_data["images"]
        for image in images:
            if image.width * image.height > MAX_IMAGE_PIXELS:
                raise ValueError(f"image of {image.width}x{image.height} pixels: at most {MAX_IMAGE_PIXELS} are taken")
        images = [image.convert("RGB") for image in images]
        config = self.info.get_hf_config()
        if not config.is_anyres:
            return BatchFeature(
                {"pixel_values": self.info.image_processor(images, return_tensors="pt")["pixel_values"]}
            )
        tile, points = config.vision_config["image_size"], config.mm_image_grid_points
        tiles, tilings = zip(*(anyres_tiles(image, self.info.image_processor, points, tile) for image in images))
        return BatchFeature({"pixel_values": torch.cat(tiles), "tiling": torch.tensor(tilings)})

    def _get_mm_fields_config(self, hf_inputs, hf_processor_mm_kwargs) -> Mapping[str, MultiModalFieldConfig]:
        if "tiling" not in hf_inputs:
            return {"pixel_values": MultiModalFieldConfig.batched("image")}
        per_image = 1 + hf_inputs["tiling"].prod(-1)  # the thumbnail and the tiles
        return {
            "pixel_values": MultiModalFieldConfig.flat_from_sizes("image", per_image),
            "tiling": MultiModalFieldConfig.batched("image", keep_on_cpu=True),
        }

    def _get_prompt_updates(self, mm_items, hf_processor_mm_kwargs, out_mm_kwargs) -> Sequence[PromptReplacement]:
        def placeholders(item: int) -> list[int]:
            size = mm_items.get_items("image", ImageProcessorItems).get_image_size(item)
            return [0] * self.info.visual_tokens(size.width, size.height)

        return [PromptReplacement(modality="image", target=[0], replacement=placeholders)]


def without_missing_visual(layer_name: str, visual: torch.Tensor) -> torch.Tensor:
    """The cross-attention's output (tokens, heads x head_dim) with 0 in the rows of text-only requests: vLLM's
    cross-attention over no keys leaves them undefined, and the reference's visual attention adds 0 there."""
    metadata = get_attention_context(layer_name)[0]
    if metadata is None:  # a warm-up or profiling run
        return visual
    query_lens = metadata.query_start_loc.diff()
    rows = (metadata.seq_lens[: len(query_lens)] > 0).repeat_interleave(query_lens)
    rows = torch.cat([rows, rows.new_zeros(len(visual) - len(rows))])  # padding rows after the batch's tokens
    return torch.where(rows.to(visual.device)[:, None], visual, 0)


class DAttnAttention(nn.Module):
    """q/k/v/o of one layer; `forward` returns the text stream's attention output and the visual stream's (its own
    values through o_proj: diagonal V2V)."""

    def __init__(self, config, layer_idx: int, vllm_config: VllmConfig, prefix: str):
        super().__init__()
        ranks = get_tensor_model_parallel_world_size()
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads // ranks
        self.num_kv_heads = max(1, config.num_key_value_heads // ranks)  # fewer KV heads than ranks: replicated
        bias = getattr(config, "attention_bias", False)
        quant = vllm_config.quant_config
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            self.head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            bias=bias,
            quant_config=quant,
            prefix=f"{prefix}.qkv_proj",
        )
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim,
            config.hidden_size,
            bias=bias,
            quant_config=quant,
            prefix=f"{prefix}.o_proj",
        )
        self.rotary_emb = get_rope(
            self.head_dim, config.max_position_embeddings, is_neox_style=True, rope_parameters=config.rope_parameters
        )
        shared = dict(
            head_size=self.head_dim,
            scale=getattr(config, "query_pre_attn_scalar", self.head_dim) ** -0.5,
            num_kv_heads=self.num_kv_heads,
            cache_config=vllm_config.cache_config,
            quant_config=quant,
            logits_soft_cap=getattr(config, "attn_logit_softcapping", None),
        )
        self.text_attn = Attention(
            self.num_heads,
            per_layer_sliding_window=config.sliding_window_of(layer_idx),
            prefix=f"{prefix}.text_attn",
            **shared,
        )
        self.visual_attn = CrossAttention(
            self.num_heads, prefix=f"{prefix}.visual_attn", attn_type=AttentionType.ENCODER_DECODER, **shared
        )

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return self.qkv_proj(x)[0].split([q_size, kv_size, kv_size], dim=-1)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, x_visual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        q, k, v = self.split(x)
        q_visual = q.contiguous()  # unrotated: T2V is debiased (the rotary op rotates in place)
        q_text, k_text = self.rotary_emb(positions, q.clone(), k.contiguous())
        visual_k = visual_v = visual_out = None
        if x_visual is not None:  # the request's first step: its visual K/V go into the cross-attention cache
            _, visual_k, visual_v = self.split(x_visual)
            visual_k, visual_v = visual_k.contiguous(), visual_v.contiguous()
            group = self.num_heads // self.num_kv_heads
            per_query_head = visual_v.unflatten(-1, (self.num_kv_heads, self.head_dim)).repeat_interleave(group, 1)
            visual_out = self.o_proj(per_query_head.flatten(1))[0]
        visual = without_missing_visual(self.visual_attn.layer_name, self.visual_attn(q_visual, visual_k, visual_v))
        return self.o_proj(self.text_attn(q_text, k_text, v.contiguous()) + visual)[0], visual_out


class DAttnMLP(nn.Module):
    def __init__(self, config, vllm_config: VllmConfig, prefix: str):
        super().__init__()
        quant = vllm_config.quant_config
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size,
            [config.intermediate_size] * 2,
            bias=False,
            quant_config=quant,
            prefix=f"{prefix}.gate_up_proj",
        )
        self.down_proj = RowParallelLinear(
            config.intermediate_size, config.hidden_size, bias=False, quant_config=quant, prefix=f"{prefix}.down_proj"
        )
        gemma = FAMILIES[config.model_type].sandwich_norms
        self.act = GeluAndMul(approximate="tanh") if gemma else SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)[0]))[0]


class DAttnDecoderLayer(nn.Module, modeling_dattn.LayerNorms):
    def __init__(self, config, layer_idx: int, vllm_config: VllmConfig, prefix: str):
        super().__init__()
        self.self_attn = DAttnAttention(config, layer_idx, vllm_config, f"{prefix}.self_attn")
        self.mlp = DAttnMLP(config, vllm_config, f"{prefix}.mlp")
        self.init_norms(config)

    def forward(
        self, positions: torch.Tensor, h: torch.Tensor, h_visual: torch.Tensor | None, need_visual: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        x_visual = None if h_visual is None else self.input_layernorm(h_visual)
        attn_out, visual_out = self.self_attn(positions, self.input_layernorm(h), x_visual)
        h_visual = self.residual_mlp(h_visual, visual_out) if h_visual is not None and need_visual else None
        return self.residual_mlp(h, attn_out), h_visual


class DAttnModel(nn.Module, modeling_dattn.ImageStream):
    def __init__(self, vllm_config: VllmConfig, prefix: str):
        super().__init__()
        config = self.config = vllm_config.model_config.hf_config
        hidden, family = config.hidden_size, FAMILIES[config.model_type]
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, hidden, prefix=f"{prefix}.embed_tokens")
        self.embed_scale = hidden**0.5 if family.sandwich_norms else None  # Gemma 2 scales the text embeddings
        self.layers = nn.ModuleList(
            DAttnDecoderLayer(config, i, vllm_config, f"{prefix}.layers.{i}") for i in range(config.num_hidden_layers)
        )
        self.norm = family.norm(hidden, eps=config.rms_norm_eps)
        self.mm_vis = VisionTower(config)
        self.mm_rand_projector = MLPProjector(config.vision_config["hidden_size"], hidden)
        self.mm_rand_norm = MMRMSNorm(hidden)
        self.mm_rand_pos_w = LearnablePositionEmbedding(hidden, config.position_grid)
        self.mm_rand_pos_h = LearnablePositionEmbedding(hidden, config.position_grid)
        self.mm_rand_llm_norm = MMRMSNorm(hidden, config.mm_std)

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        return x if self.embed_scale is None else x * torch.tensor(self.embed_scale, dtype=x.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, visual: torch.Tensor | None) -> torch.Tensor:
        h = self.embed_input_ids(input_ids)
        for i, layer in enumerate(self.layers):
            h, visual = layer(positions, h, visual, need_visual=i + 1 < len(self.layers))
        return self.norm(h)


@MULTIMODAL_REGISTRY.register_processor(
    DAttnMultiModalProcessor, info=DAttnProcessingInfo, dummy_inputs=DAttnDummyInputsBuilder
)
class DAttnForCausalLM(nn.Module, SupportsMultiModal):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = self.config = vllm_config.model_config.hf_config
        if reason := unsupported(config):
            raise ValueError(f"{vllm_config.model_config.model}: vLLM cannot serve this model: {reason}")
        self.model = DAttnModel(vllm_config, prefix="model")
        if config.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, prefix="lm_head")
        self.logits_processor = LogitsProcessor(
            config.vocab_size, soft_cap=getattr(config, "final_logit_softcapping", None)
        )

    @classmethod
    def get_placeholder_str(cls, modality: str, i: int) -> str | None:
        return None  # the image is not in the text: it is the encoder's input

    def embed_multimodal(
        self, pixel_values: torch.Tensor | list[torch.Tensor], tiling: torch.Tensor | None = None, **_
    ) -> list[torch.Tensor]:
        """Each image's visual stream (visual tokens, hidden): what the cross-attention caches are built from."""
        if tiling is None:
            pixels = torch.stack(list(pixel_values)) if isinstance(pixel_values, list) else pixel_values
            return list(self.model.embed_images(pixels[:, None]).unbind(0))
        if not isinstance(pixel_values, list):  # one image's thumbnail and tiles after another
            pixel_values = pixel_values.split((1 + tiling.prod(-1)).tolist())
        streams = []
        for pixels, (columns, rows) in zip(pixel_values, tiling.tolist()):
            tiles = pixels[1:].unflatten(0, (rows, columns))
            streams.append(self.model.anyres_stream(pixels[:1], tiles)[0])
        return streams

    def embed_input_ids(self, input_ids: torch.Tensor, multimodal_embeddings=None, *, is_multimodal=None):
        return self.model.embed_input_ids(input_ids)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, encoder_outputs: list[torch.Tensor] | None = None, **_
    ) -> torch.Tensor:
        visual = torch.cat(encoder_outputs) if encoder_outputs else None
        return self.model(input_ids, positions, visual)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            if name.startswith(NOT_SERVED) or (name == "lm_head.weight" and self.config.tie_word_embeddings):
                continue
            target, shard = name, None
            for piece, (stacked, shard_id) in STACKED.items():
                if name.startswith("model.layers.") and piece in name:
                    target, shard = name.replace(piece, stacked), shard_id
                    break
            param = params[target]
            loader = getattr(param, "weight_loader", default_weight_loader)
            loader(param, tensor) if shard is None else loader(param, tensor, shard)
            loaded.add(target)
        return loaded


class DAttnMistralForCausalLM(DAttnForCausalLM):
    pass


class DAttnGemma2ForCausalLM(DAttnForCausalLM):
    pass
