"""A family is one `Family` entry (and a line naming each class made from it): Qwen2 (q/k/v biases, no o_proj bias,
per-layer sliding windows, no head_dim in its config, no released D-Attn model) is added so. Its reference model
equals transformers' own Qwen2 on text, decodes with D-Attn's cached visual K/V as the released families do, and
every backend that runs on CPU (ONNX Runtime, onnxruntime-genai; vLLM in test_vllm.py) gives transformers' logits."""

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.builders import build_model, images, left_padded_batch, transformers_llm
from helpers.cli import run_cli
from transformers import Qwen2Config

from dattn_export.checkpoints.source import load_model
from dattn_export.demo_model import write_demo_checkpoint
from dattn_export.modeling import configuration_dattn, modeling_dattn
from dattn_export.modeling.families import FAMILIES

PACKAGE = Path(configuration_dattn.__file__).parents[1]
TOLERANCE = 1e-4  # fp32 logits, against transformers


def test_each_family_s_classes_are_written_out_by_the_names_its_entry_gives():
    """config.json's architectures, a Hub repo's auto_map and vLLM's pickles name the classes: each is written out
    by that name in the one module that makes it (grep finds it there), made from its family's entry; a family added
    without one of those lines fails here, named."""
    from dattn_export import vllm_plugin  # imports no vLLM: its serving configs are plain config classes

    made = {
        configuration_dattn: lambda family: family.config_class_name,
        modeling_dattn: lambda family: family.model_class_name,
        vllm_plugin: vllm_plugin.serving_config_name,
    }
    sources = {path: path.read_text() for path in PACKAGE.rglob("*.py")}
    lacking = []
    for family in FAMILIES.values():
        for module, name_of in made.items():
            name = name_of(family)
            cls = getattr(module, name, None)
            if cls is None:
                lacking.append(f"{module.__name__}.{name}")
                continue
            assert cls.__name__ == name and cls.__module__ == module.__name__
            config_class = cls.config_class if module is modeling_dattn else cls
            assert config_class.model_type == family.model_type
            written = [path for path, text in sources.items() if f"\n{name} = " in text]
            assert written == [Path(module.__file__)], (name, written)
    assert lacking == []
    assert set(configuration_dattn.CONFIG_CLASSES) == set(modeling_dattn.MODEL_CLASSES) == set(
        family.model_type for family in FAMILIES.values()
    )  # fmt: skip


@pytest.mark.parametrize("mode", ["sattn", "dattn"])
def test_qwen2_text_equals_transformers(mode):
    """Text only (D-Attn with no context is the LLM itself), prompts past the 8-token window of its sliding layers."""
    model = build_model("qwen2", dattn_mode=mode)
    attention = model.model.layers[0].self_attn
    assert [p.bias is not None for p in (attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj)] == [
        True, True, True, False
    ]  # fmt: skip
    assert "head_dim" not in Qwen2Config.__dataclass_fields__ and model.config.head_dim == 32  # hidden / heads
    hf = transformers_llm(model)
    assert type(hf).__name__ == "Qwen2ForCausalLM" and hf.config.layer_types[1:] == ["sliding_attention"] * 2
    ids, mask = left_padded_batch([19, 11, 4])
    with torch.no_grad():
        ours = model(ids, attention_mask=mask).logits
        theirs = hf(input_ids=ids, attention_mask=mask).logits
    keep = mask.bool()
    torch.testing.assert_close(ours[keep], theirs[keep], atol=1e-5, rtol=0)
    assert theirs[keep].std() > 0.3
    unwindowed = build_model("qwen2", dattn_mode=mode, use_sliding_window=False)  # the same weights
    with torch.no_grad():  # the window matters: without it the long prompt's logits differ
        assert (unwindowed(ids, attention_mask=mask).logits[0, -1] - theirs[0, -1]).abs().max() > 1e-3


def test_qwen2_decodes_with_cached_visual_kv():
    model = build_model("qwen2")
    ids, mask = left_padded_batch([12, 5])
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


@pytest.mark.slow
def test_qwen2_on_every_cpu_backend_equals_transformers(tmp_path):
    """The demo checkpoint of the family, converted and exported by the CLI: on text, the reference, our graphs on
    ONNX Runtime and onnxruntime-genai give transformers' Qwen2 logits (<= 1e-4, fp32) at every step of a greedy
    answer; with the demo picture, validate passes."""
    from dattn_export.runtime.genai import GenaiRuntime
    from dattn_export.runtime.ort import OrtModel

    checkpoint = write_demo_checkpoint(tmp_path / "checkpoint", "qwen2")
    converted, exported = tmp_path / "converted", tmp_path / "onnx"
    assert run_cli("convert", checkpoint, "-o", converted).returncode == 0
    result = run_cli("onnx", converted, "-o", exported)
    assert result.returncode == 0, result.stderr[-2000:]
    validated = run_cli("validate", exported, "--against", converted, "--max-new-tokens", "6")
    assert validated.returncode == 0 and "PASSED" in validated.stdout, validated.stdout[-2000:]

    model = load_model(converted)
    hf = transformers_llm(model)
    ids = torch.tensor([[1, *range(40, 60)]])  # 21 tokens: past the sliding window
    with torch.no_grad():
        answer = hf.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1] :].tolist()
        expected = hf(input_ids=torch.cat([ids, torch.tensor([answer[:-1]])], 1)).logits[0, ids.shape[1] - 1 :].numpy()
        reference = model(torch.cat([ids, torch.tensor([answer[:-1]])], 1)).logits[0, ids.shape[1] - 1 :].numpy()
    assert np.abs(reference - expected).max() <= TOLERANCE

    graphs = OrtModel(exported)
    mask = np.ones((1, ids.shape[1] + len(answer) - 1), np.int64)
    full = np.concatenate([ids.numpy(), [answer[:-1]]], 1)
    logits, _ = graphs.decode(full, mask, graphs.empty_kv(1), *graphs.no_context(1))
    assert np.abs(logits[0, ids.shape[1] - 1 :] - expected).max() <= TOLERANCE

    tokens, steps = GenaiRuntime(exported).generate(ids.numpy(), graphs.no_context(1), len(answer))
    assert tokens == answer and np.abs(np.stack(steps) - expected).max() <= TOLERANCE
