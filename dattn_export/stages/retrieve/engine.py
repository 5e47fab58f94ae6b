"""`retrieve --backend vllm`: the benchmark's queries through vLLM's offline engine (`vllm.LLM`, the engine `serve`
runs) with this package's plugin, on one machine (tensor parallel from the command line) or spread over replicas on
a Ray cluster (an actor a replica, each holding an engine, tensor parallel within it).

An engine is sized for the benchmark's videos before it starts (vLLM takes a request's encoder tokens in one step:
its budget holds the longest video's, `encoder_token_budget`). Each video is decoded as `generate --video` decodes
it (on a thread, the next while the engine answers the current), and all its queries are submitted at once, its
media named by the file (vLLM's `multi_modal_uuids`), so that the plugin's caches make its context once for all of
them; the engine's continuous batching mixes the queries of the videos in flight. A video the engine refuses (more
frames than it was sized for) is recorded on its queries, and the run goes on."""

from __future__ import annotations

import math
import os
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from ...checkpoints.source import folder_config
from ...errors import InputError
from ...media import decode_media
from ...media_options import Media
from ...modeling.marked_prompts import prompt_ids
from ...modeling.media_files import MediaError, media_duration
from ...processing import load_processor, load_tokenizer
from ...prompts import Prompt
from ...retrieval import Query
from ...vllm_plugin import unsupported
from ...vllm_plugin.logs import QUIET_ENVIRONMENT
from ...vllm_plugin.video import DEFAULT_MAX_FRAMES, encoder_token_budget
from ..serve import check_cpu_attention, cpu_environment, four_bit
from .videos import VIDEO_FAILURES, Answered, Video, failed, video_failure

IN_FLIGHT = 2  # videos whose queries the engine holds at once (the next one decoded meanwhile)


def engine_dtype(config) -> str:
    """The folder's own dtype, as `serve` runs it (a 4-bit folder in bfloat16 on a CPU, whose kernel takes 16-bit
    activations)."""
    import torch

    if four_bit(config) and not torch.cuda.is_available():
        return "bfloat16"
    return str(config.dtype).removeprefix("torch.")


