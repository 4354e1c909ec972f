"""The collection benchmark's load: a task stream kept full from a background thread, and the
workers' samplers run until each store holds TARGET samples, then paused."""

from __future__ import annotations

import random
import threading
import time
from typing import Any

from distributed import Client, Future

import dask_pyspy
from benchmarks.process_cluster import N_WORKERS, THREADS
from benchmarks.stacks import PREFIXES, TASKS
from benchmarks.stacks import VARIANTS as PATHS_PER_PREFIX

TARGET = 240_000  # samples per worker: 10 minutes at 100 Hz x 4 busy threads
IN_FLIGHT = 8 * N_WORKERS * THREADS  # tasks kept queued or running: the scheduler never runs dry


class TaskStream:
    """Keeps IN_FLIGHT tasks queued or running, from a background thread: of 50-300 ms
    while filling, longer (`pace`) while measuring, so dask's own work per task leaves the
    2 cores room and a stall is the collection's, not the load's."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.seconds = (0.05, 0.3)
        self.finished = self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="task-stream", daemon=True)

    def __enter__(self) -> TaskStream:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        rng = random.Random(0)
        futures: set[Future] = set()
        while not self._stop.is_set():
            done = {f for f in futures if f.done()}
            self.finished += len(done)
            self.errors += sum(f.status == "error" for f in done)
            futures -= done
            batch: dict[str, list[tuple[int, float]]] = {}
            for _ in range(IN_FLIGHT - len(futures)):
                batch.setdefault(rng.choice(PREFIXES), []).append(
                    (rng.randrange(PATHS_PER_PREFIX), rng.uniform(*self.seconds))
                )
            for prefix, args in batch.items():
                variants, seconds = zip(*args)
                futures.update(self.client.map(TASKS[prefix], variants, seconds, pure=False))
            self._stop.wait(0.05)
        self.client.cancel(list(futures))


# --- the samplers ---


def _store() -> dict[str, Any]:
    st = dask_pyspy.sampler.process_sampler.sampler.stats()
    return {
        "held": st["store"]["samples_held"],
        "evicted": st["store"]["samples_evicted"],
        "bytes": st["store"]["bytes"],
        "hz": st["achieved_rate"],
    }


def _pause() -> None:
    dask_pyspy.sampler.process_sampler.sampler.stop()  # its samples stay in the store


def fill(client: Client, deadline: float) -> tuple[float, dict[str, dict[str, Any]]]:
    """Sample until every worker holds TARGET samples or `deadline` s pass, pausing each
    sampler as its store gets there (they sample at different rates), then the rest."""
    began = time.perf_counter()
    paused: set[str] = set()
    while True:
        stores = client.run(_store)
        held = min(s["held"] for s in stores.values())
        print(
            f"\r  filling: {time.perf_counter() - began:.0f} s, {held:,} samples in the emptiest store",
            end="",
            flush=True,
        )
        full = [w for w, s in stores.items() if s["held"] >= TARGET and w not in paused]
        if full:
            client.run(_pause, workers=full)
            paused.update(full)
        if len(paused) == len(stores) or time.perf_counter() - began > deadline:
            break
        time.sleep(0.5)
    print()
    client.run(_pause)
    client.run_on_scheduler(_pause)
    return time.perf_counter() - began, client.run(_store)
