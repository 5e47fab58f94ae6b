"""Quantized serving on vLLM: a 16-bit converted folder and its `quantize` folders (int8 W8A8, 4-bit W4A16) served
side by side in one run, at the Vidi-7B shape (bench/scale.py's `vidi-7b`: random weights, bfloat16), on this
machine's CPU kernels (CPUInt8ScaledMMLinearKernel, CPUWNA16LinearKernel).

Each folder is served by its own engine, in its own process, one after another (bf16, eager, TP=1, 1 GiB of KV
cache), and measured after a warm-up:
  prefill  one text request of --prompt-tokens tokens, 1 token generated: tokens/s
  decode   one request generating --decode-tokens tokens: tokens/s of the steps after the first
with the process's peak anonymous memory (weights as the engine holds them), the weights' bytes on disk, and each
quantized folder's decode speed-up beside the ratio of the 16-bit weights' bytes to its own: a decode step reads every
weight once, so on a memory-bound machine it speeds up about as the bytes shrink. The decode bound printed is the
weights' bytes over this machine's measured copy bandwidth.

    python bench/vllm_quantized.py [--model vidi-7b] [--work DIR] [--prompt-tokens 256] [--decode-tokens 16]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from scale import MODELS, cli, folder_bytes, measure, write_checkpoint  # noqa: E402


def serve_once(folder: Path, prompt_tokens: int, decode_tokens: int, out: Path) -> None:
    """In its own process: one engine on `folder`, its prefill and decode timed."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams

    llm = LLM(str(folder), dtype="bfloat16", enforce_eager=True, max_model_len=prompt_tokens + decode_tokens + 8,
              max_num_seqs=1, distributed_executor_backend="uni")  # fmt: skip
    ids = np.random.default_rng(0).integers(100, 30000, prompt_tokens).tolist()
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate([{"prompt_token_ids": ids[:16]}], one, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": ids}], one, use_tqdm=False)
    prefill = time.perf_counter() - start
    short = {"prompt_token_ids": ids[:16]}
    start = time.perf_counter()
    llm.generate([short], one, use_tqdm=False)
    first = time.perf_counter() - start
    start = time.perf_counter()
    llm.generate([short], SamplingParams(temperature=0, max_tokens=decode_tokens, ignore_eos=True), use_tqdm=False)
    decode = (time.perf_counter() - start - first) / (decode_tokens - 1)
    out.write_text(json.dumps({"prefill_tokens_per_s": prompt_tokens / prefill, "decode_tokens_per_s": 1 / decode}))


def copy_bandwidth() -> float:
    """Bytes a second this machine copies (1 GiB, numpy): a decode step's floor is its weights read once at it."""
    source = np.ones(1 << 30, np.uint8)
    target = np.empty_like(source)
    np.copyto(target, source)
    start = time.perf_counter()
    np.copyto(target, source)
    return 2 * source.nbytes / (time.perf_counter() - start)  # read and written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=list(MODELS), default="vidi-7b")
    parser.add_argument("--work", type=Path, default=Path("/tmp/dattn-vllm-quantized"))
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--decode-tokens", type=int, default=16)
    parser.add_argument("--serve-once", nargs=2, type=Path, help=argparse.SUPPRESS)  # FOLDER OUT: one engine's run
    args = parser.parse_args()
    if args.serve_once:
        serve_once(args.serve_once[0], args.prompt_tokens, args.decode_tokens, args.serve_once[1])
        return
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    checkpoint, sixteen = args.work / "checkpoint", args.work / "16-bit"
    write_checkpoint(args.model, checkpoint, "safetensors")
    subprocess.run(cli("convert", checkpoint, "-o", sixteen, "--dtype", "bf16"), check=True, capture_output=True)
    shutil.rmtree(checkpoint)
    folders = {"bf16": sixteen}
    for scheme in ("w8a8", "w4a16"):
        folders[scheme] = args.work / scheme
        subprocess.run(cli("quantize", sixteen, "-o", folders[scheme], "--scheme", scheme), check=True,
                       capture_output=True)  # fmt: skip
    bandwidth = copy_bandwidth()
    rows = {}
    for name, folder in folders.items():
        out = args.work / f"{name}.json"
        command = [sys.executable, __file__, "--serve-once", folder, out, "--prompt-tokens", str(args.prompt_tokens),
                   "--decode-tokens", str(args.decode_tokens)]  # fmt: skip
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{os.cpu_count() - 1}"
        run = measure(command, f"serve {name}")
        if run["code"]:
            rows[name] = {"error": run["last_line"]}
            continue
        weights = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
        rows[name] = json.loads(out.read_text()) | {"peak_gib": run["anon_gib"], "weights": weights}
        rows[name]["decode_bound"] = bandwidth / weights
        print(name, rows[name], flush=True)
    base = rows["bf16"]
    print(
        f"\n| {args.model} on vLLM CPU (bf16 activations) | prefill tokens/s | decode tokens/s (bound: weights read "
        f"once at {bandwidth / 1e9:.1f} GB/s) | decode vs bf16 | weights | bf16 bytes / its bytes | peak anonymous |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, r in rows.items():
        if "error" in r:
            print(f"| {name} | failed: {r['error']} | | | | | |")
            continue
        speedup = r["decode_tokens_per_s"] / base["decode_tokens_per_s"] if "error" not in base else float("nan")
        print(f"| {name} | {r['prefill_tokens_per_s']:.1f} | {r['decode_tokens_per_s']:.2f} "
              f"(bound {r['decode_bound']:.2f}) | {speedup:.2f}x | {r['weights'] / 1e9:.1f} GB | "
              f"{folder_bytes(sixteen) / folder_bytes(folders[name]):.2f}x | {r['peak_gib']:.1f} GiB |")  # fmt: skip
    shutil.rmtree(args.work, ignore_errors=True)


if __name__ == "__main__":
    main()
