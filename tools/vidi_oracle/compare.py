"""Our side, in this project's venv: the untouched folder Vidi saved -> info, convert, verify, onnx, validate, push
--dry-run; then our logits (PyTorch and ONNX Runtime) against Vidi's own.  usage: python compare.py OUT"""

import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from dattn_export.checkpoints.source import load_model
from dattn_export.media import open_image
from dattn_export.modeling.images import anyres_grid
from dattn_export.processing import load_processor
from dattn_export.runtime.ort import OrtModel

root = Path(sys.argv[1])
ckpt, conv, onnx_dir = root / "checkpoint", root / "converted", root / "onnx"
oracle = torch.load(root / "oracle.pt", weights_only=False)
video, anyres, pictures = oracle.get("video", False), oracle.get("anyres", False), oracle.get("pictures")
picture_args = [["--image", oracle["cases"]["wide"][1]]] if pictures else [[]]
for args in (
    ["info", ckpt],
    ["convert", ckpt, "-o", conv, "--force"],
    ["verify", conv, "--against", ckpt],
    ["onnx", conv, "-o", onnx_dir, "--force"],
    ["validate", onnx_dir, *picture_args[0]],
    ["generate", conv, "--raw-prompt", "hi", "--max-new-tokens", "2", *picture_args[0]] if pictures else ["info", conv],
    ["push", conv, "--repo-id", "me/vidi-tiny", "--dry-run"],
):
    r = subprocess.run(["dattn-export", *map(str, args)], capture_output=True, text=True)
    print(
        f"dattn-export {args[0]}: rc {r.returncode}",
        (r.stdout + r.stderr).strip().splitlines()[-1][:150] if r.returncode else "",
    )
model = load_model(conv)
runtime = OrtModel(onnx_dir)


def ort_error(ids, contexts, expected) -> str:
    """Our graphs on ONNX Runtime: each sample's context, batched, then the decoder."""
    caches, mask = runtime.batch_contexts(contexts)
    logits, _ = runtime.decode(ids.numpy(), np.ones_like(ids.numpy()), runtime.empty_kv(len(ids)), caches, mask)
    return f"   ORT {float(np.abs(logits - expected.numpy()).max()):.2e}"


VLLM_SCRIPT = """
import json, sys
from PIL import Image
from vllm import LLM, SamplingParams
folder, cases = sys.argv[1], json.loads(sys.argv[2])
llm = LLM(folder, dtype="float32", max_model_len=256, enforce_eager=True, limit_mm_per_prompt={"image": 1})
params = SamplingParams(max_tokens=1, temperature=0, logprobs=20)
out = {}
for name, (ids, path) in cases.items():
    request = {"prompt_token_ids": ids, "multi_modal_data": {"image": Image.open(path).convert("RGB")}}
    (result,) = llm.generate([request], params, use_tqdm=False)
    out[name] = {int(t): p.logprob for t, p in result.outputs[0].logprobs[0].items()}
print("LOGPROBS", json.dumps(out))
"""


def vllm_logprob_errors(cases) -> dict:
    """vLLM through our plugin on the converted folder: each picture's first-token log-probabilities (its top 20)
    against the oracle's (its head_dim must be one vLLM's CPU attention takes: 32 and up)."""
    import json
    import os

    if model.config.head_dim < 32 or __import__("importlib").util.find_spec("vllm") is None:
        return {}
    requests = {name: (ids[0].tolist(), path) for name, (ids, path, _, _) in cases.items()}
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0-1"}
    run = subprocess.run(
        [sys.executable, "-c", VLLM_SCRIPT, conv, json.dumps(requests)], capture_output=True, text=True, env=env
    )
    line = next((x for x in run.stdout.splitlines() if x.startswith("LOGPROBS ")), None)
    if line is None:
        return {name: f"vLLM failed: {run.stderr.strip().splitlines()[-1:]}" for name in cases}
    got = json.loads(line.removeprefix("LOGPROBS "))
    errors = {}
    for name, (_, _, _, expected) in cases.items():
        reference = torch.log_softmax(expected[0, -1].double(), -1)
        errors[name] = max(abs(p - float(reference[int(t)])) for t, p in got[name].items())
    return errors


