"""The decomposed-attention math: the single reference every other implementation is tested against.
Pure torch: this file ships inside Hub repos with the model.

Text queries attend to two key segments:
  * the visual segment: visual keys, no mask by default, queried with `q_vis` (unrotated in D-Attn: "debiased");
  * the text segment: text keys (past + current), causal/padding/window mask, queried with `q_txt` (rotated).

merge="alpha": one softmax over the concatenated logits [visual ; text]. This equals the paper's
    sigmoid(S_V - S_T) * XA + sigmoid(S_T - S_V) * SA, with S_* the log-sum-exp of each segment.
merge="sum":   softmax per segment, outputs added (released Vidi-style models, MMCA's text rule).

Grouped-query attention is computed by viewing the query heads as (kv_heads, group) so keys and
values are never repeated.
"""

from __future__ import annotations

import torch
from torch import Tensor

MERGE_MODES = ("alpha", "sum")


def _logits(q: Tensor, k: Tensor, mask: Tensor | None, scale: float, softcap: float | None) -> Tensor:
    """(B, Hq, T, D) x (B, Hkv, S, D) -> fp32 logits (B, Hkv, G, T, S), soft-capped, masked positions at -inf."""
    kv_heads = k.shape[1]
    q = q.float().unflatten(1, (kv_heads, q.shape[1] // kv_heads))
    s = torch.matmul(q, k.float().unsqueeze(2).transpose(-1, -2)) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    if mask is not None:
        s = s.masked_fill(~mask[:, None, None], float("-inf"))
    return s


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
) -> Tensor:
    """Text-query attention over a visual and a text key segment.

    Shapes: q_* (B, Hq, T, D); k_*, v_* (B, Hkv, S, D) with Hq % Hkv == 0; masks bool (B, T, S),
    True where the query may attend (None: all). Without a visual segment this is plain attention.
    Computes in fp32 and returns (B, Hq, T, D) in q_txt's dtype. A query that sees no key outputs 0.
    """
    if merge not in MERGE_MODES:
        raise ValueError(f"merge must be one of {MERGE_MODES}, got {merge!r}")
    s_txt = _logits(q_txt, k_txt, txt_mask, scale, softcap)
    if k_vis is None:
        out = _weighted_values(_softmax(s_txt), v_txt)
    else:
        s_vis = _logits(q_vis, k_vis, vis_mask, scale, softcap)
        if merge == "alpha":
            p = _softmax(torch.cat([s_vis, s_txt], dim=-1))
            p_vis, p_txt = p.split([s_vis.shape[-1], s_txt.shape[-1]], dim=-1)
        else:
            p_vis, p_txt = _softmax(s_vis), _softmax(s_txt)
        out = _weighted_values(p_vis, v_vis) + _weighted_values(p_txt, v_txt)
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
    visual_mask: Tensor,
    *,
    scale: float,
    softcap: float | None,
    window: int | None,
    merge: str,
    causal_visual: bool,
    causal: bool,
) -> Tensor:
    """The DecomposedAttention op's math (its contract, with defaults, is `dattn_export.plugins.contract`).

    The T queries `q` (rotated) sit at the last T of the S text key slots; `key_mask` (B, S) and
    `visual_mask` (B, V) mark real keys (V may be 0). Text keys are causal, and with `window` a query at slot
    i sees slot j only when i - j < window. Every visual key is visible to `q_vis` (debiased), unless
    `causal_visual`: then the visual keys take slots [0, V) before the text and the same causal and window
    rule covers them (conventional attention, no debiasing). With `causal` false every real text key is visible
    (MMCA's attention within an image).
    """
    txt_mask, vis_mask = segment_masks(key_mask, visual_mask, q.shape[2], window, causal_visual, causal)
    return decomposed_attention(
        q, k, v, txt_mask, q_vis, k_vis, v_vis, vis_mask, scale=scale, softcap=softcap, merge=merge
    )


def segment_masks(
    key_mask: Tensor,
    visual_mask: Tensor,
    num_queries: int,
    window: int | None,
    causal_visual: bool,
    causal: bool,
) -> tuple[Tensor, Tensor]:
    """The op contract's (text, visual) bool masks, (B, T, S) and (B, T, V), from key validity."""
    if not causal:
        txt_mask = key_mask.bool()[:, None, :].expand(-1, num_queries, -1)
        return txt_mask, visual_mask.bool()[:, None, :].expand(-1, num_queries, -1)
    if causal_visual:
        full = causal_mask(torch.cat([visual_mask, key_mask], dim=1), num_queries, window)
        num_visual = visual_mask.shape[1]
        return full[..., num_visual:], full[..., :num_visual]
    return causal_mask(key_mask, num_queries, window), visual_mask.bool()[:, None, :].expand(-1, num_queries, -1)


def segment_shares(
    q: Tensor,
    k: Tensor,
    key_mask: Tensor,
    q_vis: Tensor,
    k_vis: Tensor,
    visual_mask: Tensor,
    *,
    scale: float,
    softcap: float | None,
    window: int | None,
    causal_visual: bool,
    text_split: Tensor | None = None,
    contexts: tuple[tuple[Tensor, Tensor], ...] = (),
) -> Tensor:
    """Per head and query, the share of one softmax over [visual ; text] keys (the op contract's masks) that
    falls on each segment: (B, Hq, T, 2) as [visual, text], or with `text_split` (S,) bool over the text keys
    (B, Hq, T, 3) as [visual, text where split, text elsewhere]. `contexts`: more context segments (keys
    (B, Hkv, A, D), mask (B, A)) that `q_vis` reads like the visual one (a video model's audio), each a share
    after the visual one. For the alpha merge and conventional attention this is the attention mass on each segment
    (visual: sigmoid(S_V - S_T)); for the sum merge the share one softmax would give; a query that sees no key
    gets 0."""
    num_queries = q.shape[2]
    txt_mask, vis_mask = segment_masks(key_mask, visual_mask, num_queries, window, causal_visual, causal=True)
    context_logits = [
        _logits(q_vis, keys, mask.bool()[:, None, :].expand(-1, num_queries, -1), scale, softcap)
        for keys, mask in contexts
    ]
    s = torch.cat(
        [_logits(q_vis, k_vis, vis_mask, scale, softcap), *context_logits, _logits(q, k, txt_mask, scale, softcap)],
        dim=-1,
    )
    p = _softmax(s)
    sizes = [keys.shape[2] for keys, _ in contexts]
    p_contexts = p[..., k_vis.shape[2] : k_vis.shape[2] + sum(sizes)].split(sizes, dim=-1)
    p_text = p[..., k_vis.shape[2] + sum(sizes) :]
    text, context_shares = p_text.sum(-1), [part.sum(-1) for part in p_contexts]
    visual = p.sum(-1) - text  # not a sum over the visual keys: that axis may be empty
    for share in context_shares:
        visual = visual - share
    shares = [visual, *context_shares]
    shares += [text] if text_split is None else [p_text[..., text_split].sum(-1), p_text[..., ~text_split].sum(-1)]
    return torch.stack(shares, dim=-1).flatten(1, 2)
