"""A Ray cluster of several nodes on this machine, started as the several-machines recipe starts a node a machine."""

import json
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from helpers.ray_cpu_shim import RESOURCE as RAY_RANK_RESOURCE
from helpers.real_checkpoints import free_port


@contextmanager
def ray_nodes(count: int, logs: Path):
    """A Ray cluster of `count` nodes on this machine, started as the several-machines recipe starts one node per
    machine (`ray start --head`, then `ray start --address=HEAD` on each other), each node offering one core and one
    tensor-parallel rank (on CPU the shim's resource; GPU workers take a GPU); its address, until the block ends."""
    ray, port, nodes = Path(sys.executable).with_name("ray"), free_port(), []
    try:
        for core in range(count):
            where = (
                ["--head", f"--port={port}", "--include-dashboard=false"]
                if core == 0
                else [f"--address=127.0.0.1:{port}"]
            )
            resources = [
                "--num-cpus=1",
                f"--resources={json.dumps({RAY_RANK_RESOURCE: 1})}",
                "--object-store-memory=100000000",
            ]
            log = logs / f"ray-node-{core}.log"
            node = subprocess.Popen(
                [ray, "start", "--block", *where, *resources],
                stdout=log.open("w"),
                stderr=subprocess.STDOUT,
                env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "VLLM_CPU_OMP_THREADS_BIND": str(core)},
                start_new_session=True,  # the node's processes in a group of their own, killed together
            )
            nodes.append(node)
            deadline = time.monotonic() + 120
            while "Ray runtime started" not in log.read_text():
                assert node.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.5)
        yield f"127.0.0.1:{port}"
    finally:
        for node in reversed(nodes):  # a SIGTERM'd node waits 30 s to drain; these hold nothing worth draining
            os.killpg(node.pid, signal.SIGKILL)
            node.wait()
