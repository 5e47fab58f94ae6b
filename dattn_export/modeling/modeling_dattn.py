"""The D-Attn model's decoder (the reference in PyTorch): the LLM's decoder layers (its family's weights and names,
`families.py`) run two streams over the context tokens that `context.py` makes (pictures' visual tokens; a video's
frames, then its audio):
  * context: V2V is diagonal (each token attends only to itself) so a layer's context K/V depend on the
    medium alone: `encode_context` computes them once per picture or video and any prompt reuses them;
  * text: one op call (`dattn_op`) per layer over [context K/V (unrotated) ; text K/V (causal)]; a video model's
    context is [frames ; audio], each key's segment given by its mask, each segment with its own softmax.
`dattn_mode="sattn"` turns the decomposition off (full causal V2V, RoPE everywhere, positions shared):
conventional self-attention over [visual ; text].

WINGS (`wings_rank` > 0): in the chosen layers two low-rank residual attention learners run beside the text
attention, a visual one over the visual stream's layer inputs (unrotated, so cacheable with the image) and a
text one over the text's (rotated, causal); a router (linear + softmax over the main attention's per-head
[visual, text] mass) weighs their outputs, which are added to the attention's output. The visual stream itself
has no learners: it must stay a function of the image alone.

Ships in a Hub repo for `trust_remote_code=True`, so it imports only torch, transformers and its siblings:
attention.py (the op and its math), configuration_dattn.py, context.py (the context streams) and families.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import Cache, PreTrainedModel
from transformers import initialization as init
from transformers.modeling_outputs import ModelOutput
from transformers.models.gemma2.modeling_gemma2 import (
    Gemma2MLP,
    Gemma2RMSNorm,
    Gemma2RotaryEmbedding,
    Gemma2TextScaledWordEmbedding,
)
from transformers.models.llama.modeling_llama import rotate_half
from transformers.models.mistral.modeling_mistral import MistralMLP, MistralRMSNorm, MistralRotaryEmbedding
from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP, Qwen2RMSNorm, Qwen2RotaryEmbedding

from .attention import causal_mask, dattn_op, decomposed_attention, segment_shares
from .configuration_dattn import CONFIG_CLASSES
from .context import KV, ContextCaches, ContextStreams, MMRMSNorm
from .families import FAMILIES, Family
from .generation import DAttnGenerationMixin
from .streams import MEDIA_INPUTS


class StaticKV(tuple):
    """One layer's text cache in buffers of a fixed length (key, value (B, kv_heads, L, head_dim)): a decode step
    writes its token's K/V at `slot` (a one-element tensor, on the buffers' device) instead of growing the cache, so
    every step has the same shapes (a CUDA graph replays it). The attention mask marks the slots written."""

    slot: Tensor

    def __new__(cls, key: Tensor, value: Tensor, slot: Tensor):
        kv = super().__new__(cls, (key, value))
        kv.slot = slot
        return kv


@dataclass(frozen=True)
class CachedKV:
    """One layer's text cache in a transformers `Cache` (the one `generate` keeps): `index` its layer there, and
    `learner` the layer holding its WINGS text learner's (past the decoder's layers)."""

    cache: Cache
    index: int
    learner: int

    def learner_part(self) -> CachedKV:
        return CachedKV(self.cache, self.learner, self.learner)


def extend(past, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """A layer's text K/V with this call's appended: the past's and the new concatenated, a StaticKV's buffers with
    the new written at its slot, or a transformers Cache's layer appended to (`Cache.update`)."""
    if past is None:
        return k, v
    if isinstance(past, CachedKV):
        return past.cache.update(k, v, past.index)
    if isinstance(past, StaticKV):
        return past[0].index_copy_(2, past.slot, k), past[1].index_copy_(2, past.slot, v)
    return torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)


def learner_part(past):
    """The WINGS text learner's cache beside a layer's: the last two of its K/V tuple, or its Cache layer."""
    if past is None:
        return None
    return past.learner_part() if isinstance(past, CachedKV) else (past[2], past[3])


@dataclass(frozen=True)
class FamilyModules:
    """The modules a family's layers take from transformers as they are."""

    rms_norm: type[nn.Module]
    mlp: type[nn.Module]
    rotary: type[nn.Module]
    scaled_embedding: type[nn.Module] | None = None  # where the family scales its text embeddings (embedding_scaled)


FAMILY_MODULES = {  # a line a family (families.py): the classes transformers defines for it
    "mistral": FamilyModules(MistralRMSNorm, MistralMLP, MistralRotaryEmbedding),
    "gemma2": FamilyModules(Gemma2RMSNorm, Gemma2MLP, Gemma2RotaryEmbedding, Gemma2TextScaledWordEmbedding),
    "qwen2": FamilyModules(Qwen2RMSNorm, Qwen2MLP, Qwen2RotaryEmbedding),
}


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate (B, H, S, D) by per-position cos/sin (B, S, D)."""
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


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


class NormsAndMLP:
    """A decoder layer's norms, and what runs after its attention (residual add, the MLP, the family's norms): mixed
    into this decoder layer and the vLLM plugin's, which hold the same modules under the same names."""

    mlp: nn.Module  # the host's MLP (this file's family MLP, or the plugin's tensor-parallel one)

    def init_norms(self, config, norm: type[nn.Module] | None = None) -> None:
        """The layer's norms; `norm`: the host's RMSNorm class for the family (default: transformers' module)."""
        norm = norm or FAMILY_MODULES[config.family.name].rms_norm
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


