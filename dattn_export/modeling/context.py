"""The context streams of the D-Attn model: pictures, a video's frames and its audio, from pixels and log-mel features
to the tokens the decoder's layers take (towers, adapter, pooling, position and time embeddings, norms), then to
every layer's K/V, made once per picture or video and reused by any prompt (`ContextCaches`).

Ships to the Hub beside modeling_dattn.py: only torch, transformers and its siblings are imported."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import CLIPVisionModel, PretrainedConfig, SiglipVisionModel
from transformers.models.whisper.modeling_whisper import WhisperEncoder

from .images import anyres_grid
from .streams import (
    AUDIO,
    CONTEXT_CHUNK,
    FRAMES,
    AudioStream,
    FramesStream,
    ImageStream,
    pooled_side,
)

# one layer's cache: key, value (B, kv_heads, S, head_dim) [, WINGS key, value (B, hidden / head_dim, S, head_dim)]
KV = tuple[Tensor, ...]


def rms_norm(x: Tensor, eps: float = 1e-5) -> Tensor:
    """x * rsqrt(mean(x^2) + eps), computed in fp32 and returned in x's dtype (the released models' rms_norm)."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def linear_fp32(layer: nn.Linear, x: Tensor) -> Tensor:
    return F.linear(x.float(), layer.weight.float(), None if layer.bias is None else layer.bias.float())


class MMRMSNorm(nn.Module):
    """weight * rms_norm(x): the adapter's norms (mm_rand_norm, mm_rand_llm_norm)."""

    def __init__(self, dim: int, initial: float = 1.0):
        super().__init__()
        self.initial = initial
        self.weight = nn.Parameter(torch.full((dim,), float(initial)))

    def forward(self, x: Tensor) -> Tensor:
        return self.weight * rms_norm(x)


class LearnablePositionEmbedding(nn.Module):
    """A learnable embedding of fractional positions along one axis (mm_rand_pos_h / _w): `length` positions are
    spread evenly over [0, num_positions - 1], their sinusoids (hidden-wide, sin on even channels and cos on odd,
    transformer frequencies) go through Linear-GELU-Linear in fp32, and the result is RMS-normalised."""

    def __init__(self, hidden_size: int, num_positions: int):
        super().__init__()
        self.num_positions = num_positions
        self.mlp = nn.Sequential(nn.Linear(hidden_size, hidden_size), nn.GELU(), nn.Linear(hidden_size, hidden_size))

    def forward(self, length: int, dtype: torch.dtype) -> Tensor:
        """(length, hidden) in `dtype`."""
        index = torch.arange(length, device=self.mlp[0].weight.device)
        return self.at(index, torch.ones_like(index).sum(), dtype)  # the length as a tensor: graphs keep it dynamic

    def at(self, index: Tensor, length: int | Tensor, dtype: torch.dtype) -> Tensor:
        """(N, hidden): the embeddings of positions `index` (N,) out of `length` (an int, or a 0-d tensor in a
        graph that embeds part of a stream)."""
        device, hidden = self.mlp[0].weight.device, self.mlp[0].in_features
        position = index.float() / torch.clamp(torch.as_tensor(length, device=device) - 1, min=1).float()
        position = position * (self.num_positions - 1)
        channel = torch.arange(0, hidden, 2, dtype=torch.float32, device=device)
        frequency = torch.exp(channel * (-math.log(1e4) / hidden))
        angle = position[:, None] * frequency
        features = torch.stack([angle.sin(), angle.cos()], dim=-1).flatten(-2)  # interleaved: sin, cos, sin, ...
        return rms_norm(linear_fp32(self.mlp[2], F.gelu(linear_fp32(self.mlp[0], features))).to(dtype))


class MLPProjector(nn.Module):
    """mlp2x_gelu: Linear-GELU-Linear (tensor names model.0 / model.2)."""

    def __init__(self, in_dim: int, hidden_size: int):
        super().__init__()
        self.model = nn.Sequential(nn.Linear(in_dim, hidden_size), nn.GELU(), nn.Linear(hidden_size, hidden_size))

    def forward(self, x: Tensor) -> Tensor:
        return self.model(x)


