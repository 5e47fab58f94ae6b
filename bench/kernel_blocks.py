"""The Triton kernel's speed on a GPU by tile shape, warps and pipeline stages, against PyTorch's SDPA on the same
attention written conventionally (K/V expanded to the query heads, the causal mask over [context ; text]).

For each case (Vidi-7B's and Vidi1.5-9B's attention shapes, fp16, prefill of 256 queries and a decode step after
2048 text tokens, 16k and 64k context tokens) it times every configuration, prints a row as each finishes and the
best per case with its ratio to SDPA, and writes kernel_blocks.json under --out (each row as soon as it is timed,
so a run cut short keeps what it measured). With --splits it times instead a decode step at the chosen tiles by the
number of shares its context keys are split into and the key tile (2k to 64k context tokens), and the shares'
merge alone.
Needs a CUDA GPU.

    python bench/kernel_blocks.py --out bench-out
    python bench/kernel_blocks.py --splits --out bench-out
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

from triton.testing import do_bench

from dattn_export.plugins.contract import Attributes
from dattn_export.plugins.triton_kernel import constants, key_splits, launch, merge_shares

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools" / "gpu_check"))
from gpu_check import conventional_case  # noqa: E402  the inputs and their SDPA twin, as the GPU check times them

SHAPES = {  # query heads, KV heads, head dim, softcap, window
    "Vidi-7B (Mistral)": (32, 8, 128, 0.0, 0),
    "Vidi1.5-9B (Gemma 2)": (16, 8, 256, 50.0, 4096),
}
CASES = [  # phase, queries, past text tokens, context tokens
    ("prefill", 256, 0, 16384),
    ("prefill", 256, 0, 65536),
    ("decode", 1, 2048, 65536),
]
PREFILL_BLOCKS = [(16, 64), (64, 64), (64, 128), (128, 64), (128, 32)]
DECODE_BLOCKS = [(16, 16), (16, 64), (16, 128), (16, 256)]
WARPS_STAGES = [(4, 2), (4, 3), (8, 2), (8, 3)]
SPLIT_CONTEXTS = [2048, 8192, 16384, 32768, 65536]
DECODE_PAST = 2048  # text tokens before a decode step
SPLITS = [1, 2, 4, 8, 16, 32, 64, 128, 256]
SPLIT_BLOCKS = {128: [128, 256], 256: [64, 128]}  # key tiles by head dim


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench-out")))
    parser.add_argument("--splits", action="store_true", help="time a decode step by its key shares instead")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.splits:
        return time_splits(args.out)
    rows, best = [], {}
    for (name, shape), (phase, queries, past, context) in itertools.product(SHAPES.items(), CASES):
        heads, kv_heads, dim, softcap, window = shape
        inputs, sdpa_call = conventional_case(heads, kv_heads, dim, queries, past, context, "cuda", dim**-0.5)
        attributes = Attributes(dim**-0.5, softcap=softcap, window=window)
        baseline = do_bench(sdpa_call)
        blocks = PREFILL_BLOCKS if phase == "prefill" else DECODE_BLOCKS
        for (block_m, block_n), (warps, stages) in itertools.product(blocks, WARPS_STAGES):
            config = dict(block_m=block_m, block_n=block_n, num_warps=warps, num_stages=stages)
            try:
                ms = do_bench(lambda: launch(*inputs, attributes, **config))  # noqa: B023
            except Exception as error:  # noqa: BLE001 - a tile too large for shared memory is a result
                ms, note = None, str(error).splitlines()[0][:80]
            else:
                note = ""
            row = dict(attention=name, phase=phase, context=context, **config, ms=ms, sdpa_ms=baseline, note=note)
            rows.append(row)
            print(json.dumps(row), flush=True)
            (args.out / "kernel_blocks.json").write_text(json.dumps(rows, indent=1))
            key = (name, phase, context)
            if ms is not None and (key not in best or ms < best[key]["ms"]):
                best[key] = row
    print("\n| attention | phase | context | best (m, n, warps, stages) | ms | SDPA ms | SDPA/ours |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for (name, phase, context), row in best.items():
        tiles = f"{row['block_m']}, {row['block_n']}, {row['num_warps']}, {row['num_stages']}"
        print(f"| {name} | {phase} | {context} | {tiles} | {row['ms']:.3g} | {row['sdpa_ms']:.3g} | "
              f"{row['sdpa_ms'] / row['ms']:.2f} |")  # fmt: skip


def time_splits(out: Path) -> None:
    import torch

    rows = []
    for (name, (heads, kv_heads, dim, softcap, window)), context in itertools.product(SHAPES.items(), SPLIT_CONTEXTS):
        inputs, sdpa_call = conventional_case(heads, kv_heads, dim, 1, DECODE_PAST, context, "cuda", dim**-0.5)
        attributes = Attributes(dim**-0.5, softcap=softcap, window=window)
        baseline = do_bench(sdpa_call)
        slots = constants(attributes, dim, 16, 16, WRITE_LSE=False, UPCAST=False, SPLITS=2)["SLOTS"]
        for splits, block_n in itertools.product(SPLITS, SPLIT_BLOCKS[dim]):
            ms = do_bench(lambda: launch(*inputs, attributes, splits=splits, block_n=block_n))  # noqa: B023
            partial = torch.randn(splits, slots, heads, 1, dim, device="cuda")
            lse = torch.randn(partial.shape[:-1], device="cuda")
            merged = torch.empty(1, heads, 1, dim, device="cuda", dtype=torch.float16)
            merge_ms = do_bench(lambda: merge_shares(partial, lse, merged, False)) if splits > 1 else 0.0  # noqa: B023
            row = dict(attention=name, context=context, splits=splits, block_n=block_n,
                       default=key_splits(1, DECODE_PAST + 1 + context), ms=ms, merge_ms=merge_ms, sdpa_ms=baseline,
                       sdpa_over_ours=baseline / ms)  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
            (out / "kernel_splits.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
