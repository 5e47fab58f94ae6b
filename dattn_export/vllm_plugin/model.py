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

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from functools import cached_property, partial
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import nn
from transformers import BatchFeature
from vllm.config import VllmConfig
from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.model_executor.layers.activation import get_act_and_mul_fn
from vllm.model_executor.layers.attention import Attention, CrossAttention
from vllm.model_executor.layers.attention.attention import get_attention_context
from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.clip import CLIPVisionModel
from vllm.model_executor.models.interfaces import SupportsMultiModal
from vllm.model_executor.models.siglip import SiglipVisionModel
from vllm.model_executor.models.utils import AutoWeightsLoader
from vllm.model_executor.models.whisper import WhisperEncoder, WhisperForConditionalGeneration
from vllm.multimodal import MULTIMODAL_REGISTRY
from vllm.multimodal.inputs import MultiModalFieldConfig
from vllm.multimodal.parse import MultiModalDataParser
from vllm.multimodal.processing import (
    BaseDummyInputsBuilder,
    BaseProcessingInfo,
    EncDecMultiModalProcessor,
    PromptReplacement,
)
from vllm.v1.attention.backend import AttentionType

from ..modeling import modeling_dattn
from ..modeling.modeling_dattn import o_proj_per_kv_head
from ..modeling.streams import AUDIO, ContextStream
from ..processing import (
    MEDIA_MARKERS,
    audio_features,
    load_audio_processor,
    load_image_processor,
    normalize_pixels,
    picture_bytes,
    prompt_ids,
    tiles_bytes,
)
from . import DEFAULT_CONTEXT_CACHE_GIB, VIDEO_BACKEND, unsupported
from .context_cache import (
    ByteBoundCache,
    ContextBatch,
    ContextCache,
    digest_keys,
    media_digest,
    named_digest,
)
from .media import FILE_DIGEST
from .video import FRAME_LIMIT_OPTION, longest_sound_track, longest_video, max_video_frames, video_tokens

MAX_IMAGE_PIXELS = 64 * 2**20  # a request's image may hold at most this many pixels (it is resized to the tower's)

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
# vLLM's RMSNorm for each scale a family's norm applies to its normalized input, weight x (norm_offset + w) (vLLM's
# fused kernels where the platform has them)
SERVING_NORMS = {0.0: RMSNorm, 1.0: GemmaRMSNorm}
IMAGE_MODEL_UNUSED = ("model.mm_aud.",)  # the audio tower a released image checkpoint carries and never runs
PROFILING = "dattn_profiling"  # in a video's metadata: the dummy video vLLM profiles and warms up with
# the names (vLLM's multi_modal_uuids) of the items the processor is processing, per item
ITEM_NAMES: ContextVar[Sequence[str | None]] = ContextVar("dattn_item_names", default=())
# the name vLLM gives an item its request does not name, where its processor cache and prefix caching are off (ours:
# encoder-decoder), unique to the request (renderers/base.py `_process_mm_uuids`): not a name of the medium
UNNAMED = re.compile(r"renderer\d+-mm-\d+-(image|video)-\d+")


