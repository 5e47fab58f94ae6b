"""The decoder layer of the plugin's model on vLLM's parallel layers: q/k/v/o and the MLP tensor-parallel, the text's
attention through vLLM's `Attention` (causal, sliding window, soft-cap, RoPE), the context's through cross-attentions
read by `Segments` (a softmax per context segment), and the context stream's own K/V and diagonal V2V output."""

from __future__ import annotations

import torch
from torch import nn
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
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.v1.attention.backend import AttentionType

from ..modeling.modeling_dattn import NormsAndMLP, o_proj_per_kv_head
from ..modeling.streams import ContextStream
from .context_cache import ContextBatch

# vLLM's RMSNorm for each scale a family's norm applies to its normalized input, weight x (norm_offset + w) (vLLM's
# fused kernels where the platform has them)
SERVING_NORMS = {0.0: RMSNorm, 1.0: GemmaRMSNorm}


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


class DAttnDecoderLayer(nn.Module, NormsAndMLP):
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
