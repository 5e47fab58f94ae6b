"""The D-Attn vision-language model (reference implementation in PyTorch).

vision tower -> mlp2x_gelu adapter -> RMSNorm -> + row/column position embeddings -> LLM norm -> visual
stream (video models, `mm_input_type="video"`: frames pooled, + time embeddings, and an audio stream from the
Whisper tower; the audio stream runs the layers as the visual one does and text attends to it with its own
softmax, summed); the LLM's decoder layers (its family's weights and names, `families.py`) run two streams:
  * visual: V2V is diagonal (each token attends only to itself) so a layer's visual K/V depend on the
    image alone: `encode_context` computes them once per image and any prompt reuses them;
  * text: one op call (`dattn_op`) per layer over [context K/V (unrotated) ; text K/V (causal)]; a video model's
    context is [frames ; audio], each key's segment given by its mask.
`dattn_mode="sattn"` turns the decomposition off (full causal V2V, RoPE everywhere, positions shared):
conventional self-attention over [visual ; text].

WINGS (`wings_rank` > 0): in the chosen layers two low-rank residual attention learners run beside the text
attention, a visual one over the visual stream's layer inputs (unrotated, so cacheable with the image) and a
text one over the text's (rotated, causal); a router (linear + softmax over the main attention's per-head
[visual, text] mass) weighs their outputs, which are added to the attention's output. The visual stream itself
has no learners: it must stay a function of the image alone.

Only torch and transformers are imported (plus the sibling attention/config files) so this file can
ship in a Hub repo for `trust_remote_code=True`.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import CLIPVisionModel, PretrainedConfig, PreTrainedModel, SiglipVisionModel
from transformers import initialization as init
from transformers.modeling_outputs import ModelOutput
from transformers.models.llama.modeling_llama import rotate_half
from transformers.models.whisper.modeling_whisper import WhisperEncoder

from .attention import causal_mask, dattn_op, decomposed_attention, segment_shares
from .configuration_dattn import CONFIG_CLASSES
from .families import FAMILIES, Family
from .images import PreparedFrames, anyres_grid, anyres_tiles, prepare_pictures
from .streams import (
    AUDIO,
    CONTEXT_CHUNK,
    FRAMES,
    TILES,
    AudioStream,
    FramesStream,
    ImageStream,
    pooled_side,
)

# one layer's cache: key, value (B, kv_heads, S, head_dim) [, WINGS key, value (B, hidden / head_dim, S, head_dim)]
KV = tuple[Tensor, ...]


class StaticKV(tuple):
    """One layer's text cache in buffers of a fixed length (key, value (B, kv_heads, L, head_dim)): a decode step
    writes its token's K/V at `slot` (a one-element tensor, on the buffers' device) instead of growing the cache, so
    every step has the same shapes (a CUDA graph replays it). The attention mask marks the slots written."""

    slot: Tensor

    def __new__(cls, key: Tensor, value: Tensor, slot: Tensor):
        kv = super().__new__(cls, (key, value))
        kv.slot = slot
        return kv


def extend(past: KV | None, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """A layer's text K/V with this call's appended: the past's and the new concatenated, or a StaticKV's buffers
    with the new written at its slot."""
    if past is None:
        return k, v
    if isinstance(past, StaticKV):
        return past[0].index_copy_(2, past.slot, k), past[1].index_copy_(2, past.slot, v)
    return torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)


def family_part(family: Family, part: str) -> type[nn.Module]:
    """One of transformers' modules of the family, by its name after the family's prefix ("RMSNorm", "MLP", ...)."""
    name = family.transformers_module
    module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    return getattr(module, family.prefix + part)


def rms_norm(x: Tensor, eps: float = 1e-5) -> Tensor:
    """x * rsqrt(mean(x^2) + eps), computed in fp32 and returned in x's dtype (the released models' rms_norm)."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def linear_fp32(layer: nn.Linear, x: Tensor) -> Tensor:
    return F.linear(x.float(), layer.weight.float(), None if layer.bias is None else layer.bias.float())


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate (B, H, S, D) by per-position cos/sin (B, S, D)."""
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


# --- the multimodal front -------------------------------------------------------------------------


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


# --- the decoder ---------------------------------------------------------------------------------


def o_proj_per_kv_head(weight: Tensor, num_kv_heads: int, head_dim: int) -> Tensor:
    """o_proj's weight (hidden, query heads x head_dim) with the columns of the query heads that share a KV head
    summed -> (hidden, KV heads x head_dim): o_proj of each KV head's value, as the diagonal V2V outputs it."""
    return weight.unflatten(1, (num_kv_heads, -1, head_dim)).sum(2).flatten(1)


