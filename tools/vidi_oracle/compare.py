"""Our side, in this project's venv: the untouched folder Vidi saved -> info, convert, verify, onnx, validate, push
--dry-run; then our logits (PyTorch and ONNX Runtime) against Vidi's own.  usage: python compare.py OUT"""

import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from dattn_export.checkpoints.source import load_model
from dattn_export.modeling.modeling_dattn import anyres_grid
from dattn_export.runtime.ort import OrtModel

root = Path(sys.argv[1])
ckpt, conv, onnx_dir = root / "checkpoint", root / "converted", root / "onnx"
oracle = torch.load(root / "oracle.pt", weights_only=False)
video, anyres = oracle.get("video", False), oracle.get("anyres", False)
for args in (
    ["info", ckpt],
    ["convert", ckpt, "-o", conv, "--force"],
    ["verify", conv, "--against", ckpt],
    ["onnx", conv, "-o", onnx_dir, "--force"],
    ["validate", onnx_dir],
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


if anyres:
    points, tile = model.config.mm_image_grid_points, model.config.vision_config["image_size"]
    for name, (ids, tiles, sizes, expected) in oracle["cases"].items():
        with torch.no_grad():
            visual, visual_mask = model.model.encode_anyres(tiles, sizes)
            got = model(ids, visual_key_values=visual, visual_mask=visual_mask)
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
            visual, visual_mask = model.model.encode_video(frames)
            audio, audio_mask = model.model.encode_audio(mels, mel_frames)
            got = model(
                ids, visual_key_values=visual, visual_mask=visual_mask, audio_key_values=audio, audio_mask=audio_mask
            )
        contexts = [  # a sample whose frames or audio are all zero has none
            runtime.encode_video(f.numpy() if f.abs().sum() else None, (m.numpy(), n) if m.abs().sum() else None)
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
ours = model.generate(ids, pixels[:, None], torch.ones_like(ids), max_new_tokens=8)[0].tolist()
print(
    "greedy tokens equal:",
    sum(a == b for a, b in zip(ours, oracle["greedy"])),
    "of",
    len(oracle["greedy"]),
    ours,
    oracle["greedy"],
)
