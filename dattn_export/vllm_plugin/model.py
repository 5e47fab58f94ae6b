"""D-Attn on vLLM's encoder-decoder path (the one Whisper takes), so vLLM's scheduler, caches and parallel layers
serve it unchanged:
  * the encoder output is the request's context stream, computed by `embed_multimodal` with the reference's own
    `ContextStreams`: an image's visual tokens, or a video's frames then its audio; each token carries its stream's
    segment id (`streams.py`; 0: masked) in one extra column;
  * each layer runs the context stream pointwise (diagonal V2V: a token's output is its own value through o_proj,
    then the MLP) on the request's first step only, and writes the layer's unrotated context K/V into
    cross-attention caches (`context_attn`) that later steps read;
  * a context seen before (the same video or image) skips both: its K/V come from the plugin's cache
    (`context_cache.py`);
  * text queries attend to the context keys unrotated (debiased) through those cross-attentions, and to the text
    keys with RoPE through vLLM's usual `Attention` (`text_attn`: causal, sliding window, soft-cap); each segment and
    the text have their own softmax and the outputs are summed (the sum merge of the released models), then o_proj.
A cross-attention softmaxes over all of a request's encoder tokens, so a video model's two segments take
`Segments`: one softmax over frames and audio, read through N + 1 cross-attentions over the same keys (each
segment's values alone, and each segment's indicator), and each segment's output divided by its share of the
softmax: exactly the softmax over that segment alone.
The context stream computes only what is read: its keys and values (no queries), its output through o_proj with the
query heads of each KV head summed, and nothing of the last layer but its K/V.
q, k/v, o_proj and the MLP are vLLM's tensor-parallel layers; the towers are vLLM's own encoders (SigLIP or CLIP,
built up to the layer whose features are used; Whisper), the decoder's norms vLLM's; the adapters and their norms
are the reference model's own modules, replicated on every rank.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.clip import CLIPVisionModel
from vllm.model_executor.models.interfaces import SupportsMultiModal
from vllm.model_executor.models.siglip import SiglipVisionModel
from vllm.model_executor.models.utils import AutoWeightsLoader
from vllm.model_executor.models.whisper import WhisperEncoder, WhisperForConditionalGeneration
from vllm.multimodal import MULTIMODAL_REGISTRY

from ..modeling.context import ContextStreams
from ..modeling.marked_prompts import MEDIA_MARKERS
from ..modeling.streams import AUDIO
from ..processing import load_image_processor, normalize_pixels
from . import unsupported
from .context_cache import ContextBatch, ContextCache, context_cache_bytes, digest_keys
from .inputs import PictureInputs, VideoInputs
from .layers import SERVING_NORMS, DAttnDecoderLayer, rows_without_context
from .processor import DAttnDummyInputsBuilder, DAttnMultiModalProcessor, DAttnProcessingInfo

# checkpoint name -> [(vLLM parameter, shard)]: k/v and gate/up are stacked into one tensor-parallel matmul each;
# o_proj also loads the context stream's grouped o_proj
STACKED = {
    ".self_attn.k_proj.": [(".self_attn.kv_proj.", "k")],
    ".self_attn.v_proj.": [(".self_attn.kv_proj.", "v")],
    ".self_attn.o_proj.": [(".self_attn.o_proj.", None), (".self_attn.value_o_proj.", None)],
    ".mlp.gate_proj.": [(".mlp.gate_up_proj.", 0)],
    ".mlp.up_proj.": [(".mlp.gate_up_proj.", 1)],
}
# loaded by vLLM's own encoders (`vision_tower`, `audio_tower`)
VISION_TOWER, AUDIO_TOWER = "model.mm_vis.vision_model.", "model.mm_aud.encoder."
IMAGE_MODEL_UNUSED = ("model.mm_aud.",)  # the audio tower a released image checkpoint carries and never runs


class CLIPTower(CLIPVisionModel):
    """vLLM's CLIP encoder with the reference tower's features: without the class token (LLaVA's "patch")."""

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return super().forward(pixel_values, feature_select_strategy="default")


SERVING_TOWERS = {"siglip_vision_model": SiglipVisionModel, "clip_vision_model": CLIPTower}


class WhisperTower(nn.Module):
    """vLLM's Whisper encoder under the reference tower's names (`mm_aud.encoder`)."""

    def __init__(self, vllm_config: VllmConfig, whisper_config, prefix: str):
        super().__init__()
        tower_config = vllm_config.with_hf_config(whisper_config)
        self.encoder = WhisperEncoder(vllm_config=tower_config, prefix=f"{prefix}.encoder", enable_pp=False)

    def forward(self, mels: torch.Tensor) -> torch.Tensor:
        return self.encoder(mels)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The encoder's tensors under transformers' names (relative to `encoder.`), as vLLM's Whisper loads them."""

        def with_key_bias(weights):  # Whisper's k_proj has no bias; vLLM's q/k/v product has one: zeros
            for name, tensor in weights:
                yield name, tensor
                if name.endswith(".self_attn.k_proj.weight"):
                    yield name.removesuffix("weight") + "bias", tensor.new_zeros(len(tensor))

        mapper = WhisperForConditionalGeneration.hf_to_vllm_mapper
        return AutoWeightsLoader(self.encoder).load_weights(with_key_bias(weights), mapper=mapper)


class DAttnModel(nn.Module, ContextStreams):
    def __init__(self, vllm_config: VllmConfig, prefix: str):
        super().__init__()
        config = self.config = vllm_config.model_config.hf_config
        hidden, family = config.hidden_size, config.family
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, hidden, prefix=f"{prefix}.embed_tokens")
        self.embed_scale = hidden**0.5 if family.embedding_scaled else None
        self.layers = nn.ModuleList(
            DAttnDecoderLayer(config, i, vllm_config, f"{prefix}.layers.{i}") for i in range(config.num_hidden_layers)
        )
        self.norm = SERVING_NORMS[family.norm_offset](hidden, eps=config.rms_norm_eps)
        self.vllm_config = vllm_config  # the audio tower's is derived from it
        self.init_streams(config, audio_tower=AUDIO in config.streams)

    def vision_tower(self, config) -> nn.Module:
        """vLLM's own encoder (SigLIP or CLIP) in place of the reference's `VisionTower`, computing the same: built
        only up to the layer whose features are used, without the post-norm or the pooling head."""
        tower_config, layers = config.vision_tower_config, config.tower_layers_run
        tower = SERVING_TOWERS[tower_config.model_type]
        return tower(tower_config, num_hidden_layers_override=layers, require_post_norm=False, prefix="model.mm_vis")

    def audio_tower(self, config) -> nn.Module:
        """vLLM's own Whisper encoder in place of the reference's `AudioTower`."""
        return WhisperTower(self.vllm_config, config.audio_tower_config, prefix="model.mm_aud")

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        return x if self.embed_scale is None else x * torch.tensor(self.embed_scale, dtype=x.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, contexts: ContextBatch | None) -> torch.Tensor:
        """`contexts`: those of the step's requests in their first step, the new ones run through every layer."""
        h = self.embed_input_ids(input_ids)
        missing = rows_without_context(self.layers[0].self_attn.context_attn_name, len(h))
        h_context = None if contexts is None else contexts.stream
        for i, layer in enumerate(self.layers):
            h, h_context = layer(positions, h, contexts, h_context, i + 1 < len(self.layers), missing)
        if contexts is not None:
            contexts.finish()
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
        self.logits_processor = LogitsProcessor(config.vocab_size, soft_cap=config.logits_softcap)
        self.context_cache = ContextCache(context_cache_bytes(config))
        # pictures and frames arrive as bytes (`pixels`)
        self.image_processor = load_image_processor(Path(vllm_config.model_config.model), config)

    @classmethod
    def get_placeholder_str(cls, modality: str, i: int) -> str | None:
        """The released marker, which a chat request's text then starts with (`<image>` and a newline, for a picture
        or a video, as the released scripts ask); the processor cuts it out (the media is the encoder's input)."""
        return MEDIA_MARKERS[0]

    def embed_multimodal(self, **inputs) -> list[torch.Tensor]:
        """Each request's context, (tokens, hidden + 1): the tokens the cross-attention caches are built from, and
        in the last column each token's segment (`streams.py`; 0: masked); a marker for a context cached on this
        rank (`context_cache`), whose towers do not run."""
        if "sizes" in inputs:
            videos = VideoInputs.parse(self.config.streams, inputs)
            items = videos.items()
            embed = lambda new: [self.video_stream(*items[i]) for i in new]
            return self.context_cache.hand_over(digest_keys(videos.digest), embed)
        pictures = PictureInputs.parse(inputs)
        items, embed_pictures = pictures.items(), self.config.streams[0].part_on(self, "embed")
        embed = lambda new: embed_pictures([items[i] for i in new])
        return self.context_cache.hand_over(digest_keys(pictures.digest), embed)

    def embed_image(self, pictures: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        """Pictures that are not tiled, (1, 3, H, W) each: through the tower at once."""
        segment, pixels = self.config.streams[0].segment, self.pixels(torch.stack([p for p, _ in pictures]))
        return [with_segment(stream, segment) for stream in self.model.embed_images(pixels)]

    def embed_tiles(self, pictures: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        """anyres pictures, each its thumbnail and tiles (1 + columns x rows, 3, side, side) and its tiling."""
        segment, streams = self.config.streams[0].segment, []
        for pixels, (columns, rows) in pictures:
            pixels = self.pixels(pixels)
            tiles = pixels[1:].unflatten(0, (rows, columns))
            streams.append(with_segment(self.model.anyres_stream(pixels[:1], tiles)[0], segment))
        return streams

    def pixels(self, pictures: torch.Tensor) -> torch.Tensor:
        """Pictures or frames as the processor sends them (bytes) -> their pixel values in the model's dtype."""
        return normalize_pixels(pictures, self.image_processor).to(self.model.dtype)

    def video_stream(self, *item: torch.Tensor) -> torch.Tensor:
        """One video's streams end to end in the model's order, from its processed media (a tensor per stream, then
        its sizes); a stream the video lacks gives none."""
        *media, sizes = item
        streams = []
        for stream, tensor, amount in zip(self.config.streams, media, sizes[1::2].tolist(), strict=True):
            if (embedded := stream.part_on(self, "embed")(tensor, amount)) is not None:
                tokens, mask = embedded
                streams.append(with_segment(tokens, stream.segment * mask))
        return torch.cat(streams)

    def embed_frames(self, frames: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The frames' stream tokens and mask: the frames come as bytes, normalized as the processor would have."""
        return self.model.embed_video([self.pixels(frames)])

    def embed_audio(self, mels: torch.Tensor, mel_frames: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The sound track's stream tokens and mask (None: a video without one)."""
        return self.model.embed_audio([mels], [mel_frames]) if mel_frames else None

    def embed_input_ids(self, input_ids: torch.Tensor, multimodal_embeddings=None, *, is_multimodal=None):
        return self.model.embed_input_ids(input_ids)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, encoder_outputs: list[torch.Tensor] | None = None, **_
    ) -> torch.Tensor:
        contexts = self.context_cache.contexts(encoder_outputs) if encoder_outputs else None
        return self.model(input_ids, positions, contexts)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params, towers = dict(self.named_parameters()), {VISION_TOWER: self.model.mm_vis.vision_model}
        if AUDIO in self.config.streams:
            towers[AUDIO_TOWER] = self.model.mm_aud
        quantized = QuantizedOProj.of(self.config)
        loaded = set()
        for name, tensor in weights:
            unused = AUDIO_TOWER not in towers and name.startswith(IMAGE_MODEL_UNUSED)
            if unused or (name == "lm_head.weight" and self.config.tie_word_embeddings):
                continue
            tower = next((prefix for prefix in towers if name.startswith(prefix)), None)
            if tower:  # vLLM's encoders stack their q/k/v, and skip the layers they do not build
                loaded |= {tower + n for n in towers[tower].load_weights([(name.removeprefix(tower), tensor)])}
                continue
            targets = [(name, None, tensor)]
            for piece, stacked in STACKED.items():
                if name.startswith("model.layers.") and piece in name:
                    targets = [(name.replace(piece, target), shard, tensor) for target, shard in stacked]
                    break
            if quantized and ".self_attn.o_proj." in name:  # the context stream's o_proj once its parts are in
                targets = targets[:1] + quantized.add(name, tensor)
            for target, shard, value in targets:
                param = params[target]
                loader = getattr(param, "weight_loader", default_weight_loader)
                loader(param, value) if shard is None else loader(param, value, shard)
                loaded.add(target)
        return loaded


class QuantizedOProj:
    """A compressed-tensors checkpoint's o_proj parts (its quantized weight, scales, shape), per layer, until the
    layer's are all in: then its weight dequantized by compressed-tensors (the values the quantized o_proj computes
    with) for the context stream's `value_o_proj`, which sums its columns per KV head and stays unquantized."""

    def __init__(self, scheme, compressor):
        self.scheme, self.compressor = scheme, compressor
        self.names = compressor.compression_param_names(scheme)
        self.parts: dict[str, dict[str, torch.Tensor]] = {}

    @classmethod
    def of(cls, config) -> QuantizedOProj | None:
        fields = getattr(config, "quantization_config", None)
        if not fields:
            return None
        from compressed_tensors.compressors import BaseCompressor
        from compressed_tensors.quantization import QuantizationConfig

        quantization = QuantizationConfig.model_validate(fields)
        (scheme,) = quantization.config_groups.values()
        return cls(scheme, BaseCompressor.load_from_registry(quantization.format))

    def add(self, name: str, tensor: torch.Tensor) -> list[tuple[str, None, torch.Tensor]]:
        """[] until the layer's o_proj is complete, then [(its value_o_proj's weight, None, the dense weight)]."""
        module, part = name.rsplit(".", 1)
        parts = self.parts.setdefault(module, {})
        parts[part] = tensor
        if set(self.names) - set(parts):
            return []
        dense = self.compressor.decompress(self.parts.pop(module), self.scheme)["weight"]
        return [(module.replace(".o_proj", ".value_o_proj") + ".weight", None, dense)]


def with_segment(stream: torch.Tensor, segment: torch.Tensor | int) -> torch.Tensor:
    """(1, tokens, hidden) or (tokens, hidden) stream and each token's segment -> (tokens, hidden + 1)."""
    stream = stream.reshape(-1, stream.shape[-1])
    column = torch.as_tensor(segment, dtype=stream.dtype, device=stream.device).reshape(-1, 1).expand(len(stream), 1)
    return torch.cat([stream, column], dim=-1)
