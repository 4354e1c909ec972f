"""What watching the loops costs (target 6): the sampler's CPU per tick and the loop's per
poll (6a), the stall records' memory filled for a day (6b), the small-tasks run (6c)."""

from __future__ import annotations

import asyncio
import json
import os
import selectors
import statistics
import subprocess
import sys
import threading
import time
from typing import Any, Callable

import dask
from distributed import Client, LocalCluster

import dask_pyspy
from benchmarks import ROOT
from benchmarks.activities import activities
from benchmarks.common import Section, interleave, spread, table, verdict
from benchmarks.stalls.stalls_servers import THRESHOLD_S, wait_for, watching
from dask_pyspy.sampler import Sampler

RECORD_BYTES = 12  # a stall record (rust/sampling/stalls.rs)
DAY = 86_400  # records: a day at one stall a second
# An invalid threshold: each server logs an error and does not watch its loop.
WATCH_OFF = {"pyspy.stall-threshold": "off"}

# ---- 6a: per tick and per poll


class LoopThread:
    """An asyncio loop in a thread of its own, with a 20 ms periodic callback as a
    server's tick, and its selector watched by 0 or more LoopWatches."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.selector = self.loop._selector  # type: ignore[attr-defined]
        self.watches: list[Any] = []
        self.thread = threading.Thread(target=self.loop.run_forever, name="watched-loop", daemon=True)
        self.thread.start()
        self.call(lambda: self.loop.call_later(0.02, self._tick))

    def _tick(self) -> None:
        sum(range(1000))  # a little work, as distributed's tick does
        self.loop.call_later(0.02, self._tick)

    def call(self, fn: Callable[[], Any]) -> Any:
        """`fn()` on the loop's thread (a LoopWatch keys on the calling thread)."""

        async def run() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(30)

    def watch(self, sampler: Sampler, n: int) -> None:
        def add() -> None:
            for _ in range(n):
                self.selector.select = sampler.native.watch_loop(self.selector.select, THRESHOLD_S)
                self.watches.append(self.selector.select)

        self.call(add)

    def unwatch(self, sampler: Sampler) -> None:
        def remove() -> None:
            for watch in reversed(self.watches):
                sampler.native.unwatch_loop(watch)
            self.watches.clear()
            vars(self.selector).pop("select", None)

        self.call(remove)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()


def tick_cost(rounds: int, seconds: float) -> dict[str, dict[str, list[float]]]:
    """The sampler's CPU per tick (us) with the loop watched by 0, 1 and 64 watches,
    interleaved; each run a window of the one running sampler's own counters."""
    sampler = Sampler(rate=100, cpu_budget=1.0)
    sampler.start()
    loop = LoopThread()
    parked = threading.Event()
    others = [threading.Thread(target=parked.wait, daemon=True) for _ in range(4)]
    for t in others:
        t.start()

    def run(n: int) -> Callable[[], dict[str, float]]:
        def once() -> dict[str, float]:
            loop.watch(sampler, n)
            time.sleep(0.5)
            before = sampler.stats()
            time.sleep(seconds)
            after = sampler.stats()
            loop.unwatch(sampler)
            ticks = after["ticks"] - before["ticks"]
            reads = after["reader_stats"]["thread_reads"] - before["reader_stats"]["thread_reads"]
            return {"us per tick": (after["cpu_s"] - before["cpu_s"]) / ticks * 1e6, "reads per tick": reads / ticks}

        return once

    try:
        return interleave({"0": run(0), "1": run(1), "64": run(64)}, rounds)
    finally:
        parked.set()
        loop.close()
        sampler.stop()


def poll_cost(n: int, reps: int) -> dict[str, Any]:
    """ns per `select(0)` of an epoll selector, plain and through a LoopWatch, alternating."""
    sampler = Sampler()
    selector = selectors.DefaultSelector()
    watch = sampler.native.watch_loop(selector.select, THRESHOLD_S)

    def timed(select: Callable[[float], Any]) -> float:
        began = time.perf_counter_ns()
        for _ in range(n):
            select(0)
        return (time.perf_counter_ns() - began) / n

    try:
        runs = [(timed(selector.select), timed(watch)) for _ in range(reps)]
    finally:
        sampler.native.unwatch_loop(watch)
        selector.close()
    plain, watched = [p for p, _ in runs], [w for _, w in runs]
    return {"plain": statistics.median(plain), "watched": statistics.median(watched), "extra": [w - p for p, w in runs]}


