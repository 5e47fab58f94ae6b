"""transformers' own `generate` drives the model, in this process and, published, in one that cannot import
dattn_export: greedy equals `dattn-export generate` token for token and its logits the reference's at every step;
sampling is the reference's distributions through transformers' warpers, seeded alike twice; beam search is what
transformers' beam search gives over the reference model's log-probabilities (the reference run whole at each step,
no cache: `Recomputed`); streamers, stop strings, a repetition penalty, a left-padded batch of two pictures and the
pipeline's settings and streaming, each held to what it must give."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers.builders import KINDS, demo_folders
from PIL import Image
from transformers import (
    GenerationMixin,
    LogitsProcessorList,
    PreTrainedModel,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.modeling_outputs import CausalLMOutput

from dattn_export.checkpoints.source import load_model
from dattn_export.demo_model import write_video
from dattn_export.media_options import Media
from dattn_export.modeling.processing_dattn import DAttnProcessor
from dattn_export.prompts import Prompt
from dattn_export.stages.generate import run_prompt

QUESTION = "What happens here?"
TOKENS = 6
SAMPLING = {"temperature": 0.7, "top_k": 50, "top_p": 0.9}  # applied by transformers in this order
PENALTY = 1.3


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    """Two pictures of different sizes, and a 3 s video (4 fps) with its sound."""
    root = tmp_path_factory.mktemp("media")
    for name, size in (("wide.png", (64, 80)), ("tall.png", (90, 40))):
        pixels = np.random.default_rng(len(name)).integers(0, 256, (*size, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(root / name)
    samples = (np.sin(np.arange(16000 * 5) / 7.0) * 8000).astype(np.int16)
    frames = [np.random.default_rng(i).integers(0, 256, (48, 64, 3), np.uint8) for i in range(12)]
    write_video(root / "clip.mov", frames, 4, samples)
    return SimpleNamespace(picture=root / "wide.png", other=root / "tall.png", video=root / "clip.mov")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return demo_folders(tmp_path_factory.mktemp("generate"))


def conversation(kind: str, path: Path) -> list[dict]:
    medium = {"type": "video" if kind == "video" else "image", "path": str(path)}
    return [{"role": "user", "content": [medium, {"type": "text", "text": QUESTION}]}]


def media_path(kind: str, media) -> Path:
    return media.video if kind == "video" else media.picture


class Recomputed(PreTrainedModel, GenerationMixin):
    """The reference model under transformers' search, without a cache: each step runs the whole sequence again
    over the context encoded once (repeated for each row of the batch the search holds), so that nothing of the
    model's own generation hooks takes part."""

    def __init__(self, model, context, segments):
        super().__init__(model.config)
        self.reference, self.context, self.segments = model, context, segments
        self.generation_config = model.generation_config

    def forward(self, input_ids, attention_mask=None, **kwargs):
        rows = input_ids.shape[0] // self.segments.shape[0]
        context = [tuple(t.repeat_interleave(rows, 0) for t in kv) for kv in self.context]
        logits = self.reference(input_ids, attention_mask=attention_mask, context_key_values=context,
                                context_mask=self.segments.repeat_interleave(rows, 0)).logits  # fmt: skip
        return CausalLMOutput(logits=logits)

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, **kwargs):
        return {"input_ids": input_ids, "attention_mask": attention_mask}

    @classmethod
    def _supports_default_dynamic_cache(cls):
        return False


def reference_of(folder: Path, inputs):
    """The reference model, its context for `inputs`, and the logits of the next token after each prefix."""
    model = load_model(folder)
    given = {key: value for key, value in inputs.items() if key not in ("input_ids", "attention_mask")}
    context, segments = model.model.encode_inputs(**given)

    @torch.no_grad()
    def next_logits(ids: list[int]) -> torch.Tensor:
        row = torch.tensor([ids])
        return model(row, context_key_values=context, context_mask=segments).logits[0, -1]

    return model, context, segments, next_logits