class Engine:
    """One `vllm.LLM` on a folder, sized for a benchmark's videos: `frames` the most a video may have, `prompt_tokens`
    the longest prompt's; answering any number of videos, their queries submitted a video at a time."""

    def __init__(self, folder: Path, frames: int, prompt_tokens: int, max_new_tokens: int, tensor_parallel: int = 1,
                 verbose: bool = False):  # fmt: skip
        import torch

        self.folder, self.config = Path(folder), folder_config(folder)
        self.processor, self.dtype = load_processor(self.folder, self.config), engine_dtype(self.config)
        self.tokenizer = self.processor.tokenizer
        self.max_new_tokens, self.frames, self.tensor_parallel = max_new_tokens, frames, tensor_parallel
        if not torch.cuda.is_available():
            check_cpu_attention(self.folder, self.config)
            for name, value in cpu_environment(tensor_parallel).items():
                os.environ.setdefault(name, value)
        in_this_process = {**({} if verbose else QUIET_ENVIRONMENT), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        for name, value in in_this_process.items():
            os.environ.setdefault(name, value)
        from vllm import LLM

        length = min(prompt_tokens + max_new_tokens + 1, self.config.max_position_embeddings)
        hop = self.processor.feature_extractor.hop_length
        self.llm = LLM(
            str(self.folder),
            dtype=self.dtype,
            tensor_parallel_size=tensor_parallel,
            max_model_len=length,
            enforce_eager=not torch.cuda.is_available(),
            distributed_executor_backend="uni" if tensor_parallel == 1 else None,
            limit_mm_per_prompt={"video": {"count": 1, "num_frames": frames}},
            max_num_batched_tokens=max(encoder_token_budget(self.config, frames, hop), length),
            use_tqdm_on_load=False,
        )

    @property
    def where(self) -> str:
        return f"one vLLM engine, tensor parallel {self.tensor_parallel}"

    def close(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()

    def __call__(self, todo: list[Video], seconds) -> Iterator[Answered]:
        try:
            yield from self.answers(todo)
        finally:
            self.close()

    def prepare(self, video: Video) -> tuple[list[dict], float]:
        """A video's requests (each query's prompt ids, the decoded frames and sound track, named by the file) and
        the file's length; raises what makes the video unusable."""
        decoded = decode_media(Media(video=video.path), self.processor)
        if len(decoded.frames) > self.frames:
            raise InputError(video.path, f"has {len(decoded.frames)} frames at 1 frame/s, more than the engine was "
                             f"sized for ({self.frames})")  # fmt: skip
        frames = np.stack([np.asarray(frame.convert("RGB")) for frame in decoded.frames])
        media = {"video": (frames, {"audio": decoded.samples})}
        stat = Path(video.path).stat()
        name = f"{Path(video.path).resolve()}:{stat.st_size}:{stat.st_mtime_ns}"  # the medium's name for the caches
        requests = []
        for query in video.queries:
            text = Prompt(query.query, "query").text_for(self.tokenizer, self.config.family, True, decoded.duration)
            requests.append({"prompt_token_ids": prompt_ids(self.tokenizer, text), "multi_modal_data": media,
                             "multi_modal_uuids": {"video": [name]}})  # fmt: skip
        return requests, decoded.duration

    def answers(self, videos: list[Video]) -> Iterator[Answered]:
        """Every query of `videos`, answered as the engine finishes each: IN_FLIGHT videos' queries in the engine at
        once, the next video decoded on a thread meanwhile."""
        from vllm import SamplingParams

        from ...answers import answer_text

        params = SamplingParams(temperature=0, max_tokens=self.max_new_tokens, detokenize=False)
        waiting: dict[str, tuple[Query, float]] = {}  # request id -> (query, the file's length)
        left: dict[str, int] = {}  # video -> its queries in the engine
        with ThreadPoolExecutor(1) as decoding:
            upcoming = deque((video, decoding.submit(self.prepare, video)) for video in videos[:IN_FLIGHT])
            queued = IN_FLIGHT
            while upcoming or waiting:
                while upcoming and len(left) < IN_FLIGHT:
                    video, prepared = upcoming.popleft()
                    if queued < len(videos):
                        upcoming.append((videos[queued], decoding.submit(self.prepare, videos[queued])))
                        queued += 1
                    try:
                        requests, duration = prepared.result()
                        ids = self.llm.enqueue(requests, params, use_tqdm=False)
                    except VIDEO_FAILURES as e:
                        reason, code = video_failure(e)
                        yield from failed(video, reason, code)
                        continue
                    # the engine's outputs name a request by its id without the suffix `enqueue` returns with it
                    external = [request.split("-", 1)[0] for request in ids]
                    waiting |= {request: (query, duration) for request, query in zip(external, video.queries)}
                    left[video.name] = len(ids)
                if not waiting:
                    continue
                for output in self.llm.llm_engine.step():
                    if output.finished and output.request_id in waiting:
                        query, duration = waiting.pop(output.request_id)
                        left[query.video] -= 1
                        if not left[query.video]:
                            del left[query.video]
                        tokens = list(output.outputs[0].token_ids)
                        yield Answered(query, answer_text(self.tokenizer, tokens), duration)


def sizes(folder: Path, videos: list[Video]) -> tuple[int, int]:
    """What an engine must take for `videos`: the most frames a video has at 1 frame/s (by the files' durations, one
    to spare; at most DEFAULT_MAX_FRAMES, a longer video then refused on its own) and the longest prompt."""
    config = folder_config(folder)
    tokenizer = load_tokenizer(folder, config)
    frames, prompt_tokens = 1, 1
    for video in videos:
        try:
            length = media_duration(video.path)
        except (MediaError, OSError):  # decoding it fails later, on its own
            continue
        frames = max(frames, min(math.ceil(length) + 1, DEFAULT_MAX_FRAMES))
        for query in video.queries:
            text = Prompt(query.query, "query").text_for(tokenizer, config.family, True, length)
            prompt_tokens = max(prompt_tokens, len(prompt_ids(tokenizer, text)))
    return frames, prompt_tokens


def check_servable(folder: Path, config) -> None:
    if reason := unsupported(config):
        raise InputError(Path(folder) / "config.json", f"vLLM cannot serve this model: {reason}")
