"""Thread states from the kernel: each shape of work reads as what it is, on an idle or
a loaded machine. Shares are bounded loosely: the machine may be busy with other work,
which only moves time into "waiting for a CPU"."""

from __future__ import annotations

import hashlib
import os
import time
from typing import Any, Callable

import dask
import pytest

from dask_pyspy import PySpyProfiler

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


def matmul(i: int) -> int:
    """BLAS: its own threads, plus the caller computing or spinning for them."""
    import numpy as np

    m = np.random.default_rng(i).random((800, 800))
    end = time.monotonic() + SECONDS
    while time.monotonic() < end:
        m = m @ m
        m /= m.max()
    return i


def shares(work: Callable[..., int], threads: int, *args: Any, samples: int = 150) -> tuple[dict[str, float], dict]:
    """`threads` tasks of `work` at once, again until its prefix has `samples` samples:
    each state's share of the prefix's wall time, and the process's stats."""
    prefix = work.__name__
    with PySpyProfiler() as prof:
        for _ in range(60):
            tasks = [dask.delayed(work, pure=False)(i, *args, dask_key_name=f"{prefix}-{i}") for i in range(threads)]
            dask.compute(tasks, scheduler="threads", num_workers=threads)
            rows = {p["prefix"]: p for p in prof.profile.summary()["prefixes"]}
            if prefix in rows and rows[prefix]["samples"] >= samples:
                break
    row = rows[prefix]
    assert row["samples"] >= samples, row
    assert abs(sum(row[s] for s in STATES) - row["seconds"]) < 1e-6, "the states add up to the wall time"
    return {s: row[s] / row["seconds"] for s in STATES}, prof.profile.processes[0]["stats"]


def test_threads_contending_for_the_gil_wait_for_it():
    got, _ = shares(spin, 4)
    assert got["gil_wait"] >= 0.3, got
    # One thread holds the GIL at a time: four share at most one thread's time.
    assert got["gil"] <= 0.4, got
    assert got["blocked"] <= 0.1, got


def test_more_busy_threads_than_cores_wait_for_a_cpu():
    cores = len(os.sched_getaffinity(0))
    got, stats = shares(hash_, 2 * cores)
    assert stats["cores"] == os.cpu_count() or stats["cores"] == cores
    # Twice the threads of the cores: each waits for a CPU about half its time.
    assert got["cpu_wait"] >= 0.25, got
    assert got["no_gil"] > got["gil"], got
    assert got["blocked"] <= 0.1, got


def test_a_sleep_is_blocked():
    got, _ = shares(nap, 2, samples=80)
    assert got["blocked"] >= 0.9, got


@pytest.fixture(scope="module")
def parquet_file(tmp_path_factory):
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path_factory.mktemp("states") / "t.parquet"
    pq.write_table(pa.table({f"c{i}": np.random.rand(200_000) for i in range(16)}), path, compression="zstd")
    return str(path)


def test_waiting_on_native_threads_is_not_io(parquet_file):
    got, stats = shares(parquet, 1, parquet_file)
    assert got["native"] >= 0.3 and got["native"] > got["blocked"], got
    window = stats["window_cpu"]
    assert 0 < window["native_cpu_s"] <= window["process_cpu_s"], window


def test_a_blas_kernel_reads_as_cpu_work():
    got, _ = shares(matmul, 1)
    assert got["no_gil"] + got["cpu_wait"] + got["native"] >= 0.7, got
    assert got["blocked"] <= 0.2, got
