"""CPU time per sample versus threads x stack depth, with and without line numbers."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

from benchmarks.common import Section, table
from dask_pyspy import Sampler


def _hold(depth: int, ready: threading.Barrier, stop: threading.Event) -> None:
    if depth:
        return _hold(depth - 1, ready, stop)
    ready.wait()
    stop.wait()


def sampler_thread_times() -> tuple[float, float]:
    """(user, system) seconds of this process's sampling thread, from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            if f.read().strip().startswith("dask-pyspy-sam"):
                with open(f"/proc/self/task/{tid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                return int(fields[11]) / tick, int(fields[12]) / tick
    return 0.0, 0.0


def measure(threads: int, depth: int, lines: bool, seconds: float) -> dict[str, float]:
    """Sample `threads` parked threads, each `depth` frames deep; cost per tick and per frame."""
    stop = threading.Event()
    ready = threading.Barrier(threads + 1)
    pool = [threading.Thread(target=_hold, args=(depth, ready, stop), daemon=True) for _ in range(threads)]
    for t in pool:
        t.start()
    ready.wait()
    s = Sampler(rate=200, idle=True, cpu_budget=1.0, lines=lines)
    s.start()
    time.sleep(seconds)
    user, system = sampler_thread_times()
    s.stop()
    stop.set()
    for t in pool:
        t.join()
    stats = s.stats()
    doc = s.profile().speedscope()
    frames = sum(len(p["samples"][0]) for p in doc["profiles"] if p["samples"])
    per_tick = stats["cpu_s"] / max(stats["ticks"], 1)
    return {
        "frames": frames,
        "us_per_tick": 1e6 * per_tick,
        "us_per_frame": 1e6 * per_tick / max(frames, 1),
        "system_share": system / max(user + system, 1e-9),
        "ticks": stats["ticks"],
    }


CHILD = """
import threading, time, sys
sys.path.insert(0, {root!r})
from benchmarks.sample_cost import measure
r = measure({threads}, {depth}, True, 2.0)
print("FRAMES", r["frames"], "TICKS", r["ticks"])
"""


def readv_calls_per_frame(threads: int, depth: int) -> str:
    """process_vm_readv calls per frame read, counted by strace in a child process."""
    strace = shutil.which("strace")
    if strace is None:
        return "strace not installed"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.NamedTemporaryFile(suffix=".txt") as out:
        done = subprocess.run(
            [strace, "-f", "-c", "-e", "trace=process_vm_readv", "-o", out.name, sys.executable, "-c",
             CHILD.format(root=root, threads=threads, depth=depth)],
            capture_output=True, text=True, timeout=120,
        )
        report = open(out.name).read()
    counted = re.search(r"FRAMES (\d+) TICKS (\d+)", done.stdout)
    calls = re.search(r"^\s*[\d.]+\s+[\d.]+\s+\d+\s+(\d+)\s+(?:\d+\s+)?process_vm_readv", report, re.M)
    if not (counted and calls):
        return f"not measured: {done.stderr[-200:]!r}"
    frames, ticks = int(counted.group(1)), int(counted.group(2))
    return f"{int(calls.group(1)) / ticks / frames:.1f}"


def run(quick: bool) -> Section:
    seconds = 1.0 if quick else 3.0
    rows = []
    for threads, depth in [(1, 5), (4, 25), (9, 50), (16, 50)] + ([] if quick else [(32, 50), (65, 50)]):
        on = measure(threads, depth, True, seconds)
        off = measure(threads, depth, False, seconds)
        rows.append([threads, depth, on["frames"], f"{on['us_per_tick']:.0f}", f"{on['us_per_frame']:.1f}",
                     f"{off['us_per_frame']:.1f}", f"{100 * (1 - off['us_per_tick'] / on['us_per_tick']):.0f}%",
                     f"{100 * on['system_share']:.0f}%"])
    readv = readv_calls_per_frame(4, 25)
    return Section(
        "Sample cost",
        "Threads parked `depth` frames deep, sampled at 200 Hz with idle threads kept and no budget. "
        "Cost is the sampling thread's CPU clock per tick; frames per tick include the main thread.",
        [table(["threads", "depth", "frames/tick", "us/tick", "us/frame (lines)", "us/frame (no lines)",
                "saved without lines", "system time share"], rows)],
        [f"process_vm_readv calls per frame (strace -c, 4 threads x 25 deep): {readv}",
         "Almost all of the cost is system time: py-spy copies each frame, code object, name, "
         "filename and line table out of our own memory with one syscall each. A reader that "
         "dereferences pointers directly would remove the syscalls but could fault on a torn read "
         "(a frame freed mid-read) and take the process down, which process_vm_readv turns into EFAULT."],
    )
