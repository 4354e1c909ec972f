"""Store size and RSS over a long, compressed-in-time run; the built-in profiler for comparison."""

from __future__ import annotations

import itertools
import threading
import time

import dask
from distributed import Client, LocalCluster

import dask_pyspy
from benchmarks.common import Section, table
from benchmarks.workload import cpu_task
from dask_pyspy import Sampler


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))
    return kb / 1024


def _steady(stop: threading.Event, depth: int) -> None:
    if depth:
        return _steady(stop, depth - 1)
    while not stop.is_set():
        time.sleep(0.001)


def _churn(sampler: Sampler, stop: threading.Event) -> None:
    """Short-lived threads, each running 'tasks' with keys never seen before."""
    counter = itertools.count()

    def short_life() -> None:
        ident = threading.get_ident()
        for _ in range(5):
            sampler.set_thread_tag(ident, f"('task-{next(counter)}', 0)", "task")
            time.sleep(0.01)
            sampler.clear_thread_tag(ident)

    while not stop.is_set():
        t = threading.Thread(target=short_life, name=f"churn-{next(counter)}")
        t.start()
        t.join()


def long_run(seconds: float, churn: bool, max_memory: int) -> list[list[object]]:
    stop = threading.Event()
    s = Sampler(rate=2000, idle=True, cpu_budget=1.0, max_memory=max_memory)
    # Shallow stacks make ticks cheap, so more samples (hours of 100 Hz) fit in the run.
    workers = [threading.Thread(target=_steady, args=(stop, 2), daemon=True) for _ in range(8)]
    if churn:
        workers.append(threading.Thread(target=_churn, args=(s, stop), daemon=True))
    for t in workers:
        t.start()
    s.start()
    rows = []
    began = time.time()
    for mark in (0.25, 0.5, 0.75, 1.0):
        time.sleep(max(0.0, began + mark * seconds - time.time()))
        st = s.stats()
        hours = st["store"]["samples_recorded"] / (100 * 8 * 3600)
        rows.append(
            [
                f"{'yes' if churn else 'no'}",
                f"{time.time() - began:.0f}",
                f"{hours:.2f}",
                st["store"]["samples_held"],
                st["store"]["samples_evicted"],
                st["store"]["compactions"],
                f"{st['store']['bytes'] / 2**20:.1f}",
                f"{rss_mib():.0f}",
            ]
        )
    s.stop()
    stop.set()
    return rows


def worker_growth(seconds: float, builtin: bool) -> list[object]:
    """A worker busy for `seconds`: its RSS growth with the built-in profiler or with dask-pyspy."""
    config = {"distributed.worker.profile.enabled": builtin, "distributed.worker.profile.interval": "10ms"}
    with (
        dask.config.set(config),
        LocalCluster(n_workers=1, threads_per_worker=2, processes=True, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        if not builtin:
            client.register_plugin(dask_pyspy.PySpyPlugin())

        def rss():
            return next(iter(client.run(lambda: __import__("psutil").Process().memory_info().rss).values())) / 2**20

        before = rss()
        began = time.time()
        i = 0
        while time.time() - began < seconds:
            client.gather(client.map(cpu_task, range(i, i + 50), [0.01] * 50))
            i += 50
        after = rss()
    return [
        "built-in profiler (10 ms)" if builtin else "dask-pyspy (defaults)",
        f"{before:.0f}",
        f"{after:.0f}",
        f"{after - before:+.0f}",
    ]


def run(quick: bool) -> Section:
    seconds = 60.0 if quick else 600.0
    cap = 4 * 2**20 if quick else 64 * 2**20
    rows = long_run(seconds, False, cap) + long_run(seconds, True, cap)
    growth = [worker_growth(seconds / 2, True), worker_growth(seconds / 2, False)]
    return Section(
        "Memory",
        f"8 threads a few frames deep, sampled at up to 2000 Hz with idle threads kept, for {seconds:.0f} s; "
        f"store cap {cap // 2**20} MiB. 'Hours' = samples recorded / (100 Hz x 8 threads x 3600 s).",
        [
            table(
                [
                    "thread churn + new task keys",
                    "s",
                    "equivalent hours at 100 Hz x 8 threads",
                    "samples held",
                    "samples evicted",
                    "table compactions",
                    "store MiB",
                    "process RSS MiB",
                ],
                rows,
            ),
            table(["worker busy for %.0f s with" % (seconds / 2), "RSS MiB before", "after", "growth"], growth),
        ],
    )