class VisionTower(nn.Module):
    """SigLIP or CLIP tower under the released name `vision_model`; features from a selectable layer. The whole
    tower is held (a checkpoint's every tensor loads and converts as stored), but only the layers up to the selected
    one run: those after it, the final norm and SigLIP's pooling head never reach the features (at layer -2 of
    SigLIP so400m's 27: one layer and the head, 7% of the tower's work)."""

    def __init__(self, config):
        super().__init__()
        tower_config = config.vision_tower_config
        self.is_clip = tower_config.model_type == "clip_vision_model"
        self.vision_model = (CLIPVisionModel if self.is_clip else SiglipVisionModel)(tower_config)
        self.layers_run = config.tower_layers_run

    def forward(self, pixel_values: Tensor) -> Tensor:
        tower = self.vision_model
        features = tower.embeddings(pixel_values)
        if self.is_clip:
            features = tower.pre_layrnorm(features)
        for layer in tower.encoder.layers[: self.layers_run]:
            features = layer(features, None)
        return features[:, 1:] if self.is_clip else features  # CLIP: drop the class token (LLaVA "patch")


class AudioTower(nn.Module):
    """The Whisper encoder the released models carry (`model.mm_aud.encoder.*`); image prompts do not run it."""

    def __init__(self, config):
        super().__init__()
        self.encoder = WhisperEncoder(config.audio_tower_config)

    def forward(self, mels: Tensor) -> Tensor:
        """(chunks, mel bins, chunk frames) log-mel features -> (chunks, positions, width)."""
        return self.encoder(mels).last_hidden_state


