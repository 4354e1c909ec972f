"""Do the readers read the same stacks? Stable parked stacks, then stacks churning faster than a read."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any, Callable

from benchmarks.common import READERS, Section, table, verdict
from dask_pyspy import Sampler

Stack = list[tuple[str, str, int]]


def descend(n: int, ready: threading.Semaphore, release: threading.Event) -> None:
    if n > 1:
        return descend(n - 1, ready, release)
    ready.release()
    release.wait()


def generator(ready: threading.Semaphore, release: threading.Event):
    yield descend(3, ready, release)


async def coroutine(ready: threading.Semaphore, release: threading.Event) -> None:
    descend(3, ready, release)  # blocks the loop on purpose: the coroutine's frame stays on the stack


def parked_targets() -> list[Callable[[threading.Semaphore, threading.Event], Any]]:
    """Depths 1-300 (300 spans several stack chunks), a generator and a coroutine on an asyncio loop."""
    plain = [lambda r, e, n=n: descend(n, r, e) for n in (1, 10, 40, 100, 300)]
    return [*plain, lambda r, e: next(generator(r, e)), lambda r, e: asyncio.run(coroutine(r, e))]


def python_stacks(idents: set[int]) -> dict[int, Stack]:
    """Leaf first, as Python itself reports them."""
    out = {}
    for ident, frame in sys._current_frames().items():
        if ident in idents:
            out[ident] = []
            while frame is not None:
                out[ident].append((frame.f_code.co_qualname, frame.f_code.co_filename, frame.f_lineno))
                frame = frame.f_back
    return out


def dumped_stacks(sampler: Sampler, idents: set[int]) -> dict[int, Stack]:
    return {
        t["ident"]: [(f["name"], f["file"], f["line"]) for f in t["frames"]]
        for t in sampler.dump()["threads"]
        if t["ident"] in idents
    }


@contextlib.contextmanager
def parked() -> Iterator[tuple[set[int], dict[int, Stack]]]:
    """Threads parked at known stacks for the block: their idents, and their stacks as
    Python itself reports them."""
    ready, release = threading.Semaphore(0), threading.Event()
    threads = [threading.Thread(target=t, args=(ready, release)) for t in parked_targets()]
    for t in threads:
        t.start()
    for _ in threads:
        ready.acquire()
    idents = {t.ident for t in threads if t.ident is not None}
    try:
        yield idents, python_stacks(idents)
    finally:
        release.set()
        for t in threads:
            t.join()


def stable(rounds: int) -> dict[str, int]:
    """Dump parked threads with both readers `rounds` times; count agreeing thread-stacks."""
    counts = {"thread-stacks": 0, "fast = pyspy": 0, "fast = Python": 0, "pyspy = Python": 0}
    with parked() as (idents, truth):
        samplers = {reader: Sampler(rate=10, idle=True, cpu_budget=1.0, reader=reader) for reader in READERS}
        for s in samplers.values():
            s.start()
        try:
            for _ in range(rounds):
                fast, spy = (dumped_stacks(samplers[r], idents) for r in READERS)
                for ident in idents:
                    counts["thread-stacks"] += 1
                    counts["fast = pyspy"] += ident in fast and fast[ident] == spy.get(ident)
                    counts["fast = Python"] += fast.get(ident) == truth[ident]
                    counts["pyspy = Python"] += spy.get(ident) == truth[ident]
        finally:
            for s in samplers.values():
                s.stop()
    return counts


# Two call chains through the same stack slots, switched every few hundred nanoseconds.
def a1() -> int:
    return a2()


def a2() -> int:
    return 1


def b1() -> int:
    return b2()


def b2() -> int:
    return 2


def churn(running: list[bool]) -> None:
    while running[0]:
        a1()
        b1()


BASE = ["Thread._bootstrap", "Thread._bootstrap_inner", "Thread.run", "churn"]
KNOWN = [BASE + chain[:k] for chain in (["a1", "a2"], ["b1", "b2"]) for k in range(3)]


def churning(reader: str, seconds: float) -> dict[str, float]:
    """Sample 2 churning threads at 1000 Hz; lost reads and mixed chains (kept)."""
    running = [True]
    threads = [threading.Thread(target=churn, args=(running,), name=f"churn-{i}") for i in range(2)]
    for t in threads:
        t.start()
    s = Sampler(rate=1000, cpu_budget=1.0, reader=reader)
    s.start()
    time.sleep(seconds)
    s.stop()
    running[0] = False
    for t in threads:
        t.join()
    doc = s.profile().speedscope()
    frames = doc["shared"]["frames"]
    samples = mixed = 0
    for prof in doc["profiles"]:
        if " churn-" in prof["name"]:
            for sample in prof["samples"]:
                samples += 1
                mixed += [frames[i]["name"] for i in sample] not in KNOWN
    reads = s.stats()["reader_stats"]
    lost = reads.get("lost_reads", reads.get("torn_reads", 0))
    return {"samples": samples, "mixed": mixed, "reads": reads.get("thread_reads", 0), "lost": lost}


def run(quick: bool) -> Section:
    counts = stable(300 if quick else 1000)
    total = counts.pop("thread-stacks")
    shares = {k: v / total for k, v in counts.items()}
    churn_rows, notes = (
        [],
        [
            f"Target (issue 9): fast matches pyspy on >= 99.9% of stable thread-stacks. "
            f"Measured {100 * shares['fast = pyspy']:.2f}%: {verdict(shares['fast = pyspy'] >= 0.999)}."
        ],
    )
    for reader in READERS:
        r = churning(reader, 3.0 if quick else 10.0)
        lost = r["lost"] / r["reads"] if r["reads"] else float("nan")
        mixed = r["mixed"] / r["samples"]
        churn_rows.append(
            [reader, r["samples"], f"{100 * lost:.2f}%".replace("nan%", "-"), r["mixed"], f"{100 * mixed:.2f}%"]
        )
        if reader == "fast":
            notes.append(
                f"Target (issue 18): under churn, mixed chains <= 0.5% of the fast reader's samples. "
                f"Measured {100 * mixed:.2f}% ({100 * lost:.2f}% of reads lost): {verdict(mixed <= 0.005)}."
            )
    return Section(
        "Reader oracle",
        "Stable: 7 threads parked at known stacks (depths 1-300, a generator, a coroutine on an asyncio loop), "
        "dumped by a sampler of each reader in turn; names, files and lines compared. Churn: 2 threads "
        "alternating two call chains through the same frames, sampled at 1000 Hz by each reader in turn.",
        [
            table(["thread-stacks", *counts], [[total, *(f"{100 * s:.2f}%" for s in shares.values())]]),
            table(["reader", "churning thread-samples", "reads lost", "mixed chains kept", "mixed share"], churn_rows),
        ],
        notes
        + [
            "A lost read is a thread the fast reader saw change under it in every copy, through its re-reads "
            "in the tick (counted in its stats, not kept; py-spy's reader loses the whole tick instead). A mixed "
            "chain is a kept sample whose stack is neither chain nor a prefix of one."
        ],
    )
