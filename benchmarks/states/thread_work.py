"""Shapes of work whose thread states are known: pure Python contending for the GIL,
C code without the GIL, sleeps, arrow's native pool, BLAS. Used by tests/inprocess/test_states.py
and the states benchmark."""

from __future__ import annotations

import hashlib
import threading
import time
from typing import Any, Callable

import dask

from dask_pyspy import Profile, PySpyProfiler

STATES = ("gil", "no_gil", "cpu_wait", "gil_wait", "native", "blocked")
SECONDS = 0.4  # per task


def spin(i: int) -> int:
    """Pure Python: needs the GIL all the time."""
    end, x = time.monotonic() + SECONDS, 0
    while time.monotonic() < end:
        x += 1
    return x


BUFFER = b"x" * (8 << 20)


def hash_(i: int) -> int:
    """sha256 of a big buffer releases the GIL: CPU work in C."""
    end, n = time.monotonic() + SECONDS, 0
    while time.monotonic() < end:
        hashlib.sha256(BUFFER).digest()
        n += 1
    return n


def nap(i: int) -> int:
    time.sleep(SECONDS)
    return i


def parquet(i: int, path: str) -> int:
    """arrow decodes columns in its own C++ threads while the caller waits on a future."""
    import pyarrow.parquet as pq

    end, n = time.monotonic() + SECONDS, 0
    while time.monotonic() < end:
        n += pq.read_table(path, use_threads=True).num_rows
    return n


def write_parquet(path: str) -> str:
    """16 columns of 200,000 floats, zstd-compressed: enough for arrow's pool to decode."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({f"c{i}": np.random.rand(200_000) for i in range(16)}), path, compression="zstd")
    return path


def matmul(i: int) -> int:
    """BLAS: its own threads, plus the caller computing or spinning for them."""
    import numpy as np

    m = np.random.default_rng(i).random((800, 800))
    end = time.monotonic() + SECONDS
    while time.monotonic() < end:
        m = m @ m
        m /= m.max()
    return i


class Accounted:
    """`work`, adding up what the kernel's schedstat says each call's thread did:
    CPU seconds, run-queue seconds (waiting for a CPU) and wall seconds."""

    def __init__(self, work: Callable[..., int]) -> None:
        self.work, self.__name__ = work, work.__name__
        self.cpu = self.runq = self.wall = 0.0
        self.lock = threading.Lock()

    def __call__(self, *args: Any) -> int:
        path = f"/proc/self/task/{threading.get_native_id()}/schedstat"
        read = lambda: [int(x) / 1e9 for x in open(path).read().split()[:2]]  # noqa: E731
        (cpu, runq), start = read(), time.monotonic()
        try:
            return self.work(*args)
        finally:
            (cpu2, runq2), end = read(), time.monotonic()
            with self.lock:
                self.cpu, self.runq, self.wall = (
                    self.cpu + cpu2 - cpu,
                    self.runq + runq2 - runq,
                    self.wall + end - start,
                )

    def truth(self) -> dict[str, float]:
        """Shares of wall time on a CPU, waiting for one, and neither."""
        wall = self.wall or 1.0
        return {"cpu": self.cpu / wall, "runq": self.runq / wall, "neither": 1 - (self.cpu + self.runq) / wall}


def shares(work: Callable[..., int], threads: int, *args: Any, samples: int = 150) -> tuple[dict[str, float], Profile]:
    """`threads` tasks of `work` at once, again until its prefix has `samples` samples:
    each state's share of the prefix's wall time, and the profile."""
    prefix = work.__name__
    deadline = time.monotonic() + 240
    with PySpyProfiler() as prof:
        # A loaded machine throttles the sampler (py-spy's reader on 3.9/3.10 most): go on
        # until the samples are there, under a generous deadline.
        while time.monotonic() < deadline:
            tasks = [dask.delayed(work, pure=False)(i, *args, dask_key_name=f"{prefix}-{i}") for i in range(threads)]
            dask.compute(tasks, scheduler="threads", num_workers=threads)
            rows = {p["prefix"]: p for p in prof.profile.summary()["prefixes"]}
            if prefix in rows and rows[prefix]["samples"] >= samples:
                break
    row = rows[prefix]
    assert row["samples"] >= samples, row
    assert abs(sum(row[s] for s in STATES) - row["seconds"]) < 1e-6, "the states add up to the wall time"
    return {s: row[s] / row["seconds"] for s in STATES}, prof.profile
