"""Quantized serving on vLLM: a 16-bit converted folder and its `quantize` folders (int8 W8A8, 4-bit W4A16, FP8)
served one after another in one run, at the Vidi-7B shape (bench/scale.py's `vidi-7b`: random weights, bfloat16), on
this machine's CPU kernels (CPUInt8ScaledMMLinearKernel, CPUWNA16LinearKernel, ChannelWiseTorchFP8ScaledMMLinear).

Each folder is served by its own engine, in its own process (bf16 activations, eager, TP=1, 2 GiB of KV cache), and
measured after a warm-up:
  prefill  one text request of --prompt-tokens tokens, 1 token generated: tokens/s
  decode   one request generating --decode-tokens tokens: tokens/s of the steps after the first
with the process's peak anonymous memory (the weights as the engine holds them), the folder's bytes, and each
folder's decode speed-up beside the ratio of the 16-bit decoder's bytes to its own: a decode step reads every weight
once, so where decoding is memory-bound it speeds up about as the bytes shrink. The bounds printed beside: decode,
the decoder layers' and the head's bytes read once at the read bandwidth torch measures here; prefill, 2 FLOPs a
decoder layer weight a token at the bf16 matmul rate torch measures here. Each quantized folder is written just
before it is served and removed after (the four would take 40 GB of disk).

At Vidi-7B's full 32 layers the engines do not fit 24 GiB beside their KV cache (with a 4096-token encoder budget the
bf16 engine held 18.7 GiB before vLLM refused for want of KV cache space, the w8a8 one 25.5 GiB as sampled):
`--layers 16` measures half its decoder, the towers, embeddings and head whole.

    python bench/vllm_quantized.py [--model vidi-7b] [--layers 16] [--work DIR] [--prompt-tokens 256]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from onnx_scaling import best_of  # noqa: E402
from scale import MODELS, cli, folder_bytes, measure, write_checkpoint  # noqa: E402

from dattn_export.checkpoints.lazy import read_safetensors  # noqa: E402

SCHEMES = ("w8a8", "w4a16", "fp8")


def serve_once(folder: Path, prompt_tokens: int, decode_tokens: int, out: Path) -> None:
    """In its own process: one engine on `folder`, its prefill and decode timed."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams

    # text requests: a video model's encoder budget held to one frame (vLLM sizes its profiling run by the largest
    # video it allows, 0.5 M tokens by default: 20 GiB at this size)
    llm = LLM(str(folder), dtype="bfloat16", enforce_eager=True, max_model_len=prompt_tokens + decode_tokens + 8,
              max_num_seqs=1, distributed_executor_backend="uni", max_num_batched_tokens=1024,
              limit_mm_per_prompt={"video": {"count": 1, "num_frames": 1}})  # fmt: skip
    ids = np.random.default_rng(0).integers(100, 4000, prompt_tokens).tolist()  # within the bench tokenizer's 4096
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


def read_bandwidth() -> float:
    """Bytes a second this machine reads (2 GiB summed by torch on every core, the best of 5): a decode step's
    ceiling is its weights read once at it."""
    import torch

    data = torch.ones(1 << 29, dtype=torch.float32)
    return data.nbytes / best_of(5, data.sum)


def matmul_flops() -> float:
    """FLOPs a second of a bf16 matmul of 1024 tokens by an MLP projection of the Vidi-7B shape (torch, every core,
    the best of 5): prefill's ceiling here."""
    import torch

    a, b = torch.randn(1024, 4096, dtype=torch.bfloat16), torch.randn(4096, 14336, dtype=torch.bfloat16)
    return 2 * a.shape[0] * a.shape[1] * b.shape[1] / best_of(5, lambda: a @ b)


