"""The stalls benchmark's servers: a scheduler and workers run as `dask` command-line
processes with distributed's tick limit lowered, each logging to a file of its own; the
functions they run to stall their loops; and their logs' "Event loop was unresponsive"
lines, each with the dask-pyspy line after it, paired with our stalls."""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Callable
from unittest import mock

from distributed import Client

import dask_pyspy
from benchmarks.process_cluster import free_port, spawn, stop_group

# distributed.admin.tick.limit in the servers: distributed logs a gap between its 20 ms
# ticks longer than this. Read when distributed.core is imported, so set in their environment.
TICK_LIMIT_S = 0.3
THRESHOLD_S = 0.2  # pyspy.stall-threshold's default
PAIRED_WITHIN_S = 0.5  # a stall of ours ended this near distributed's line is the one it measured

UNRESPONSIVE = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) - distributed\.core - \w+ - "
    r"Event loop was unresponsive in (\w+) for ([\d.]+)s"
)
EXPLAINED = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) - distributed\.core - \w+ - dask-pyspy: that (.*)$")


# ---- what the servers run (imported there by name: PYTHONPATH holds this checkout)


def hold_gil(n: int) -> float:
    """One C call that keeps the GIL: `sum` over a range. Returns its own wall seconds."""
    began = time.perf_counter()
    sum(range(n))
    return time.perf_counter() - began


def hold_gil_where(n: int) -> tuple[float, str]:
    """`hold_gil`, and the name of the executor thread that ran it."""
    return hold_gil(n), threading.current_thread().name


def sum_rate() -> float:
    """Elements a second `sum(range(n))` gets through here: the best of 3 runs of ~0.5 s,
    the one least disturbed by the rest of the machine."""
    return max(2 * 10**7 / hold_gil(2 * 10**7) for _ in range(3))


def spin(comm: Any = None, seconds: float = 1.0) -> float:
    """A handler that keeps its loop busy in Python for `seconds`; returns its own wall seconds."""
    began = time.perf_counter()
    while time.perf_counter() - began < seconds:
        pass
    return time.perf_counter() - began


def nap(comm: Any = None, seconds: float = 1.0) -> float:
    """A handler that blocks its loop in `time.sleep` (clock_nanosleep)."""
    began = time.perf_counter()
    time.sleep(seconds)
    return time.perf_counter() - began


def worker_nap(seconds: float) -> float:
    """Through `client.run`, which calls a plain function on the worker's loop."""
    return nap(None, seconds)


def add_handlers(dask_scheduler: Any) -> None:
    dask_scheduler.handlers.update(spin=spin, nap=nap)


def park(seconds: float) -> None:
    time.sleep(seconds)


# ---- the processes


@dataclass
class Servers:
    address: str
    workers: list[str]
    logs: dict[str, str]  # process name as stalls give it -> its log file


@contextlib.contextmanager
def servers(nthreads: list[int]) -> Iterator[Servers]:
    """A scheduler and a worker (no nanny) per item of `nthreads`, with that many threads."""
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    dask_cli = os.path.join(os.path.dirname(sys.executable), "dask")
    logs_dir = tempfile.mkdtemp(prefix="pyspy-stalls-")
    logs = {f"scheduler {address}": os.path.join(logs_dir, "scheduler.log")}
    procs = []
    try:
        with mock.patch.dict(os.environ, {"DASK_DISTRIBUTED__ADMIN__TICK__LIMIT": f"{TICK_LIMIT_S * 1000:.0f}ms"}):
            args = ["scheduler", "--host", "127.0.0.1", "--port", str(port), "--no-dashboard"]
            procs.append(spawn([dask_cli, *args], logs[f"scheduler {address}"]))
            for i, threads in enumerate(nthreads):
                worker_port = free_port()
                worker = f"tcp://127.0.0.1:{worker_port}"
                logs[worker] = os.path.join(logs_dir, f"worker-{i}.log")
                args = ["worker", address, "--no-nanny", "--nthreads", str(threads), "--memory-limit", "0"]
                args += ["--host", "127.0.0.1", "--worker-port", str(worker_port), "--no-dashboard"]
                procs.append(spawn([dask_cli, *args], logs[worker]))
        yield Servers(address, [w for w in logs if not w.startswith("scheduler ")], logs)
    finally:
        for proc in reversed(procs):
            stop_group(proc)
        shutil.rmtree(logs_dir, ignore_errors=True)


def wait_for(what: str, done: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:.0f} s")
        time.sleep(0.2)


def watching(client: Client) -> list[bool]:
    """Per process that samples: whether it watches its loop for stalls."""
    procs = dask_pyspy.get_profile(client, last=1.0).processes
    return [bool((p.get("stats") or {}).get("stalls", {}).get("watched")) for p in procs]


def wait_watched(client: Client, processes: int) -> None:
    def done() -> bool:
        found = watching(client)
        return len(found) >= processes and all(found)

    wait_for("the plugin watching every loop", done)


# ---- their logs


@dataclass
class Line:
    process: str
    at: float  # Unix seconds: when distributed's tick ran, at the gap's end
    seconds: float
    explained: str | None = None  # our line after it, if any


def _log_time(stamp: str) -> float:
    # distributed's log format: local time, milliseconds after a comma (record.created's clock).
    return datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def unresponsive_lines(logs: dict[str, str], since: float, until: float) -> list[Line]:
    """distributed's "Event loop was unresponsive" lines in [since, until), each with the
    dask-pyspy line that explains it: the next in time in the same log. (Ours is logged
    from another thread, and can reach the file a moment before distributed's.)"""
    out = []
    for process, path in logs.items():
        with open(path, errors="replace") as f:
            rows = f.read().splitlines()
        lines = [Line(process, _log_time(m[1]), float(m[3])) for m in map(UNRESPONSIVE.match, rows) if m]
        for m in filter(None, map(EXPLAINED.match, rows)):
            at = _log_time(m[1])
            before = [line for line in lines if line.at <= at and line.explained is None]
            if before:
                max(before, key=lambda line: line.at).explained = m[2]
        out += [line for line in lines if since <= line.at < until]
    return sorted(out, key=lambda line: line.at)


def pair(lines: list[Line], stalls: list[dict[str, Any]]) -> list[tuple[Line, dict[str, Any] | None]]:
    """Each of distributed's lines with the stall of ours in the same process that ended
    nearest to it, within PAIRED_WITHIN_S; each stall taken once."""
    taken: set[int] = set()
    out: list[tuple[Line, dict[str, Any] | None]] = []
    for line in lines:
        gaps = [
            (abs(s["start"] + s["duration"] - line.at), i)
            for i, s in enumerate(stalls)
            if i not in taken and s["process"] == line.process
        ]
        gap, i = min(gaps, default=(PAIRED_WITHIN_S + 1, -1))
        if gap <= PAIRED_WITHIN_S:
            taken.add(i)
        out.append((line, stalls[i] if gap <= PAIRED_WITHIN_S else None))
    return out
