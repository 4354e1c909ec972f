"""One run of the export-lateness benchmark with this interpreter's own dask_pyspy
(run from outside the checkout): prints JSON. Argument: JSON with `history_s`,
`export_s` and `stress` (CPU hogs beside it, 0 for none)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
from typing import Any

from dask_pyspy import Profile, Sampler, _native

RATE = 100


def level(n: int, width: int, stop: threading.Event) -> None:
    """Call paths of `width` ways at each of `n` levels: many distinct stacks."""
    if n:
        return [level0, level1, level2][int(time.perf_counter() * 1e4) % width](n - 1, width, stop)
    end = time.perf_counter() + 0.002
    while time.perf_counter() < end:
        pass


def level0(n: int, width: int, stop: threading.Event) -> None:
    level(n, width, stop)


def level1(n: int, width: int, stop: threading.Event) -> None:
    level(n, width, stop)


def level2(n: int, width: int, stop: threading.Event) -> None:
    level(n, width, stop)


def work(depth: int, stop: threading.Event) -> None:
    while not stop.is_set():
        level(depth, 3, stop)


def source() -> Profile:
    """Real samples of four threads on many call paths, to replay as history."""
    sampler = Sampler(rate=200, cpu_budget=1.0)
    stop = threading.Event()
    threads = [threading.Thread(target=work, args=(8 + i, stop)) for i in range(4)]
    sampler.start()
    for t in threads:
        t.start()
    time.sleep(3)
    stop.set()
    for t in threads:
        t.join()
    sampler.stop()
    return sampler.profile()


def lateness_over(sampler: Sampler, seconds: float) -> dict[str, Any]:
    """The sampler's tick lateness after `seconds` (its last 1,024 ticks)."""
    time.sleep(seconds)
    return sampler.stats()["tick_lateness_s"]


def main() -> None:
    args = json.loads(sys.argv[1])
    now = time.time()
    sampler = Sampler(rate=RATE, cpu_budget=0.5)
    _native._testing.replay(sampler.native, source()._native, now - args["history_s"], args["history_s"], RATE)
    store = sampler.stats()["store"]
    hogs = None
    if args["stress"] and shutil.which("stress-ng"):
        hogs = subprocess.Popen(["stress-ng", "--cpu", str(args["stress"]), "--quiet", "--timeout", "600s"])
    try:
        sampler.start()
        # 10.24 s of ticks fill the lateness record: first without exports, then during them.
        quiet = lateness_over(sampler, 11)
        done = threading.Event()
        took: list[float] = []

        def export() -> None:
            for i in range(10**6):
                if done.is_set():
                    break
                began = time.perf_counter()
                sampler.export(now - args["history_s"] - 60, time.time(), bool(i % 2), "bench", {}, {})
                took.append(time.perf_counter() - began)

        exporter = threading.Thread(target=export)
        exporter.start()
        during = lateness_over(sampler, args["export_s"])
        done.set()
        exporter.join()
        stats = sampler.stats()
    finally:
        sampler.stop()
        if hogs:
            hogs.kill()
            hogs.wait()
    result = {
        "store": {k: store[k] for k in ("samples_held", "folded_held", "bytes")},
        "quiet": quiet,
        "during": during,
        "exports": len(took),
        "export_s": sorted(took)[len(took) // 2] if took else None,
        "interval_s": 1 / RATE,
        "rate": stats["achieved_rate"],
        "stress": bool(hogs),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
