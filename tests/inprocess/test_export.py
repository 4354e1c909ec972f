"""Exports and the sampling thread: a window being built never holds sampling up."""

from __future__ import annotations

import threading
import time

from dask_pyspy import Sampler, _native


def busy(stop: threading.Event) -> None:
    while not stop.is_set():
        sum(range(2000))


def test_sampling_goes_on_while_an_export_holds_the_store():
    sampler = Sampler(rate=100, cpu_budget=1.0)
    stop = threading.Event()
    worker = threading.Thread(target=busy, args=(stop,), name="busy")
    worker.start()
    sampler.start()
    try:
        held_from = time.time()
        _native._testing.hold_store(sampler.native, 3.0)  # a slow export, GIL released
        held_to = time.time()
        # Once the store is free again, the next tick records what the held ticks took.
        ticks = sampler.stats()["ticks"]
        deadline = time.monotonic() + 60
        while sampler.stats()["ticks"] < ticks + 2:
            assert time.monotonic() < deadline, "the sampler stopped ticking"
            time.sleep(0.05)
    finally:
        sampler.stop()
        stop.set()
        worker.join()
    steps = sampled_steps(sampler, held_from + 0.5, held_to - 0.5)
    assert steps >= 2, "ticks went on while the store was held, at their own times"
    assert sampler.stats()["deferred_samples"] >= steps


def sampled_steps(sampler: Sampler, start: float, stop: float) -> int:
    """How many 0.1 s steps of [start, stop] hold samples."""
    timeline = sampler.profile(start=start, stop=stop).timeline(step=0.1)
    return sum(1 for wall in timeline["kinds"]["worker"]["wall"] if wall > 0)
