"""Requests for the vLLM tests, and a script that runs them through `vllm.LLM` (vLLM spawns its workers, so it runs
in its own process): `python vllm_requests.py FOLDER TENSOR_PARALLEL OUT.json [RAY_ADDRESS | --long-video FRAMES]`
writes each request's greedy tokens and their log-probabilities; with a Ray cluster's address, the workers are Ray
actors placed by vLLM's Ray executor (on CPU through `ray_cpu_shim`), and the nodes they ran on are written too;
with --long-video, one request on a video that long; with --repeat GIB, a context cache of GIB and, after REQUESTS,
REPEATED (questions on two videos, asked again and again) in the same engine, its cache emptied first, and each
rank's cache statistics written last."""

import json
import os
import sys
from pathlib import Path

import numpy as np
from PIL import Image

MAX_MODEL_LEN = 256
MAX_FRAMES = 8
# (prompt text or token ids, image seed or None for a text-only request, tokens to generate): several images,
# prompt lengths and lengths of output, so that with at most three sequences in flight first steps and decodes
# share batches; token ids without BOS, as a tokenizer that adds none gives them (vLLM must not add one)
REQUESTS = [
    ("a b c", 0, 6),
    ("hello there, how are you", 1, 12),
    ("the cat", 2, 9),
    ("x y z w v u", 3, 14),
    ("no image at all", None, 7),
    ([67, 314, 286, 90], 4, 5),
]


def prompt_of(prompt: str | list[int]) -> dict:
    return {"prompt_token_ids": prompt} if isinstance(prompt, list) else {"prompt": prompt}


def request_image(seed: int) -> Image.Image:
    """An RGB picture of its own size: the processor resizes it to the tower's."""
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (30 + 7 * seed, 50 - 5 * seed, 3), dtype=np.uint8))


def request_video(seed: int) -> tuple[np.ndarray, np.ndarray | None]:
    """A video model's request: frames (F, H, W, 3) uint8 of their own count and size, and a sound track of its own
    length at 16 kHz (none for odd seeds), as a video file decodes to."""
    rng = np.random.default_rng(100 + seed)
    frames = rng.integers(0, 255, (2 + seed, 20 + 3 * seed, 26, 3), dtype=np.uint8)
    samples = None if seed % 2 else (rng.integers(-9000, 9000, 16000 * (3 + seed)) / 32768).astype(np.float32)
    return frames, samples


def long_video(frames: int) -> tuple[np.ndarray, np.ndarray]:
    """A video of `frames` small frames at 1 frame/s and a sound track as long: past the demo video model's resize
    budget when long enough (`streams.pooled_side`)."""
    rng = np.random.default_rng(frames)
    samples = (rng.integers(-9000, 9000, 16000 * frames) / 32768).astype(np.float32)
    return rng.integers(0, 255, (frames, 20, 26, 3), dtype=np.uint8), samples


LONG_VIDEO_REQUEST = ("what happens in the long video", 5)  # (prompt, tokens to generate)
# questions on two videos (seed 2's has a sound track, seed 1's none) or two pictures, interleaved and repeated: with
# three in flight, the first step holds two new requests on one; later ones find their medium's context cached (or
# evicted, with a cache too small for both)
REPEATED = [
    ("what is in this video", 2, 6),
    ("and in this one", 1, 5),
    ("who speaks first", 2, 7),
    ("what color is the sky", 1, 4),
    ("what happens at the end", 2, 5),
    ("is anyone there", 1, 6),
    ("what is in this video", 2, 3),
]

# asked alone once REPEATED is answered: its medium's context is one the last step kept however the steps fell (with
# room for one context, the only one), so the cache is read at least once
ASKED_AGAIN = REPEATED[-1:]
# asked last, one after the other, each naming its medium "clip" (vLLM's multi_modal_uuids): the second's medium is
# another, which the name stands for as vLLM's caches take it (one name, one medium), so it is answered about the
# first's (whose context and processed media the first request left in the caches)
NAMED = [("what is in this video", 2, 4), ("and what now", 3, 5)]
NAMED_AS = [("what is in this video", 2, 4), ("and what now", 2, 5)]  # what they are answered as


def request_media(video_model: bool, seed: int) -> dict:
    if video_model:
        frames, samples = request_video(seed)
        return {"video": (frames, {"audio": samples})}
    return {"image": request_image(seed)}


