"""Converter throughput and memory, measured side by side with `cp` of the same bytes.

Writes synthetic D-Attn checkpoints (Mistral-shaped LLM, hidden 2048) at two sizes, N and 2N, in two layouts:
bf16 `.bin` shards (Trainer save_model output) and a ZeRO-3 `global_stepN/` folder (fp32 masters, world
size 2). For each it times `cp -r` of the source folder and `dattn-export convert --dtype bf16` (both
followed by sync), and reads the converter's peak RSS from the kernel (wait4).

Targets (issue 3): throughput >= 0.5 x cp; peak RSS <= 2 x the largest tensor + 500 MB, flat as size doubles.
The same run also times `convert` of the tiny demo checkpoint: the fixed start-up (importing torch and
transformers, building the model on the meta device for the shape check) that every conversion pays, so the
table can show the data path's own rate against cp's as well.

    python bench/convert.py               # N = 2 GB, 2N = 4 GB of bf16 weights (ZeRO: 4 and 8 GB fp32)
    python bench/convert.py --size-gb 18  # a 9B-parameter model: ~37 GB of ZeRO fp32 masters
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict
from pathlib import Path

import torch

from dattn_export.checkpoints.source import model_shapes
from dattn_export.presets import tiny_config

HIDDEN, INTERMEDIATE, VOCAB = 2048, 8192, 32000


def bench_config(size_gb: float):
    """A config whose bf16 weights take about `size_gb` (layers scale; the largest tensor stays the embedding)."""
    per_layer = 2 * HIDDEN * HIDDEN + 2 * HIDDEN * 1024 + 3 * HIDDEN * INTERMEDIATE + 2 * HIDDEN
    layers = max(1, round((size_gb * 1e9 / 2 - 2 * VOCAB * HIDDEN) / per_layer))
    return tiny_config(
        "mistral",
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        dtype="bfloat16",
    )


def fill(shape, seed: int, dtype) -> torch.Tensor:
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 0.02).to(dtype)


def write_bin(folder: Path, config, shapes, shard_bytes: int = 1 << 30) -> None:
    folder.mkdir(parents=True)
    config.save_pretrained(folder)
    shards, current, used = [], {}, 0
    for seed, (name, shape) in enumerate(shapes.items()):
        current[name] = fill(shape, seed, torch.bfloat16)
        used += current[name].nbytes
        if used >= shard_bytes:
            shards.append(current)
            current, used = {}, 0
    if current:
        shards.append(current)
    weight_map = {}
    for k, shard in enumerate(shards, start=1):
        file = f"pytorch_model-{k:05d}-of-{len(shards):05d}.bin"
        torch.save(shard, folder / file)
        weight_map.update(dict.fromkeys(shard, file))
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def write_zero3(folder: Path, config, shapes, world_size: int = 2) -> Path:
    """DeepSpeed ZeRO-3 layout at sizes no test can train (tests/test_real_checkpoints.py reads real runs), one rank
    at a time."""
    folder.mkdir(parents=True)
    config.save_pretrained(folder)
    step = folder / "global_step1"
    step.mkdir()
    parts = {name: math.ceil(math.prod(shape) / world_size) for name, shape in shapes.items()}
    param_shapes = [OrderedDict((n, torch.Size(s)) for n, s in shapes.items())]
    for rank in range(world_size):
        flat = torch.empty(sum(parts.values()), dtype=torch.float32)
        offset = 0
        for seed, (name, shape) in enumerate(shapes.items()):
            full = fill(shape, seed, torch.float32).flatten()
            piece = full[rank * parts[name] : (rank + 1) * parts[name]]
            flat[offset : offset + piece.numel()] = piece
            flat[offset + piece.numel() : offset + parts[name]] = 0
            offset += parts[name]
        torch.save(
            {
                "module": {},
                "buffer_names": [],
                "param_shapes": param_shapes,
                "shared_params": {},
                "frozen_param_shapes": None,
                "frozen_param_fragments": {},
                "ds_version": "0.19.8",
            },
            step / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt",
        )
        torch.save(
            {"optimizer_state_dict": {"zero_stage": 3, "partition_count": world_size, "fp32_flat_groups": [flat]}},
            step / f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt",
        )
        del flat
    return step


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def timed(command: list[str]) -> tuple[float, int]:
    """Wall seconds (command + sync) and the command's peak RSS in bytes. close_fds=False lets Python use
    posix_spawn, so the child's peak RSS never includes a forked copy of this process's pages."""
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, close_fds=False)
    _, status, usage = os.wait4(process.pid, 0)
    if status != 0:
        sys.exit(f"{' '.join(command)} failed ({status})")
    os.sync()
    return time.perf_counter() - start, usage.ru_maxrss * 1024


def settle() -> None:
    """Let deletions finish (the disk may be mounted with `discard`) before the next timed run."""
    os.sync()
    time.sleep(2)


def measure(source: Path, work: Path, largest_tensor: int) -> dict:
    """Best of two runs each, in alternating order (cp, ours, ours, cp): the disk's state after a large
    delete slows whichever command runs next, so neither side always pays for it."""
    data = folder_bytes(source)
    commands = {
        "cp": ["cp", "-r", str(source), str(work / "copy")],
        "ours": ["dattn-export", "convert", str(source), "-o", str(work / "copy"), "--dtype", "bf16"],
    }
    seconds, rss, largest_shard = {"cp": [], "ours": []}, 0, 0
    for which in ("cp", "ours", "ours", "cp"):
        settle()
        elapsed, peak = timed(commands[which])
        seconds[which].append(elapsed)
        if which == "ours":
            rss = max(rss, peak)
            largest_shard = max(p.stat().st_size for p in (work / "copy").glob("*.safetensors"))
        shutil.rmtree(work / "copy")
    return dict(
        bytes=data,
        cp=min(seconds["cp"]),
        ours=min(seconds["ours"]),
        rss=rss,
        largest_tensor=largest_tensor,
        largest_shard=largest_shard,
    )


def startup_seconds(work: Path) -> float:
    """Best of three `convert` runs of the tiny demo checkpoint (1 MB): the command's fixed cost."""
    from dattn_export.demo_model import write_demo_checkpoint

    tiny = write_demo_checkpoint(work / "tiny")
    runs = []
    for _ in range(3):
        runs.append(timed(["dattn-export", "convert", str(tiny), "-o", str(work / "tiny-out"), "--force"])[0])
    shutil.rmtree(work / "tiny-out")
    return min(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gb", type=float, default=4.0, help="bf16 weight size of the larger model (2N)")
    parser.add_argument("--workdir", type=Path, default=None, help="scratch folder (default: a temp folder)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="dattn-bench-", dir=args.workdir))
    rows = []
    try:
        startup = startup_seconds(work)
        for size in (args.size_gb / 2, args.size_gb):
            config = bench_config(size)
            shapes = model_shapes(config)
            largest_bf16 = max(math.prod(s) for s in shapes.values()) * 2
            for layout, writer, largest in (
                ("bf16 .bin shards", write_bin, largest_bf16),
                ("ZeRO-3 fp32, 2 ranks", write_zero3, 2 * largest_bf16),
            ):
                print(f"writing {layout} for {config.num_hidden_layers} layers ...", file=sys.stderr, flush=True)
                with multiprocessing.get_context("spawn").Pool(1) as pool:  # this process stays small
                    written = pool.apply(writer, (work / "source", config, shapes))
                source = written if isinstance(written, Path) else work / "source"
                os.sync()
                rows.append((layout, config.num_hidden_layers, measure(source, work, largest)))
                shutil.rmtree(work / "source")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"start-up (convert of the 1 MB demo checkpoint, best of 3): {startup:.2f} s")
    header = (
        f"{'source':<22}{'layers':>7}{'GB':>7}{'cp s':>7}{'ours s':>8}{'ours/cp':>9}{'w/o start-up':>13}"
        f"{'peak RSS':>10}{'RSS/shard':>10}{'RSS bound':>10}{'ok':>4}"
    )
    print(header)
    for layout, layers, m in rows:
        ratio = m["cp"] / m["ours"]  # throughput ratio: same bytes, so the inverse of the time ratio
        bound = 2 * m["largest_tensor"] + 500e6
        ok = ratio >= 0.5 and m["rss"] <= bound
        print(
            f"{layout:<22}{layers:>7}{m['bytes'] / 1e9:>7.2f}{m['cp']:>7.1f}{m['ours']:>8.1f}{ratio:>9.2f}"
            f"{m['cp'] / (m['ours'] - startup):>13.2f}{m['rss'] / 1e6:>9.0f}M{m['rss'] / m['largest_shard']:>10.2f}"
            f"{bound / 1e6:>9.0f}M{'yes' if ok else 'NO':>4}"
        )
    for layout in ("bf16 .bin shards", "ZeRO-3 fp32, 2 ranks"):
        small, large = (m for name, _, m in rows if name == layout)
        print(f"{layout}: peak RSS at 2N / at N = {large['rss'] / small['rss']:.2f} (flat = 1.00)")


if __name__ == "__main__":
    main()
