"""Latency and size of `client.pyspy_profile()`, and event-loop blocking on workers while it runs."""

from __future__ import annotations

import asyncio
import statistics
import time

from distributed import Client, LocalCluster

import dask_pyspy
from benchmarks.common import Section, table


async def _install_lag_monitor(dask_worker) -> None:
    state = {"max": 0.0}
    dask_worker.pyspy_bench_lag = state

    async def watch() -> None:
        while True:
            t = time.perf_counter()
            await asyncio.sleep(0.005)
            state["max"] = max(state["max"], time.perf_counter() - t - 0.005)

    dask_worker.pyspy_bench_task = asyncio.ensure_future(watch())


def _reset(dask_worker) -> None:
    dask_worker.pyspy_bench_lag["max"] = 0.0


def _read(dask_worker) -> float:
    return dask_worker.pyspy_bench_lag["max"]


def _pause_sampling() -> None:
    """Stop the filling sampler (its samples stay): 16 of them at full speed would starve 2 cores."""
    dask_pyspy.sampler.process_sampler.sampler.stop()


def measure(n_workers: int, fill_seconds: float) -> list[object]:
    with LocalCluster(n_workers=n_workers, threads_per_worker=1, processes=True, dashboard_address=":0",
                      worker_dashboard_address=None) as cluster, Client(cluster) as client:
        client.register_plugin(dask_pyspy.PySpyPlugin(rate=1000, cpu_budget=1.0, idle=True))
        client.run(_install_lag_monitor)
        time.sleep(fill_seconds)
        client.run(_pause_sampling)
        client.run(_reset)
        time.sleep(1.0)
        idle_lag = max(client.run(_read).values())
        client.run(_reset)
        latencies, sizes, samples = [], [], 0
        for _ in range(3):
            t = time.perf_counter()
            prof = client.pyspy_profile(last=3600)
            latencies.append(time.perf_counter() - t)
            sizes.append(len(prof.to_wire()))
            samples = prof.n_samples
        lag = max(client.run(_read).values())
    minutes = samples / (n_workers + 1) / (100 * 4) / 60  # per process, ~4 busy threads at 100 Hz
    return [n_workers, samples, f"{minutes:.1f}", f"{statistics.median(latencies):.2f} ({min(latencies):.2f}-{max(latencies):.2f})",
            f"{statistics.median(sizes) / 2**20:.1f}", f"{1000 * idle_lag:.0f}", f"{1000 * lag:.0f}"]


def run(quick: bool) -> Section:
    fill = 20.0 if quick else 90.0
    rows = [measure(n, fill) for n in (1, 4, 16)]
    return Section(
        "Collection",
        f"Worker processes x 1 thread, sampled for {fill:.0f} s at up to 1000 Hz with idle threads kept; then "
        "sampling is paused (the stores kept) and the whole window collected 3 times, so the figures are the "
        "collection path itself on 2 cores. Loop lag is the worst delay of a 5 ms timer on any worker.",
        [table(["worker processes", "samples collected", "equivalent minutes (100 Hz x 4 threads per process)",
                "latency s, median (min-max)", "wire MiB (gzip)", "loop lag ms, idle", "loop lag ms, collecting"], rows)],
    )