class DAttnProcessingInfo(BaseProcessingInfo):
    def get_supported_mm_limits(self) -> Mapping[str, int | None]:
        return {self.get_hf_config().modality: 1}

    def get_data_parser(self) -> MultiModalDataParser:
        """A video comes with its metadata, which carries its sound track (`media.DAttnVideoLoader`)."""
        return MultiModalDataParser(
            expected_hidden_size=self._get_expected_hidden_size(),
            video_needs_metadata=AUDIO in self.get_hf_config().streams,
        )

    @cached_property
    def image_processor(self):
        return load_image_processor(Path(self.ctx.model_config.model), self.get_hf_config())

    @cached_property
    def audio_processor(self):
        return load_audio_processor(Path(self.ctx.model_config.model), self.get_hf_config())

    @cached_property
    def processed_media(self) -> ByteBoundCache:
        """Pictures and videos as processed (pictures, tiles and frames as bytes; log-mel chunks) by digest, within the
        context cache's size: vLLM keeps no processed media for encoder-decoder models, so a question on a picture
        seen before would resize and normalize it again (15 ms of a 672-pixel one here, half a later question's
        time), one on a video would process its every frame and its whole sound track."""
        return ByteBoundCache(context_cache_bytes(self.get_hf_config()))

    def processed(self, digest: torch.Tensor, process: Callable[[], tuple[torch.Tensor, ...]], keep: bool = True):
        """`process()`'s tensors for the medium of `digest`, from the cache when it was processed before."""
        key = bytes(digest.tolist())
        if (item := self.processed_media.get(key)) is None:
            item = process()
            if keep:
                self.processed_media.put(key, item, sum(t.nbytes for t in item if isinstance(t, torch.Tensor)))
        return item

    def max_frames(self) -> int:
        options = self.ctx.get_mm_config().limit_per_prompt.get("video")
        return max_video_frames(self.get_hf_config(), None if options is None else options.num_frames)