class DAttnAttention(nn.Module):
    """The layer's own q/k/v/o projections; D-Attn adds no attention weights."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden, bias = config.hidden_size, config.has_bias
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias("q_proj"))
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias("k_proj"))
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias("v_proj"))
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias("o_proj"))
        self.scale = config.attention_scale
        self.softcap = config.attention_softcap
        self.merge = config.merge
        self.window = config.sliding_window_of(layer_idx)
        self.causal_context = not config.use_debias
        self.num_contexts = config.num_contexts
        # the one seam to the op: the ONNX exporter swaps in a fused-node emitter, analyze a recorder
        self.op = dattn_op

    def heads(self, proj: nn.Linear, x: Tensor) -> Tensor:
        """(B, S, hidden) -> (B, heads, S, head_dim)."""
        return proj(x).unflatten(-1, (-1, self.head_dim)).transpose(1, 2)

    def output(self, attn: Tensor) -> Tensor:
        """(B, heads, S, head_dim) -> (B, S, hidden)."""
        return self.o_proj(attn.transpose(1, 2).flatten(2))

    def value_output(self, v: Tensor) -> Tensor:
        """`output` of every query head's own KV head's value (B, kv heads, S, head_dim): the diagonal V2V. The
        query heads sharing a KV head output the same value, so their columns of o_proj are summed first: 1/group
        of o_proj's work, and no repeated values."""
        weight = o_proj_per_kv_head(self.o_proj.weight, self.num_kv_heads, self.head_dim)
        return F.linear(v.transpose(1, 2).flatten(2), weight, self.o_proj.bias)

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        key_mask: Tensor,
        q_vis: Tensor,
        context: KV,
        context_mask: Tensor,
        causal: bool = True,
    ) -> Tensor:
        return self.op(
            q,
            k,
            v,
            key_mask,
            q_vis,
            *context,
            context_mask.to(torch.int32),  # each context key's segment (the kernels read int32 ids)
            scale=self.scale,
            softcap=self.softcap,
            window=self.window if causal else None,
            merge=self.merge,
            causal_context=self.causal_context,
            causal=causal,
            num_contexts=self.num_contexts,
        )

    def no_context(self, like: Tensor) -> tuple[KV, Tensor]:
        """An empty visual segment for a batch like `like`: (K, V) with zero keys and its (B, 0) mask."""
        empty = like.new_zeros(like.shape[0], self.num_kv_heads, 0, self.head_dim)
        return (empty, empty), torch.ones(like.shape[0], 0, dtype=torch.bool, device=like.device)


def low_rank(hidden: int, rank: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(hidden, rank, bias=False), nn.Linear(rank, hidden, bias=False))


class WingsLearner(nn.Module):
    """A WINGS low-rank residual attention learner: q/k/v = x(1 + AB) (the input plus a rank-r update); the output
    projection is rank r alone. Every second matrix starts at zero, so a new learner adds nothing."""

    def __init__(self, config):
        super().__init__()
        self.head_dim = config.head_dim
        hidden, rank = config.hidden_size, config.wings_rank
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (low_rank(hidden, rank) for _ in range(4))

    def heads(self, proj: nn.Sequential, x: Tensor) -> Tensor:
        """x(1 + AB) as (B, heads, S, head_dim)."""
        return (x + proj(x)).unflatten(-1, (-1, self.head_dim)).transpose(1, 2)

    def keys(self, x: Tensor) -> KV:
        return self.heads(self.k_proj, x), self.heads(self.v_proj, x)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
        """(B, heads, T, head_dim) queries over masked keys -> (B, T, hidden); no visible key gives 0."""
        out = decomposed_attention(q, k, v, mask, scale=self.head_dim**-0.5, softcap=None, merge="alpha")
        return self.o_proj(out.transpose(1, 2).flatten(2))