def penalized_greedy(next_logits, prompt: list[int], steps: int, eos: int) -> list[int]:
    """Greedy with the repetition penalty written out: each token seen so far (prompt included) has its logit
    divided by the penalty where positive, multiplied where negative."""
    ids = list(prompt)
    for _ in range(steps):
        logits = next_logits(ids).clone()
        seen = torch.tensor(sorted(set(ids)))
        logits[seen] = torch.where(logits[seen] < 0, logits[seen] * PENALTY, logits[seen] / PENALTY)
        ids.append(int(logits.argmax()))
        if ids[-1] == eos:
            break
    return ids[len(prompt) :]


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_greedy_sampling_and_beams_in_this_process(folders, media, family):
    """The quick check: greedy is `greedy`'s (the reference loop), a seeded sample repeats, beams are
    transformers' beam search over the reference recomputed whole."""
    folder = folders(family, "image")
    processor, model = DAttnProcessor.from_pretrained(folder, trust_remote_code=True), load_model(folder)
    inputs = processor.apply_chat_template(conversation("image", media.picture), add_generation_prompt=True,
                                           tokenize=True, return_dict=True, return_tensors="pt")  # fmt: skip
    prompt = inputs["input_ids"].shape[1]
    tokens = model.generate(**inputs, max_new_tokens=TOKENS)
    expected = model.greedy(**inputs, max_new_tokens=TOKENS, eos_token_id=model.generation_config.eos_token_id)
    assert tokens[0, prompt:].tolist() == expected[0].tolist()
    sampled = []
    for _ in range(2):
        torch.manual_seed(3)
        sampled.append(model.generate(**inputs, do_sample=True, max_new_tokens=TOKENS, **SAMPLING))
    assert torch.equal(sampled[0], sampled[1])
    _, context, segments, _ = reference_of(folder, inputs)
    recomputed = Recomputed(model, context, segments)
    for beams in (2, 4):
        settings = dict(num_beams=beams, num_return_sequences=2, max_new_tokens=TOKENS, return_dict_in_generate=True,
                        output_scores=True)  # fmt: skip
        ours = model.generate(**inputs, **settings)
        theirs = recomputed.generate(inputs["input_ids"], attention_mask=inputs["attention_mask"], use_cache=False,
                                     **settings)  # fmt: skip
        assert ours.sequences.tolist() == theirs.sequences.tolist()
        torch.testing.assert_close(ours.sequences_scores, theirs.sequences_scores, atol=1e-5, rtol=0)


# --- published: a fresh process that cannot import dattn_export --------------------------------------------------

FRESH_PROCESS = textwrap.dedent("""
    import json, sys, threading
    sys.modules["dattn_export"] = None  # this process must not be able to use the package
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor, TextIteratorStreamer, pipeline

    asks, out, tokens = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    sampling, penalty = json.loads(sys.argv[4]), float(sys.argv[5])
    answers = {}

    def streamed(run, tokenizer, pipeline=False, **settings):
        streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
        given = {"generate_kwargs": {"streamer": streamer}} if pipeline else {"streamer": streamer}
        thread = threading.Thread(target=run, kwargs={**settings, **given})
        thread.start()
        text = "".join(streamer)
        thread.join()
        return text

    for name, (repo, conversation, other) in asks.items():
        processor = AutoProcessor.from_pretrained(repo, trust_remote_code=True)
        model = AutoModelForImageTextToText.from_pretrained(repo, trust_remote_code=True, dtype=torch.float32)
        inputs = processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True,
                                               return_dict=True, return_tensors="pt")
        prompt, got = inputs["input_ids"].shape[1], {}
        new = lambda ids: ids[prompt:].tolist()
        greedy = model.generate(**inputs, max_new_tokens=tokens, return_dict_in_generate=True, output_scores=True,
                                output_logits=True)
        got["greedy"] = new(greedy.sequences[0])
        got["logits"] = [step[0].tolist() for step in greedy.logits]
        got["scores"] = [step[0].tolist() for step in greedy.scores]
        runs = []
        for _ in range(2):
            torch.manual_seed(11)
            runs.append(model.generate(**inputs, do_sample=True, max_new_tokens=tokens, return_dict_in_generate=True,
                                       output_scores=True, **sampling))
        got["sampled"] = [new(run.sequences[0]) for run in runs]
        got["sampled scores"] = [step[0].tolist() for step in runs[0].scores]
        for beams in (2, 4):
            found = model.generate(**inputs, num_beams=beams, num_return_sequences=2, max_new_tokens=tokens,
                                   return_dict_in_generate=True, output_scores=True)
            got[f"beams {beams}"] = [found.sequences.tolist(), found.sequences_scores.tolist()]
        got["streamed"] = streamed(model.generate, processor.tokenizer, **inputs, max_new_tokens=tokens)
        got["decoded"] = processor.decode(got["greedy"], skip_special_tokens=True)
        # a random model's answer may be bytes that are no whole character: a sequence bias makes it " the" at every
        # step, and the stop string ends it at the second
        (the,) = processor.tokenizer(" the", add_special_tokens=False)["input_ids"]
        got["the"] = the
        got["stopped"] = new(model.generate(**inputs, max_new_tokens=tokens, sequence_bias={(the,): 100.0},
                                            stop_strings=["the the"], tokenizer=processor.tokenizer)[0])
        got["penalized"] = new(model.generate(**inputs, max_new_tokens=tokens, repetition_penalty=penalty)[0])
        if other is not None:  # a left-padded batch of two pictures: each row as alone
            second = [{"role": "user", "content": [{"type": "image", "path": other}, *conversation[0]["content"][1:]]}]
            batch = processor.apply_chat_template([conversation, second], add_generation_prompt=True, tokenize=True,
                                                  return_dict=True, return_tensors="pt", padding=True)
            rows = model.generate(**batch, max_new_tokens=tokens)[:, batch["input_ids"].shape[1]:]
            alone = processor.apply_chat_template(second, add_generation_prompt=True, tokenize=True, return_dict=True,
                                                  return_tensors="pt")
            got["batch"] = rows.tolist()
            alone_prompt = alone["input_ids"].shape[1]
            got["second alone"] = model.generate(**alone, max_new_tokens=tokens)[0, alone_prompt:].tolist()
            pipe = pipeline("image-text-to-text", model=repo, trust_remote_code=True, dtype=torch.float32)
            said = pipe(text=conversation, max_new_tokens=tokens, generate_kwargs={"repetition_penalty": penalty},
                        return_full_text=False)
            got["pipeline"] = said[0]["generated_text"]
            got["pipeline streamed"] = streamed(pipe, processor.tokenizer, pipeline=True, text=conversation,
                                                max_new_tokens=tokens, return_full_text=False)
        answers[name] = got
    json.dump(answers, open(out, "w"))
""")


