"""WINGS learners: the literal formulas, incremental decoding, conversion of their tensors, ONNX Runtime."""

import math

import numpy as np
import pytest
import torch
from helpers.builders import build_model, checkpoint_of, images, left_padded_batch, write_hf
from helpers.checks import SHAPES, assert_converted_equals, run_case

from dattn_export.checkpoints.source import load_model, saved_state_dict
from dattn_export.runtime.ort import OrtModel
from dattn_export.stages.convert import convert
from dattn_export.stages.info import describe
from dattn_export.stages.onnx_export import export_onnx
from dattn_export.stages.validate import validate

RANK = 8
ATOL = 1e-5


def wings_model(family, mode="dattn", seed=0, **overrides):
    return build_model(family, seed=seed, dattn_mode=mode, wings_rank=RANK, **overrides)


# --- a literal implementation of the formulas, head by head, every softmax materialised ---------------------


def residual_low_rank(x, seq):
    """x(1 + W) with W = A B the learner's rank-r matrices."""
    w = seq[0].weight.T @ seq[1].weight.T
    assert torch.linalg.matrix_rank(w) <= RANK
    return x @ (torch.eye(w.shape[0]) + w)


def split_heads(x, head_dim):
    return x.unflatten(-1, (-1, head_dim)).transpose(1, 2)