class LayerNorms:
    """A decoder layer's norms, and what runs after its attention (residual add, the MLP, the family's norms): mixed
    into this decoder layer and the vLLM plugin's, which hold the same modules under the same names."""

    mlp: nn.Module  # the host's MLP (this file's family MLP, or the plugin's tensor-parallel one)

    def init_norms(self, config, norm: type[nn.Module] | None = None) -> None:
        """The layer's norms; `norm`: the host's RMSNorm class for the family (default: transformers' module)."""
        norm = norm or family_part(config.family, "RMSNorm")
        self.input_layernorm = norm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = norm(config.hidden_size, eps=config.rms_norm_eps)
        self.sandwich_norms = config.family.sandwich_norms
        if self.sandwich_norms:
            self.pre_feedforward_layernorm = norm(config.hidden_size, eps=config.rms_norm_eps)
            self.post_feedforward_layernorm = norm(config.hidden_size, eps=config.rms_norm_eps)

    def residual_mlp(self, residual: Tensor, attn_out: Tensor) -> Tensor:
        """Everything after the attention: residual add, the MLP and the family's norms."""
        if self.sandwich_norms:
            h = residual + self.post_attention_layernorm(attn_out)
            return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
        h = residual + attn_out
        return h + self.mlp(self.post_attention_layernorm(h))


class DAttnDecoderLayer(nn.Module, LayerNorms):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.self_attn = DAttnAttention(config, layer_idx)
        self.mlp = family_part(config.family, "MLP")(config)
        self.init_norms(config)
        self.diagonal = config.use_diagonal
        self.debias = config.use_debias
        self.tokens_per_image = config.tokens_per_image if config.v2v_per_image else None
        self.wings = config.has_wings(layer_idx)
        if self.wings:
            self.wings_visual, self.wings_text = WingsLearner(config), WingsLearner(config)
            self.wings_router = nn.Linear(2 * config.num_attention_heads, 2)
            self.wings_heads = config.wings_heads

    def no_context(self, like: Tensor) -> tuple[KV, Tensor]:
        """An empty visual cache (every part of it) for a batch like `like`, and its (B, 0) mask."""
        (empty, _), mask = self.self_attn.no_context(like)
        if not self.wings:
            return (empty, empty), mask
        learner_empty = like.new_zeros(like.shape[0], self.wings_heads, 0, self.self_attn.head_dim)
        return (empty, empty, learner_empty, learner_empty), mask

    def context_forward(
        self, h: Tensor, rope: tuple[Tensor, Tensor], valid: Tensor, need_output: bool = True
    ) -> tuple[Tensor | None, KV]:
        """One layer of the visual stream: its output (unless not needed: the last layer's is never read)
        and the visual K/V that text queries will read."""
        attn = self.self_attn
        x = self.input_layernorm(h)
        k, v = attn.heads(attn.k_proj, x), attn.heads(attn.v_proj, x)
        k_rot = apply_rope(k, *rope)
        context_kv = (k if self.debias else k_rot, v)
        if self.wings:  # the visual learner's keys: position-free like debiased T2V, so cacheable with the image
            context_kv += self.wings_visual.keys(x)
        if not need_output:
            return None, context_kv
        if self.diagonal:  # softmax over the token's own key alone is 1: the output is its value
            return self.residual_mlp(h, attn.value_output(v)), context_kv
        if self.tokens_per_image:  # MMCA: full attention within each image, images never mix
            q = apply_rope(attn.heads(attn.q_proj, x), *rope)
            per_image = lambda t: t.unflatten(2, (-1, self.tokens_per_image)).transpose(1, 2).flatten(0, 1)  # noqa: E731
            q_i, k_i, v_i, valid_i = (
                per_image(q),
                per_image(k_rot),
                per_image(v),
                valid.unflatten(1, (-1, self.tokens_per_image)).flatten(0, 1),
            )
            out = attn.attend(q_i, k_i, v_i, valid_i, q_i, *attn.no_context(q_i), causal=False)
            out = out.unflatten(0, (h.shape[0], -1)).transpose(1, 2).flatten(2, 3)
        else:  # causal self-attention among visual tokens, as the base LLM does
            q = apply_rope(attn.heads(attn.q_proj, x), *rope)
            out = attn.attend(q, k_rot, v, valid, q, *attn.no_context(q))
        return self.residual_mlp(h, attn.output(out)), context_kv

    def text_forward(
        self,
        h: Tensor,
        rope,
        past: KV | None,
        context: KV,
        key_mask: Tensor,
        context_mask: Tensor,
    ) -> tuple[Tensor, KV]:
        """One layer of the text stream; returns its output and the text K/V cache (past + new). `context`: the
        context K/V, `context_mask` (B, V) each key's context segment (a video model's frames 1, audio 2; 0: none),
        every segment under its own softmax with the sum merge."""
        attn = self.self_attn
        x = self.input_layernorm(h)
        q = attn.heads(attn.q_proj, x)
        q_rot, k = apply_rope(q, *rope), apply_rope(attn.heads(attn.k_proj, x), *rope)
        v = attn.heads(attn.v_proj, x)
        k, v = extend(past, k, v)
        q_vis = q if self.debias else q_rot
        heads_out = attn.attend(q_rot, k, v, key_mask, q_vis, context[:2], context_mask)
        attn_out = attn.output(heads_out)
        if not self.wings:
            return self.residual_mlp(h, attn_out), (k, v)
        shares = segment_shares(
            q_rot,
            k,
            key_mask,
            q_vis,
            context[0],
            context_mask,
            scale=attn.scale,
            softcap=attn.softcap,
            window=attn.window,
            causal_context=attn.causal_context,
        )
        learners_out, learner_kv = self.learners(x, rope, past, context, key_mask, context_mask, shares)
        return self.residual_mlp(h, attn_out + learners_out), (k, v, *learner_kv)

    def learners(
        self, x: Tensor, rope, past: KV | None, context: KV, key_mask: Tensor, context_mask: Tensor, shares: Tensor
    ) -> tuple[Tensor, KV]:
        """WINGS: the visual and text learners' outputs weighed by the router, and the text learner's cache.
        `shares` (B, heads, T, 2): the main attention's mass on [visual, text] per head, the router's input."""
        num_new = x.shape[1]
        router_input = shares.transpose(1, 2).flatten(2).to(x.dtype)  # the shares are fp32 in a 16-bit model
        weights = torch.softmax(self.wings_router(router_input), dim=-1)  # (B, T, 2)
        context_mask = context_mask.bool()[:, None, :].expand(-1, num_new, -1)
        visual_learner, text_learner = self.wings_visual, self.wings_text
        visual_out = visual_learner.attend(visual_learner.heads(visual_learner.q_proj, x), *context[2:], context_mask)
        q, k = (apply_rope(text_learner.heads(proj, x), *rope) for proj in (text_learner.q_proj, text_learner.k_proj))
        v = text_learner.heads(text_learner.v_proj, x)
        if past is not None:
            k, v = torch.cat([past[2], k], dim=2), torch.cat([past[3], v], dim=2)
        text_out = text_learner.attend(q, k, v, causal_mask(key_mask.bool(), num_new, window=None))
        return weights[..., :1] * visual_out + weights[..., 1:] * text_out, (k, v)