class DAttnDummyInputsBuilder(BaseDummyInputsBuilder[DAttnProcessingInfo]):
    def get_dummy_text(self, mm_counts: Mapping[str, int]) -> str:
        return ""

    def get_dummy_mm_data(self, seq_len: int, mm_counts: Mapping[str, int], mm_options):
        """The largest image: an anyres model's widest tiling, filled exactly; the video with the most tokens
        (`video.longest_video`), with a sound track as long."""
        config = self.info.get_hf_config()
        size = config.vision_config["image_size"]
        if config.modality == "video":
            frames, _ = longest_video(config, self.info.max_frames(), self.info.audio_processor.hop_length)
            video = self._get_dummy_videos(width=size, height=size, num_frames=frames, num_videos=1)[0]
            audio = np.random.default_rng(0).uniform(-0.5, 0.5, longest_sound_track(frames))
            metadata = {"audio": audio.astype(np.float32), PROFILING: True}
            return {"video": [(video, metadata)] * mm_counts.get("video", 0)}
        columns, rows = picture_stream(config).largest(config)
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

    def create_decoder_prompt(self, prompt: str | list[int], mm_items) -> list[int]:
        """The text's ids as the reference makes them (`prompt_ids`: a media marker cut out, as the released code
        does); ids that hold no marker are taken as they are."""
        tokenizer = self.info.get_tokenizer()
        text = prompt if isinstance(prompt, str) else tokenizer.decode(prompt)
        if isinstance(prompt, str) or any(marker in text for marker in MEDIA_MARKERS):
            return prompt_ids(tokenizer, text.removeprefix(tokenizer.bos_token or ""))
        return prompt

    def apply(self, inputs, timing_ctx):
        """vLLM's processing, with the request's names for its items (`multi_modal_uuids`) at hand: a named item's
        digest is its name's (`named_digest`), as vLLM's own caches take the name for the item's hash, so a
        question about a named video hashes none of its frames and samples."""
        names = ITEM_NAMES.set((inputs.mm_uuid_items or {}).get(self.info.get_hf_config().modality, ()))
        try:
            return super().apply(inputs, timing_ctx)
        finally:
            ITEM_NAMES.reset(names)

    @staticmethod
    def digests(items: Sequence, content_digest: Callable[[object], torch.Tensor]) -> list[torch.Tensor]:
        """Each item's digest: its name's where its request names it, else `content_digest(item)`."""
        names = ITEM_NAMES.get() or [None] * len(items)  # vLLM checks that a request names each item or none
        return [
            content_digest(item) if name is None or UNNAMED.fullmatch(name) else named_digest(name)
            for item, name in zip(items, names)
        ]

    def _call_hf_processor(self, hf_data: Mapping[str, object], hf_kwargs: Mapping[str, object]) -> BatchFeature:
        if "videos" in hf_data:
            return self.video_features(hf_data["videos"])
        images = hf_data["images"]
        for image in images:
            if image.width * image.height > MAX_IMAGE_PIXELS:
                raise ValueError(f"image of {image.width}x{image.height} pixels: at most {MAX_IMAGE_PIXELS} are taken")
        images = [image if image.mode == "RGB" else image.convert("RGB") for image in images]
        digests = torch.stack(self.digests(images, lambda image: media_digest(np.asarray(image))))
        process = picture_stream(self.info.get_hf_config()).process
        processed = [self.info.processed(d, partial(process, self, i)) for d, i in zip(digests, images)]
        pixels, tilings = zip(*processed)
        return BatchFeature({"pixel_values": joined(pixels), "tiling": torch.tensor(tilings), "digest": digests})

    def whole_part(self, image: Image.Image) -> tuple[torch.Tensor, tuple[int, int]]:
        """A picture as the released code prepares one (mm_image_aspect_ratio), as bytes until the model normalizes
        it (a quarter of what is kept, sent and batched): (1, 3, H, W)."""
        config = self.info.get_hf_config()
        return picture_bytes([image], config.mm_image_aspect_ratio, self.info.image_processor), (0, 0)

    def tiles_part(self, image: Image.Image) -> tuple[torch.Tensor, tuple[int, int]]:
        """An anyres picture's thumbnail and tiles, as bytes, and its tiling (columns, rows)."""
        return tiles_bytes(image, self.info.image_processor, self.info.get_hf_config().mm_image_grid_points)

    def video_features(self, videos: list[tuple[np.ndarray, dict]]) -> BatchFeature:
        """Each video's processed media, a field per stream (`VIDEO_STREAMS`: the frames as the tower's squares,
        uint8 until the model normalizes them, a quarter of the memory and of what is sent to the workers; log-mel
        chunks of the sound track), flat (a video's parts after another's), with `sizes`: per video and stream, its
        parts and the amount its tokens count; and each video's `digest` (`context_cache`)."""
        most, processed = self.info.max_frames(), []
        for video, _ in videos:
            if len(video) > most:
                raise ValueError(
                    f"video of {len(video)} frames: at most {most} are served ({FRAME_LIMIT_OPTION} raises it)"
                )
        tracks = [sound_track(metadata) for _, metadata in videos]
        digests = self.digests(range(len(videos)), lambda i: video_digest(videos[i], tracks[i]))
        for (video, metadata), samples, digest in zip(videos, tracks, digests):
            # vLLM's start-up video (the longest) is never asked about
            process = partial(self.process_video, video, samples)
            processed.append(self.info.processed(digest, process, keep=not metadata.get(PROFILING)))
        *fields, sizes = zip(*processed)
        names = video_fields(self.info.get_hf_config())
        flat = {name: joined(parts) for name, parts in zip(names, fields, strict=True)}
        return BatchFeature(flat | {"sizes": torch.tensor(sizes), "digest": torch.stack(digests)})

    def process_video(self, video: np.ndarray, samples: np.ndarray | None) -> tuple:
        """A video's processed media, a tensor per stream, and its sizes [parts, amount] per stream."""
        tensors, sizes = [], []
        for stream in self.info.get_hf_config().streams:
            tensor, amount = VIDEO_STREAMS[stream.name].process(self, video, samples)
            tensors.append(tensor)
            sizes += [len(tensor), amount]
        return *tensors, sizes

    def frames_part(self, video: np.ndarray, samples: np.ndarray | None) -> tuple[torch.Tensor, int]:
        """The frames as bytes (F, 3, side, side), and their count."""
        config = self.info.get_hf_config()
        pictures = [Image.fromarray(np.asarray(frame)).convert("RGB") for frame in video]
        return picture_bytes(pictures, config.mm_image_aspect_ratio, self.info.image_processor), len(pictures)

    def audio_part(self, video: np.ndarray, samples: np.ndarray | None) -> tuple[torch.Tensor, int]:
        """The sound track's log-mel chunks and its length in mel frames; one chunk of zeros and 0 without one (or
        with one too short for a token)."""
        config, extractor = self.info.get_hf_config(), self.info.audio_processor
        if samples is not None:
            mels, mel_frames = audio_features(samples, extractor)
            if mel_frames >= config.mel_frames_per_audio_token:
                return mels, mel_frames
        return torch.zeros(1, extractor.feature_size, extractor.nb_max_frames), 0

    def _get_mm_fields_config(self, hf_inputs, hf_processor_mm_kwargs) -> Mapping[str, MultiModalFieldConfig]:
        if "sizes" in hf_inputs:
            parts = field_parts(self.info.get_hf_config(), hf_inputs["sizes"])
            return {name: MultiModalFieldConfig.flat_from_sizes("video", counts) for name, counts in parts.items()} | {
                "sizes": MultiModalFieldConfig.batched("video", keep_on_cpu=True),
                "digest": MultiModalFieldConfig.batched("video", keep_on_cpu=True),
            }
        per_image = 1 + hf_inputs["tiling"].prod(-1)  # the thumbnail and the tiles (none: a picture not tiled)
        return {
            "pixel_values": MultiModalFieldConfig.flat_from_sizes("image", per_image),
            "tiling": MultiModalFieldConfig.batched("image", keep_on_cpu=True),
            "digest": MultiModalFieldConfig.batched("image", keep_on_cpu=True),
        }

    def _get_prompt_updates(self, mm_items, hf_processor_mm_kwargs, out_mm_kwargs) -> Sequence[PromptReplacement]:
        """One placeholder per visual token, counted from the item as processed (its digest's processed media: a
        named item's may be another call's), so that the request's cross-attention cache fits its context."""
        config = self.info.get_hf_config()
        if config.modality == "video":

            def video_placeholders(item: int) -> list[int]:
                amounts = out_mm_kwargs.get_data()["sizes"][item][1::2].tolist()  # each stream's
                return [0] * video_tokens(config, *amounts)

            return [PromptReplacement(modality="video", target=[0], replacement=video_placeholders)]

        def placeholders(item: int) -> list[int]:
            columns, rows = out_mm_kwargs.get_data()["tiling"][item].tolist()  # the thumbnail's grid, then the tiles'
            return [0] * (config.tokens_per_image * (1 + columns * rows))

        return [PromptReplacement(modality="image", target=[0], replacement=placeholders)]


