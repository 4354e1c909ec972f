"""Activities (issue 19): what naming the event loops costs per message, whether the
small-tasks workload slows, and how much of the loops' running time gets a name."""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any, Callable

import dask
from distributed import Client, LocalCluster

import dask_pyspy
from benchmarks.common import Section, interleave, spread, table, verdict
from benchmarks.workload import run_workloads, tiny
from dask_pyspy import _native, config
from dask_pyspy.server.activities import Named, NamedHandlers, Shared

ACTIVITY_FILE = "dask activity"
BASE = ": event loop"


def per_message_ns(n: int) -> dict[str, float]:
    """Nanoseconds a handler lookup and call take through the hooks, minus a plain dict's."""
    native = _native.Sampler(config.sampler_options())
    named = Named(native, "scheduler")

    def sync_handler(**kwargs: Any) -> None:
        return None

    async def async_handler(**kwargs: Any) -> None:
        await asyncio.sleep(0)

    plain = {"sync": sync_handler, "async": async_handler}
    hooked = NamedHandlers(plain, named)

    def sync_loop(handlers: dict[str, Callable[..., Any]]) -> float:
        began = time.perf_counter()
        for _ in range(n):
            handlers["sync"](x=1)
        return time.perf_counter() - began

    async def async_loop(handlers: dict[str, Callable[..., Any]]) -> float:
        began = time.perf_counter()
        for _ in range(n):
            await handlers["async"](x=1)  # two steps: before and after the sleep
        return time.perf_counter() - began

    async def read(comm: Any) -> None:
        await asyncio.sleep(0)

    async def comm_loop(read: Callable[..., Any]) -> float:
        began = time.perf_counter()
        for _ in range(n):
            await read(None)
        return time.perf_counter() - began

    out = {}
    Shared.hold(named)  # this thread is the server's loop: comm reads are named
    try:
        cases: dict[str, tuple[Callable[[Any], float], Any, Any]] = {
            "sync": (sync_loop, hooked, plain),
            "async": (lambda h: asyncio.run(async_loop(h)), hooked, plain),
            "comm": (lambda r: asyncio.run(comm_loop(r)), Shared._comm_io(read, "receiving"), read),
        }
        for kind, (measure, through_hooks, bare) in cases.items():
            extra = [(measure(through_hooks) - measure(bare)) / n * 1e9 for _ in range(5)]
            out[kind] = statistics.median(extra)
    finally:
        Shared.release(named)
    return out


def small_tasks(plugin: bool, quick: bool, settings: dict[str, Any] | None = None) -> Callable[[], dict[str, float]]:
    """Tiny tasks on 2 workers x 1 thread, timed; `settings`: dask config for the cluster."""

    def run() -> dict[str, float]:
        with (
            dask.config.set(settings or {}),
            LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster,
            Client(cluster) as client,
        ):
            client.gather(client.map(tiny, range(100), key=[f"warm-{i}" for i in range(100)]))
            if plugin:
                client.register_plugin(dask_pyspy.PySpyPlugin(rate=100))
            began = time.perf_counter()
            client.gather(client.map(tiny, range(2000 if quick else 6000)))
            return {"small tasks": time.perf_counter() - began}

    return run


def loop_threads_named(doc: dict[str, Any]) -> dict[str, float]:
    """CPU seconds of the event-loop threads' samples outside tasks: named by a dispatch
    point, by the loop's base activity alone, and unnamed."""
    frames = doc["shared"]["frames"]
    out = {"dispatch": 0.0, "base": 0.0, "unnamed": 0.0}
    for thread in doc["x-dask-pyspy"]["threads"]:
        profile = doc["profiles"][thread["profile"]]
        for stack, weight in zip(profile["samples"], profile["weights"]):
            root = frames[stack[0]]
            if root.get("file") == "dask task":
                continue
            names = [frames[i]["name"] for i in stack]
            if root.get("file") == ACTIVITY_FILE:
                out["base" if root["name"].endswith(BASE) else "dispatch"] += weight
            elif "BaseEventLoop.run_forever" in names:
                out["unnamed"] += weight
    return out


def named_share(quick: bool) -> dict[str, float]:
    with (
        LocalCluster(n_workers=2, threads_per_worker=2, processes=True, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        client.register_plugin(dask_pyspy.PySpyPlugin(rate=100))
        began = time.time()
        run_workloads(client, quick)
        doc = client.pyspy_profile(start=began, by="prefix").speedscope(weight="cpu")
    return loop_threads_named(doc)


def run(quick: bool) -> Section:
    cost = per_message_ns(20_000 if quick else 100_000)
    results = interleave(
        {"plugin off": small_tasks(False, quick), "plugin on (activities named)": small_tasks(True, quick)},
        rounds=3 if quick else 5,
    )
    base = statistics.median(results["plugin off"]["small tasks"])
    rows = [
        [name, spread(r["small tasks"], "{:.2f}"), f"{statistics.median(r['small tasks']) / base:.3f}"]
        for name, r in results.items()
    ]
    shares = named_share(quick)
    total = sum(shares.values()) or 1.0
    dispatch, base_share = shares["dispatch"] / total, shares["base"] / total
    notes = [
        f"Extra time per dispatched message through the hooks (median of 5): a sync handler "
        f"{cost['sync']:.0f} ns, a coroutine handler with one await {cost['async']:.0f} ns; a comm read "
        f"or write (one per batch of stream messages) {cost['comm']:.0f} ns. "
        f"Target <= 2 us: {verdict(max(cost.values()) <= 2000)}.",
        f"Event-loop threads' running (CPU-weighted) samples outside tasks in the demo workload: "
        f"{100 * dispatch:.1f}% named by what ran (an op, a callback, a state machine step, a comm's "
        f"receiving or sending), {100 * base_share:.1f}% only by the loop's base "
        f"activity (`<kind>: event loop`), {100 * (1 - dispatch - base_share):.1f}% unnamed "
        f"(torn reads, threads the hooks do not cover); {total:.2f} CPU s in all. Before activities: 0% "
        f"named (all '(no task)'). Target >= 90% carry an activity: {verdict(dispatch + base_share >= 0.9)}.",
    ]
    header = ["small tasks (6,000 tiny tasks, 2 workers)", "seconds, median (min-max)", "ratio"]
    return Section("Activities: cost and coverage (issue 19)", __doc__ or "", [table(header, rows)], notes)
