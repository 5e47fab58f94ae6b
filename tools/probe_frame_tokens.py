"""How much of the demo corpus's colours a video model's frame tokens carry, stage by stage: a linear probe (ridge
regression on standardized features, fitted on train clips, judged on held-out ones) of which colours each frame shows,
read from the vision tower's output, the pooled grid, the projector and norm, and the finished stream tokens (time
embedding and LLM norm included). Run on the untrained and trained folders `tools/train_demo_retrieval.py` writes:

    python tools/probe_frame_tokens.py OUT/untrained OUT/trained [--train-clips 60] [--held-out 20]

A frame counts as right when every colour's presence is predicted right."""

from __future__ import annotations

import argparse

import numpy as np
import torch
from PIL import Image

from dattn_export.checkpoints.source import load_model
from dattn_export.demo_corpus import COLOURS, SPLITS, frame, make_clip
from dattn_export.modeling.media_files import resized_to_tower
from dattn_export.processing import load_processor

STAGES = ("tower", "pooled", "projected", "tokens")


@torch.no_grad()
def stage_features(model, processor, pixels: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each frame's features (frames, features) after each stage of the frames stream (context.frame_stream)."""
    streams, grid = model.model, model.config.patch_grid
    tower = streams.mm_vis(pixels)
    pooled = streams.mm_rand_img_pool(tower.unflatten(1, (grid, grid)).permute(0, 3, 1, 2), None).permute(0, 2, 3, 1)
    projected = streams.mm_rand_img_norm(streams.mm_rand_img_projector(pooled))
    tokens, _ = streams.embed_video([pixels])
    finished = {"tower": tower, "pooled": pooled, "projected": projected, "tokens": tokens[0]}
    return {stage: x.reshape(len(pixels), -1) for stage, x in finished.items()}


def features_and_colours(folder, seeds: range) -> tuple[dict[str, np.ndarray], np.ndarray]:
    model = load_model(folder).eval()
    processor = load_processor(folder, model.config)
    side = processor.frame_square
    features, colours = {stage: [] for stage in STAGES}, []
    for seed in seeds:
        clip = make_clip(seed)
        pictures = [resized_to_tower(Image.fromarray(frame(clip, s)), side) for s in range(clip.seconds)]
        for stage, x in stage_features(model, processor, processor.prepared_frames(pictures)[:]).items():
            features[stage].append(x.numpy())
        for second in range(clip.seconds):
            shown = {e.what.split()[0] for e in clip.events if e.seen and e.on(second)}
            colours.append([colour in shown for colour in COLOURS])
    return {stage: np.concatenate(x) for stage, x in features.items()}, np.array(colours)


def probe(train: np.ndarray, labels: np.ndarray, held_out: np.ndarray, truth: np.ndarray) -> float:
    """The share of held-out frames whose every colour a ridge probe fitted on `train` predicts right."""
    mean, scale = train.mean(0), train.std(0) + 1e-6
    design = lambda x: np.c_[(x - mean) / scale, np.ones(len(x))]  # noqa: E731
    a = design(train)
    weights = np.linalg.solve(a.T @ a + 10 * np.eye(a.shape[1]), a.T @ (2 * labels - 1))
    return float(((design(held_out) @ weights > 0) == truth).all(1).mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+")
    parser.add_argument("--train-clips", type=int, default=60)
    parser.add_argument("--held-out", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"{'folder':40s} " + " ".join(f"{stage:>10s}" for stage in STAGES))
    for folder in args.folders:
        train, labels = features_and_colours(folder, range(SPLITS["train"], SPLITS["train"] + args.train_clips))
        held_out, truth = features_and_colours(folder, range(SPLITS["held-out"], SPLITS["held-out"] + args.held_out))
        shares = [probe(train[stage], labels, held_out[stage], truth) for stage in STAGES]
        print(f"{folder:40s} " + " ".join(f"{share:10.3f}" for share in shares), flush=True)


if __name__ == "__main__":
    main()
