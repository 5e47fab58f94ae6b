"""The reference model against transformers' own Mistral / Gemma 2, and D-Attn's defining identities."""

import pytest
import torch
from helpers.builders import build_model, images, left_padded_batch, transformers_llm

from dattn_export.modeling.modeling_dattn import MODEL_CLASSES
from dattn_export.presets import tiny_config

ATOL = 1e-5


def valid_positions(mask):
    return mask.bool()


@pytest.mark.parametrize(
    "family, overrides",
    [("mistral", {}), ("gemma2", {}), ("gemma2", {"attn_logit_softcapping": 1.5})],  # a cap that bites on O(1) logits
)
def test_sattn_text_only_equals_transformers(family, overrides):
    model = build_model(family, dattn_mode="sattn", **overrides)
    hf = transformers_llm(model)
    ids, mask = left_padded_batch([13, 9, 4])  # longer than Gemma's 8-token sliding window
    with torch.no_grad():
        ours = model(ids, attention_mask=mask).logits
        theirs = hf(input_ids=ids, attention_mask=mask).logits
    keep = valid_positions(mask)
    torch.testing.assert_close(ours[keep], theirs[keep], atol=ATOL, rtol=0)
    assert theirs[keep].std() > 0.3  # logits are O(1): the comparison can fail


@pytest.mark.parametrize("num_images", [1, 2])
def test_decomposition_identity(family, num_images):
    """D-Attn with diagonal OFF, debias OFF, alpha merge == conventional causal attention over [visual ; text]."""
    ablated = build_model(family, dattn_diagonal=False, dattn_debias=False)
    sattn = build_model(family, dattn_mode="sattn")
    ids, mask = left_padded_batch([11, 6, 3])
    pixels = images(3, num_images)
    with torch.no_grad():
        decomposed = ablated(ids, pixels, attention_mask=mask).logits
        visual = sattn.model.embed_images(pixels)
        text = sattn.model.embed_tokens(ids)
        full_mask = torch.cat([torch.ones(3, visual.shape[1], dtype=torch.long), mask], dim=1)
        hidden, _ = sattn.model(inputs_embeds=torch.cat([visual, text], dim=1), attention_mask=full_mask)
        conventional = sattn.lm_head(hidden[:, visual.shape[1] :])
        if family == "gemma2":
            conventional = torch.tanh(conventional / 30.0) * 30.0
    keep = valid_positions(mask)
    torch.testing.assert_close(decomposed[keep], conventional[keep], atol=ATOL, rtol=0)
    with torch.no_grad():  # and the real D-Attn differs: the identity is not vacuous
        dattn = build_model(family)(ids, pixels, attention_mask=mask).logits
    assert (dattn[keep] - conventional[keep]).abs().max() > 0.1


def test_diagonal_visual_stream_equals_transformers_on_single_tokens(family):
    """Diagonal V2V: each visual token attends only to itself, i.e. it is a one-token sequence. transformers'
    own model run on each visual token alone (position 0: RoPE is the identity) caches the same K/V."""
    model = build_model(family)
    hf = transformers_llm(model)
    with torch.no_grad():
        visual = model.model.embed_images(images(2, 2))
        ours = model.model.encode_context(visual)
        batch, num_context, hidden = visual.shape
        cache = hf.model(inputs_embeds=visual.reshape(batch * num_context, 1, hidden), use_cache=True).past_key_values
    for layer, (k, v) in enumerate(ours):
        for got, theirs in ((k, cache.layers[layer].keys), (v, cache.layers[layer].values)):
            expected = theirs.reshape(batch, num_context, *theirs.shape[1:]).squeeze(3).transpose(1, 2)
            torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("vision, select_layer", [("siglip", -2), ("siglip", -1), ("clip", -2), ("clip", 1)])
