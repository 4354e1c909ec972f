"""Achieved versus requested sampling rate, and how the CPU budget throttles."""

from __future__ import annotations

import threading
import time

from benchmarks.common import Section, table
from dask_pyspy import Sampler


def busy(stop: threading.Event) -> None:
    while not stop.is_set():
        sum(range(500))


def achieved(rate: float, threads: int, budget: float, seconds: float) -> dict[str, float]:
    stop = threading.Event()
    pool = [threading.Thread(target=busy, args=(stop,), daemon=True) for _ in range(threads)]
    for t in pool:
        t.start()
    s = Sampler(rate=rate, cpu_budget=budget)
    s.start()
    time.sleep(seconds)
    s.stop()
    stop.set()
    for t in pool:
        t.join()
    return s.stats()


def run(quick: bool) -> Section:
    seconds = 2.0 if quick else 5.0
    rows = []
    for budget in (1.0, 0.02):
        for threads in (1, 2, 8):
            for rate in (10, 100, 1000):
                st = achieved(rate, threads, budget, seconds)
                rows.append([f"{budget:g}", threads, rate, f"{st['achieved_rate']:.1f}",
                             f"{100 * (st['achieved_rate'] / rate - 1):+.1f}%",
                             f"{100 * st['cpu_fraction']:.2f}%", f"{100 * st['throttled_ticks'] / max(st['ticks'], 1):.0f}%"])
    return Section(
        "Rate fidelity",
        "A bare process with busy Python threads; budget 1.0 never throttles, 0.02 is the default.",
        [table(["cpu budget", "busy threads", "requested Hz", "achieved Hz", "error", "sampler CPU (of one core)",
                "throttled ticks"], rows)],
    )
