"""The decomposed-attention math: the single reference every other implementation is tested against.
Pure torch: this file ships inside Hub repos with the model.

Text queries attend to the text keys and to N context segments:
  * the context keys (a video model's frames then its audio; an image model's visual tokens, N = 1), no mask by
    default, queried with `q_vis` (unrotated in D-Attn: "debiased"); an integer mask gives each key its segment
    (1..N; 0: not a key), a bool mask puts every visible key in segment 1;
  * the text segment: text keys (past + current), causal/padding/window mask, queried with `q_txt` (rotated).

merge="alpha": one softmax over the concatenated logits [context ; text]. With one context segment this equals the
    paper's sigmoid(S_V - S_T) * XA + sigmoid(S_T - S_V) * SA, with S_* the log-sum-exp of each segment.
merge="sum":   softmax per segment (each context segment and the text), outputs added (the released Vidi models:
    text, frames and audio each with their own softmax; MMCA's text rule).

Grouped-query attention is computed by viewing the query heads as (kv_heads, group) so keys and
values are never repeated.
"""

from __future__ import annotations

import torch
from torch import Tensor

MERGE_MODES = ("alpha", "sum")


def _logits(q: Tensor, k: Tensor, scale: float, softcap: float | None) -> Tensor:
    """(B, Hq, T, D) x (B, Hkv, S, D) -> fp32 logits (B, Hkv, G, T, S), soft-capped."""
    kv_heads = k.shape[1]
    q = q.float().unflatten(1, (kv_heads, q.shape[1] // kv_heads))
    s = torch.matmul(q, k.float().unsqueeze(2).transpose(-1, -2)) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    return s


def _masked(s: Tensor, visible: Tensor | None) -> Tensor:
    """Logits with the positions `visible` (B, T, S) does not allow at -inf."""
    return s if visible is None else s.masked_fill(~visible[:, None, None], float("-inf"))


def _softmax(s: Tensor) -> Tensor:
    """Softmax over the last axis where a row with no visible key, or no key at all, gives zeros (not NaN).
    The floor column keeps the max defined for an empty segment without a shape-dependent branch."""
    floor = s.new_full((*s.shape[:-1], 1), torch.finfo(s.dtype).min)
    row_max = torch.cat([s, floor], dim=-1).amax(-1, keepdim=True)
    p = torch.exp(s - row_max)
    denom = p.sum(-1, keepdim=True)
    return p / torch.where(denom == 0, 1.0, denom)


def _weighted_values(p: Tensor, v: Tensor) -> Tensor:
    """(B, Hkv, G, T, S) probabilities x (B, Hkv, S, D) values -> (B, Hkv, G, T, D)."""
    return torch.matmul(p, v.float().unsqueeze(2))


def decomposed_attention(
    q_txt: Tensor,
    k_txt: Tensor,
    v_txt: Tensor,
    txt_mask: Tensor | None,
    q_vis: Tensor | None = None,
    k_vis: Tensor | None = None,
    v_vis: Tensor | None = None,
    vis_mask: Tensor | None = None,
    *,
    scale: float,
    softcap: float | None,
    merge: str,
    num_contexts: int = 1,
) -> Tensor:
    """Text-query attention over the context segments and a text key segment.

    Shapes: q_* (B, Hq, T, D); k_*, v_* (B, Hkv, S, D) with Hq % Hkv == 0; `txt_mask` bool (B, T, S), True where
    the query may attend (None: all); `vis_mask` (B, T, V) the context key's segment, 1..`num_contexts`, where the
    query may attend it and 0 elsewhere (bool: segment 1; None: all in segment 1). Without context keys this is
    plain attention. Computes in fp32 and returns (B, Hq, T, D) in q_txt's dtype. A query that sees no key
    outputs 0.
    """
    if merge not in MERGE_MODES:
        raise ValueError(f"merge must be one of {MERGE_MODES}, got {merge!r}")
    s_txt = _masked(_logits(q_txt, k_txt, scale, softcap), txt_mask)
    if k_vis is None:
        return _weighted_values(_softmax(s_txt), v_txt).flatten(1, 2).to(q_txt.dtype)
    s_vis = _logits(q_vis, k_vis, scale, softcap)
    segment = s_vis.new_ones(s_vis.shape[:1] + s_vis.shape[3:], dtype=torch.long) if vis_mask is None else vis_mask
    if merge == "alpha":
        p = _softmax(torch.cat([_masked(s_vis, segment != 0), s_txt], dim=-1))
        p_vis, p_txt = p.split([s_vis.shape[-1], s_txt.shape[-1]], dim=-1)
        out = _weighted_values(p_vis, v_vis) + _weighted_values(p_txt, v_txt)
    else:
        out = _weighted_values(_softmax(s_txt), v_txt)
        for index in range(1, num_contexts + 1):
            out = out + _weighted_values(_softmax(_masked(s_vis, segment.long() == index)), v_vis)
    return out.flatten(1, 2).to(q_txt.dtype)


def causal_mask(key_valid: Tensor, num_queries: int, window: int | None, query_offset: int | None = None) -> Tensor:
    """Bool (B, T, S) mask for T queries that sit at the last T of S key slots (or at `query_offset`).

    `key_valid` (B, S) marks real (non-padding) keys. With `window`, a query at slot i sees slot j only
    when i - j < window (transformers' sliding-window convention).
    """
    num_keys = key_valid.shape[1]
    offset = num_keys - num_queries if query_offset is None else query_offset
    q_slot = torch.arange(num_queries, device=key_valid.device)[:, None] + offset
    k_slot = torch.arange(num_keys, device=key_valid.device)[None, :]
    allowed = k_slot <= q_slot
    if window is not None:
        allowed = allowed & (q_slot - k_slot < window)
    return allowed[None] & key_valid[:, None, :].bool()


def dattn_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    key_mask: Tensor,
    q_vis: Tensor,
    k_vis: Tensor,
    v_vis: Tensor,
    context_mask: Tensor,
    *,
    scale: float,
    softcap: float | None,
    window: int | None,
    merge: str,
    causal_context: bool,
    causal: bool,
    num_contexts: int = 1,
) -> Tensor:
    """The DecomposedAttention op's math (its contract, with defaults, is `dattn_export.plugins.contract`).

    The T queries `q` (rotated) sit at the last T of the S text key slots; `key_mask` (B, S) marks real text keys
    and `context_mask` (B, V) each context key's segment, 1..`num_contexts` (0: not a key; V may be 0). Text keys
    are causal, and with `window` a query at slot i sees slot j only when i - j < window. Every context key is
    visible to `q_vis` (debiased), unless `causal_context` (one segment): then the visual keys take slots [0, V)
    before the text and the same causal and window rule covers them (conventional attention, no debiasing). With
    `causal` false every real text key is visible (MMCA's attention within an image).
    """
    if causal_context and num_contexts != 1:
        raise ValueError(f"causal visual keys take one context segment, not {num_contexts}")
    txt_mask, vis_mask = segment_masks(key_mask, context_mask, q.shape[2], window, causal_context, causal)
    return decomposed_attention(
        q,
        k,
        v,
        txt_mask,
        q_vis,
        k_vis,
        v_vis,
        vis_mask,
        scale=scale,
        softcap=softcap,
        merge=merge,
        num_contexts=num_contexts,
    )


def segment_masks(
    key_mask: Tensor,
    context_mask: Tensor,
    num_queries: int,
    window: int | None,
    causal_context: bool,
    causal: bool,
) -> tuple[Tensor, Tensor]:
    """The op contract's masks from key validity: text bool (B, T, S), and the context keys' segments (B, T, V),
    0 where a query may not attend."""
    segments = context_mask.long()[:, None, :].expand(-1, num_queries, -1)
    if not causal:
        return key_mask.bool()[:, None, :].expand(-1, num_queries, -1), segments
    if causal_context:
        full = causal_mask(torch.cat([context_mask.bool(), key_mask.bool()], dim=1), num_queries, window)
        num_context = context_mask.shape[1]
        return full[..., num_context:], segments * full[..., :num_context]
    return causal_mask(key_mask, num_queries, window), segments


def segment_shares(
    q: Tensor,
    k: Tensor,
    key_mask: Tensor,
    q_vis: Tensor,
    k_vis: Tensor,
    context_mask: Tensor,
    *,
    scale: float,
    softcap: float | None,
    window: int | None,
    causal_context: bool,
    num_contexts: int = 1,
    text_split: Tensor | None = None,
) -> Tensor:
    """Per head and query, the share of one softmax over [context ; text] keys (the op contract's masks) that
    falls on each segment: (B, Hq, T, N + 1) as [context segment 1, ..., N, text], or with `text_split` (S,) bool
    over the text keys (B, Hq, T, N + 2) as [..., text where split, text elsewhere]. For the alpha merge and
    conventional attention this is the attention mass on each segment (one visual segment: sigmoid(S_V - S_T));
    for the sum merge the share one softmax would give; a query that sees no key gets 0."""
    txt_mask, segments = segment_masks(key_mask, context_mask, q.shape[2], window, causal_context, causal=True)
    s_vis = _masked(_logits(q_vis, k_vis, scale, softcap), segments != 0)
    p = _softmax(torch.cat([s_vis, _masked(_logits(q, k, scale, softcap), txt_mask)], dim=-1))
    p_vis, p_text = p.split([k_vis.shape[2], k.shape[2]], dim=-1)
    shares = [(p_vis * (segments == index)[:, None, None]).sum(-1) for index in range(1, num_contexts + 1)]
    shares += (
        [p_text.sum(-1)] if text_split is None else [p_text[..., text_split].sum(-1), p_text[..., ~text_split].sum(-1)]
    )
    return torch.stack(shares, dim=-1).flatten(1, 2)
