"""The checkpoints DeepSpeed and the Trainer really write: trained once per test run, shared by all workers.

Each run trains a tiny model for two steps under DeepSpeed's own launcher (see deepspeed_training.py) and keeps
what it saved, plus `<run>.truth.safetensors`: the trained module's parameters (16-bit where the run is).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

from filelock import FileLock

SCRIPT = Path(__file__).with_name("deepspeed_training.py")

# name: (world size, run). Engine runs save `global_step2/`; Trainer runs `checkpoint-2/`; the released run
# `trainer.save_model(out)`. Vidi publishes no DeepSpeed config; the usual ZeRO-3 configs for Trainer runs gather
# 16-bit weights on save (the Trainer run without gathering covers the other case).
RUNS = {
    "zero1-bf16-w2": (2, dict(kind="engine", stage=1, precision="bf16")),
    "zero1-fp32-w3": (3, dict(kind="engine", stage=1, precision="fp32", family="mistral", tied=False)),
    "zero2-bf16-w1": (1, dict(kind="engine", stage=2, precision="bf16")),
    "zero2-fp16-w2": (2, dict(kind="engine", stage=2, precision="fp16", family="mistral")),
    "zero2-fp32-w3": (3, dict(kind="engine", stage=2, precision="fp32")),
    "zero3-bf16-w2": (2, dict(kind="engine", stage=3, precision="bf16")),
    "zero3-fp16-w3": (3, dict(kind="engine", stage=3, precision="fp16", family="mistral")),
    "zero3-fp32-w1": (1, dict(kind="engine", stage=3, precision="fp32")),
    "zero3-wings-w3": (3, dict(kind="engine", stage=3, precision="bf16", config=dict(wings_rank=8, wings_layers=[1]))),
    "trainer-zero3-gathered-w2": (2, dict(kind="trainer", stage=3, precision="bf16", gather=True)),
    "trainer-zero3-w2": (2, dict(kind="trainer", stage=3, precision="bf16", gather=False)),
    "released-zero3-w2": (2, dict(kind="released", stage=3, precision="bf16", gather=True)),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_all(root: Path, environment: dict | None = None) -> None:
    """One launch per world size, as a user runs `deepspeed --num_gpus N train.py`, in `environment` (default: this
    process's)."""
    shutil.rmtree(root, ignore_errors=True)  # what a failed attempt left
    root.mkdir(parents=True)
    launcher = Path(sys.executable).with_name("deepspeed")
    # DeepSpeed compiles its shared-memory all-reduce on first use, under a lock file in the torch extensions folder;
    # a build killed midway leaves that lock behind and every later launch waits on it forever. A folder of this
    # run's own cannot hold a stale lock.
    env = {
        **(environment or os.environ),
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "TORCH_EXTENSIONS_DIR": str(root / "torch-extensions"),
    }
    for world in sorted({w for w, _ in RUNS.values()}):
        plan = [{**run, "out": str(root / name)} for name, (w, run) in RUNS.items() if w == world]
        plan_file = root / f"plan-w{world}.json"
        plan_file.write_text(json.dumps(plan))
        port = free_port()
        command = [launcher, "--num_gpus", str(world), "--master_port", str(port), SCRIPT, plan_file]
        done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=root)
        # DeepSpeed's CPU all-reduce leaves its shared-memory buffers (69 MB each) in RAM after the ranks exit
        for buffer in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"):
            buffer.unlink(missing_ok=True)
        if done.returncode:
            raise RuntimeError(
                f"DeepSpeed training (world size {world}) failed:\n{done.stdout[-4000:]}{done.stderr[-4000:]}"
            )


def real_checkpoints(shared_root: Path, environment: dict | None = None) -> dict[str, Path]:
    """The runs' output folders under `shared_root`, trained by the first worker that asks (in `environment`)."""
    root = shared_root / "deepspeed-runs"
    with FileLock(f"{root}.lock"):
        if not (root / "done").is_file():
            train_all(root, environment)
            (root / "done").touch()
    return {name: root / name for name in RUNS}
