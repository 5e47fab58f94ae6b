"""`python vllm_quantized.py REQUESTS.json OUT.json FOLDER...`: each request ({"prompt", "image" or "video": a file,
"steps"}) through `vllm.LLM` in bfloat16 (vLLM's CPU 4-bit kernel takes 16-bit activations) on each folder in turn,
greedy, with each token's log-probability: a 16-bit folder and its quantized ones served alike, for the tests to
compare ({folder: answers})."""

import json
import os
import sys

from PIL import Image


def media_of(request: dict) -> dict:
    if request.get("image"):
        return {"multi_modal_data": {"image": Image.open(request["image"]).convert("RGB")}}
    if request.get("video"):
        import numpy as np

        from dattn_export.modeling.video_decoding import load_video

        frames, samples = load_video(request["video"])
        return {"multi_modal_data": {"video": (np.stack([np.asarray(f) for f in frames]), {"audio": samples})}}
    return {}


def answers(folder: str, requests: list[dict]) -> list[dict]:
    from vllm import LLM, SamplingParams

    video_model = any(r.get("video") for r in requests)
    llm = LLM(folder, dtype="bfloat16", enforce_eager=True, max_model_len=256, max_num_seqs=3,
              distributed_executor_backend="uni",
              limit_mm_per_prompt={"video": {"count": 1, "num_frames": 8}} if video_model else None)  # fmt: skip
    prompts = [{"prompt": r["prompt"]} | media_of(r) for r in requests]
    params = [SamplingParams(temperature=0, max_tokens=r["steps"], ignore_eos=True, logprobs=0) for r in requests]
    results = []
    for output in llm.generate(prompts, params, use_tqdm=False):
        completion = output.outputs[0]
        chosen = [step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids)]
        results.append({"tokens": list(completion.token_ids), "logprobs": chosen})
    llm.llm_engine.engine_core.shutdown()
    return results


def main(requests_file: str, out: str, *folders: str) -> None:
    requests = json.loads(open(requests_file).read())
    results = {folder: answers(folder, requests) for folder in folders}
    with open(out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    main(*sys.argv[1:])
