"""What a process holds (descriptors, threads), before and after our servers ran in
it. Each scenario runs in a fresh interpreter, so the counts are the process's own:
`python -m tests.cluster.traces SCENARIO` prints them as JSON."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import dask
from distributed import Client, Scheduler, Worker

PRELOADS = {"distributed.scheduler.preload": ["dask_pyspy"], "distributed.worker.preload": ["dask_pyspy"]}
DEADLINE_S = 30.0


def each(folder: str, read: Callable[[str], str]) -> list[str]:
    """`read` of each entry of a /proc folder, skipping those gone since it was listed."""
    out = []
    for name in os.listdir(folder):
        try:
            out.append(read(f"{folder}/{name}"))
        except FileNotFoundError:
            pass
    return out


def thread_names() -> list[str]:
    """Every thread of the process, Python's or not, by its kernel name."""
    return each("/proc/self/task", lambda task: Path(task, "comm").read_text().strip())


def fds() -> list[str]:
    """Where each open descriptor of the process points."""
    return each("/proc/self/fd", os.readlink)


def python_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate())


def thread_files() -> list[str]:
    """Descriptors on some thread's /proc files, of threads alive or not."""
    return [f for f in fds() if "/task/" in f]


def counts() -> dict[str, int]:
    gc.collect()
    return {"fds": len(fds()), "threads": len(thread_names())}


def steady() -> dict[str, int]:
    """The counts once unchanged for half a second (threads and files of servers just
    closed take a moment to go), or as they are at the deadline."""
    deadline = time.monotonic() + DEADLINE_S
    last = counts()
    while time.monotonic() < deadline:
        time.sleep(0.5)
        if (now := counts()) == last:
            break
        last = now
    return last