class DAttnDecoderLayer(nn.Module, NormsAndMLP):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.self_attn = DAttnAttention(config, layer_idx)
        self.mlp = FAMILY_MODULES[config.family.name].mlp(config)
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
            per_image = lambda t: t.unflatten(2, (-1, self.tokens_per_image)).transpose(1, 2).flatten(0, 1)
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
        k, v = extend(learner_part(past), k, v)
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
        elif isinstance(module, FAMILY_MODULES[self.config.family.name].rms_norm):  # scales by (norm_offset + weight)
            init.constant_(module.weight, 1.0 - self.config.family.norm_offset)
        elif hasattr(module, "scalar_embed_scale"):  # a family's scaled embedding: its scale is a buffer not saved
            init.constant_(module.embed_scale, module.scalar_embed_scale)
        elif isinstance(module, WingsLearner):  # x(1 + AB) starts at x, and the learner's output at 0
            for proj in (module.q_proj, module.k_proj, module.v_proj, module.o_proj):
                init.zeros_(proj[1].weight)


class DAttnModel(DAttnPreTrainedModel, ContextStreams, ContextCaches):
    def __init__(self, config):
        super().__init__(config)
        family, hidden = config.family, config.hidden_size
        if family.embedding_scaled:
            embedding = FAMILY_MODULES[family.name].scaled_embedding
            self.embed_tokens = embedding(config.vocab_size, hidden, config.pad_token_id, embed_scale=hidden**0.5)
        else:
            self.embed_tokens = nn.Embedding(config.vocab_size, hidden, config.pad_token_id)
        self.layers = nn.ModuleList(DAttnDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = FAMILY_MODULES[family.name].rms_norm(hidden, eps=config.rms_norm_eps)
        self.rotary_emb = FAMILY_MODULES[family.name].rotary(config)
        self.init_streams(config, audio_tower=config.audio_config is not None)
        self.post_init()

    def forward(
        self,
        input_ids: Tensor | None = None,
        inputs_embeds: Tensor | None = None,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        past_key_values: list[KV] | Cache | None = None,
        context_key_values: list[KV] | None = None,
        context_mask: Tensor | None = None,
    ) -> tuple[Tensor, list[KV] | Cache]:
        """The text stream. attention_mask (B, past + T) marks real text tokens (left padding allowed);
        context_mask (B, V) each context key's segment (`streams.py`; a bool mask: one segment), 0 or False for
        none; past_key_values a layer's K/V each, or a transformers Cache (`generate`'s), appended to. Returns the
        final hidden states and the text cache (that Cache, where one was given)."""
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        batch, num_new = h.shape[:2]
        cache = past_key_values if isinstance(past_key_values, Cache) else None
        if cache is not None:
            num_past = cache.get_seq_length()
        else:
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

        present, layers = [], len(self.layers)
        for i, layer in enumerate(self.layers):
            if cache is not None:
                past = CachedKV(cache, i, layers + i)
            else:
                past = None if past_key_values is None else past_key_values[i]
            if context_key_values is None:
                context, layer_context_valid = layer.no_context(h)
            else:
                context, layer_context_valid = context_key_values[i], context_valid
            h, kv = layer.text_forward(h, rope, past, context, text_valid, layer_context_valid)
            present.append(kv)
        return self.norm(h), present if cache is None else cache


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


class DAttnForCausalLM(DAttnPreTrainedModel, DAttnGenerationMixin):
    """The model; config.json's auto_map registers it for AutoModelForCausalLM and AutoModelForImageTextToText: it
    takes the processor's output as it is (`processing_dattn.py`), `model.generate(**inputs)`, and the
    image-text-to-text pipeline."""

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
        use_cache: bool | None = None,
        return_dict: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        **media: Tensor | None,
    ) -> DAttnOutput:
        """Logits for the text tokens. The media come as the processor gives them (`pixel_values` (B, images, 3, H,
        W), and `media`: an anyres picture's `image_sizes`, a video's `pixel_values_videos` and `video_frames`,
        sound as `input_features` and `audio_mel_frames`), or as the `context_key_values` and `context_mask` an
        earlier call returned (or `model.encode_inputs` made): the context's K/V are a function of the media alone.
        The text cache is always returned (`use_cache`, and `return_dict`, as transformers passes them, change
        nothing); attentions and hidden states are not kept, and asking for them is refused."""
        if output_attentions or output_hidden_states:
            raise ValueError("this model returns no attentions or hidden states (`dattn-export analyze` reports "
                             "where the text's attention goes)")  # fmt: skip
        if unknown := sorted(set(media) - set(MEDIA_INPUTS)):
            raise TypeError(f"forward() got unexpected keyword arguments {unknown}")
        if context_key_values is None and (pixel_values is not None or any(v is not None for v in media.values())):
            context_key_values, media_mask = self.model.encode_inputs(pixel_values, **media)
            context_mask = media_mask if context_mask is None else media_mask * context_mask.bool()
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