def decode_reads(folder: Path) -> tuple[int, int]:
    """(weights, bytes) of the decoder layers and the head, as the folder stores them: what a decode step reads
    (the towers, their adapters and the embedding table, of which a step reads one row, left out); the weights are
    what prefill multiplies, the head's on the last token only."""
    weights = stored = 0
    for shard in folder.glob("*.safetensors"):
        for name, tensor in read_safetensors(shard).items():
            if name.startswith(("model.layers.", "lm_head.")):
                stored += tensor.nbytes
                weights += math.prod(tensor.shape) if name.startswith("model.layers.") else 0
    return weights, stored


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=list(MODELS), default="vidi-7b")
    parser.add_argument("--work", type=Path, default=Path("/tmp/dattn-vllm-quantized"))
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--decode-tokens", type=int, default=16)
    parser.add_argument("--layers", type=int, help="Decoder layers (default: the model's), fewer where it won't fit.")
    parser.add_argument("--serve-once", nargs=2, type=Path, help=argparse.SUPPRESS)  # FOLDER OUT: one engine's run
    args = parser.parse_args()
    if args.serve_once:
        serve_once(args.serve_once[0], args.prompt_tokens, args.decode_tokens, args.serve_once[1])
        return
    model = args.model
    if args.layers:
        model = f"{args.model}, {args.layers} layers"
        MODELS[model] = MODELS[args.model] | {"num_hidden_layers": args.layers}
    checkpoint, sixteen = args.work / "checkpoint", args.work / "16-bit"
    if not (sixteen / "dattn_manifest.json").is_file():  # a run's 16-bit folder is kept for the next until it ends
        shutil.rmtree(args.work, ignore_errors=True)
        args.work.mkdir(parents=True)
        write_checkpoint(model, checkpoint, "safetensors")
        subprocess.run(cli("convert", checkpoint, "-o", sixteen, "--dtype", "bf16"), check=True, capture_output=True)
        shutil.rmtree(checkpoint)
    bandwidth, flops = read_bandwidth(), matmul_flops()
    rows = {}
    for name in ("bf16", *SCHEMES):
        folder = sixteen if name == "bf16" else args.work / name
        if name != "bf16":
            subprocess.run(cli("quantize", sixteen, "-o", folder, "--scheme", name, "--force"), check=True,
                           capture_output=True)  # fmt: skip
        out = args.work / f"{name}.json"
        command = [sys.executable, __file__, "--serve-once", folder, out, "--prompt-tokens", str(args.prompt_tokens),
                   "--decode-tokens", str(args.decode_tokens)]  # fmt: skip
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{os.cpu_count() - 1}"
        run = measure(command, f"serve {name}")
        sizes = {"folder": folder_bytes(folder), "reads": decode_reads(folder)[1]}
        if run["code"]:
            rows[name] = {"error": run["last_line"]} | sizes
        else:
            rows[name] = json.loads(out.read_text()) | {"peak_gib": run["anon_gib"]} | sizes
            print(name, rows[name], flush=True)
        if name != "bf16":
            shutil.rmtree(folder)
    prefill_bound = flops / (2 * decode_reads(sixteen)[0])
    base = rows["bf16"]
    print(
        f"\n| {model} on vLLM CPU ({os.cpu_count()} cores, bf16 activations) | prefill tokens/s (bound: "
        f"{flops / 1e9:.0f} GFLOP/s bf16 matmul) | decode tokens/s (bound: its decoder read once at "
        f"{bandwidth / 1e9:.1f} GB/s) | decode vs bf16 | bf16 decoder bytes / its | decoder (layers, head) | folder "
        "| peak anonymous |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, r in rows.items():
        sizes = f"{base['reads'] / r['reads']:.2f}x | {r['reads'] / 1e9:.1f} GB | {r['folder'] / 1e9:.1f} GB"
        if "error" in r:
            print(f"| {name} | failed: {r['error']} | | | {sizes} | |")
            continue
        speedup = r["decode_tokens_per_s"] / base["decode_tokens_per_s"] if "error" not in base else float("nan")
        print(f"| {name} | {r['prefill_tokens_per_s']:.1f} (bound {prefill_bound:.1f}) | "
              f"{r['decode_tokens_per_s']:.2f} (bound {bandwidth / r['reads']:.2f}) | {speedup:.2f}x | {sizes} | "
              f"{r['peak_gib']:.1f} GiB |")  # fmt: skip
    shutil.rmtree(args.work, ignore_errors=True)


if __name__ == "__main__":
    main()