class FramePool(nn.Module):
    """mm_rand_img_pool: frames' tower features (N, C, g, g) -> (N, C', s, s), by the config's mm_pool_rule."""

    def __init__(self, config):
        super().__init__()
        self.rule, self.pool = config.mm_pool_rule, config.mm_image_pool_size
        channels = config.vision_config["hidden_size"]
        if self.rule == "conv-interpolate":
            self.conv = nn.Conv2d(channels, channels, kernel_size=math.ceil(config.patch_grid / self.pool), bias=False)
        self.out_channels = channels if self.rule == "conv-interpolate" else channels * self.pool**2

    def forward(self, x: Tensor, side: int | None = None) -> Tensor:
        """`side`: space-to-depth's pooled side in tokens (`streams.pooled_side`), which the padded grid is resized
        to first (bilinear, as utils.resize_by_tokens); None: the grid as the tower gives it. The graph always
        passes it (resizing a grid to its own size changes nothing), so that one graph takes any video length."""
        if self.rule == "conv-interpolate":  # mm_vision/pool.py (Vidi_7B)
            return F.interpolate(self.conv(x), size=self.pool, mode="bilinear", align_corners=True)
        x = F.pad(x, (0, 1, 0, 1))  # mm_vision/pool.py (Vidi1.5_9B), with the size multimodal.py chooses
        if side is not None:
            x = F.interpolate(x, size=(side * self.pool, side * self.pool), mode="bilinear", align_corners=False)
        frames, channels, height, width = x.shape
        m = self.pool  # utils.space_to_depth: m x m blocks into channels
        x = x.reshape(frames, channels, height // m, m, width // m, m).permute(0, 1, 3, 5, 2, 4)
        return x.reshape(frames, channels * m * m, height // m, width // m)


class ContextStreams:
    """The context streams before the decoder layers: images (tower -> adapter -> positions -> LLM norm), a video
    model's frames and audio. Mixed into DAttnModel and into the vLLM plugin's model, which hold these modules under
    the same names (`init_streams`)."""

    config: PretrainedConfig  # what the host provides beside the modules init_streams makes
    dtype: torch.dtype  # the weights' dtype, which the towers' inputs are cast to

    @property
    def towers_device(self) -> torch.device:
        """Where the towers' weights are: their inputs, prepared on the CPU, are moved there as they are read."""
        return next(self.mm_vis.parameters()).device

    def init_streams(self, config, audio_tower: bool) -> None:
        """The modules from pixels (and a video model's audio) to the context streams; `audio_tower`: the Whisper
        tower too (an image model's checkpoint may carry one that its image path never runs)."""
        hidden = config.hidden_size
        self.mm_vis = self.vision_tower(config)
        if audio_tower:
            self.mm_aud = self.audio_tower(config)
        self.mm_rand_llm_norm = MMRMSNorm(hidden, config.mm_std)
        for stream in config.streams:
            stream.part_on(self, "modules")(config, stream)

    def modules_image(self, config, stream: ImageStream) -> None:
        """A picture's (or its tiles'): projected, normed, with row and column embeddings."""
        hidden = config.hidden_size
        self.mm_rand_projector = MLPProjector(config.vision_config["hidden_size"], hidden)
        self.mm_rand_norm = MMRMSNorm(hidden)
        self.mm_rand_pos_w = LearnablePositionEmbedding(hidden, stream.position_grid(config))
        self.mm_rand_pos_h = LearnablePositionEmbedding(hidden, stream.position_grid(config))

    modules_tiles = modules_image  # a tiled picture's are a picture's; its embeddings span the joined grid

    def modules_frames(self, config, stream: FramesStream) -> None:
        """A frame's: pooled, projected, normed, with row and column embeddings (over the pooled grid)."""
        hidden = config.hidden_size
        self.mm_rand_img_pool = FramePool(config)
        self.mm_rand_img_projector = MLPProjector(self.mm_rand_img_pool.out_channels, hidden)
        self.mm_rand_img_norm = MMRMSNorm(hidden)
        self.mm_rand_pos_w = LearnablePositionEmbedding(hidden, config.mm_image_pool_size)
        self.mm_rand_pos_h = LearnablePositionEmbedding(hidden, config.mm_image_pool_size)

    def modules_audio(self, config, stream: AudioStream) -> None:
        """The sound's: pooled, projected, normed; and the time embeddings frames and audio both add."""
        hidden, whisper, pool = config.hidden_size, config.audio_config["d_model"], config.mm_audio_pool_size
        audio_width = whisper if config.mm_pool_rule == "conv-interpolate" else hidden
        self.mm_rand_aud_pool = nn.Conv1d(whisper, audio_width, kernel_size=pool, stride=pool, bias=False)
        self.mm_rand_aud_projector = MLPProjector(audio_width, hidden)
        self.mm_rand_aud_norm = MMRMSNorm(hidden)
        self.mm_rand_pos_t = LearnablePositionEmbedding(hidden, config.mm_time_interval)

    def vision_tower(self, config) -> nn.Module:
        """The module under `mm_vis`: (N, 3, H, W) pixels -> (N, patches, tower width) features (a host may give its
        own encoders that compute the same, here and in `audio_tower`)."""
        return VisionTower(config)

    def audio_tower(self, config) -> nn.Module:
        """The module under `mm_aud`: (chunks, mel bins, chunk frames) -> (chunks, positions, width) features."""
        return AudioTower(config)

    def scaled(self, stream: Tensor) -> Tensor:
        """A context stream as the decoder takes it: with mm_scale_streams, times sqrt(hidden) as a family with
        embedding_scaled scales its text embeddings (rounded to the stream's dtype, as it rounds its normalizer)."""
        if not self.config.mm_scale_streams:
            return stream
        return stream * torch.tensor(self.config.hidden_size**0.5, dtype=stream.dtype)

    def embed_images(self, pixel_values: Tensor) -> Tensor:
        """(B, images, 3, H, W) pixels -> (B, images * tokens_per_image, hidden) visual embeddings: tower features
        -> projector -> norm -> + row, + column embeddings -> LLM norm (-> x sqrt(hidden) with mm_scale_streams)."""
        if "images" not in self.config.streams[0].media:
            raise ValueError("a video model takes frames and audio (encode_video, encode_audio), not images")
        batch, images = pixel_values.shape[:2]
        grid = self.config.patch_grid
        features = self.mm_vis(pixel_values.flatten(0, 1).to(self.towers_device, self.dtype)).unflatten(1, (grid, grid))
        x = self.mm_rand_norm(self.mm_rand_projector(features))
        x = self.with_positions(x)
        x = self.scaled(self.mm_rand_llm_norm(x.flatten(1, 2)))
        return x.unflatten(0, (batch, images)).flatten(1, 2)

    def anyres_tokens(self, thumbnail: Tensor, tiles: Tensor) -> Tensor:
        """One image's projected features, its thumbnail's (grid^2, hidden) and its tiles' (rows, columns, grid^2,
        hidden) -> (grid^2 + rows x columns x grid^2, hidden): the thumbnail's grid, then the tiles joined into one
        (rows x grid, columns x grid) grid, each + row, + column embeddings."""
        grid = self.config.patch_grid
        thumbnail = self.with_positions(thumbnail.unflatten(0, (grid, grid)))
        joined = tiles.unflatten(2, (grid, grid)).permute(0, 2, 1, 3, 4).flatten(0, 1).flatten(1, 2)
        return torch.cat([thumbnail.flatten(0, 1), self.with_positions(joined).flatten(0, 1)])

    def anyres_stream(self, thumbnail: Tensor, tiles: Tensor) -> Tensor:
        """One anyres image as its stream tokens (the anyres vision graph): its thumbnail (1, 3, H, W) and tiles
        (rows, columns, 3, H, W) -> (1, L, hidden)."""
        pixels = torch.cat([thumbnail, tiles.flatten(0, 1)]).to(self.towers_device, self.dtype)
        features = self.mm_rand_projector(self.mm_vis(pixels))
        return self.stream_tokens(self.anyres_tokens(features[0], features[1:].unflatten(0, tiles.shape[:2])))[None]

    def with_positions(self, x: Tensor) -> Tensor:
        """(..., rows, columns, hidden) + row embeddings, then + column embeddings."""
        x = x + self.mm_rand_pos_h(x.shape[-3], x.dtype)[:, None, :]
        return x + self.mm_rand_pos_w(x.shape[-2], x.dtype)[None, :, :]

    def stream_tokens(self, x: Tensor) -> Tensor:
        """Context tokens as the decoder takes them: LLM-normed (token by token), scaled with mm_scale_streams."""
        return self.scaled(self.mm_rand_llm_norm(x))

    def embed_anyres(self, tiles: list[Tensor], image_sizes: list[tuple[int, int]]) -> tuple[Tensor, Tensor]:
        """Anyres images (multimodal.py encode_images, its list branch): each sample's thumbnail and tiles
        (1 + columns x rows, 3, H, W) and its image's (width, height) -> (B, L, hidden) visual embeddings and their
        mask; each image is one `anyres_stream` part."""
        tile = self.config.vision_config["image_size"]
        samples = []
        for pixels, size in zip(tiles, image_sizes):
            columns, rows = anyres_grid(size, self.config.mm_image_grid_points, tile)
            samples.append(self.anyres_stream(pixels[:1], pixels[1:].unflatten(0, (rows, columns)))[0])
        # the released path leaves masked tokens unzeroed; they are never read, so the shared stream ending serves
        return self.padded_samples(samples, [t.abs().sum() != 0 for t in tiles])

    def embed_video(self, frames: list[Tensor]) -> tuple[Tensor, Tensor]:
        """Each sample's frames (F_i, 3, H, W) -> (B, L, hidden) visual embeddings and their (B, L) mask
        (multimodal.py encode_video_images), `frame_stream` part by part. A sample whose frames are all zero has no
        video."""
        side = self.resized_side(sum(len(f) for f in frames))  # the released budget counts the batch's frames
        samples, has_video = [], []
        for sample in frames:  # a tensor, or images.PreparedFrames: each part prepared as it is read
            tokens, nonzero = [], False
            for start in range(0, len(sample), FRAMES.parts_per_run):
                pixels = sample[start : start + FRAMES.parts_per_run].to(self.towers_device)
                index = torch.arange(start, start + len(pixels), device=pixels.device)
                num_frames = torch.tensor(len(sample), device=pixels.device)
                tokens.append(self.frame_stream(pixels, index, num_frames, side)[0])
                nonzero = nonzero | (pixels.abs().sum() != 0)
            samples.append(torch.cat(tokens))
            has_video.append(nonzero)
        return self.padded_samples(samples, has_video)

    def resized_side(self, total_frames: int) -> int | None:
        """Space-to-depth past the resize budget: the pooled side (in tokens) each frame's grid is resized to for a
        video of `total_frames` frames; None where the released pool does not resize."""
        config = self.config
        if config.mm_pool_rule != "space-to-depth":
            return None
        side = pooled_side(config.patch_grid + 1, config.mm_image_pool_size, total_frames)
        return None if side * config.mm_image_pool_size == config.patch_grid + 1 else side

    def frame_stream(
        self, pixels: Tensor, frame_index: Tensor, num_frames: Tensor, pooled_side: int | None = None
    ) -> Tensor:
        """Part of one video as its stream tokens (the frames graph): frames (N, 3, H, W) at `frame_index` (N,) of
        the video's `num_frames` -> (1, N * tokens per frame, hidden): tower features -> mm_rand_img_pool (each grid
        resized to `pooled_side` tokens a side first: `resized_side`) -> projector -> norm -> + row, + column
        embeddings (over the pooled grid) -> + time embeddings (over the video's frames)."""
        grid, size = self.config.patch_grid, self.config.vision_config["image_size"]
        if tuple(pixels.shape[-3:]) != (3, size, size):
            raise ValueError(f"frames of shape {list(pixels.shape[-3:])}: the tower takes [3, {size}, {size}]")
        features = self.mm_vis(pixels.to(self.dtype)).unflatten(1, (grid, grid)).permute(0, 3, 1, 2)
        x = self.mm_rand_img_pool(features, pooled_side).permute(0, 2, 3, 1)
        x = self.with_positions(self.mm_rand_img_norm(self.mm_rand_img_projector(x)))
        x = x + self.mm_rand_pos_t.at(frame_index, num_frames, x.dtype)[:, None, None]
        return self.stream_tokens(x.flatten(0, 2))[None]

    def embed_audio(self, mels: list[Tensor], mel_frames: list[int]) -> tuple[Tensor, Tensor]:
        """Each sample's log-mel chunks (C_i, mel bins, chunk frames) and its length in mel frames -> (B, L, hidden)
        audio embeddings and their (B, L) mask (multimodal.py encode_video_audios), `audio_stream` part by part,
        each part's tokens within the sample kept. A sample whose features are all zero has no audio."""
        samples = []
        for sample, length in zip(mels, mel_frames):
            parts = sample.to(self.towers_device).split(self.audio_chunks_per_run())
            starts = range(0, len(sample), self.audio_chunks_per_run())
            streams = [
                self.audio_stream(
                    part, torch.tensor(start, device=part.device), torch.tensor(length, device=part.device)
                )
                for part, start in zip(parts, starts)
            ]
            samples.append(torch.cat([x[0, within[0] == 1] for x, within in streams]))
        return self.padded_samples(samples, [m.abs().sum() != 0 for m in mels])

    def audio_chunks_per_run(self) -> int:
        """AUDIO.parts_per_run, rounded up so that no pooling window spans two runs: then the parts pool as the
        sample's chunks end to end do."""
        positions, pool = self.config.audio_config["max_source_positions"], self.config.mm_audio_pool_size
        period = pool // math.gcd(positions, pool)  # chunks after which a pooling window ends with a chunk
        return -(-AUDIO.parts_per_run // period) * period

    def audio_stream(self, mels: Tensor, first_chunk: Tensor, mel_frames: Tensor) -> tuple[Tensor, Tensor]:
        """Part of one sample's audio as its stream tokens (the audio graph): 30 s chunks `first_chunk`, ... of
        log-mel features (C, mel bins, chunk frames) of a sample `mel_frames` long -> (1, C * tokens per chunk,
        hidden) and (1, C * tokens per chunk) int64, 1 for the tokens within the sample. The Whisper encoder per
        chunk -> the chunks end to end -> mm_rand_aud_pool (a strided conv) -> projector -> norm -> + time
        embeddings (over the sample's tokens). A part starts where a pooling window starts (`audio_chunks_per_run`)."""
        features = self.mm_aud(mels.to(self.dtype))
        x = self.mm_rand_aud_pool(features.flatten(0, 1)[None].transpose(1, 2)).transpose(1, 2)[0]
        x = self.mm_rand_aud_norm(self.mm_rand_aud_projector(x))
        first = first_chunk * features.shape[1] // self.config.mm_audio_pool_size
        index = first + torch.arange(x.shape[0], device=x.device)
        num_tokens = AUDIO.tokens(self.config, mel_frames)
        x = self.stream_tokens(x + self.mm_rand_pos_t.at(index, num_tokens, x.dtype))
        return x[None], (index < num_tokens).long()[None]

    @staticmethod
    def join_contexts(*contexts: tuple[list[KV], Tensor]) -> tuple[list[KV], Tensor]:
        """Context streams (each an `encode_*`'s every-layer K/V and segment ids), in the model's stream order, as
        the one context the model takes, as every backend does: each layer's keys and values end to end, and each
        key's segment."""
        if len(contexts) == 1:
            return contexts[0]
        layers = zip(*(kv for kv, _ in contexts))
        caches = [tuple(torch.cat(parts, dim=2) for parts in zip(*layer)) for layer in layers]
        return caches, torch.cat([mask.long() for _, mask in contexts], dim=1)

    @staticmethod
    def padded_samples(samples: list[Tensor], present: list[Tensor]) -> tuple[Tensor, Tensor]:
        """Per-sample stream tokens -> padded to the longest (B, L, hidden) and zeroed outside the mask: the tokens
        that are not padding, of the samples that are `present`."""
        x = nn.utils.rnn.pad_sequence(samples, batch_first=True)
        mask = (x.abs().sum(-1) != 0) & torch.stack(present)[:, None]
        return x * mask[..., None], mask


class ContextCaches:
    """Every layer's K/V of a context stream: a function of the picture or video alone, made once and reused by any
    prompt. Mixed into DAttnModel, whose decoder layers (`layers`, `rotary_emb`) run the stream."""

    config: PretrainedConfig
    layers: nn.ModuleList
    rotary_emb: nn.Module

    def encode_anyres(self, tiles: list[Tensor], image_sizes: list[tuple[int, int]]) -> tuple[list[KV], Tensor]:
        """Every layer's visual K/V for anyres images, and the visual mask."""
        return self.stream_caches(*self.embed_anyres(tiles, image_sizes))

    def encode_video(self, frames: list[Tensor]) -> tuple[list[KV], Tensor]:
        """Every layer's K/V for each sample's frames, and their segment ids (`join_contexts` adds the audio's)."""
        caches, mask = self.stream_caches(*self.embed_video(frames))
        return caches, FRAMES.segment * mask.long()

    def encode_audio(self, mels: list[Tensor], mel_frames: list[int]) -> tuple[list[KV], Tensor]:
        """Every layer's audio K/V (the audio stream runs the layers as the visual one does), and their segment ids."""
        caches, mask = self.stream_caches(*self.embed_audio(mels, mel_frames))
        return caches, AUDIO.segment * mask.long()

    def stream_caches(self, embeds: Tensor, mask: Tensor) -> tuple[list[KV], Tensor]:
        """A context stream's K/V for every layer, with the mask that goes with them."""
        return self.encode_context(embeds, mask), mask

    def image_mask(self, pixel_values: Tensor) -> Tensor:
        """(B, images * tokens_per_image) bool: with mm_mask_empty_images an all-zero image stands for "no image"
        (how the released models batch samples without one) and text does not attend to it."""
        present = pixel_values.flatten(2).abs().sum(-1).to(self.towers_device) != 0
        if not self.config.mm_mask_empty_images:
            present = torch.ones_like(present)
        return present.repeat_interleave(self.config.tokens_per_image, dim=1)

    def encode_images(self, pixel_values: Tensor) -> tuple[list[KV], Tensor]:
        """Every layer's visual K/V for the images, and the visual mask that goes with them."""
        return self.stream_caches(self.embed_images(pixel_values), self.image_mask(pixel_values))

    def encode_inputs(
        self,
        pixel_values: Tensor | None = None,
        image_sizes: Tensor | None = None,
        pixel_values_videos: Tensor | None = None,
        video_frames: Tensor | None = None,
        input_features: Tensor | None = None,
        audio_mel_frames: Tensor | None = None,
    ) -> tuple[list[KV] | None, Tensor | None]:
        """The processor's media (processing_dattn.py, MEDIA_INPUTS) as one context, its every-layer K/V and each
        key's segment, (None, None) without media: computed once, it serves any question about them
        (`generate(..., context_key_values=, context_mask=)`). Each prompt's zero padding is cut off first: an
        anyres picture's tiles past its tiling, a video's frames past its count, sound chunks past its length."""
        contexts = []
        if pixel_values is not None and image_sizes is not None:
            sizes = [tuple(size) for size in image_sizes.tolist()]
            grid_points, tile = self.config.mm_image_grid_points, self.config.vision_config["image_size"]
            tilings = [anyres_grid(size, grid_points, tile) for size in sizes]
            contexts.append(self.encode_anyres([t[: 1 + c * r] for t, (c, r) in zip(pixel_values, tilings)], sizes))
        elif pixel_values is not None:
            contexts.append(self.encode_images(pixel_values))
        if pixel_values_videos is not None:
            contexts.append(self.encode_video([v[:n] for v, n in zip(pixel_values_videos, video_frames.tolist())]))
        if input_features is not None:
            lengths, chunk = audio_mel_frames.tolist(), input_features.shape[-1]
            chunks = [f[: max(1, -(-n // chunk))] for f, n in zip(input_features, lengths)]
            contexts.append(self.encode_audio(chunks, lengths))
        return self.join_contexts(*contexts) if contexts else (None, None)

    def encode_context(self, context_embeds: Tensor, context_mask: Tensor | None = None) -> list[KV]:
        """Every layer's K/V of a context stream: a function of the stream alone, reusable for any prompt. With
        diagonal V2V a token's K/V depend on that token alone, so long streams (videos) run through the layers in
        chunks written into the caches: memory beyond the caches stays that of one chunk."""
        batch, num_context = context_embeds.shape[:2]
        valid = (
            torch.ones(batch, num_context, dtype=torch.bool, device=context_embeds.device)
            if context_mask is None
            else context_mask.bool()
        )
        positions = torch.arange(num_context, device=context_embeds.device).expand(batch, -1)
        if self.config.v2v_per_image:  # each image is its own sequence
            positions = positions % self.config.tokens_per_image
        tracing = torch.compiler.is_compiling() or torch.onnx.is_in_onnx_export()
        if not self.config.use_diagonal or num_context <= CONTEXT_CHUNK or tracing:
            return self.stream_layers(context_embeds, valid, positions)
        caches = None
        for start in range(0, num_context, CONTEXT_CHUNK):
            part = slice(start, start + CONTEXT_CHUNK)
            chunk = self.stream_layers(context_embeds[:, part], valid[:, part], positions[:, part])
            if caches is None:
                caches = [tuple(t.new_empty(*t.shape[:2], num_context, t.shape[3]) for t in kv) for kv in chunk]
            for cache, kv in zip(caches, chunk):
                for whole, piece in zip(cache, kv):
                    whole[:, :, part] = piece
        return caches

    def stream_layers(self, embeds: Tensor, valid: Tensor, positions: Tensor) -> list[KV]:
        """A context stream through every layer: each layer's K/V (the last layer's output is never needed)."""
        rope = self.rotary_emb(embeds, positions)
        h, caches = embeds, []
        for i, layer in enumerate(self.layers):
            h, kv = layer.context_forward(h, rope, valid, need_output=i + 1 < len(self.layers))
            caches.append(kv)
        return caches