def per_tick(section: Section, quick: bool) -> None:
    runs = tick_cost(rounds=4 if quick else 12, seconds=4.0)
    us = {n: r["us per tick"] for n, r in runs.items()}
    reads = {n: statistics.median(r["reads per tick"]) for n, r in runs.items()}
    # Runs of a round are seconds apart: their difference leaves out the machine's slower drifts.
    one = [w - b for w, b in zip(us["1"], us["0"])]
    more = [(m - w) / 63 for m, w in zip(us["64"], us["1"])]
    rows: list[list[object]] = [
        [f"{n} watched", spread(v, "{:.1f}"), spread([x - b for x, b in zip(v, us["0"])], "{:+.2f}"), f"{reads[n]:.3f}"]
        for n, v in us.items()
    ]
    header = ["LoopWatches on the loop", "sampler CPU us per tick, median (min-max)", "minus none, same round, us"]
    section.tables.append(table([*header, "threads read per tick"], rows))
    poll = poll_cost(50_000, reps=7 if quick else 21)
    section.notes.append(
        f"Target 6a: detection <= 1 us per tick per server. One sampler at 100 Hz in this process (a loop thread "
        f"with a 20 ms callback, 4 parked threads), {len(us['0'])} interleaved rounds of 4 s per case, the CPU per "
        f"tick from the sampler's own counters: one watched loop {statistics.median(one):+.2f} us per tick against "
        f"none in the same round (median; {min(one):+.1f} to {max(one):+.1f}), the medians of all runs "
        f"{statistics.median(us['1']) - statistics.median(us['0']):+.2f} us apart; each watch past the first "
        f"{statistics.median(more):+.3f} us. Threads read per tick: {reads['0']:.3f} with none, {reads['1']:.3f} "
        f"with one (a loop's thread is read waiting only once it is late by a quarter of the threshold). Per tick "
        f"per server: {verdict(statistics.median(one) <= 1.0)} (the part that grows per loop watched: "
        f"{verdict(statistics.median(more) <= 1.0)}). On the loop's side, a poll (`select(0)` of an epoll "
        f"selector, nothing ready) costs {poll['plain']:.0f} ns plain and {poll['watched']:.0f} ns through the "
        f"LoopWatch: {statistics.median(poll['extra']):+.0f} ns a poll (median of {len(poll['extra'])} alternating "
        f"runs of 50,000; {min(poll['extra']):+.0f} to {max(poll['extra']):+.0f})."
    )


# ---- 6b: the stall records


def _mappings() -> dict[tuple[int, int], int]:
    """This process's mappings: (start address, size) -> resident bytes."""
    out: dict[tuple[int, int], int] = {}
    start = size = 0
    with open("/proc/self/smaps") as f:
        for row in f:
            head = row.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                start, size = lo, hi - lo
            elif head == "Rss:":
                out[(start, size)] = int(row.split()[1]) * 1024
    return out


def record_memory_apart() -> dict[str, Any]:
    """`record_memory` in a fresh process, whose large allocations are the records' alone."""
    code = "import json; from benchmarks.stalls.stalls_cost import record_memory; print(json.dumps(record_memory()))"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"record_memory failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def record_memory(most: int = DAY, past: int = 20_000) -> dict[str, Any]:
    """Fills a sampler's stall records: a LoopWatch with a 1 ns threshold makes each call
    one stall. `most` stalls, then `past` more."""
    sampler = Sampler(rate=1000, cpu_budget=1.0)
    sampler.start()
    time.sleep(0.5)
    before = _mappings()
    watch = sampler.native.watch_loop(lambda timeout=None: [], 1e-9)

    def push(n: int) -> None:
        for i in range(n):
            watch(0)
            if i % 8 == 0:
                time.sleep(0.001)  # the ring holds 64 between two of the sampler's ticks

    def stored() -> dict[str, Any]:
        # `count`: a window lists only its 2,000 longest `records`.
        return sampler.stalls(None, None, 0.0, 0)

    out: dict[str, Any] = {}
    try:
        push(most + 1)  # the first call ends no iteration
        wait_for("the sampler storing the stalls", lambda: stored()["count"] + stored()["lost"] >= most, 30)
        at_most = stored()
        out["records"], out["lost_first"] = at_most["count"], at_most["lost"]
        # glibc maps a block this large apart; the records' is the new mapping whose resident pages
        # hold them (pages past the last record are never touched).
        payload = out["records"] * RECORD_BYTES
        new = [(size, rss) for (a, size), rss in _mappings().items() if (a, size) not in before]
        buffer = [(size, rss) for size, rss in new if payload <= rss <= payload + 2 * 4096]
        out["buffer"], out["resident"] = buffer[0] if len(buffer) == 1 else (None, None)
        out["new_mappings"] = sorted(new)
        push(past)
        time.sleep(0.5)
        later = stored()
        out["records_past"], out["dropped"], out["lost"] = later["count"], later["dropped"], later["lost"]
    finally:
        sampler.native.unwatch_loop(watch)
        sampler.stop()
    return out