def rotate(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos[:, None] + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin[:, None]


def softmax_rows(s):
    """Softmax per row; a row that sees no key (all -inf) is zeros."""
    return torch.nan_to_num(torch.softmax(s, dim=-1), nan=0.0)


def learner_attention(q, k, v, allowed, o_proj):
    """Per head: softmax(q k^T / sqrt(d)) v over the allowed keys, heads concatenated, then the rank-r output."""
    outs = []
    for h in range(q.shape[1]):
        s = (q[:, h] @ k[:, h].transpose(-1, -2)) / math.sqrt(q.shape[-1])
        outs.append(softmax_rows(s.masked_fill(~allowed, float("-inf"))) @ v[:, h])
    return torch.cat(outs, dim=-1) @ o_proj[0].weight.T @ o_proj[1].weight.T


def main_attention_mass(layer, q, q_vis, k, k_vis, key_mask, context_mask):
    """(B, T, 2 * heads): per head [mass on visual keys, mass on text keys] of one softmax over all keys, from
    slots written out: visual keys at slots [0, V) (causal and windowed only when not debiased), text after."""
    attn = layer.self_attn
    heads, num_new = q.shape[1:3]
    num_context, num_text = k_vis.shape[2], k.shape[2]
    q_slot = num_context + num_text - num_new + torch.arange(num_new)
    k_slot = torch.cat([torch.arange(num_context), num_context + torch.arange(num_text)])
    is_text = torch.arange(num_context + num_text) >= num_context
    ordered = (k_slot[None] <= q_slot[:, None]) & (
        attn.window is None or (q_slot[:, None] - k_slot[None] < attn.window)
    )
    if not attn.causal_context:  # debiased: every real visual key is visible
        ordered = ordered | ~is_text[None]
    allowed = ordered[None] & torch.cat([context_mask, key_mask], dim=1).bool()[:, None]
    features = []
    for h in range(heads):
        kv_head = h // (heads // k.shape[1])
        s = torch.cat(
            [q_vis[:, h] @ k_vis[:, kv_head].transpose(-1, -2), q[:, h] @ k[:, kv_head].transpose(-1, -2)], -1
        )
        s = s * attn.scale
        if attn.softcap:
            s = torch.tanh(s / attn.softcap) * attn.softcap
        p = softmax_rows(s.masked_fill(~allowed, float("-inf")))
        features += [p[..., ~is_text].sum(-1), p[..., is_text].sum(-1)]
    return torch.stack(features, dim=-1)


@pytest.mark.parametrize("mode", ["dattn", "sattn", "mmca"])
def test_layer_equals_literal_formulas(family, mode):
    """One WINGS layer (Gemma 2: a sliding one) against the formulas written out by hand."""
    model = wings_model(family, mode)
    layer, attn = model.model.layers[0], model.model.layers[0].self_attn
    ids, key_mask = left_padded_batch([13, 10, 4])  # beyond Gemma's 8-token window
    batch, num_new = ids.shape
    pixels = images(batch, 2)
    context_mask = torch.ones(batch, 32, dtype=torch.long)
    context_mask[1, 20:] = 0  # a second image that is padding for row 1
    generator = torch.Generator().manual_seed(3)
    h = torch.randn(batch, num_new, model.config.hidden_size, generator=generator)
    positions = (key_mask.cumsum(-1) - 1).clamp_min(0) + (0 if model.config.use_debias else 32)
    with torch.no_grad():
        embeds = model.model.embed_images(pixels)
        visual = model.model.encode_context(embeds, context_mask)[0]
        cos, sin = model.model.rotary_emb(h, positions)
        got, cache = layer.text_forward(h, (cos, sin), None, visual, key_mask, context_mask)

        # the visual learner's keys come from the visual stream's input to this layer (layer 0: the embeddings)
        x_vis = layer.input_layernorm(embeds)
        k_wv = split_heads(residual_low_rank(x_vis, layer.wings_visual.k_proj), attn.head_dim)
        v_wv = split_heads(residual_low_rank(x_vis, layer.wings_visual.v_proj), attn.head_dim)
        torch.testing.assert_close(visual[2], k_wv, atol=ATOL, rtol=0)
        torch.testing.assert_close(visual[3], v_wv, atol=ATOL, rtol=0)

        x = layer.input_layernorm(h)
        q_main = split_heads(attn.q_proj(x), attn.head_dim)
        q_rot, k_main = rotate(q_main, cos, sin), rotate(split_heads(attn.k_proj(x), attn.head_dim), cos, sin)
        v_main = split_heads(attn.v_proj(x), attn.head_dim)
        q_vis = q_main if model.config.use_debias else q_rot
        mass = main_attention_mass(layer, q_rot, q_vis, k_main, visual[0], key_mask, context_mask)
        router = layer.wings_router
        weights = torch.softmax(mass @ router.weight.T + router.bias, dim=-1)

        q_v = split_heads(residual_low_rank(x, layer.wings_visual.q_proj), attn.head_dim)
        visual_out = learner_attention(
            q_v, k_wv, v_wv, context_mask.bool()[:, None, :].expand(-1, num_new, -1), layer.wings_visual.o_proj
        )
        text = layer.wings_text
        q_t = rotate(split_heads(residual_low_rank(x, text.q_proj), attn.head_dim), cos, sin)
        k_t = rotate(split_heads(residual_low_rank(x, text.k_proj), attn.head_dim), cos, sin)
        v_t = split_heads(residual_low_rank(x, text.v_proj), attn.head_dim)
        causal = torch.ones(num_new, num_new, dtype=torch.bool).tril()[None] & key_mask.bool()[:, None, :]
        text_out = learner_attention(q_t, k_t, v_t, causal, text.o_proj)

        # the main attention is tested against transformers elsewhere: here it is the trusted term of the sum
        main = attn.output(attn.attend(q_rot, k_main, v_main, key_mask, q_vis, visual[:2], context_mask))
        expected = layer.residual_mlp(h, main + weights[..., :1] * visual_out + weights[..., 1:] * text_out)

    keep = key_mask.bool()
    torch.testing.assert_close(got[keep], expected[keep], atol=ATOL, rtol=0)
    torch.testing.assert_close(cache[2], k_t, atol=ATOL, rtol=0)
    assert weights[keep].std() > 0.05 and (weights[keep][:, 0] > 0.01).all()  # the router is not degenerate
    assert (weights[..., :1] * visual_out + weights[..., 1:] * text_out)[keep].std() > 0.1  # learners matter
    assert mass[..., 0][keep].max() > 0.05 and mass[keep].sum(-1).sub(attn.num_heads).abs().max() < 1e-5  # per head: 1


def test_silent_learners_leave_the_base_model(family):
    """A WINGS model whose learners' output matrices are zero (as initialised) gives the base model's logits."""
    base = build_model(family)
    wings = wings_model(family)
    state = saved_state_dict(base)
    for name, tensor in saved_state_dict(wings).items():
        if name.endswith("o_proj.1.weight") and ".wings_" in name:
            state[name] = torch.zeros_like(tensor)
        elif ".wings_" in name:
            state[name] = tensor
    wings.load_state_dict(state, strict=False)
    ids, mask = left_padded_batch([9, 5])
    pixels = images(2, 2)
    with torch.no_grad():
        torch.testing.assert_close(wings(ids, pixels, mask).logits, base(ids, pixels, mask).logits, atol=0, rtol=0)
        wings.model.layers[1].wings_text.o_proj[1].weight.fill_(0.05)
        assert (wings(ids, pixels, mask).logits - base(ids, pixels, mask).logits).abs().max() > 1e-2


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["dattn", "sattn", "mmca"])
def test_incremental_decoding_equals_full_forward(family, mode):
    model = wings_model(family, mode, wings_layers=[0, 2])
    ids, mask = left_padded_batch([12, 7, 3])
    pixels = images(3, 2)
    with torch.no_grad():
        full = model(ids, pixels, mask).logits
        step = model(ids[:, :6], pixels, mask[:, :6])
        pieces = [step.logits]
        for t in range(6, ids.shape[1]):
            step = model(
                ids[:, t : t + 1],
                attention_mask=mask[:, : t + 1],
                past_key_values=step.past_key_values,
                context_key_values=step.context_key_values,
            )
            pieces.append(step.logits)
        assert [len(layer) for layer in step.past_key_values] == [4, 2, 4]
        tokens = model.greedy(ids, pixels, mask, max_new_tokens=8)
        # generation re-run one token at a time through the full forward: the same tokens
        running, running_mask = ids, mask
        for _ in range(8):
            nxt = model(running, pixels, running_mask).logits[:, -1].argmax(-1, keepdim=True)
            running, running_mask = torch.cat([running, nxt], 1), torch.cat([running_mask, torch.ones_like(nxt)], 1)
    keep = mask.bool()
    torch.testing.assert_close(torch.cat(pieces, dim=1)[keep], full[keep], atol=ATOL, rtol=0)
    assert tokens.tolist() == running[:, ids.shape[1] :].tolist()


