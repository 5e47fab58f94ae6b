"""The decomposed-attention math: the single reference every other implementation is tested against.

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
    """Softmax over the last axis where a row with no visible key gives zeros (not NaN)."""
    row_max = s.amax(-1, keepdim=True).clamp_min(torch.finfo(s.dtype).min)
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
    softcap: float | None = None,
    merge: str = "alpha",
) -> Tensor:
    """Text-query attention over a visual and a text key segment.

    Shapes: q_* (B, Hq, T, D); k_*, v_* (B, Hkv, S, D) with Hq % Hkv == 0; masks bool (B, T, S),
    True where the query may attend (None: all). Without a visual segment this is plain attention.
    Computes in fp32 and returns (B, Hq, T, D) in q_txt's dtype. A query that sees no key outputs 0.
    """
    if merge not in MERGE_MODES:
        raise ValueError(f"merge must be one of {MERGE_MODES}, got {merge!r}")
    s_txt = _logits(q_txt, k_txt, txt_mask, scale, softcap)
    if k_vis is None or k_vis.shape[2] == 0:
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


def causal_mask(
    key_valid: Tensor, num_queries: int, window: int | None = None, query_offset: int | None = None
) -> Tensor:
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
