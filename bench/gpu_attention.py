"""GPU only: the DecomposedAttention Triton kernel (torch.ops.dattn.decomposed_attention) against PyTorch SDPA
over the same keys, and the GPU tests (engines, TRT vs PyTorch, plugin vs function fallback).

    python bench/gpu_attention.py            # timings table, then pytest -m gpu

Shapes: 32 query heads / 8 KV heads, head dim 128, fp16; |V| = 576, 2304, 9216 visual keys; prefill of 64
text tokens and a decode step after 64. SDPA runs the equivalent conventional attention: the 64 text
queries over [visual ; text] keys with the matching mask, K/V expanded to the query heads as SDPA needs.
"""

from __future__ import annotations

import subprocess
import sys

import torch
import torch.nn.functional as F


def timed(fn, repeat: int = 50) -> float:
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeat


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("no CUDA GPU: this benchmark and the gpu tests run on a GPU machine")
    from dattn_export.plugins.torch_op import decomposed_attention

    heads, kv_heads, dim, dtype = 32, 8, 128, torch.float16
    print(f"{'|V|':>6}{'phase':>9}{'dattn kernel ms':>17}{'SDPA ms':>10}{'speed-up':>10}")
    for num_context in (576, 2304, 9216):
        for phase, queries, past in (("prefill", 64, 0), ("decode", 1, 64)):
            keys = past + queries
            rand = lambda *shape: torch.randn(*shape, device="cuda", dtype=dtype)  # noqa: E731
            q, k, v = rand(1, heads, queries, dim), rand(1, kv_heads, keys, dim), rand(1, kv_heads, keys, dim)
            k_vis, v_vis = rand(1, kv_heads, num_context, dim), rand(1, kv_heads, num_context, dim)
            key_mask = torch.ones(1, keys, dtype=torch.bool, device="cuda")
            context_mask = torch.ones(1, num_context, dtype=torch.bool, device="cuda")
            ours = timed(lambda: decomposed_attention(q, k, v, key_mask, q, k_vis, v_vis, context_mask, dim**-0.5))
            all_k = torch.cat([k_vis, k], 2).repeat_interleave(heads // kv_heads, 1)
            all_v = torch.cat([v_vis, v], 2).repeat_interleave(heads // kv_heads, 1)
            slots = torch.arange(num_context + keys, device="cuda")
            mask = slots[None, :] <= (num_context + past + torch.arange(queries, device="cuda"))[:, None]
            sdpa = timed(lambda: F.scaled_dot_product_attention(q, all_k, all_v, attn_mask=mask))
            print(f"{num_context:>6}{phase:>9}{ours:>17.3f}{sdpa:>10.3f}{sdpa / ours:>9.2f}x")
    sys.exit(subprocess.call([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests"]))


if __name__ == "__main__":
    main()
