"""The stalls benchmark's runs on clusters: stalls provoked one at a time on the servers
of stalls_servers.py, tasks started on an executor that has no thread yet, a small-tasks
workload, and an idle LocalCluster; what our stalls and distributed's lines were."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

from distributed import Client, LocalCluster

import dask_pyspy
from benchmarks.stalls.stalls_servers import (
    Line,
    Servers,
    add_handlers,
    hold_gil,
    hold_gil_where,
    park,
    servers,
    sum_rate,
    unresponsive_lines,
    wait_watched,
    worker_nap,
)
from benchmarks.workload import tiny

LENGTHS_S = (0.4, 0.7, 1.0, 1.5, 2.0, 3.0)
COLD_THREADS = 4  # the second worker's, started one by one by GIL-holding tasks
GAP_S = 1.0  # between two provoked stalls, so that they stay apart
# distributed's line comes at its loop's next tick, and ours up to 2 s after it (FIND_FOR_S).
SETTLE_S = 2.5
KINDS = (
    "worker task holding the GIL",
    "worker handler blocked in sleep",
    "scheduler handler spinning",
    "scheduler handler blocked in sleep",
)


@dataclass
class Provoked:
    kind: str
    asked: float
    process: str
    began: float
    ended: float
    own: float  # the provoking code's own wall seconds
    key: str | None = None
    stalls: list[dict[str, Any]] = field(default_factory=list)  # ours overlapping it


@dataclass
class Observed:
    """Our stalls and distributed's lines in one stretch of the run."""

    stalls: list[dict[str, Any]]
    lines: list[Line]


@dataclass
class Runs:
    rate: float  # the first worker's `sum(range(n))` elements a second
    cold: list[dict[str, Any]]
    provoked: list[Provoked]
    during: Observed  # the provoked stalls'
    small: int
    small_s: float
    small_seen: Observed


def provoke(client: Client, cluster: Servers, kind: str, seconds: float, rate: float, i: int) -> Provoked:
    worker = cluster.workers[0]
    scheduler = f"scheduler {cluster.address}"
    began = time.time()
    key = None
    if kind == KINDS[0]:
        key = f"hold_gil-{i}"
        own, process = client.submit(hold_gil, int(seconds * rate), key=key, workers=[worker]).result(), worker
    elif kind == KINDS[1]:
        own, process = client.run(worker_nap, seconds, workers=[worker])[worker], worker
    else:
        op = "spin" if kind == KINDS[2] else "nap"
        own, process = client.sync(_scheduler_op(client, op), seconds=seconds), scheduler
    return Provoked(kind, seconds, process, began, time.time(), own, key)


def _scheduler_op(client: Client, op: str) -> Callable[..., Any]:
    assert client.scheduler is not None, "connected"
    return getattr(client.scheduler, op)


def overlapping(stalls: list[dict[str, Any]], process: str, began: float, ended: float) -> list[dict[str, Any]]:
    return [s for s in stalls if s["process"] == process and s["start"] < ended and s["start"] + s["duration"] > began]


def observe(client: Client, cluster: Servers, since: float, until: float) -> Observed:
    """Our stalls that began in [since, until), and distributed's lines up to 1 s after."""
    time.sleep(SETTLE_S)
    ours = [s for s in dask_pyspy.get_stalls(client, start=since, limit=None) if s["start"] < until]
    return Observed(ours, unresponsive_lines(cluster.logs, since, until + 1))


def cold_threads(client: Client, worker: str, threads: int, rate: float) -> list[dict[str, Any]]:
    """1 s GIL-holding tasks, one at a time, on a worker whose executor has no thread yet:
    each of the first `threads` starts one (distributed's executor adds a thread per submit
    up to its size; the loop waits in `Thread.start`), the last runs on a started one."""
    out = []
    for i in range(threads + 1):
        time.sleep(GAP_S)
        began = time.time()
        key = f"hold_gil-cold-{i}"
        own, ran_on = client.submit(hold_gil_where, int(rate), key=key, workers=[worker]).result()
        ended = time.time()
        time.sleep(GAP_S)
        found = overlapping(dask_pyspy.get_stalls(client, start=began - 1, limit=None), worker, began, ended)
        thread = "started for it" if i < threads else "already started"
        out.append({"key": key, "own": own, "thread": thread, "ran_on": ran_on, "stalls": found})
    return out


def provoke_all(client: Client, cluster: Servers, rate: float, rounds: int) -> tuple[list[Provoked], Observed]:
    """Each kind at each length, `rounds` times, GAP_S apart."""
    t0 = time.time()
    provoked: list[Provoked] = []
    for r in range(rounds):
        for seconds in LENGTHS_S:
            for kind in KINDS:
                print(f"  round {r + 1}/{rounds}: {kind}, {seconds} s", flush=True)
                provoked.append(provoke(client, cluster, kind, seconds, rate, len(provoked)))
                time.sleep(GAP_S)
    seen = observe(client, cluster, t0, time.time())
    for p in provoked:
        p.stalls = overlapping(seen.stalls, p.process, p.began, p.ended)
    return provoked, seen


def run_on_servers(quick: bool) -> Runs:
    """Targets 1-4, and 5's small tasks, on one cluster of command-line processes."""
    with servers([2, COLD_THREADS]) as cluster, Client(cluster.address, timeout=60) as client:
        client.wait_for_workers(2, timeout=120)
        client.register_plugin(dask_pyspy.PySpyPlugin())
        client.run_on_scheduler(add_handlers)
        wait_watched(client, 3)
        worker = cluster.workers[0]
        rate = client.submit(sum_rate, pure=False, workers=[worker]).result()
        # Both executor threads started: a task on a thread the worker starts for it is another case.
        client.gather([client.submit(park, 0.3, pure=False, workers=[worker]) for _ in range(2)])
        cold = cold_threads(client, cluster.workers[1], COLD_THREADS, rate)
        time.sleep(GAP_S)
        provoked, during = provoke_all(client, cluster, rate, 1 if quick else 3)

        small = 5_000 if quick else 20_000
        time.sleep(GAP_S)
        since = time.time()
        began = time.perf_counter()
        client.gather(client.map(tiny, range(small), pure=False))
        small_s = time.perf_counter() - began
        time.sleep(GAP_S)
        small_seen = observe(client, cluster, since, time.time())
    return Runs(rate, cold, provoked, during, small, small_s, small_seen)


def idle_cluster(seconds: float) -> dict[str, Any]:
    """Target 5's first part: the stalls of a LocalCluster left alone with the plugin."""
    with (
        LocalCluster(n_workers=2, threads_per_worker=2, processes=True, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        client.register_plugin(dask_pyspy.PySpyPlugin())
        wait_watched(client, 3)
        start = time.time()
        time.sleep(seconds)
        stop = time.time()
        found = dask_pyspy.get_stalls(client, start=start, stop=stop, limit=None)
        processes = len(dask_pyspy.get_profile(client, start=stop - 1.0, stop=stop).processes)
    return {"seconds": stop - start, "stalls": found, "processes": processes}