def test_tower_runs_only_the_layers_its_features_come_from(vision, select_layer):
    """The tower's features are transformers' own full forward's hidden state at the selected layer, bit for bit;
    the layers after it, the final norm and SigLIP's pooling head never run (NaN weights there change nothing)."""
    tower = build_model("mistral", vision=vision, mm_vision_select_layer=select_layer).model.mm_vis
    pixels = images(2)[:, 0]
    with torch.no_grad():
        expected = tower.vision_model(pixels, output_hidden_states=True).hidden_states[select_layer]
        expected = expected[:, 1:] if vision == "clip" else expected
        unused = [
            weight
            for name, weight in tower.vision_model.named_parameters()
            if name.startswith(("post_layernorm", "head"))
            or (name.startswith("encoder.layers.") and int(name.split(".")[2]) >= tower.layers_run)
        ]
        for weight in unused:
            weight.fill_(float("nan"))
        assert unused and torch.equal(tower(pixels), expected)


@pytest.mark.parametrize("mode", ["dattn", "dattn-sum"])
def test_visual_kv_independent_of_text(family, mode):
    model = build_model(family, dattn_mode=mode)
    pixels = images(2)
    with torch.no_grad():
        ids_a, mask_a = left_padded_batch([5, 3], seed=1)
        ids_b, mask_b = left_padded_batch([12, 12], seed=2)
        a = model(ids_a, pixels, mask_a).context_key_values
        b = model(ids_b, pixels, mask_b).context_key_values
    for (ka, va), (kb, vb) in zip(a, b):
        assert torch.equal(ka, kb) and torch.equal(va, vb)


@pytest.mark.parametrize("mode", ["dattn", "dattn-sum"])
def test_text_position_shift_leaves_logits_unchanged(family, mode):
    """Debiased T2V and relative T2T: moving the text to other positions changes nothing."""
    model = build_model(family, dattn_mode=mode)
    ids, mask = left_padded_batch([7, 7])
    pixels = images(2)
    positions = torch.arange(7).expand(2, -1)
    with torch.no_grad():
        at_zero = model(ids, pixels, mask, position_ids=positions).logits
        shifted = model(ids, pixels, mask, position_ids=positions + 37).logits
        sattn = build_model(family, dattn_mode="sattn")
        conv_zero = sattn(ids, pixels, mask, position_ids=positions + 16).logits
        conv_shift = sattn(ids, pixels, mask, position_ids=positions + 53).logits
    torch.testing.assert_close(at_zero, shifted, atol=ATOL, rtol=0)
    assert (conv_zero - conv_shift).abs().max() > 1e-3  # conventional attention is position-biased


@pytest.mark.parametrize("mode", ["dattn", "dattn-sum", "sattn", "mmca"])
def test_incremental_decoding_equals_full_forward(family, mode):
    model = build_model(family, dattn_mode=mode)
    ids, mask = left_padded_batch([10, 6])  # crosses Gemma's sliding window while decoding
    pixels = images(2, 2)
    with torch.no_grad():
        full = model(ids, pixels, mask).logits
        context_kv = model.model.encode_context(model.model.embed_images(pixels))  # an earlier call's K/V
        prompt = 4
        out = model(ids[:, :prompt], attention_mask=mask[:, :prompt], context_key_values=context_kv)
        steps = [out.logits]
        for t in range(prompt, ids.shape[1]):
            out = model(
                ids[:, t : t + 1],
                attention_mask=mask[:, : t + 1],
                past_key_values=out.past_key_values,
                context_key_values=context_kv,
            )
            steps.append(out.logits)
    incremental = torch.cat(steps, dim=1)
    keep = valid_positions(mask)
    torch.testing.assert_close(incremental[keep], full[keep], atol=ATOL, rtol=0)


def test_greedy_generate_matches_argmax_of_full_forward(family):
    model = build_model(family)
    ids, mask = left_padded_batch([6, 4])
    pixels = images(2)
    generated = model.greedy(ids, pixels, mask, max_new_tokens=6)
    with torch.no_grad():  # re-derive each token from a full forward over prompt + generated prefix
        for step in range(generated.shape[1]):
            seq = torch.cat([ids, generated[:, :step]], dim=1)
            seq_mask = torch.cat([mask, torch.ones_like(generated[:, :step])], dim=1)
            logits = model(seq, pixels, seq_mask).logits[:, -1]
            assert torch.equal(logits.argmax(-1), generated[:, step])


