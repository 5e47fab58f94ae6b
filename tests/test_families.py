"""A family is one spec: a third one (Llama), registered by this file alone, builds the reference model, which equals
transformers' own Llama on text and decodes with D-Attn's cached visual K/V as the two released families do."""

import pytest
import torch
from helpers.builders import build_model, images, left_padded_batch, transformers_llm

from dattn_export.modeling import families
from dattn_export.modeling.configuration_dattn import CONFIG_CLASSES, config_class
from dattn_export.modeling.modeling_dattn import MODEL_CLASSES, model_class

# everything that adding Llama to families.FAMILIES would add (the released fields name no released model)
LLAMA = families.Family(
    name="llama",
    transformers_module="llama",
    prefix="Llama",
    activation_key="hidden_act",
    sandwich_norms=False,
    embedding_scaled=False,
    norm_offset=0.0,
    window_per_layer=False,
    genai_type="llama",
    released_model="none",
    released_architecture="none",
    released_pool_rule="space-to-depth",
    released_scales_streams=False,
    tiny=dict(families.TINY_SIZES, num_key_value_heads=2, head_dim=16, attention_bias=True),
)


@pytest.fixture
def llama(monkeypatch):
    monkeypatch.setitem(families.FAMILIES, LLAMA.name, LLAMA)
    monkeypatch.setitem(families.BY_MODEL_TYPE, LLAMA.model_type, LLAMA)
    monkeypatch.setitem(CONFIG_CLASSES, LLAMA.model_type, config_class(LLAMA))
    monkeypatch.setitem(MODEL_CLASSES, LLAMA.model_type, model_class(LLAMA))


def test_third_family_text_equals_transformers(llama):
    model = build_model("llama", dattn_mode="sattn")
    assert type(model).__name__ == "DAttnLlamaForCausalLM" and model.model.layers[0].self_attn.q_proj.bias is not None
    hf = transformers_llm(model)
    assert type(hf).__name__ == "LlamaForCausalLM"
    ids, mask = left_padded_batch([9, 5])
    with torch.no_grad():
        ours = model(ids, attention_mask=mask).logits
        theirs = hf(input_ids=ids, attention_mask=mask).logits
    keep = mask.bool()
    torch.testing.assert_close(ours[keep], theirs[keep], atol=1e-5, rtol=0)
    assert theirs[keep].std() > 0.3


def test_third_family_decodes_with_cached_visual_kv(llama):
    model = build_model("llama")
    ids, mask = left_padded_batch([8, 5])
    pixels = images(2, 1)
    with torch.no_grad():
        full = model(ids, pixels, mask).logits
        context_kv = model.model.encode_context(model.model.embed_images(pixels))
        out = model(ids[:, :4], attention_mask=mask[:, :4], context_key_values=context_kv)
        steps = [out.logits]
        for t in range(4, ids.shape[1]):
            out = model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], past_key_values=out.past_key_values,
                        context_key_values=context_kv)  # fmt: skip
            steps.append(out.logits)
    keep = mask.bool()
    torch.testing.assert_close(torch.cat(steps, dim=1)[keep], full[keep], atol=1e-5, rtol=0)
    with torch.no_grad():  # the image matters: the comparison can fail
        assert (model(ids, images(2, 1, seed=7), mask).logits[keep] - full[keep]).abs().max() > 1e-2
