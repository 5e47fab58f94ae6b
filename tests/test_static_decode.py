"""Static-cache decoding (runtime/static_decode.py), what a GPU captures in a CUDA graph, against the dynamic
cache's: the same greedy tokens and, at every step, the same logits, on both families (Gemma 2's sliding window
shorter than the text, folded into the key mask), a video model's two context segments, dattn's alpha merge and a
batch with left padding. The ops are the reference's; on a GPU the kernel's (the GPU check)."""

import pytest
import torch
from helpers.builders import build_model, released_model

from dattn_export.runtime.static_decode import static_generate

MODELS = {
    "mistral": lambda: build_model("mistral"),
    "gemma2, window 6": lambda: released_model("gemma2", window=6),
    "video, frames + audio": lambda: released_model("mistral", video=True),
    "alpha merge": lambda: build_model("gemma2", dattn_mode="dattn", sliding_window=5),
}


def dynamic_logits(model, ids, tokens, context) -> list[torch.Tensor]:
    """Each step's next-token logits of the dynamic cache's decoding of `tokens` after `ids`."""
    out = model(ids, attention_mask=torch.ones_like(ids), **context)
    logits, mask = [out.logits[:, -1]], torch.ones_like(ids)
    for token in tokens[:-1]:
        mask = torch.cat([mask, torch.ones(1, 1, dtype=mask.dtype)], dim=1)
        out = model(torch.tensor([[token]]), attention_mask=mask, past_key_values=out.past_key_values, **context)
        logits.append(out.logits[:, -1])
    return logits


def context_of(model, seed: int = 3) -> dict:
    """A context for the model: a picture's K/V, or a video model's frames and audio joined."""
    config, g = model.config, torch.Generator().manual_seed(seed)
    size = config.vision_config["image_size"]
    if config.mm_input_type != "video":
        keys, mask = model.model.encode_images(torch.randn(1, 1, 3, size, size, generator=g))
        return dict(context_key_values=keys, context_mask=mask)
    frames = model.model.encode_video([torch.randn(3, 3, size, size, generator=g)])
    chunk = 2 * config.audio_config["max_source_positions"]
    mel = torch.randn(1, config.audio_config["num_mel_bins"], chunk, generator=g)
    keys, segments = model.model.join_contexts(frames, model.model.encode_audio([mel], [chunk]))
    return dict(context_key_values=keys, context_mask=segments)


@pytest.mark.parametrize("name", list(MODELS))
@torch.no_grad()
def test_static_decoding_gives_the_dynamic_cache_s_tokens_and_logits(name):
    model = MODELS[name]()
    context = context_of(model)
    ids = torch.randint(3, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(5))
    expected = model.greedy(ids, max_new_tokens=12, **context)[0].tolist()
    decoded = static_generate(model, ids, 12, keep_logits=True, **context)
    assert decoded.tokens == [expected]
    for got, want in zip(decoded.step_logits, dynamic_logits(model, ids, expected, context), strict=True):
        torch.testing.assert_close(got, want.float(), atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_a_left_padded_batch_decodes_as_each_prompt_alone():
    """Two prompts of different lengths, the shorter left-padded: each row's tokens are its own alone."""
    model = MODELS["gemma2, window 6"]()
    context = context_of(model)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, model.config.vocab_size, (1, n), generator=g) for n in (9, 6)]
    alone = [model.greedy(p, max_new_tokens=8, **context)[0].tolist() for p in prompts]
    batch = torch.zeros(2, 9, dtype=torch.long)
    batch[0], batch[1, 3:] = prompts[0][0], prompts[1][0]
    padded = static_batch(model, batch, torch.tensor([[1] * 9, [0] * 3 + [1] * 6]), context)
    assert padded == alone


def static_batch(model, ids, mask, context) -> list[list[int]]:
    """static_generate on a left-padded batch: the prompt's padding masked, its positions counted from each row's
    first token, as the reference counts them."""
    keys = [tuple(t.expand(2, *t.shape[1:]) for t in layer) for layer in context["context_key_values"]]
    context = dict(context_key_values=keys, context_mask=context["context_mask"].expand(2, -1))
    return static_generate(model, ids, 8, attention_mask=mask, **context).tokens


def test_a_static_cache_refuses_what_it_cannot_hold():
    """WINGS learners' caches grow with the text: static decoding says so in one line."""
    model = build_model("mistral", wings_rank=4)
    with pytest.raises(ValueError, match="static decoding does not take WINGS learners"):
        static_generate(model, torch.tensor([[5, 6, 7]]), 2)


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_validate_backend_torch_holds_the_16_bit_model_to_its_fp32_run(tmp_path, family, monkeypatch):
    """`validate --backend torch`: the demo model in bf16 with static-cache decoding, against itself in fp32 (on the
    CPU here; on a GPU with the kernel and CUDA graphs): within 5% of the largest logit; held to fp32's own accuracy
    instead, the same bf16 model fails."""
    from dattn_export.demo_model import write_demo_checkpoint
    from dattn_export.stages import validate_model as stage
    from dattn_export.stages.validate_model import validate_model

    checkpoint = write_demo_checkpoint(tmp_path / "ckpt", family)
    report = validate_model(checkpoint, "cpu", steps=8)
    assert report.passed and report.dtype == "bfloat16" and report.backend == "torch", report.to_json()
    logits = [c for c in report.comparisons if c.output.startswith("logits")]
    assert [c.output for c in logits] == ["logits (prefill)", "logits (decode steps)"]
    assert all(0 < c.max_abs <= report.tolerance for c in logits)  # bf16 is not fp32, and is within the share
    monkeypatch.setitem(stage.SCALE_TOLERANCES, "bfloat16", 1e-6)
    assert not validate_model(checkpoint, "cpu", steps=8).passed


def test_a_gpu_that_is_absent_is_one_line(tmp_path):
    """`--device cuda` for the PyTorch model without a GPU: one line, exit 3, before the model loads."""
    from helpers.cli import error_line, run_cli

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: nothing is absent")
    for command in (("generate", tmp_path, "--prompt", "Hi", "--device", "cuda"),
                    ("validate", tmp_path, "--backend", "torch", "--device", "cuda")):  # fmt: skip
        result = run_cli(*command)
        assert result.returncode == 3, result.stderr
        assert error_line(result.stderr) == "Error: --device cuda: no CUDA GPU is visible: run on a GPU machine, or " \
            "without --device"  # fmt: skip