def joined(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Items' processed media one after another: a request's one item (the usual case) as it is kept, not copied
    (a millisecond of a later question on a 672-pixel picture here)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def context_cache_bytes(config) -> int:
    """The context cache's size per rank (`--hf-overrides '{"context_cache_gib": N}'`), in bytes."""
    return int(float(getattr(config, "context_cache_gib", DEFAULT_CONTEXT_CACHE_GIB)) * 2**30)


def video_digest(video: tuple[np.ndarray, Mapping[str, object]], samples: np.ndarray | None) -> torch.Tensor:
    """A video's content digest: its file's where it was read from one (which names its decoded frames and sound as
    well as theirs does, and costs nothing here), else its frames' and `samples`'."""
    frames, metadata = video
    digest = metadata.get(FILE_DIGEST)
    return media_digest(np.asarray(frames), samples) if digest is None else digest


def sound_track(metadata: Mapping[str, object]) -> np.ndarray | None:
    """A video's sound track from its metadata (None: a video without one); a video that another of vLLM's loaders
    decoded is refused: those sample a fixed count of frames, not the released 1 frame/s, and drop the sound."""
    if "audio" not in metadata:
        backend = metadata.get("video_backend", "its own")
        raise ValueError(
            f"the video was decoded by vLLM's {backend} loader, which drops its sound track: serve with "
            f'--media-io-kwargs \'{{"video": {{"video_backend": "{VIDEO_BACKEND}"}}}}\' (dattn-export serve '
            "does), or give the frames with {'audio': samples or None}"
        )
    samples = metadata["audio"]
    return None if samples is None else np.asarray(samples, dtype=np.float32)


def per_item(config, inputs: Mapping[str, object], names: Sequence[str]) -> list[tuple]:
    """The batch's multimodal fields, item by item: vLLM hands a field over as one tensor when its items' shapes
    agree, else as a list; flat fields (a video's parts of a stream, or an image's thumbnail and tiles, after
    another's) are split by `sizes` / `tiling`."""
    fields = [inputs[name] for name in names]
    if "sizes" in inputs:
        counts = field_parts(config, inputs["sizes"])
    else:
        counts = {"pixel_values": 1 + inputs["tiling"].prod(-1)}
    fields = [
        x.split(counts[name].tolist()) if name in counts and isinstance(x, torch.Tensor) else x
        for name, x in zip(names, fields)
    ]
    return list(zip(*fields))


def video_fields(config) -> list[str]:
    """The processor's field of each of a video's streams, in the model's order."""
    return [VIDEO_STREAMS[stream.name].field for stream in config.streams]


def field_parts(config, sizes: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each video stream's field -> each video's parts in it, from the videos' `sizes` (videos, [parts, amount] per
    stream)."""
    return dict(zip(video_fields(config), sizes[:, 0::2].unbind(-1), strict=True))


def with_segment(stream: torch.Tensor, segment: torch.Tensor | int) -> torch.Tensor:
    """(1, tokens, hidden) or (tokens, hidden) stream and each token's segment -> (tokens, hidden + 1)."""
    stream = stream.reshape(-1, stream.shape[-1])
    column = torch.as_tensor(segment, dtype=stream.dtype, device=stream.device).reshape(-1, 1).expand(len(stream), 1)
    return torch.cat([stream, column], dim=-1)


def rows_without_context(layer_name: str, tokens: int) -> torch.Tensor | None:
    """The rows (tokens,) of a step's batch whose request has no context: vLLM's cross-attention over no keys leaves
    their output undefined, and the reference's attention to the context adds 0 there; None when every request has
    one (or in a warm-up or profiling run). The same for every layer: computed once a step."""
    metadata = get_attention_context(layer_name)[0]
    if metadata is None:
        return None
    query_lens = metadata.query_start_loc.diff()
    without = metadata.seq_lens[: len(query_lens)] == 0
    if not without.any():  # checked per request, before the per-token expansion (a second host sync on a GPU)
        return None
    missing = without.repeat_interleave(query_lens)
    return torch.cat([missing, missing.new_zeros(tokens - len(missing))])  # padding rows after the batch's tokens


class Segments:
    """A cross-attention over N context streams with a softmax each, from one softmax over all of them: the
    streams' values apart and their indicators, read through N + 1 cross-attentions over the same keys. Stream i
    gives sum_i p v / sum_i p, with p the one softmax: its own softmax exactly (the common normalizer cancels); a
    stream a request lacks gives 0."""

    def __init__(self, streams: tuple[ContextStream, ...], head_dim: int):
        self.streams, self.count, self.head_dim = streams, len(streams), head_dim

    @property
    def reads(self) -> tuple[str, ...]:
        """The cross-attentions of a layer, by name (vLLM allows no digit but the layer's in an attention's name):
        one where a single stream is the whole encoder sequence."""
        return ("context",) if self.count == 1 else (*(stream.name for stream in self.streams), "shares")

    def values(self, v: torch.Tensor, segment: torch.Tensor) -> list[torch.Tensor]:
        """(tokens, kv heads x head_dim) values and each token's segment (0: none) -> each read's values."""
        if self.count == 1:
            return [v]
        member = torch.stack([segment == stream.segment for stream in self.streams], dim=-1).to(v.dtype)  # (tokens, N)
        v = v.unflatten(-1, (-1, self.head_dim))
        indicator = torch.cat([member, member.new_zeros(len(v), self.head_dim - self.count)], -1)
        per_segment = [v * member[:, None, i : i + 1] for i in range(self.count)]
        return [x.flatten(1) for x in per_segment] + [indicator[:, None].expand_as(v).flatten(1).contiguous()]

    def merge(self, reads: list[torch.Tensor]) -> torch.Tensor:
        """Each read's output (tokens, heads x head_dim) -> the sum of the segments' own softmax outputs."""
        if self.count == 1:
            return reads[0]
        share = reads[-1].unflatten(-1, (-1, self.head_dim))[..., : self.count]  # (tokens, heads, N)
        out = 0
        for i, read in enumerate(reads[:-1]):
            mass = share[..., i : i + 1]
            out = out + torch.where(mass > 0, read.unflatten(-1, (-1, self.head_dim)) / mass, 0)
        return out.flatten(1)


class DAttnAttention(nn.Module):
    """q/k/v/o of one layer; `forward` returns the text stream's attention output and the context stream's (its own
    values through o_proj: diagonal V2V). Queries and keys/values are two products, so that context tokens compute
    only their keys and values; their output goes through `value_o_proj`, o_proj with the columns of the query heads
    that share a KV head summed (1/group of o_proj's work; the reference's `value_output`)."""

    def __init__(self, config, layer_idx: int, vllm_config: VllmConfig, prefix: str):
        super().__init__()
        ranks = get_tensor_model_parallel_world_size()
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads // ranks
        self.num_kv_heads = max(1, config.num_key_value_heads // ranks)  # fewer KV heads than ranks: replicated
        bias, quant = config.has_bias, vllm_config.quant_config
        self.q_proj = ColumnParallelLinear(
            config.hidden_size,
            config.num_attention_heads * self.head_dim,
            bias=bias("q_proj"),
            quant_config=quant,
            prefix=f"{prefix}.q_proj",
        )
        # vLLM's q/k/v layer with no query heads: its tensor-parallel split of k and v (KV heads replicated where
        # there are fewer than ranks)
        self.kv_proj = QKVParallelLinear(
            config.hidden_size,
            self.head_dim,
            0,
            config.num_key_value_heads,
            bias=bias("k_proj"),  # k and v have biases alike in every family
            quant_config=quant,
            prefix=f"{prefix}.kv_proj",
        )
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim,
            config.hidden_size,
            bias=bias("o_proj"),
            quant_config=quant,
            prefix=f"{prefix}.o_proj",
        )
        self.value_o_proj = RowParallelLinear(
            self.num_kv_heads * ranks * self.head_dim,
            config.hidden_size,
            bias=bias("o_proj"),
            prefix=f"{prefix}.value_o_proj",
        )
        self.value_o_proj.weight.weight_loader = self.load_value_o_proj
        self.rotary_emb = get_rope(
            self.head_dim, config.max_position_embeddings, is_neox_style=True, rope_parameters=config.rope_parameters
        )
        shared = dict(
            head_size=self.head_dim,
            scale=config.attention_scale,
            num_kv_heads=self.num_kv_heads,
            cache_config=vllm_config.cache_config,
            quant_config=quant,
            logits_soft_cap=config.attention_softcap,
        )
        self.text_attn = Attention(
            self.num_heads,
            per_layer_sliding_window=config.sliding_window_of(layer_idx),
            prefix=f"{prefix}.text_attn",
            **shared,
        )
        self.segments = Segments(config.streams, self.head_dim)
        self.context_attn = nn.ModuleDict(
            {
                name: CrossAttention(
                    self.num_heads,
                    prefix=f"{prefix}.context_attn.{name}",
                    attn_type=AttentionType.ENCODER_DECODER,
                    **shared,
                )
                for name in self.segments.reads
            }
        )

    def load_value_o_proj(self, param: nn.Parameter, o_proj: torch.Tensor) -> None:
        """o_proj's weight (hidden, heads x head_dim) -> this rank's query heads' columns, summed per KV head."""
        columns = self.num_heads * self.head_dim
        mine = o_proj.narrow(1, get_tensor_model_parallel_rank() * columns, columns).to(param.dtype)
        param.data.copy_(o_proj_per_kv_head(mine, self.num_kv_heads, self.head_dim))

    @property
    def context_attn_name(self) -> str:
        """A cross-attention's name in vLLM's forward context (the cross-attentions share one metadata)."""
        return self.context_attn[self.segments.reads[0]].layer_name

    def kv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kv_proj(x)[0].chunk(2, dim=-1)

    def context_stream(self, x_context: torch.Tensor, need_out: bool) -> tuple[torch.Tensor, ...]:
        """New context tokens' K, V and (unless it is never read: the last layer's) output."""
        context_k, context_v = (t.contiguous() for t in self.kv(x_context))
        return context_k, context_v, self.value_o_proj(context_v)[0] if need_out else None

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        context_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
        rows_without_context: torch.Tensor | None,
    ) -> torch.Tensor:
        """The text's attention output; `context_kv`: the K, V and segments of the contexts of the step's requests
        in their first step, which go into the cross-attention caches."""
        q, (k, v) = self.q_proj(x)[0], self.kv(x)
        context_k, context_values = None, [None] * len(self.segments.reads)
        if context_kv is not None:
            context_k, context_v, segment = context_kv
            context_values = self.segments.values(context_v, segment)
        # T2V takes the queries unrotated (debiased), before the rotary op rotates q and k in place
        reads = [attn(q, context_k, values) for attn, values in zip(self.context_attn.values(), context_values)]
        context = self.segments.merge(reads)
        if rows_without_context is not None:
            context = context.masked_fill(rows_without_context[:, None], 0)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.text_attn(q, k, v) + context)[0]


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
        self.act = get_act_and_mul_fn(config.activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)[0]))[0]


