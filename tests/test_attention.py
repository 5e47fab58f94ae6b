"""The reference attention function against literal implementations of the paper's formulas and SDPA."""

import math

import pytest
import torch
import torch.nn.functional as F
from helpers.checks import context_segments

from dattn_export.modeling.attention import causal_mask, decomposed_attention, segment_masks

torch.manual_seed(0)


def literal_segment(q, k, v, mask, scale, softcap):
    """One segment's attention XA or SA with materialised weights, K/V repeated per query head, and its LSE."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1).double(), v.repeat_interleave(groups, 1).double()
    logits = q.double() @ k.transpose(-1, -2) * scale
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    logits = logits.masked_fill(~mask[:, None], -math.inf)
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    return torch.softmax(logits, dim=-1) @ v, lse


def random_problem(batch=2, heads=8, kv_heads=2, queries=5, past=3, visual=7, dim=16, window=None):
    q_txt, q_vis = torch.randn(2, batch, heads, queries, dim).unbind(0)
    k_txt, v_txt = torch.randn(2, batch, kv_heads, past + queries, dim).unbind(0)
    k_vis, v_vis = torch.randn(2, batch, kv_heads, visual, dim).unbind(0)
    valid = torch.ones(batch, past + queries, dtype=torch.bool)
    valid[0, :2] = False  # left padding in the first row
    txt_mask = causal_mask(valid, queries, window)
    return q_txt, k_txt, v_txt, txt_mask, q_vis, k_vis, v_vis


@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("kv_heads", [1, 2, 8])
@pytest.mark.parametrize("window", [None, 3])
def test_alpha_merge_is_sigmoid_of_lse_difference(softcap, kv_heads, window):
    """out_t = sigmoid(S_V - S_T) * XA(t, V) + sigmoid(S_T - S_V) * SA(t, T): the paper's formula, literally."""
    q_txt, k_txt, v_txt, txt_mask, q_vis, k_vis, v_vis = random_problem(kv_heads=kv_heads, window=window)
    scale = 0.3
    vis_mask = torch.ones(q_txt.shape[0], q_txt.shape[2], k_vis.shape[2], dtype=torch.bool)
    xa, s_v = literal_segment(q_vis, k_vis, v_vis, vis_mask, scale, softcap)
    sa, s_t = literal_segment(q_txt, k_txt, v_txt, txt_mask, scale, softcap)
    expected = torch.sigmoid(s_v - s_t) * xa + torch.sigmoid(s_t - s_v) * sa
    got = decomposed_attention(
        q_txt, k_txt, v_txt, txt_mask, q_vis, k_vis, v_vis, scale=scale, softcap=softcap, merge="alpha"
    )
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=0)
    # the two segments really are weighted: neither alone gives the answer
    assert (got.double() - sa).abs().max() > 0.05 and (got.double() - xa).abs().max() > 0.05


@pytest.mark.parametrize("softcap", [None, 2.0])
def test_sum_merge_adds_two_softmaxes(softcap):
    q_txt, k_txt, v_txt, txt_mask, q_vis, k_vis, v_vis = random_problem()
    vis_mask = torch.ones(q_txt.shape[0], q_txt.shape[2], k_vis.shape[2], dtype=torch.bool)
    xa, _ = literal_segment(q_vis, k_vis, v_vis, vis_mask, 0.25, softcap)
    sa, _ = literal_segment(q_txt, k_txt, v_txt, txt_mask, 0.25, softcap)
    got = decomposed_attention(
        q_txt, k_txt, v_txt, txt_mask, q_vis, k_vis, v_vis, scale=0.25, softcap=softcap, merge="sum"
    )
    torch.testing.assert_close(got.double(), xa + sa, atol=1e-5, rtol=0)


