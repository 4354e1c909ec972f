"""Heavy native work runs at a lower priority than the event loop, and only the part
without the GIL: the threads holding the GIL around it keep the loop's priority."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from pathlib import Path

import pytest

from dask_pyspy import Sampler
from dask_pyspy._loop import off_loop
from dask_pyspy._native import _testing

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="only Linux sets nice per thread")

NICE = 10  # rust/priority.rs


def nice_here() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def heavy_thread_nices(stop: threading.Event, seen: list[int]) -> None:
    """Polls this process's threads for the native core's heavy one, and its nice."""
    while not stop.is_set():
        for task in Path("/proc/self/task").iterdir():
            try:
                if (task / "comm").read_text().strip() == "pyspy-heavy":
                    seen.append(os.getpriority(os.PRIO_PROCESS, int(task.name)))
            except OSError:  # the thread ended while we looked
                pass
        time.sleep(0.001)


def test_exports_run_nicer_and_the_pool_keeps_the_loops_priority():
    sampler = Sampler(rate=200, idle=True)
    sampler.start()
    try:
        deadline = time.time() + 60
        while sampler.stats()["store"]["samples_held"] < 20 and time.time() < deadline:
            sum(range(10_000))
        recorded = sampler.profile(0, time.time())
    finally:
        sampler.stop()
    # An hour at 100 Hz of those samples: an export long enough to be seen.
    _testing.replay(sampler._native, recorded._native, time.time() - 3600, 3600, 100)

    seen: list[int] = []
    stop = threading.Event()
    watcher = threading.Thread(target=heavy_thread_nices, args=(stop, seen))
    watcher.start()
    try:
        deadline = time.time() + 120
        while not seen and time.time() < deadline:
            sampler._native.export((0, time.time()), False, "here")
    finally:
        stop.set()
        watcher.join()

    loop_nice = nice_here()
    assert seen, "no export thread was seen in 120 s"
    assert set(seen) == {min(19, loop_nice + NICE)}
    assert nice_here() == loop_nice
    assert asyncio.run(off_loop(nice_here)) == loop_nice
