"""retrieve at the released workload's shape, on the demo video model (both families by `--family`), side by side in
one run:

  queries/s   a synthetic benchmark of videos of 1, 10 and 60 minutes (1 frame/s, a sound track as long), QUERIES
              queries each, answered by torch, ort and vLLM (`retrieve`'s own pieces, each backend's model loaded
              once, its load timed apart): the queries a second of the answering, decoding and encoding included
  k vs k x 1  one video's k queries answered from one context, against k one-query videos of the same file (each
              decoded and encoded again): what grouping by video saves (the 10-minute video by default)
  memory      100 distinct 10 s videos, one query each, through torch: the process's resident memory after 10, 50
              and 100 videos and its peak (flat: nothing kept per video)

The demo model's weights are random, so it never ends an answer: every answer runs to --max-new-tokens.

    python bench/retrieval.py                              # gemma2, 1/10/60 minutes, 5 queries, torch ort vllm
    python bench/retrieval.py --family mistral --minutes 1,10 --backends torch,ort
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from many_questions import synthetic_video  # noqa: E402

from dattn_export.demo_model import write_demo_checkpoint  # noqa: E402
from dattn_export.retrieval import Query  # noqa: E402
from dattn_export.stages.convert import convert  # noqa: E402
from dattn_export.stages.onnx_export import export_onnx  # noqa: E402
from dattn_export.stages.retrieve.videos import Video  # noqa: E402

QUERIES = ["a red circle appears", "a tone rises", "the screen goes dark", "someone speaks", "a car passes"]


def videos_of(files: dict[int, Path], queries: int) -> list[Video]:
    return [
        Video(
            f"{minutes}min",
            [
                Query(f"{minutes}-{n}", f"{minutes}min", QUERIES[n % len(QUERIES)], minutes * 60.0)
                for n in range(queries)
            ],
            path,
        )  # fmt: skip
        for minutes, path in files.items()
    ]


def local_answering(folder: Path, backend: str, tokens: int):
    from dattn_export.stages.generate import Asker
    from dattn_export.stages.retrieve.job import LocalAnswers

    start, asker = time.perf_counter(), Asker(folder, backend)
    asker.load({})
    return LocalAnswers(asker, tokens), time.perf_counter() - start


def vllm_answering(folder: Path, videos: list[Video], tokens: int):
    from dattn_export.stages.retrieve.engine import Engine, sizes

    start = time.perf_counter()
    frames, prompt_tokens = sizes(folder, videos)
    return Engine(folder, frames, prompt_tokens, tokens), time.perf_counter() - start


def timed_answers(answer, videos: list[Video]) -> tuple[float, int]:
    """`answer(videos)`'s answers, timed."""
    from dattn_export.ui import stages_unseen

    start = time.perf_counter()
    with stages_unseen():
        answered = list(answer(videos))
    assert not any(a.failure for a in answered), [a.failure for a in answered if a.failure]
    return time.perf_counter() - start, len(answered)


def backend_run(args) -> None:
    """In a process of its own (its memory and threads its own): one backend over the benchmark, then for torch the
    k-vs-k-times-one and memory figures; a JSON line on stdout."""
    work, backend, tokens = Path(args.work), args.backend_run, args.max_new_tokens
    files = {int(m): work / f"video-{m}min.mov" for m in args.minutes.split(",")}
    videos = videos_of(files, args.queries)
    folder = work / ("onnx" if backend == "ort" else "converted")
    if backend == "vllm":
        answering, load = vllm_answering(folder, videos, tokens)
    else:
        answering, load = local_answering(folder, backend, tokens)
    result = {"backend": backend, "load": load, "videos": {}}
    if backend == "torch":  # first, in a process that has decoded no long video yet
        result["memory"] = memory_over_videos(lambda todo: answering(todo, {}), work)
    # vLLM's engine shuts down after a call: its videos asked one at a time through `answers`, then closed
    answer = answering.answers if backend == "vllm" else lambda todo: answering(todo, {})
    for video in videos:  # each length on its own: its queries a second, decoding and encoding included
        seconds, count = timed_answers(answer, [video])
        result["videos"][video.name] = {"seconds": seconds, "queries": count}
    if backend == "vllm":
        answering.close()
    if backend == "torch":  # on the second-shortest video (10 minutes by default)
        video = videos[min(1, len(videos) - 1)]
        together, _ = timed_answers(answer, [video])
        apart, _ = timed_answers(answer, [Video(video.name, [q], video.path) for q in video.queries])
        result["k_vs_one"] = {"video": video.name, "k": len(video.queries), "together": together, "apart": apart}
    print(json.dumps(result))


def resident() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


def memory_over_videos(answer, work: Path, count: int = 100) -> dict:
    """Resident memory after 10, 50 and 100 distinct 10 s videos, one query each, and the peak."""
    marks = {}
    for number in range(1, count + 1):
        path = synthetic_video(work / "many.mov", 10, seed=number)  # written over: one file on disk at a time
        timed_answers(answer, [Video(f"v{number}", [Query(number, f"v{number}", QUERIES[0], 10.0)], path)])
        if number in (10, 50, 100):
            marks[number] = resident()
    return {"after": marks, "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="gemma2")
    parser.add_argument("--minutes", default="1,10,60", help="the videos' lengths")
    parser.add_argument("--queries", type=int, default=5, help="queries a video")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--backends", default="torch,ort,vllm")
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--backend-run", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.backend_run:
        return backend_run(args)
    work = Path(tempfile.mkdtemp(prefix="bench-retrieval-"))
    checkpoint = write_demo_checkpoint(work / "checkpoint", args.family, video=True)
    convert(checkpoint, work / "converted")
    if "ort" in args.backends:
        export_onnx(work / "converted", work / "onnx")
    for minutes in map(int, args.minutes.split(",")):
        synthetic_video(work / f"video-{minutes}min.mov", minutes * 60)
    results = []
    for backend in args.backends.split(","):
        command = [sys.executable, __file__, "--work", str(work), "--backend-run", backend, "--minutes", args.minutes,
                   "--queries", str(args.queries), "--max-new-tokens", str(args.max_new_tokens)]  # fmt: skip
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
        run = subprocess.run(command, capture_output=True, text=True, env=env)
        if run.returncode:
            print(f"{backend}: failed\n{run.stderr[-3000:]}")
            continue
        results.append(json.loads(run.stdout.strip().splitlines()[-1]))
    print(f"\nretrieve on the demo video model ({args.family}), {args.queries} queries a video, "
          f"{args.max_new_tokens} new tokens an answer")  # fmt: skip
    print(f"{'backend':<8} {'load s':>7}  " + "  ".join(f"{m + ' min':>16}" for m in args.minutes.split(",")))
    for result in results:
        cells = []
        for minutes in args.minutes.split(","):
            video = result["videos"][f"{minutes}min"]
            cells.append(f"{video['queries'] / video['seconds']:>7.2f} q/s {video['seconds']:>5.1f}s")
        print(f"{result['backend']:<8} {result['load']:>7.1f}  " + "  ".join(cells))
    for result in results:
        if "k_vs_one" in result:
            k = result["k_vs_one"]
            ratio = k["apart"] / k["together"]
            print(f"\ntorch, the {k['video']} video: {k['k']} queries from one context "
                  f"{k['together']:.1f} s, {k['k']} one-query videos {k['apart']:.1f} s: {ratio:.2f}x")  # fmt: skip
            memory = result["memory"]
            marks = ", ".join(f"after {n} videos {int(v) / 2**30:.2f} GiB" for n, v in memory["after"].items())
            print(f"torch, 100 videos of 10 s: resident {marks}; peak {memory['peak'] / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
