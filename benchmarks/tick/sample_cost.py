"""CPU time per sample versus threads x stack depth, per reader, with and without line numbers."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator

from benchmarks import ROOT
from benchmarks.common import READERS, Section, sampler_tid, table, verdict
from dask_pyspy import Sampler

# Frames of a parked thread besides _hold's: Thread._bootstrap, _bootstrap_inner, run; Event.wait, Condition.wait.
OTHER_FRAMES = 5
TARGET = (10, 40)  # issue 9: threads x frames, lines on


def _hold(frames: int, ready: threading.Barrier, stop: threading.Event) -> None:
    if frames > 1:
        return _hold(frames - 1, ready, stop)
    ready.wait()
    stop.wait()


@contextlib.contextmanager
def parked(threads: int, depth: int) -> Iterator[None]:
    """`threads` threads parked `depth` Python frames deep."""
    stop = threading.Event()
    ready = threading.Barrier(threads + 1)
    pool = [
        threading.Thread(target=_hold, args=(depth - OTHER_FRAMES, ready, stop), daemon=True) for _ in range(threads)
    ]
    for t in pool:
        t.start()
    ready.wait()
    try:
        yield
    finally:
        stop.set()
        for t in pool:
            t.join()


def sampler_thread_times() -> tuple[float, float]:
    """(user, system) seconds of this process's sampling thread, from /proc."""
    tick, tid = os.sysconf("SC_CLK_TCK"), sampler_tid()
    if tid is None:
        return 0.0, 0.0
    with open(f"/proc/self/task/{tid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) / tick, int(fields[12]) / tick


def measure(reader: str, lines: bool, seconds: float, rate: float = 200) -> dict[str, float]:
    """Sample this process's threads for `seconds`; cost per tick and per frame."""
    s = Sampler(rate=rate, idle=True, cpu_budget=1.0, lines=lines, reader=reader)
    s.start()
    time.sleep(seconds)
    user, system = sampler_thread_times()
    s.stop()
    stats = s.stats()
    assert stats["reader"] == reader, stats["reader_stats"]
    doc = s.profile().speedscope()
    frames = sum(len(p["samples"][0]) for p in doc["profiles"] if p["samples"])
    per_tick = stats["cpu_s"] / max(stats["ticks"], 1)
    return {
        "frames": frames,
        "us_per_tick": 1e6 * per_tick,
        "us_per_frame": 1e6 * per_tick / max(frames, 1),
        # /proc counts in clock ticks (10 ms): too few of them say nothing.
        "system_share": system / (user + system) if user + system >= 0.2 else float("nan"),
        "ticks": stats["ticks"],
    }


CHILD = """
import sys
sys.path.insert(0, {root!r})
from benchmarks.tick.sample_cost import measure, parked
with parked({threads}, {depth}):
    r = measure({reader!r}, True, 2.0)
print("FRAMES", r["frames"], "TICKS", r["ticks"])
"""


def readv_calls(reader: str, threads: int, depth: int) -> list[str]:
    """process_vm_readv calls per tick and per frame, counted by strace in a child process."""
    strace = shutil.which("strace")
    if strace is None:
        return ["strace not installed", "-"]
    with tempfile.NamedTemporaryFile(suffix=".txt") as out:
        done = subprocess.run(
            [
                strace,
                "-f",
                "-c",
                "-e",
                "trace=process_vm_readv",
                "-o",
                out.name,
                sys.executable,
                "-c",
                CHILD.format(root=ROOT, threads=threads, depth=depth, reader=reader),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        report = open(out.name).read()
    counted = re.search(r"FRAMES (\d+) TICKS (\d+)", done.stdout)
    calls = re.search(r"^\s*[\d.]+\s+[\d.]+\s+\d+\s+(\d+)\s+(?:\d+\s+)?process_vm_readv", report, re.M)
    if not (counted and calls):
        return [f"not measured: {done.stderr[-200:]!r}", "-"]
    per_tick = int(calls.group(1)) / int(counted.group(2))
    return [f"{per_tick:.1f}", f"{per_tick / int(counted.group(1)):.2f}"]


def run(quick: bool) -> Section:
    seconds = 1.0 if quick else 3.0
    rows = []
    for threads, depth in [(1, 10), (4, 25), TARGET, (16, 50)] + ([] if quick else [(32, 50), (65, 50)]):
        with parked(threads, depth):
            cost = {reader: (measure(reader, True, seconds), measure(reader, False, seconds)) for reader in READERS}
            if (threads, depth) == TARGET:
                by_rate = {rate: measure("fast", True, seconds, rate)["us_per_tick"] for rate in (100, 1000)}
                target = cost
        for reader, (on, off) in cost.items():
            ratio = cost["pyspy"][0]["us_per_tick"] / on["us_per_tick"]
            rows.append(
                [
                    threads,
                    depth,
                    reader,
                    on["frames"],
                    f"{on['us_per_tick']:.0f}",
                    f"{on['us_per_frame']:.2f}",
                    f"{off['us_per_frame']:.2f}",
                    f"{100 * (1 - off['us_per_tick'] / on['us_per_tick']):.0f}%",
                    f"{100 * on['system_share']:.0f}%".replace("nan%", "-"),
                    "-" if reader == "pyspy" else f"{ratio:.0f}x",
                ]
            )
    readv = [[reader, *readv_calls(reader, *TARGET)] for reader in READERS]
    fast_us = target["fast"][0]["us_per_tick"]
    ratio = target["pyspy"][0]["us_per_tick"] / fast_us
    return Section(
        "Sample cost",
        "Threads parked `depth` Python frames deep (all of each thread's frames), sampled at 200 Hz with idle "
        "threads kept and no budget, by each reader in turn on the same threads. Cost is the sampling thread's "
        "CPU clock per tick; frames per tick include the main thread.",
        [
            table(
                [
                    "threads",
                    "depth",
                    "reader",
                    "frames/tick",
                    "us/tick",
                    "us/frame (lines)",
                    "us/frame (no lines)",
                    "saved without lines",
                    "system time share",
                    "cheaper than pyspy",
                ],
                rows,
            ),
            table(
                [
                    "reader",
                    f"process_vm_readv calls per tick ({TARGET[0]} threads x {TARGET[1]} frames, strace -c)",
                    "per frame",
                ],
                readv,
            ),
        ],
        [
            f"Target (issue 9), {TARGET[0]} threads x {TARGET[1]} frames, lines on: fast <= 100 us per tick and >= 30x "
            f"below pyspy. Measured {fast_us:.0f} us, {ratio:.0f}x: {verdict(fast_us <= 100 and ratio >= 30)}.",
            f"The fast reader's cost per tick grows with the time between ticks (caches go cold): same threads at "
            f"100 Hz {by_rate[100]:.0f} us, at 1000 Hz {by_rate[1000]:.0f} us.",
            "py-spy's reader copies each frame, code object, name, filename and line table with one syscall each. "
            "The fast reader copies each thread's live stack chunk in one batched call and caches code objects by "
            "address, so its cost is the few syscalls per tick plus walking frames in a local copy.",
        ],
    )