class DAttnPreTrainedModel(PreTrainedModel):
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ["DAttnDecoderLayer"]
    # read from the checkpoint on each call where the model runs layer by layer (`checkpoints/weights.py`), as the
    # layers are: the context streams' large modules (0.6 GB of fp32 weights at Vidi-7B's width)
    _streamed_modules = ("LearnablePositionEmbedding", "MLPProjector")

    @torch.no_grad()
    def _init_weights(self, module):
        """Also runs inside from_pretrained, where non-persistent buffers must be rebuilt (transformers'
        `init` helpers leave weights that were loaded alone)."""
        super()._init_weights(module)
        if isinstance(module, MMRMSNorm):
            init.constant_(module.weight, module.initial)
        elif isinstance(module, family_part(self.config.family, "RMSNorm")):  # scales by (norm_offset + weight)
            init.constant_(module.weight, 1.0 - self.config.family.norm_offset)
        elif hasattr(module, "scalar_embed_scale"):  # a family's scaled embedding: its scale is a buffer not saved
            init.constant_(module.embed_scale, module.scalar_embed_scale)
        elif isinstance(module, WingsLearner):  # x(1 + AB) starts at x, and the learner's output at 0
            for proj in (module.q_proj, module.k_proj, module.v_proj, module.o_proj):
                init.zeros_(proj[1].weight)


