"""Task functions for benchmark clusters (importable by worker processes), and the mixed workload."""

from __future__ import annotations

import time

import dask
from distributed import Client


def cpu_task(i: int, seconds: float = 0.03) -> int:
    end = time.perf_counter() + seconds
    n = 0
    while time.perf_counter() < end:
        n += sum(range(100))
    return n


def tiny(i: int) -> int:
    return i + 1


def run_workloads(client: Client, quick: bool) -> dict[str, float]:
    """Pure Python, a pandas shuffle and many small tasks; seconds of each."""
    out = {}
    t = time.perf_counter()
    client.gather(client.map(cpu_task, range(40 if quick else 120)))
    out["pure Python"] = time.perf_counter() - t
    t = time.perf_counter()
    df = dask.datasets.timeseries(
        start="2000-01-01", end="2000-01-05" if quick else "2000-01-11", freq="1s", partition_freq="1d"
    )
    df.set_index("id")[["x", "y"]].mean().compute()
    out["pandas shuffle"] = time.perf_counter() - t
    t = time.perf_counter()
    client.gather(client.map(tiny, range(2000 if quick else 6000)))
    out["small tasks"] = time.perf_counter() - t
    return out


def task_1ms(i: int) -> int:
    return cpu_task(i, 0.001)


def task_10ms(i: int) -> int:
    return cpu_task(i, 0.01)


def task_100ms(i: int) -> int:
    return cpu_task(i, 0.1)


def grind(seconds: float) -> None:
    """Busy with the loop in its own body: its time is its own self time."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        sum(range(200))


def spin_then_grind(i: int, spin_seconds: float, grind_seconds: float) -> float:
    """Returns the wall seconds `grind` took, by the task's own clock."""
    cpu_task(i, spin_seconds)
    t = time.perf_counter()
    grind(grind_seconds)
    return time.perf_counter() - t