class DAttnDecoderLayer(nn.Module, modeling_dattn.LayerNorms):
    def __init__(self, config, layer_idx: int, vllm_config: VllmConfig, prefix: str):
        super().__init__()
        self.layer_idx = layer_idx
        self.self_attn = DAttnAttention(config, layer_idx, vllm_config, f"{prefix}.self_attn")
        self.mlp = DAttnMLP(config, vllm_config, f"{prefix}.mlp")
        self.init_norms(config, SERVING_NORMS[config.family.norm_offset])

    def forward(
        self,
        positions: torch.Tensor,
        h: torch.Tensor,
        contexts: ContextBatch | None,
        h_context: torch.Tensor | None,
        need_context: bool,
        rows_without_context: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The text's hidden states and the new contexts' (`h_context`: None past the last layer that needs them,
        or when every context of the step is cached, its K/V read from `contexts`)."""
        context_kv = None
        if contexts is not None:
            new_k = new_v = None
            if h_context is not None:
                new_k, new_v, out = self.self_attn.context_stream(self.input_layernorm(h_context), need_context)
                h_context = None if out is None else self.residual_mlp(h_context, out)
            context_kv = (*contexts.layer_kv(self.layer_idx, new_k, new_v), contexts.segment)
        attn_out = self.self_attn(positions, self.input_layernorm(h), context_kv, rows_without_context)
        return self.residual_mlp(h, attn_out), h_context


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


class DAttnModel(nn.Module, modeling_dattn.ContextStreams):
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
        return None  # the image is not in the text: it is the encoder's input

    def embed_multimodal(self, **inputs) -> list[torch.Tensor]:
        """Each request's context, (tokens, hidden + 1): the tokens the cross-attention caches are built from, and
        in the last column each token's segment (`streams.py`; 0: masked); a marker for a context cached on this
        rank (`context_cache`), whose towers do not run."""
        keys = digest_keys(inputs["digest"])
        if "sizes" in inputs:
            videos = per_item(self.config, inputs, (*video_fields(self.config), "sizes"))
            return self.context_cache.hand_over(keys, lambda new: [self.video_stream(*videos[i]) for i in new])
        pictures = per_item(self.config, inputs, ("pixel_values", "tiling"))
        embed = picture_stream(self.config).embed
        return self.context_cache.hand_over(keys, lambda new: embed(self, [pictures[i] for i in new]))

    def whole_embeds(self, pictures: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        """Pictures that are not tiled, (1, 3, H, W) each: through the tower at once."""
        segment, pixels = self.config.streams[0].segment, self.pixels(torch.stack([p for p, _ in pictures]))
        return [with_segment(stream, segment) for stream in self.model.embed_images(pixels)]

    def tiles_embeds(self, pictures: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
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
            if (embedded := VIDEO_STREAMS[stream.name].embed(self, tensor, amount)) is not None:
                tokens, mask = embedded
                streams.append(with_segment(tokens, stream.segment * mask))
        return torch.cat(streams)

    def frames_embeds(self, frames: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The frames' stream tokens and mask: the frames come as bytes, normalized as the processor would have."""
        return self.model.embed_video([self.pixels(frames)])

    def audio_embeds(self, mels: torch.Tensor, mel_frames: int) -> tuple[torch.Tensor, torch.Tensor] | None:
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
        loaded = set()
        for name, tensor in weights:
            unused = AUDIO_TOWER not in towers and name.startswith(IMAGE_MODEL_UNUSED)
            if unused or (name == "lm_head.weight" and self.config.tie_word_embeddings):
                continue
            tower = next((prefix for prefix in towers if name.startswith(prefix)), None)
            if tower:  # vLLM's encoders stack their q/k/v, and skip the layers they do not build
                loaded |= {tower + n for n in towers[tower].load_weights([(name.removeprefix(tower), tensor)])}
                continue
            targets = [(name, None)]
            for piece, stacked in STACKED.items():
                if name.startswith("model.layers.") and piece in name:
                    targets = [(name.replace(piece, target), shard) for target, shard in stacked]
                    break
            for target, shard in targets:
                param = params[target]
                loader = getattr(param, "weight_loader", default_weight_loader)
                loader(param, tensor) if shard is None else loader(param, tensor, shard)
                loaded.add(target)
        return loaded


@dataclass(frozen=True)
class VideoStreamPart:
    """A video stream's part in the plugin: the processor's field its media travel in, how the processor makes them
    from the video's frames and sound track (a tensor of parts, and the amount its tokens count), and how the model
    embeds them (its tokens and mask; None: the video has none of it)."""

    field: str
    process: Callable[[DAttnMultiModalProcessor, np.ndarray, np.ndarray | None], tuple[torch.Tensor, int]]
    embed: Callable[[DAttnForCausalLM, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor] | None]


VIDEO_STREAMS = {  # by stream name
    "frames": VideoStreamPart("frame_pixels", DAttnMultiModalProcessor.frames_part, DAttnForCausalLM.frames_embeds),
    "audio": VideoStreamPart("audio_mels", DAttnMultiModalProcessor.audio_part, DAttnForCausalLM.audio_embeds),
}


@dataclass(frozen=True)
class PictureStreamPart:
    """An image model's stream (its only one) in the plugin: the largest picture's size in tower squares (vLLM's
    profiling run), how the processor prepares a picture (its bytes, an anyres picture's thumbnail then tiles,
    and its tiling: columns, rows; (0, 0): not tiled) and how the model embeds a batch."""

    largest: Callable[[object], tuple[int, int]]
    process: Callable[[DAttnMultiModalProcessor, Image.Image], tuple[torch.Tensor, tuple[int, int]]]
    embed: Callable[[DAttnForCausalLM, list[tuple[torch.Tensor, torch.Tensor]]], list[torch.Tensor]]


PICTURE_STREAMS = {  # by stream name
    "image": PictureStreamPart(
        lambda config: (1, 1),
        DAttnMultiModalProcessor.whole_part,
        DAttnForCausalLM.whole_embeds,
    ),
    "tiles": PictureStreamPart(
        lambda config: max(config.mm_image_grid_points, key=lambda point: point[0] * point[1]),
        DAttnMultiModalProcessor.tiles_part,
        DAttnForCausalLM.tiles_embeds,
    ),
}


def picture_stream(config) -> PictureStreamPart:
    """An image model's stream's part (its one stream)."""
    return PICTURE_STREAMS[config.streams[0].name]