if pictures:  # the released path made the pixels from picture files; ours makes them from the same files
    processor = load_processor(conv, model.config)  # every command's (generate's, validate's)
    vllm_errors = vllm_logprob_errors(oracle["cases"])
    for name, (ids, path, released, expected) in oracle["cases"].items():
        pixels = processor.pictures([[open_image(path)]])["pixel_values"][0]
        pixel_error = float((pixels - released).abs().max())
        with torch.no_grad():  # generate's path: the processor's pixels
            visual, context_mask = model.model.encode_images(pixels[None])
            got = model(ids, context_key_values=visual, context_mask=context_mask).logits
        ours = runtime.encode_images(pixels[None].numpy())  # validate's and genai's path: our graphs
        vllm = vllm_errors.get(name)
        print(
            f"{pictures} {name:5s} pixels max abs error {pixel_error:.1e}   torch (generate) logits "
            f"{float((got - expected).abs().max()):.2e}{ort_error(ids, [ours], expected)}"
            + ("" if vllm is None else f"   vLLM first-token logprobs {vllm:.2e}" if isinstance(vllm, float) else vllm)
        )
    sys.exit()
if anyres:
    points, tile = model.config.mm_image_grid_points, model.config.vision_config["image_size"]
    for name, (ids, tiles, sizes, expected) in oracle["cases"].items():
        with torch.no_grad():
            visual, context_mask = model.model.encode_anyres(tiles, sizes)
            got = model(ids, context_key_values=visual, context_mask=context_mask)
        contexts = [  # a sample whose tiles are all zero has no image: an empty context
            runtime.encode_anyres(t.numpy(), *anyres_grid(size, points, tile))
            if t.abs().sum()
            else runtime.no_context(1)
            for t, size in zip(tiles, sizes)
        ]
        error = float((got.logits - expected).abs().max())
        print(f"{name:20s} torch max abs logits error {error:.2e}{ort_error(ids, contexts, expected)}")
    sys.exit()
if video:
    for name, (ids, frames, mels, mel_frames, expected) in oracle["cases"].items():
        with torch.no_grad():
            context, segments = model.model.join_contexts(
                model.model.encode_video(frames), model.model.encode_audio(mels, mel_frames)
            )
            got = model(ids, context_key_values=context, context_mask=segments)
        contexts = [  # a sample whose frames or audio are all zero has none
            runtime.encode_streams(
                {"frames": f.numpy() if f.abs().sum() else None, "audio": (m.numpy(), n) if m.abs().sum() else None}
            )
            for f, m, n in zip(frames, mels, mel_frames)
        ]
        error = float((got.logits - expected).abs().max())
        print(f"{name:20s} torch max abs logits error {error:.2e}{ort_error(ids, contexts, expected)}")
    sys.exit()
for name, (ids, pixels, expected) in oracle["cases"].items():
    with torch.no_grad():
        got = model(ids, None if pixels is None else pixels[:, None], torch.ones_like(ids)).logits
    line = f"{name:18s} torch max abs logits error {float((got - expected).abs().max()):.2e}"
    if pixels is not None:
        visual, vmask = runtime.encode_images(pixels[:, None].numpy())
        logits, _ = runtime.decode(
            ids.numpy(), np.ones_like(ids.numpy()), runtime.empty_kv(ids.shape[0]), visual, vmask
        )
        line += f"   ORT {float(np.abs(logits - expected.numpy()).max()):.2e}"
    print(line)
ids, pixels, _ = oracle["cases"]["image"]
ours = model.greedy(ids, pixels[:, None], torch.ones_like(ids), max_new_tokens=8)[0].tolist()
print(
    "greedy tokens equal:",
    sum(a == b for a, b in zip(ours, oracle["greedy"])),
    "of",
    len(oracle["greedy"]),
    ours,
    oracle["greedy"],
)