class ContextStreams:
    """The context streams before the decoder layers: images (tower -> adapter -> positions -> LLM norm), a video
    model's frames and audio. Mixed into DAttnModel and into the vLLM plugin's model, which hold these modules under
    the same names (`init_streams`)."""

    config: PretrainedConfig  # what the host provides beside the modules init_streams makes
    dtype: torch.dtype  # the weights' dtype, which the towers' inputs are cast to

    def init_streams(self, config, audio_tower: bool) -> None:
        """The modules from pixels (and a video model's audio) to the context streams; `audio_tower`: the Whisper
        tower too (an image model's checkpoint may carry one that its image path never runs)."""
        hidden = config.hidden_size
        self.mm_vis = self.vision_tower(config)
        if audio_tower:
            self.mm_aud = self.audio_tower(config)
        self.mm_rand_llm_norm = MMRMSNorm(hidden, config.mm_std)
        for stream in config.streams:
            STREAM_MODULES[stream.name](self, config, stream)

    def image_modules(self, config, stream: ImageStream) -> None:
        """A picture's (or its tiles'): projected, normed, with row and column embeddings."""
        hidden = config.hidden_size
        self.mm_rand_projector = MLPProjector(config.vision_config["hidden_size"], hidden)
        self.mm_rand_norm = MMRMSNorm(hidden)
        self.mm_rand_pos_w = LearnablePositionEmbedding(hidden, stream.position_grid(config))
        self.mm_rand_pos_h = LearnablePositionEmbedding(hidden, stream.position_grid(config))

    def frame_modules(self, config, stream: FramesStream) -> None:
        """A frame's: pooled, projected, normed, with row and column embeddings (over the pooled grid)."""
        hidden = config.hidden_size
        self.mm_rand_img_pool = FramePool(config)
        self.mm_rand_img_projector = MLPProjector(self.mm_rand_img_pool.out_channels, hidden)
        self.mm_rand_img_norm = MMRMSNorm(hidden)
        self.mm_rand_pos_w = LearnablePositionEmbedding(hidden, config.mm_image_pool_size)
        self.mm_rand_pos_h = LearnablePositionEmbedding(hidden, config.mm_image_pool_size)

    def audio_modules(self, config, stream: AudioStream) -> None:
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
        features = self.mm_vis(pixel_values.flatten(0, 1).to(self.device, self.dtype)).unflatten(1, (grid, grid))
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
        pixels = torch.cat([thumbnail, tiles.flatten(0, 1)]).to(self.device, self.dtype)
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
        return self.context_stream(samples, [t.abs().sum() != 0 for t in tiles])

    def embed_video(self, frames: list[Tensor]) -> tuple[Tensor, Tensor]:
        """Each sample's frames (F_i, 3, H, W) -> (B, L, hidden) visual embeddings and their (B, L) mask
        (multimodal.py encode_video_images), `frame_stream` part by part. A sample whose frames are all zero has no
        video."""
        side = self.resized_side(sum(len(f) for f in frames))  # the released budget counts the batch's frames
        samples, has_video = [], []
        for sample in frames:  # a tensor, or images.PreparedFrames: each part prepared as it is read
            tokens, nonzero = [], False
            for start in range(0, len(sample), FRAMES.parts_per_run):
                pixels = sample[start : start + FRAMES.parts_per_run].to(self.device)  # prepared where they were read
                index = torch.arange(start, start + len(pixels), device=pixels.device)
                num_frames = torch.tensor(len(sample), device=pixels.device)
                tokens.append(self.frame_stream(pixels, index, num_frames, side)[0])
                nonzero = nonzero | (pixels.abs().sum() != 0)
            samples.append(torch.cat(tokens))
            has_video.append(nonzero)
        return self.context_stream(samples, has_video)

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
            parts = sample.to(self.device).split(self.audio_chunks_per_run())
            starts = range(0, len(sample), self.audio_chunks_per_run())
            streams = [
                self.audio_stream(
                    part, torch.tensor(start, device=part.device), torch.tensor(length, device=part.device)
                )
                for part, start in zip(parts, starts)
            ]
            samples.append(torch.cat([x[0, within[0] == 1] for x, within in streams]))
        return self.context_stream(samples, [m.abs().sum() != 0 for m in mels])

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
    def context_stream(samples: list[Tensor], present: list[Tensor]) -> tuple[Tensor, Tensor]:
        """Per-sample stream tokens -> padded to the longest (B, L, hidden) and zeroed outside the mask: the tokens
        that are not padding, of the samples that are `present`."""
        x = nn.utils.rnn.pad_sequence(samples, batch_first=True)
        mask = (x.abs().sum(-1) != 0) & torch.stack(present)[:, None]
        return x * mask[..., None], mask