def test_converts_from_every_layout_with_the_learners(tmp_path):
    model = wings_model("gemma2", wings_layers=[1])
    tensors = saved_state_dict(model)
    learners = {n: t for n, t in tensors.items() if ".wings_" in n}
    hidden = model.config.hidden_size
    assert (
        sum(t.numel() for t in learners.values())
        == 2 * 4 * 2 * hidden * RANK + 2 * (2 * model.config.num_attention_heads) + 2
    )
    assert describe(write_hf(tmp_path / "bin", model, tensors, "bin", 2)).parameters["WINGS learners"] == sum(
        t.numel() for t in learners.values()
    )
    convert(tmp_path / "bin", tmp_path / "from-bin", dtype="fp32")
    assert_converted_equals(tmp_path / "from-bin", tensors)
    ids, mask = left_padded_batch([6, 4])
    with torch.no_grad():
        converted = load_model(tmp_path / "from-bin")(ids, images(2), mask).logits
        torch.testing.assert_close(converted, model(ids, images(2), mask).logits, atol=0, rtol=0)

    # a WINGS config whose checkpoint lacks a learner tensor is refused, naming it
    del tensors["model.layers.1.wings_router.bias"]
    write_hf(tmp_path / "missing", model, tensors, shards=1)
    assert "model.layers.1.wings_router.bias" in " ".join(describe(tmp_path / "missing").problems)


@pytest.mark.slow
@pytest.mark.parametrize(  # with test_onnx.py's four (no WINGS), every family and mode
    "family, mode", [("mistral", "dattn"), ("gemma2", "dattn"), ("mistral", "sattn"), ("gemma2", "mmca")]
)
def test_onnx_runtime_matches_reference(tmp_path, family, mode):
    model = wings_model(family, mode, wings_layers=[0, 2])
    manifest = export_onnx(checkpoint_of(model, tmp_path / "ckpt"), tmp_path / "onnx")
    assert manifest.to_json()["model"]["wings"] == {"rank": RANK, "layers": [0, 2], "heads": model.config.wings_heads}
    decoder_inputs = [i.name for i in manifest.graphs["decoder"].inputs]
    assert "past_key_values.0.wings_key" in decoder_inputs and "past_key_values.1.wings_key" not in decoder_inputs
    assert manifest.graphs["decoder"].fused_attention_nodes == model.config.num_hidden_layers
    runtime = OrtModel(tmp_path / "onnx")
    for seed, shape in enumerate(SHAPES):
        run_case(model, runtime, *shape, seed=seed)

    # text only: empty visual caches of every part
    ids, mask = left_padded_batch([9, 5])
    no_image = [np.zeros((2, *t.shape[1:2], 0, t.shape[3]), np.float32) for t in runtime.empty_kv(2)]
    logits, _ = runtime.decode(ids.numpy(), mask.numpy(), runtime.empty_kv(2), no_image)
    with torch.no_grad():
        expected = model(ids, attention_mask=mask).logits.numpy()
    np.testing.assert_allclose(logits[mask.bool().numpy()], expected[mask.bool().numpy()], atol=1e-4, rtol=0)

    report = validate(tmp_path / "onnx", steps=20)  # greedy tokens through the graphs, every cache part compared
    assert report.passed and report.agreement == 20
    assert {c.output for c in report.comparisons} >= {
        "context_key_values.0.wings_key",
        "context_key_values.2.wings_value",
    }
