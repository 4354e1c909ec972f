"""One run of the bias benchmark, in its own process (see bias.py): prints JSON. Its
alternating workload is also the bias test's.

Imports only dask_pyspy and the standard library, so it runs under another build's
interpreter too (the side-by-side baseline).
"""

from __future__ import annotations

import json
import sys
import threading
import time

from dask_pyspy import Sampler


def leaf(x: int) -> int:
    return x + 1


def mid(x: int) -> int:
    return leaf(x) + leaf(x)


def churny(until: float) -> None:
    """Many small calls: the stack changes every few hundred nanoseconds."""
    x = 0
    while time.perf_counter() < until:
        for _ in range(10):
            x = mid(x) & 0xFFFF


def steady(until: float) -> None:
    """One frame, a plain loop."""
    x = 0
    while time.perf_counter() < until:
        for _ in range(50):
            x += 1


def alternate(period: float, share: float, truth: dict[str, float], stop: threading.Event) -> None:
    """Churny for `share` of each period, steady for the rest; keeps its own account
    of the time each got."""
    now = time.perf_counter()
    while not stop.is_set():
        churny(now + share * period)
        then = time.perf_counter()
        truth["churny"] += then - now
        steady(then + (1 - share) * period)
        now = time.perf_counter()
        truth["steady"] += now - then


def sampled(doc: dict, thread: str) -> dict[str, float]:
    """Seconds the samples of `thread` give to each function."""
    names = [f["name"] for f in doc["shared"]["frames"]]
    out = {"churny": 0.0, "steady": 0.0}
    for prof in doc["profiles"]:
        if f" {thread} (" not in prof["name"]:
            continue
        scale = {"microseconds": 1e-6, "milliseconds": 1e-3, "seconds": 1.0, "nanoseconds": 1e-9}[prof["unit"]]
        for stack, weight in zip(prof["samples"], prof["weights"]):
            for fn in ("churny", "steady"):
                if any(names[i].endswith(fn) for i in stack):
                    out[fn] += weight * scale
    return out


def main(rate: float, periods: float, share: float, threads: int, seconds: float, native: bool = False) -> dict:
    stop = threading.Event()
    truths = [{"churny": 0.0, "steady": 0.0} for _ in range(threads)]
    period = periods / rate
    pool = [
        threading.Thread(target=alternate, args=(period, share, truths[i], stop), name=f"alt-{i}")
        for i in range(threads)
    ]
    for t in pool:
        t.start()
    time.sleep(0.5)  # past the threads' start
    for truth in truths:
        truth.update(churny=0.0, steady=0.0)
    # idle=True: a thread waiting for the GIL is sampled where it waits, as its own account counts it.
    # native only when asked: a baseline build may not know the option.
    s = Sampler(rate=rate, idle=True, cpu_budget=1.0, **({"native": True} if native else {}))
    s.start()
    time.sleep(seconds)
    s.stop()
    stop.set()
    for t in pool:
        t.join()
    doc = s.profile().speedscope()
    stats = s.stats()
    return {
        "threads": [{"truth": truths[i], "sampled": sampled(doc, f"alt-{i}")} for i in range(threads)],
        "reader": stats["reader"],
        "reader_stats": stats["reader_stats"],
        "achieved_rate": stats["achieved_rate"],
        "native": stats.get("native"),
    }


if __name__ == "__main__":
    args = json.loads(sys.argv[1])
    print(json.dumps(main(**args)))