# each stream's modules, by stream (`streams.py`), under the names the released checkpoints give them
STREAM_MODULES = {
    "image": ContextStreams.image_modules,
    "tiles": ContextStreams.image_modules,
    "frames": ContextStreams.frame_modules,
    "audio": ContextStreams.audio_modules,
}


class DAttnModel(DAttnPreTrainedModel, ContextStreams):
    def __init__(self, config):
        super().__init__(config)
        family, hidden = config.family, config.hidden_size
        if family.embedding_scaled:
            embedding = family_part(family, "TextScaledWordEmbedding")
            self.embed_tokens = embedding(config.vocab_size, hidden, config.pad_token_id, embed_scale=hidden**0.5)
        else:
            self.embed_tokens = nn.Embedding(config.vocab_size, hidden, config.pad_token_id)
        self.layers = nn.ModuleList(DAttnDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = family_part(family, "RMSNorm")(hidden, eps=config.rms_norm_eps)
        self.rotary_emb = family_part(family, "RotaryEmbedding")(config)
        self.init_streams(config, audio_tower=config.audio_config is not None)
        self.post_init()

    def encode_pictures(self, pictures: list, processor) -> tuple[list[KV], Tensor]:
        """Every layer's visual K/V for one prompt's pictures (RGB PIL images) and the visual mask, each picture
        prepared as the released code prepares it (`images.py`, by mm_image_aspect_ratio; an anyres model takes one)."""
        if self.config.streams[0].name != TILES.name:
            return self.encode_images(prepare_pictures(pictures, self.config.mm_image_aspect_ratio, processor)[None])
        if len(pictures) != TILES.pictures:
            raise ValueError(f"an anyres model takes one picture a prompt, not {len(pictures)}")
        tiles, _ = anyres_tiles(pictures[0], processor, self.config.mm_image_grid_points)
        return self.encode_anyres([tiles], [pictures[0].size])

    def encode_frames(self, frames: list, processor) -> tuple[list[KV], Tensor]:
        """A video model: every layer's K/V for one video's frames (RGB PIL images, one a second) and their mask, each
        frame prepared as a picture is (mm_image_aspect_ratio)."""
        return self.encode_video([PreparedFrames(frames, self.config.mm_image_aspect_ratio, processor)])

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
        present = pixel_values.flatten(2).abs().sum(-1).to(self.device) != 0
        if not self.config.mm_mask_empty_images:
            present = torch.ones_like(present)
        return present.repeat_interleave(self.config.tokens_per_image, dim=1)

    def encode_images(self, pixel_values: Tensor) -> tuple[list[KV], Tensor]:
        """Every layer's visual K/V for the images, and the visual mask that goes with them."""
        return self.stream_caches(self.embed_images(pixel_values), self.image_mask(pixel_values))

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

    def forward(
        self,
        input_ids: Tensor | None = None,
        inputs_embeds: Tensor | None = None,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        past_key_values: list[KV] | None = None,
        context_key_values: list[KV] | None = None,
        context_mask: Tensor | None = None,
    ) -> tuple[Tensor, list[KV]]:
        """The text stream. attention_mask (B, past + T) marks real text tokens (left padding allowed);
        context_mask (B, V) each context key's segment (`streams.py`; a bool mask: one segment), 0 or False for
        none. Returns the final hidden states and the text cache."""
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        batch, num_new = h.shape[:2]
        num_past = 0 if past_key_values is None else past_key_values[0][0].shape[2]
        num_context = 0 if context_key_values is None else context_key_values[0][0].shape[2]
        text_valid = (
            torch.ones(batch, num_past + num_new, dtype=torch.bool, device=h.device)
            if attention_mask is None
            else attention_mask.bool()
        )
        context_valid = (
            torch.ones(batch, num_context, dtype=torch.bool, device=h.device) if context_mask is None else context_mask
        )
        # Debiased: text positions count text tokens only. Otherwise the visual tokens come first.
        offset = 0 if self.config.use_debias else num_context
        if position_ids is None:
            position_ids = offset + (text_valid.long().cumsum(-1) - 1).clamp_min(0)[:, -num_new:]
        rope = self.rotary_emb(h, position_ids)

        present = []
        for i, layer in enumerate(self.layers):
            past = None if past_key_values is None else past_key_values[i]
            if context_key_values is None:
                context, layer_context_valid = layer.no_context(h)
            else:
                context, layer_context_valid = context_key_values[i], context_valid
            h, kv = layer.text_forward(h, rope, past, context, text_valid, layer_context_valid)
            present.append(kv)
        return self.norm(h), present


@dataclass
class DAttnOutput(ModelOutput):
    """The forward's outputs. A ModelOutput (a dict too, which DeepSpeed ZeRO-3's hooks walk in backward); the text
    K/V is `cache`, the name transformers gives it from 5.2x on, where a field named past_key_values is renamed."""

    logits: Tensor | None = None
    cache: list[KV] | None = None
    context_key_values: list[KV] | None = None
    context_mask: Tensor | None = None

    @property
    def past_key_values(self) -> list[KV] | None:
        """The text K/V under the name transformers' models used before 5.2x."""
        return self.cache


class DAttnForCausalLM(DAttnPreTrainedModel):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config):
        super().__init__(config)
        self.model = DAttnModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(
        self,
        input_ids: Tensor | None = None,
        pixel_values: Tensor | None = None,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        past_key_values: list[KV] | None = None,
        context_key_values: list[KV] | None = None,
        context_mask: Tensor | None = None,
        inputs_embeds: Tensor | None = None,
    ) -> DAttnOutput:
        """Logits for the text tokens. Images come as `pixel_values` (B, images, 3, H, W), or as the
        `context_key_values` an earlier call returned; a video model's frames and audio as one context, the K/V and
        segment ids that `model.join_contexts` makes of `model.encode_video`'s and `model.encode_audio`'s."""
        if pixel_values is not None and context_key_values is None:
            context_key_values, image_mask = self.model.encode_images(pixel_values)
            context_mask = image_mask if context_mask is None else context_mask.bool() & image_mask
        hidden, present = self.model(
            input_ids,
            inputs_embeds,
            attention_mask,
            position_ids,
            past_key_values,
            context_key_values,
            context_mask,
        )
        logits = self.lm_head(hidden)
        cap = self.config.logits_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return DAttnOutput(
            logits=logits,
            cache=present,
            context_key_values=context_key_values,
            context_mask=context_mask,
        )

    @torch.no_grad()
    def generate(
        self,
        input_ids: Tensor,
        pixel_values: Tensor | None = None,
        attention_mask: Tensor | None = None,
        max_new_tokens: int = 20,
        context_key_values: list[KV] | None = None,
        eos_token_id: int | None = None,
        context_mask: Tensor | None = None,
    ) -> Tensor:
        """Greedy decoding with the text KV cache; the context's K/V (an image's, a video's frames and audio) are
        computed once (or reused)."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        streams = dict(context_key_values=context_key_values, context_mask=context_mask)
        out = self(input_ids, pixel_values, attention_mask, **streams)
        tokens = []
        for step in range(max_new_tokens):
            next_token = out.logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(next_token)
            if step == max_new_tokens - 1 or (eos_token_id is not None and (next_token == eos_token_id).all()):
                break
            attention_mask = torch.cat([attention_mask, torch.ones_like(next_token)], dim=1)
            out = self(
                next_token,
                attention_mask=attention_mask,
                past_key_values=out.past_key_values,
                context_key_values=out.context_key_values,
                context_mask=out.context_mask,
            )
        return torch.cat(tokens, dim=1)


def model_class(family: Family) -> type:
    """The family's D-Attn model (config.json's architectures and auto_map name it)."""
    namespace = {"config_class": CONFIG_CLASSES[family.model_type], "__module__": __name__}
    return type(family.model_class_name, (DAttnForCausalLM,), namespace)


# one per family, by the name its entry gives (Family.model_class_name): config.json's architectures and a Hub repo's
# auto_map name it
DAttnMistralForCausalLM = model_class(FAMILIES["mistral"])
DAttnGemma2ForCausalLM = model_class(FAMILIES["gemma2"])
DAttnQwen2ForCausalLM = model_class(FAMILIES["qwen2"])
MODEL_CLASSES = {
    cls.config_class.model_type: cls for cls in (DAttnMistralForCausalLM, DAttnGemma2ForCausalLM, DAttnQwen2ForCausalLM)
}