def main(
    folder: str,
    tensor_parallel: int,
    out: str,
    ray_address: str | None = None,
    long_frames: int = 0,
    repeat_gib: float | None = None,
) -> None:
    """REQUESTS, or with `long_frames` one request on a `long_video` of that many frames; with `repeat_gib`, a
    context cache of that size and then REPEATED."""
    from vllm import LLM

    if ray_address:
        import ray
        import ray_cpu_shim

        # the job's runtime environment reaches every worker vLLM starts: the shim, importable there
        here = os.path.dirname(os.path.abspath(__file__))
        hook = {"worker_process_setup_hook": "ray_cpu_shim.install", "env_vars": {"PYTHONPATH": here}}
        ray.init(address=ray_address, runtime_env=hook)
        ray_cpu_shim.install()

    video_model = json.loads(open(os.path.join(folder, "config.json")).read()).get("mm_input_type") == "video"

    if repeat_gib is not None:  # the statistics are read by a function sent to the workers, which vLLM pickles
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    frame_limit, budget = MAX_FRAMES, {}
    if long_frames:  # vLLM takes a request's encoder tokens in one step: its budget holds the video's (as serve sets)
        from dattn_export.checkpoints.source import folder_config
        from dattn_export.processing import load_audio_processor
        from dattn_export.vllm_plugin.video import encoder_token_budget

        config, frame_limit = folder_config(folder), long_frames
        hop = load_audio_processor(Path(folder), config).hop_length
        budget = {"max_num_batched_tokens": encoder_token_budget(config, long_frames, hop)}
    llm = LLM(
        folder,
        dtype="float32",
        tensor_parallel_size=tensor_parallel,
        enforce_eager=True,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=3,
        # one rank: its worker in the engine's process (this one, __main__), not a process of its own
        distributed_executor_backend="ray" if ray_address else "uni" if tensor_parallel == 1 else None,
        # a video model's encoder sequence is as long as the longest video taken: 8 frames, the requests' at most
        limit_mm_per_prompt={"video": {"count": 1, "num_frames": frame_limit}} if video_model else None,
        hf_overrides=None if repeat_gib is None else {"context_cache_gib": repeat_gib},
        **budget,
    )
    requests = REQUESTS
    if long_frames:
        text, steps = LONG_VIDEO_REQUEST
        requests = [(text, "long", steps)]
    results = answers(llm, video_model, requests, long_frames)
    if not (long_frames or video_model or ray_address or repeat_gib is not None):
        results.append({"chat": chat_answer(llm, CHAT_QUESTION)})
    if repeat_gib is not None:  # REPEATED as a fresh engine's cache sees it, then each rank's statistics
        llm.collective_rpc(empty_context_cache)
        results += answers(llm, video_model, REPEATED) + answers(llm, video_model, ASKED_AGAIN)
        results.append({"caches": llm.collective_rpc(context_cache_stats)})
        results += answers(llm, video_model, NAMED[:1], name="clip") + answers(llm, video_model, NAMED[1:], name="clip")
    if ray_address:  # which node each worker ran on, and the model it built (the plugin's, loaded there)
        results.append({"workers": llm.collective_rpc(ray_worker)})
    with open(out, "w") as f:
        json.dump(results, f)
    # the engine (and its Ray workers) shut down before Ray, and Ray before the interpreter: left to the exit, the
    # Ray executor's __del__ kills its actors while Ray's own threads are being torn down, and the process now and
    # then dies with SIGSEGV after its work is done (Ray's log: a leaked shared-memory object)
    llm.llm_engine.engine_core.shutdown()
    if ray_address:
        ray.shutdown()


CHAT_QUESTION = ("What is in the picture?", 0, 6)  # (question, image seed, tokens) asked through `LLM.chat`


def chat_answer(llm, question: tuple) -> dict:
    """A question about a picture asked through `LLM.chat` (the folder's chat template): its prompt ids and tokens."""
    from vllm import SamplingParams

    text, seed, steps = question
    content = [{"type": "image_pil", "image_pil": request_image(seed)}, {"type": "text", "text": text}]
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    (output,) = llm.chat([{"role": "user", "content": content}], params, use_tqdm=False)
    return {"prompt_ids": output.prompt_token_ids, "tokens": list(output.outputs[0].token_ids)}


def answers(llm, video_model: bool, requests: list, long_frames: int = 0, name: str | None = None) -> list[dict]:
    """Each request's prompt ids, greedy tokens and their log-probabilities; a request's media seed "long": a
    `long_video` of `long_frames` frames; `name`: each request names its medium so (multi_modal_uuids)."""
    from vllm import SamplingParams

    prompts = []
    for text, seed, _ in requests:
        if seed == "long":
            frames, samples = long_video(long_frames)
            media = {"multi_modal_data": {"video": (frames, {"audio": samples})}}
        else:
            media = {} if seed is None else {"multi_modal_data": request_media(video_model, seed)}
        named = {} if name is None else {"multi_modal_uuids": {"video" if video_model else "image": [name]}}
        prompts.append(prompt_of(text) | media | named)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=0) for *_, n in requests]
    results = []
    for output in llm.generate(prompts, params):
        completion = output.outputs[0]
        chosen = [step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids)]
        results.append(
            {"prompt_ids": output.prompt_token_ids, "tokens": list(completion.token_ids), "logprobs": chosen}
        )
    return results


def context_cache_stats(worker) -> dict:
    return worker.model_runner.get_model().context_cache.stats()


def empty_context_cache(worker) -> None:
    from dattn_export.vllm_plugin.context_cache import ContextCache

    model = worker.model_runner.get_model()
    model.context_cache = ContextCache(model.context_cache.limit_bytes)


def ray_worker(worker) -> dict:
    import ray

    model = worker.model_runner.get_model()
    return {
        "node": ray.get_runtime_context().get_node_id(),
        "model": f"{type(model).__module__}.{type(model).__name__}",
    }


if __name__ == "__main__":
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # the engine in this process (and at one rank its worker: `main`), where the Ray shim is installed too: vLLM's
    # CPU platform spawns each process it starts, which imports vLLM again (23 s a run here; `serve` keeps them)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if "--long-video" in sys.argv:  # FOLDER TENSOR_PARALLEL OUT.json --long-video FRAMES
        main(sys.argv[1], int(sys.argv[2]), sys.argv[3], long_frames=int(sys.argv[sys.argv.index("--long-video") + 1]))
    elif "--repeat" in sys.argv:  # FOLDER TENSOR_PARALLEL OUT.json --repeat GIB
        main(sys.argv[1], int(sys.argv[2]), sys.argv[3], repeat_gib=float(sys.argv[sys.argv.index("--repeat") + 1]))
    else:
        main(sys.argv[1], int(sys.argv[2]), sys.argv[3], *sys.argv[4:])
