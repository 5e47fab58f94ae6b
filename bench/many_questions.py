"""Many questions about one video with `generate`: the context encoded once, then each question answered from it.

On the demo video model (both families' by `--family`), a synthetic video of `--seconds` at 1 frame/s with its sound
track, and `--questions` prompts, for every backend that runs on CPU (torch, ort, genai), side by side in one run:

  encode     the video's context (frames + audio K/V for every layer), once
  first      the first question's answer; later: the median of the others
  with k     all k questions in one `generate` (encode + k answers)
  bound      one encode + k answers of the same questions without the video (text-only): the target is
             with k <= 1.10 x bound (issue 49)
  k calls    k one-question `generate` runs (encode + answer each), as a user without --prompt repeated pays

The graphs' load time is left out of every column (it is paid once per process either way).

    python bench/many_questions.py                     # gemma2, 300 s of video, 10 questions
    python bench/many_questions.py --family mistral --seconds 1800
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import numpy as np

from dattn_export.demo_model import write_demo_checkpoint, write_video
from dattn_export.media import Media
from dattn_export.modeling.families import FAMILIES
from dattn_export.processing import AUDIO_RATE
from dattn_export.stages.generate import run_prompts, run_prompts_graphs
from dattn_export.stages.onnx_export import export_onnx


def questions(count: int, video: bool) -> list[str]:
    marker = "<video>\n" if video else ""
    return [f"USER: {marker}What happens after minute {i}, and who speaks?\nASSISTANT:" for i in range(count)]


def answer(backend: str, folder: Path, prompts: list[str], media: Media, tokens: int):
    if backend == "torch":
        return run_prompts(folder, prompts, media, tokens)
    return run_prompts_graphs(folder, prompts, media, tokens, backend)


def encode_seconds(answers) -> float:
    return sum(v for k, v in answers.seconds.items() if k.startswith("encode"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=list(FAMILIES), default="gemma2")
    parser.add_argument("--seconds", type=int, default=300, help="video length (1 frame/s, with sound)")
    parser.add_argument("--questions", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--backends", default="torch,ort,genai")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="many-questions-"))
    checkpoint = write_demo_checkpoint(work / "checkpoint", args.family, video=True)
    export_onnx(checkpoint, work / "onnx")
    rng = np.random.default_rng(0)
    frames = [rng.integers(0, 256, (48, 64, 3), np.uint8) for _ in range(args.seconds)]
    sound = (np.sin(np.arange(AUDIO_RATE * args.seconds) / 7.0) * 8000).astype(np.int16)
    write_video(work / "video.mov", frames, 1, sound)
    media = Media(video=work / "video.mov")

    rows = []
    for backend in args.backends.split(","):
        folder = checkpoint if backend == "torch" else work / "onnx"
        many = answer(backend, folder, questions(args.questions, True), media, args.max_new_tokens)
        text = answer(backend, folder, questions(args.questions, False), Media(), args.max_new_tokens)
        each = [sum(result.seconds.values()) for result in many.results]
        encode = encode_seconds(many)
        with_k, bound = encode + sum(each), encode + sum(sum(r.seconds.values()) for r in text.results)
        tokens = many.results[0].visual_tokens + many.results[0].audio_tokens
        rows.append((backend, tokens, encode, each[0], statistics.median(each[1:]), with_k, bound, encode * len(each)))

    print(f"\n{args.family} demo video model, {args.seconds} s of video, {args.questions} questions, "
          f"{args.max_new_tokens} tokens each (seconds)")  # fmt: skip
    header = ("backend", "context tokens", "encode", "first", "later", "with k", "bound", "with k / bound", "k calls")
    print(" | ".join(header))
    for backend, tokens, encode, first, later, with_k, bound, k_encodes in rows:
        k_calls = k_encodes + with_k - encode
        print(
            f"{backend} | {tokens} | {encode:.2f} | {first:.3f} | {later:.3f} | {with_k:.2f} | {bound:.2f} | "
            f"{with_k / bound:.2f} | {k_calls:.2f}"
        )


if __name__ == "__main__":
    main()