def settled(expected: dict[str, int], keys: tuple[str, ...] = ("fds", "threads")) -> dict[str, int]:
    """The counts once at `expected` in `keys`, or as they are at the deadline."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        now = counts()
        if all(now[k] == expected[k] for k in keys) or time.monotonic() >= deadline:
            return now
        time.sleep(0.1)


async def run_cluster(preload: bool, end: str) -> dict[str, Any]:
    """A scheduler and a worker in this process run a task; the worker closes, the
    scheduler closes (`end="close"`) or only stops (`"stop"`, as some of distributed's
    own tests leave it)."""
    with dask.config.set(PRELOADS if preload else {}):
        s = await Scheduler(host="127.0.0.1", dashboard_address=":0")
        w = await Worker(s.address, nthreads=2, host="127.0.0.1")
        async with Client(s.address, asynchronous=True) as c:
            assert await c.submit(sum, range(1000)) == 499500
            seen: dict[str, Any] = {}
            if preload:
                seen["sampling"] = await until_sampled()
                # Counted once the sampler has opened one: under load it may not have yet
                # when the task returns.
                seen["thread_files"] = len(thread_files())
                # A collection runs in our job threads, on the servers and in the client.
                seen["processes_profiled"] = len((await c.pyspy_profile()).processes)
        await w.close()
        if end == "close":
            await s.close()
        else:
            s.stop()
            await asyncio.sleep(0)  # the release it scheduled starts
        return seen


async def until_sampled() -> dict[str, Any]:
    """The process sampler's stats once it has read some thread's system call."""
    from dask_pyspy.sampler import process_sampler

    deadline = time.monotonic() + DEADLINE_S
    while True:
        sampler = process_sampler.sampler
        stats = sampler.stats() if sampler is not None else {}
        if stats.get("states", {}).get("syscall_files", 0) > 0 or time.monotonic() > deadline:
            return {"running": stats.get("running"), "syscall_files": stats.get("states", {}).get("syscall_files")}
        await asyncio.sleep(0.05)


def server_ends(end: str) -> dict[str, Any]:
    """The counts after a plain cluster, after a second plain one, and after a
    preloaded one: what the preloaded one leaves beyond distributed's own (its first
    servers start process-wide threads; a scheduler only stopped keeps a descriptor)
    is ours."""
    asyncio.run(run_cluster(preload=False, end=end))
    first = steady()
    asyncio.run(run_cluster(preload=False, end=end))
    plain = steady()
    during = asyncio.run(run_cluster(preload=True, end=end))
    expected = {k: 2 * v - first[k] for k, v in plain.items()}
    after = settled(expected)
    from dask_pyspy.sampler import process_sampler

    sampler = process_sampler.sampler
    return {
        "plain": [first, plain],
        "expected": expected,
        "after": after,
        "during": during,
        "sampler_running": sampler is not None and sampler.is_running,
        "thread_files_after": thread_files(),
        "threads_after": python_threads(),
    }


async def worker_comes_and_goes() -> dict[str, Any]:
    """A worker starts and closes beside a preloaded scheduler whose sampler runs on:
    the process comes back to the descriptors it had once the scheduler started (as
    distributed's test_worker_fds asks)."""
    # The worker would start the loop's executor thread, which stays, with its files
    # (as any live thread's): started first, as in distributed's test. And the only
    # one: a pool of more starts another for a call that comes before the last call's
    # thread is idle again (Worker.close's back-to-back `to_thread`s, when free-threaded
    # or loaded), which outlives the worker, with its files.
    loop = asyncio.get_running_loop()
    loop.set_default_executor(ThreadPoolExecutor(max_workers=1, thread_name_prefix="asyncio"))
    await loop.run_in_executor(None, gc.collect)
    with dask.config.set(PRELOADS):
        async with Scheduler(host="127.0.0.1", dashboard_address=":0") as s:
            # Steady, with the loop free: on a loaded machine a descriptor of the
            # scheduler's start (or of a thread the sampler has not yet seen go) can
            # still be open at first.
            before = await asyncio.get_running_loop().run_in_executor(None, steady)
            async with Worker(s.address, nthreads=2, host="127.0.0.1"):
                during = counts()
            after = settled(before, keys=("fds",))
            return {"before": before, "during": during, "after": after, "threads_after": python_threads()}


def a_sleeper_wakes() -> dict[str, Any]:
    """A thread asleep when the sampler starts (so not read: idle threads are not
    kept) later works: the descriptors stay those counted once the sampler started."""
    from dask_pyspy import Sampler

    wake, worked, end = threading.Event(), threading.Event(), threading.Event()

    def sleeper() -> None:
        wake.wait()
        until = time.monotonic() + 0.5
        while time.monotonic() < until:
            sum(range(1000))
        worked.set()
        end.wait()

    thread = threading.Thread(target=sleeper)
    thread.start()
    s = Sampler(rate=200)
    s.start()
    before = counts()
    wake.set()
    worked.wait()
    after = settled(before)
    samples = s.profile().n_samples
    s.stop()
    end.set()
    thread.join()
    return {"before": before, "after": after, "samples": samples}


def short_threads(n: int = 1000, at_once: int = 50) -> dict[str, Any]:
    """`n` threads, `at_once` at a time, each computing then sleeping, under a sampler
    reading every thread (and their native stacks)."""
    from dask_pyspy import Sampler

    s = Sampler(rate=500, idle=True, native=True, cpu_budget=1.0)
    s.start()
    deadline = time.monotonic() + DEADLINE_S
    while s.stats()["states"]["syscall_files"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    before = counts()
    peak = 0

    def work_then_wait() -> None:
        sum(range(20_000))
        time.sleep(0.05)

    for _ in range(n // at_once):
        batch = [threading.Thread(target=work_then_wait) for _ in range(at_once)]
        for t in batch:
            t.start()
        while any(t.is_alive() for t in batch):
            peak = max(peak, s.stats()["states"]["syscall_files"])
            time.sleep(0.005)
    after = settled(before)
    s.stop()
    return {"before": before, "after": after, "peak_syscall_files": peak, "threads_started": n}


SCENARIOS: dict[str, Callable[[], dict[str, Any]]] = {
    "close": lambda: server_ends("close"),
    "stop": lambda: server_ends("stop"),
    "worker": lambda: asyncio.run(worker_comes_and_goes()),
    "sleeper": a_sleeper_wakes,
    "short-threads": short_threads,
}

if __name__ == "__main__":
    print(json.dumps(SCENARIOS[sys.argv[1]]()))
