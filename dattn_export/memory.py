"""How much memory a command may take, and the one-line refusal when it cannot fit: never the kernel's OOM kill.

The budget is the machine's available memory (MemAvailable: free memory plus the page cache it can drop, which is
where mapped checkpoints sit), or `DATTN_MEMORY_GIB` where a user caps it (a shared machine, a container whose
limit the kernel does not report).
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from pathlib import Path

from .errors import EnvironmentFailure

MEMORY_ENV = "DATTN_MEMORY_GIB"
HEADROOM = 1 << 30  # the process itself (torch, onnx) and a forward pass's activations, beyond the weights


def gib(count: int) -> str:
    return f"{count / (1 << 30):.1f} GiB"


def available() -> int:
    """Bytes this command may use."""
    if os.environ.get(MEMORY_ENV):
        try:
            return int(float(os.environ[MEMORY_ENV]) * (1 << 30))
        except ValueError:
            raise EnvironmentFailure(MEMORY_ENV, f"{os.environ[MEMORY_ENV]!r} is not a number of GiB") from None
    try:
        with open("/proc/meminfo") as meminfo:
            fields = dict(line.split(":", 1) for line in meminfo)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):  # not Linux: all of physical memory
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def return_freed_blocks() -> None:
    """From now on every block of 1 MiB or more is mapped on its own and given back to the system when freed. glibc
    otherwise serves blocks under 32 MiB from per-thread arenas that keep what is freed, and a model streamed layer
    by layer grows by the fragments (verify of a 1 GB model: a peak of 0.74-0.99 GB, 0.57 GB with this, 10% slower).
    Without glibc (no mallopt): nothing changes."""
    try:
        ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, 1 << 20)
    except (OSError, AttributeError):
        pass


def fits(needed: int) -> bool:
    return needed + HEADROOM <= available()


def require(needed: int, what: str, way_out: str) -> None:
    """Refuse in one line, with the figures and the way out, what cannot fit."""
    if not fits(needed):
        have = available()
        raise EnvironmentFailure(
            "memory",
            f"{what} needs about {gib(needed + HEADROOM)} but this machine has {gib(have)} available: {way_out}",
        )


def require_gpu(needed: int, what: str) -> None:
    """A CUDA GPU that can hold `needed` bytes besides what it holds now, or one line saying what is missing."""
    import torch

    if not torch.cuda.is_available():
        raise EnvironmentFailure("--device cuda", "no CUDA GPU is visible: run on a GPU machine, or without --device")
    free, total = torch.cuda.mem_get_info()
    if needed + HEADROOM > free:
        raise EnvironmentFailure(
            "GPU memory",
            f"{what} needs about {gib(needed + HEADROOM)} but the GPU has {gib(free)} free of {gib(total)}",
        )


class AnonPeak(threading.Thread):
    """The largest anonymous memory (RssAnon: not the mapped checkpoint's pages, which the kernel can drop) of a
    process and its children, sampled every `interval` seconds while it runs; for the benchmarks and the tests."""

    def __init__(self, pid: int, interval: float = 0.02):
        super().__init__(daemon=True)
        self.pid, self.interval, self.peak, self.running = pid, interval, 0, True

    def tree(self) -> list[int]:
        pids, queue = [], [self.pid]
        while queue:
            pid = queue.pop()
            pids.append(pid)
            try:
                queue += [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
            except OSError:
                pass
        return pids

    def run(self) -> None:
        while self.running:
            total = 0
            for pid in self.tree():
                try:
                    status = Path(f"/proc/{pid}/status").read_text()
                except OSError:
                    continue
                line = next((x for x in status.splitlines() if x.startswith("RssAnon:")), "RssAnon: 0 kB")
                total += int(line.split()[1]) * 1024
            self.peak = max(self.peak, total)
            time.sleep(self.interval)

    def stop(self) -> int:
        self.running = False
        self.join()
        return self.peak