def memory(section: Section) -> None:
    found = record_memory_apart()
    payload = DAY * RECORD_BYTES
    buffer, resident = found["buffer"], found["resident"]
    if buffer:
        allocation = (
            f" At {found['records']:,} records the records' buffer is a mapping of {buffer:,} bytes "
            f"({buffer / 2**20:.3f} MiB, room for {(buffer - 4096) // RECORD_BYTES:,} records at most), "
            f"{resident:,} bytes of it resident: "
            f"address space {verdict(buffer <= 2**20)}, resident {verdict(resident <= 2**20)}."
        )
    else:
        allocation = f" The records' buffer was not told apart among the new mappings {found['new_mappings']}."
    section.notes.append(
        f"Target 6b: <= 1 MiB a day at one stall a second. A record is {RECORD_BYTES} bytes and a process keeps at "
        f"most {DAY:,}: {payload:,} bytes ({payload / 2**20:.3f} MiB) of records: {verdict(payload <= 2**20)}. "
        f"Filled for real in a fresh process (a LoopWatch with a 1 ns threshold called in a loop: one stall per "
        f"call): {found['records']:,} records kept of {DAY:,} stalls ({found['lost_first']} lost from the loop's "
        f"ring)."
        + allocation
        + f" 20,000 stalls more: {found['records_past']:,} kept, {found['dropped']:,} thinned out (the older half "
        f"keeps its longest stall per second), {found['lost']} lost from the ring in all."
    )


# ---- 6c: the small-tasks run


def loop_watches() -> int:
    """In a server's process: the loops it times for stalls."""
    from dask_pyspy.server.stalls import LoopWatch

    return len(LoopWatch._held)


def watches_with(settings: dict[str, Any]) -> list[int]:
    """Loops timed in each process (scheduler first) of a cluster started with `settings`.
    Not the profile's `watched`: the scheduler here shares this process's sampler, which
    says whether a loop was ever watched."""
    with (
        dask.config.set(settings),
        LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        client.register_plugin(dask_pyspy.PySpyPlugin())
        wait_for("every process sampling", lambda: len(watching(client)) >= 3)
        return [client.run_on_scheduler(loop_watches), *client.run(loop_watches).values()]


def small_tasks(section: Section, quick: bool) -> None:
    watches = {"on": watches_with({}), "off": watches_with(WATCH_OFF)}
    results = interleave(
        {
            "plugin off": activities.small_tasks(False, quick),
            "plugin on, stall watch off": activities.small_tasks(True, quick, WATCH_OFF),
            "plugin on": activities.small_tasks(True, quick),
        },
        rounds=3 if quick else 7,
    )
    secs = {name: r["small tasks"] for name, r in results.items()}
    off, unwatched, on = secs["plugin off"], secs["plugin on, stall watch off"], secs["plugin on"]
    rows: list[list[object]] = [
        [name, spread(v, "{:.2f}"), f"{statistics.median(v) / statistics.median(off):.3f}"] for name, v in secs.items()
    ]
    tasks = 2000 if quick else 6000
    header = [f"{tasks:,} tiny tasks (LocalCluster, 2 workers x 1 thread)", "seconds, median (min-max)", "ratio"]
    section.tables.append(table(header, rows))
    section.notes.append(
        f"Target 6c: the small-tasks run no slower with the plugin beyond noise. Median ratio with the plugin "
        f"{statistics.median(on) / statistics.median(off):.3f} (range {min(on):.2f}-{max(on):.2f} s against "
        f"{min(off):.2f}-{max(off):.2f} s off): {verdict(statistics.median(on) <= max(off))}. The stall watch's "
        f"own share: plugin on {statistics.median(on):.2f} s against {statistics.median(unwatched):.2f} s with the "
        f"watch off: {verdict(statistics.median(on) <= max(unwatched))}. The watch is turned off with an invalid "
        f"`pyspy.stall-threshold` ('off'): each server logs an error and samples on without watching its loop, an "
        f"error path the project keeps but does not offer as a switch. Loops timed per process (scheduler, "
        f"workers) on a cluster of its own: {watches['off']} with it, {watches['on']} without."
    )