@pytest.mark.slow  # pushes six repos and asks each a dozen ways in a fresh process
def test_published_repos_generate_as_transformers_models_do(folders, media, tmp_path):
    from helpers.hub_server import client_env, push_with_cli, start

    server, _, endpoint = start({"hf_token_a": "alice"})
    try:
        asks = {}
        for family in ("mistral", "gemma2"):
            for kind in KINDS:
                repo = f"alice/{family}-{kind}"
                push_with_cli(folders(family, kind), repo, client_env(tmp_path, endpoint, "hf_token_a"))
                other = str(media.other) if kind == "image" else None
                asks[f"{family} {kind}"] = (repo, conversation(kind, media_path(kind, media)), other)
        script = tmp_path / "fresh.py"
        script.write_text(FRESH_PROCESS)
        run = subprocess.run(
            [sys.executable, str(script), json.dumps(asks), str(tmp_path / "answers.json"), str(TOKENS),
             json.dumps(SAMPLING), str(PENALTY)],
            capture_output=True, text=True, timeout=900, env=client_env(tmp_path, endpoint, None), cwd=tmp_path,
        )  # fmt: skip
    finally:
        server.shutdown()
    assert run.returncode == 0, run.stderr[-3000:]
    answers = json.loads((tmp_path / "answers.json").read_text())
    for name, got in answers.items():
        family, kind = name.split()
        check_published(folders(family, kind), kind, media, got)


def check_published(folder: Path, kind: str, media, got: dict) -> None:
    processor = DAttnProcessor.from_pretrained(folder, trust_remote_code=True)
    inputs = processor.apply_chat_template(conversation(kind, media_path(kind, media)), add_generation_prompt=True,
                                           tokenize=True, return_dict=True, return_tensors="pt")  # fmt: skip
    prompt = inputs["input_ids"][0].tolist()
    model, context, segments, next_logits = reference_of(folder, inputs)
    eos = model.generation_config.eos_token_id
    cli = run_prompt(folder, Prompt(QUESTION), Media(video=media.video) if kind == "video" else
                     Media(images=[media.picture]), TOKENS)  # fmt: skip
    assert cli.prompt_ids == prompt and got["greedy"] == cli.generated_ids  # `dattn-export generate`'s
    for step, (logits, scores) in enumerate(zip(got["logits"], got["scores"])):  # the reference's, each prefix
        expected = next_logits(prompt + got["greedy"][:step])
        torch.testing.assert_close(torch.tensor(logits), expected, atol=1e-4, rtol=0)
        assert scores == logits  # greedy processes nothing
    assert got["sampled"][0] == got["sampled"][1]
    warpers = LogitsProcessorList(
        [
            TemperatureLogitsWarper(SAMPLING["temperature"]),
            TopKLogitsWarper(SAMPLING["top_k"]),
            TopPLogitsWarper(SAMPLING["top_p"]),
        ]
    )
    for step, scores in enumerate(got["sampled scores"]):
        ids = prompt + got["sampled"][0][:step]
        expected = warpers(torch.tensor([ids]), next_logits(ids)[None].clone())[0]
        scores = torch.tensor(scores)
        assert torch.equal(torch.isinf(scores), torch.isinf(expected)), step  # the same tokens kept
        torch.testing.assert_close(scores[~torch.isinf(scores)], expected[~torch.isinf(expected)], atol=1e-4, rtol=0)
    recomputed = Recomputed(model, context, segments)
    for beams in (2, 4):
        theirs = recomputed.generate(inputs["input_ids"], attention_mask=inputs["attention_mask"], use_cache=False,
                                     num_beams=beams, num_return_sequences=2, max_new_tokens=TOKENS,
                                     return_dict_in_generate=True, output_scores=True)  # fmt: skip
        sequences, scores = got[f"beams {beams}"]
        assert sequences == theirs.sequences.tolist()
        np.testing.assert_allclose(scores, theirs.sequences_scores.tolist(), atol=1e-4, rtol=0)
    assert got["streamed"] == got["decoded"] == processor.decode(cli.generated_ids, skip_special_tokens=True)
    assert got["stopped"] == [got["the"]] * 2  # biased to " the", stopped at "the the"
    assert got["penalized"] == penalized_greedy(next_logits, prompt, TOKENS, eos)
    if "batch" in got:  # each row as alone, up to where it ended (then padded)
        for row, alone in zip(got["batch"], (got["greedy"], got["second alone"])):
            assert row[: len(alone)] == alone, (row, alone)
        assert got["pipeline"] == processor.decode(got["penalized"], skip_special_tokens=True)
        assert got["pipeline streamed"] == got["decoded"]
