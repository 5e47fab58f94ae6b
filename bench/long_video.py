"""Long videos through `generate` on every backend that runs on CPU: the released workload (1 frame/s and the whole
sound track) from a minute to two hours, past the resize budget of Vidi1.5's pool (306 frames at its real size,
3750 for the demo model's tiny tower).

Each video is made once by the ffmpeg command line (imageio-ffmpeg's static build: testsrc2 and a 44.1 kHz stereo
sine, h264 + AAC in mp4, 30 fps) and kept in `--cache`. Then, side by side for each length and height:

  ffmpeg      `ffmpeg -i FILE -f null -`: the command line's own decode of the whole file, frames and sound
  decode      ours as `generate` runs it (`decode_media`: every frame decoded, one a second kept at the tower's
              square, the sound track at 16 kHz mono), and its ratio to ffmpeg's (the goal: <= 1.2)
  backends    `dattn-export generate FILE --video ... --max-new-tokens 4` per backend: wall time, peak resident
              memory (/usr/bin/time), the visual and audio tokens, and whether its tokens equal torch's

    python bench/long_video.py                                   # gemma2, 60 s and 600 s at 480p
    python bench/long_video.py --seconds 3600 7200 --heights 480 1080 --family mistral
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

import imageio_ffmpeg

from dattn_export.demo_model import write_demo_checkpoint
from dattn_export.media import Media, decode_media
from dattn_export.modeling.families import FAMILIES
from dattn_export.stages.onnx_export import export_onnx

BACKENDS = {"torch": "checkpoint", "ort": "onnx", "genai": "onnx"}
PROMPT = "USER: <video>\nDuring which time segments in the video can we see a clock?\nASSISTANT:"


def make_video(path: Path, seconds: int, height: int) -> Path:
    if not path.is_file():
        width = height * 16 // 9 // 2 * 2
        subprocess.run(
            [imageio_ffmpeg.get_ffmpeg_exe(), "-v", "error", "-y",
             "-f", "lavfi", "-i", f"testsrc2=size={width}x{height}:rate=30",
             "-f", "lavfi", "-i", "sine=frequency=440:sample_rate=44100", "-t", str(seconds),
             "-c:v", "libx264", "-preset", "ultrafast", "-pix_fmt", "yuv420p", "-c:a", "aac", "-ac", "2",
             str(path) + ".partial.mp4"],
            check=True,
        )  # fmt: skip
        Path(str(path) + ".partial.mp4").rename(path)
    return path


def ffmpeg_decode_seconds(path: Path) -> float:
    start = time.perf_counter()
    subprocess.run([imageio_ffmpeg.get_ffmpeg_exe(), "-v", "error", "-i", str(path), "-f", "null", "-"], check=True)
    return time.perf_counter() - start


def our_decode_seconds(path: Path, checkpoint: Path) -> float:
    from dattn_export.checkpoints.source import open_source

    config = open_source(checkpoint).config
    start = time.perf_counter()
    decode_media(Media(video=path), checkpoint, config)
    return time.perf_counter() - start


def generate(folder: Path, backend: str, video: Path) -> dict:
    """One `generate` run in a process of its own: wall seconds, peak RSS (GiB), tokens and generated ids."""
    command = ["/usr/bin/time", "-f", "peak_kib %M", sys.executable, "-m", "dattn_export", "generate", str(folder),
               "--backend", backend, "--video", str(video), "--prompt", PROMPT, "--max-new-tokens", "4"]  # fmt: skip
    start = time.perf_counter()
    run = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if run.returncode != 0:
        return {"error": run.stderr.strip().splitlines()[-1]}
    number = lambda pattern: int(re.search(pattern, run.stdout).group(1).replace(",", ""))  # noqa: E731
    return {
        "seconds": seconds,
        "peak_gib": int(re.search(r"peak_kib (\d+)", run.stderr).group(1)) / 2**20,
        "visual": number(r"visual tokens\s*\S?\s*([\d,]+)"),
        "audio": number(r"audio tokens\s*\S?\s*([\d,]+)"),
        "ids": re.search(r"generated ids \(\d+\): (\[.*\])", run.stdout).group(1),
    }


def cell(run: dict, reference: str | None) -> str:
    if "error" in run:
        return run["error"]
    differ = reference is not None and run["ids"] != reference
    return f"{run['seconds']:.0f} s, {run['peak_gib']:.2f} GiB{', ids differ from torch' if differ else ''}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=list(FAMILIES), default="gemma2")
    parser.add_argument("--seconds", type=int, nargs="+", default=[60, 600])
    parser.add_argument("--heights", type=int, nargs="+", default=[480])
    parser.add_argument("--backends", nargs="+", choices=list(BACKENDS), default=list(BACKENDS))
    parser.add_argument("--cache", type=Path, default=Path("bench-long-video"))
    args = parser.parse_args()
    args.cache.mkdir(exist_ok=True)
    model = args.cache / f"{args.family}-video"
    folders = {"checkpoint": model / "checkpoint", "onnx": model / "onnx"}
    if not (folders["onnx"] / "onnx_manifest.json").is_file():
        write_demo_checkpoint(folders["checkpoint"], args.family, video=True)
        export_onnx(folders["checkpoint"], folders["onnx"], force=True)
    print(f"| video | ffmpeg decode | our decode | ratio | {' | '.join(args.backends)} | tokens (visual + audio) |")
    print(f"| --- | ---: | ---: | ---: | {' | '.join('---:' for _ in args.backends)} | ---: |")
    for height in args.heights:
        for seconds in args.seconds:
            video = make_video(args.cache / f"{seconds}s-{height}p.mp4", seconds, height)
            ffmpeg, ours = ffmpeg_decode_seconds(video), our_decode_seconds(video, folders["checkpoint"])
            runs = {b: generate(folders[BACKENDS[b]], b, video) for b in args.backends}
            reference = runs.get("torch", {}).get("ids")
            cells = [cell(run, reference) for run in runs.values()]
            first = next(run for run in runs.values() if "error" not in run)
            decode = f"{ffmpeg:.1f} s | {ours:.1f} s | {ours / ffmpeg:.2f}"
            row = [f"{seconds} s, {height}p", decode, *cells, f"{first['visual']:,} + {first['audio']:,}"]
            print(f"| {' | '.join(row)} |", flush=True)


if __name__ == "__main__":
    main()