@pytest.mark.parametrize("lengths", [[7, 5], [6, 4, 3]])
@pytest.mark.parametrize("shuffled", [False, True])
def test_sum_merge_one_softmax_per_context_segment(lengths, shuffled):
    """A video model's text attention: text, frames and audio each under its own softmax, outputs added; each
    segment computed literally on its own keys, row by row (a row without audio adds nothing for it)."""
    q_txt, k_txt, v_txt, txt_mask, q_vis, k_vis, v_vis = random_problem(visual=sum(lengths))
    segments = context_segments(2, lengths, torch.Generator().manual_seed(1) if shuffled else None)
    _, vis_segments = segment_masks(torch.ones(2, 8), segments, q_txt.shape[2], None, False, True)
    got = decomposed_attention(
        q_txt, k_txt, v_txt, txt_mask, q_vis, k_vis, v_vis, vis_segments, scale=0.25, softcap=2.0, merge="sum",
        num_contexts=len(lengths),
    )  # fmt: skip
    for row in range(2):
        expected, _ = literal_segment(
            q_txt[row : row + 1], k_txt[row : row + 1], v_txt[row : row + 1], txt_mask[row : row + 1], 0.25, 2.0
        )
        for index in range(1, len(lengths) + 1):
            keys = segments[row] == index
            if keys.any():
                all_visible = torch.ones(1, q_txt.shape[2], int(keys.sum()), dtype=torch.bool)
                part, _ = literal_segment(
                    q_vis[row : row + 1], k_vis[row : row + 1, :, keys], v_vis[row : row + 1, :, keys], all_visible,
                    0.25, 2.0,
                )  # fmt: skip
                expected = expected + part
        torch.testing.assert_close(got[row : row + 1].double(), expected, atol=1e-5, rtol=0)
    # the segments really are separate softmaxes: one softmax over all context keys differs
    one_softmax = decomposed_attention(
        q_txt, k_txt, v_txt, txt_mask, q_vis, k_vis, v_vis, vis_segments > 0, scale=0.25, softcap=2.0, merge="sum"
    )
    assert (got - one_softmax).abs().max() > 0.05


def test_alpha_merge_over_segments_is_one_softmax():
    """alpha: one softmax over every context key and the text, whatever segment a key is in."""
    q_txt, k_txt, v_txt, txt_mask, q_vis, k_vis, v_vis = random_problem(visual=12)
    segments = context_segments(2, [7, 5])[:, None, :].expand(-1, q_txt.shape[2], -1)
    got = decomposed_attention(
        q_txt, k_txt, v_txt, txt_mask, q_vis, k_vis, v_vis, segments, scale=0.3, softcap=None, merge="alpha",
        num_contexts=2,
    )  # fmt: skip
    expected = decomposed_attention(
        q_txt, k_txt, v_txt, txt_mask, q_vis, k_vis, v_vis, segments > 0, scale=0.3, softcap=None, merge="alpha"
    )
    torch.testing.assert_close(got, expected, atol=0, rtol=0)


def test_without_visual_segment_is_sdpa():
    """No visual keys: plain causal GQA attention, as torch's own scaled_dot_product_attention computes it."""
    q_txt, k_txt, v_txt, _, *_ = random_problem(queries=6, past=0)
    mask = causal_mask(torch.ones(2, 6, dtype=torch.bool), 6, window=None)
    got = decomposed_attention(q_txt, k_txt, v_txt, mask, scale=16**-0.5, softcap=None, merge="alpha")
    expected = F.scaled_dot_product_attention(q_txt, k_txt, v_txt, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_query_that_sees_nothing_outputs_zero():
    q_txt, k_txt, v_txt, txt_mask, q_vis, k_vis, v_vis = random_problem()
    txt_mask[1, 2] = False
    vis_mask = torch.ones(2, q_txt.shape[2], k_vis.shape[2], dtype=torch.bool)
    vis_mask[1, 2] = False
    for merge in ("alpha", "sum"):
        out = decomposed_attention(
            q_txt, k_txt, v_txt, txt_mask, q_vis, k_vis, v_vis, vis_mask, scale=0.25, softcap=None, merge=merge
        )
        assert torch.isfinite(out).all()
        assert out[1, :, 2].abs().max() == 0


def test_causal_mask_window_matches_definition():
    valid = torch.tensor([[False, True, True, True, True, True]])
    mask = causal_mask(valid, 3, window=2)[0]
    for i in range(3):
        for j in range(6):
            q_slot = 3 + i
            assert mask[i, j] == (valid[0, j] and j <= q_slot and q_slot - j < 2)