def test_mmca_visual_stream_is_attention_within_each_image(family):
    """MMCA: visual tokens attend, both ways, to the tokens of their own image only. Each image's visual K/V
    equal those of the image encoded alone; layer 0 computed literally (per-image softmax attention with
    per-image rotary positions) gives layer 1's visual keys."""
    model = build_model(family, dattn_mode="mmca")
    m, config = model.model, model.config
    per_image = config.patch_grid**2
    with torch.no_grad():
        visual = m.embed_images(images(2, 3))
        together = m.encode_context(visual)
        alone = m.encode_context(visual[:, per_image : 2 * per_image])
        for (k, v), (k_alone, v_alone) in zip(together, alone):
            torch.testing.assert_close(k[:, :, per_image : 2 * per_image], k_alone, atol=ATOL, rtol=0)
            torch.testing.assert_close(v[:, :, per_image : 2 * per_image], v_alone, atol=ATOL, rtol=0)

        layer, attn = m.layers[0], m.layers[0].self_attn
        x = layer.input_layernorm(visual)
        q, k, v = (attn.heads(p, x) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
        cos, sin = m.rotary_emb(visual, (torch.arange(visual.shape[1]) % per_image)[None])
        rotate = lambda t: (
            t * cos[:, None] + torch.cat([-t[..., t.shape[-1] // 2 :], t[..., : t.shape[-1] // 2]], -1) * sin[:, None]
        )
        q, k = rotate(q), rotate(k)
        groups = config.num_attention_heads // config.num_key_value_heads
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        logits = q @ k.transpose(-1, -2) * attn.scale
        if attn.softcap:
            logits = attn.softcap * torch.tanh(logits / attn.softcap)
        image_of = torch.arange(visual.shape[1]) // per_image
        logits = logits.masked_fill(image_of[:, None] != image_of[None, :], float("-inf"))
        h1 = layer.residual_mlp(visual, attn.output(torch.softmax(logits, -1) @ v))
        next_layer = m.layers[1]
        expected_k = next_layer.self_attn.heads(next_layer.self_attn.k_proj, next_layer.input_layernorm(h1))
    torch.testing.assert_close(together[1][0], expected_k, atol=ATOL, rtol=0)


def test_model_runs_on_the_device_of_its_weights(family):
    """Every tensor the model makes for itself (masks, positions) is made on its weights' device: on the meta
    device, as on a GPU, one made on the CPU fails the forward (the GPU check found `forward` making its masks on
    the CPU). A prompt over an image, then a step with the text cache and the image's K/V."""
    config = tiny_config(family)
    with torch.device("meta"):
        model = MODEL_CLASSES[config.model_type](config).eval()
        ids = torch.randint(3, config.vocab_size, (1, 6))
        size = config.vision_config["image_size"]
        pixels = torch.rand(1, 1, 3, size, size)
    with torch.no_grad():
        first = model(ids, pixels)
        step = model(ids[:, :1], past_key_values=first.cache, context_key_values=first.context_key_values)
    assert step.logits.device.type == "meta" and step.logits.shape == (1, 1, config.vocab_size)


def test_media_prepared_on_the_cpu_reach_the_model_s_device(family):
    """Pixels are prepared on the CPU (decoding, the processors); the model moves them to its own device as its tower
    reads them: a model on the meta device (as on a GPU) encodes a CPU picture and CPU frames, and its context K/V and
    masks are on its device. (The audio's tokens are selected by their values, which the meta device cannot do.)"""
    with torch.device("meta"):
        image_model = MODEL_CLASSES[tiny_config(family).model_type](tiny_config(family)).eval()
        video_config = tiny_config(family, audio=True, video=True)
        video_model = MODEL_CLASSES[video_config.model_type](video_config).eval()
    size = video_config.vision_config["image_size"]
    picture = image_model.config.vision_config["image_size"]
    with torch.no_grad():
        keys, mask = image_model.model.encode_images(torch.rand(1, 1, 3, picture, picture))
        frames = video_model.model.encode_video([torch.rand(3, 3, size, size)])
    for context, segments in ((keys, mask), frames):
        assert context[0][0].device.type == "meta" and segments.device.type == "meta"
