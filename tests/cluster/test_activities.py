"""Event-loop activities: time outside tasks named by what distributed dispatched."""

from __future__ import annotations

import sys
import time
from typing import Any

import cloudpickle
import numpy as np
from distributed.core import rpc

from tests.cluster.test_preload import preloaded

# The functions below run in a `dask scheduler` subprocess, which cannot import tests.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

ACTIVITY_FILE = "dask activity"


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def spin_before_await() -> None:
    spin(0.2)


def spin_after_await() -> None:
    spin(0.2)


def spin_in_stream() -> None:
    spin(0.2)


async def custom_rpc(comm: Any = None) -> str:
    import asyncio

    spin_before_await()
    await asyncio.sleep(0.05)
    spin_after_await()
    return "spun"


def custom_stream(**kwargs: Any) -> None:
    spin_in_stream()


def add_custom_handlers(dask_scheduler: Any) -> None:
    dask_scheduler.handlers["custom_rpc"] = custom_rpc
    dask_scheduler.stream_handlers["custom-stream"] = custom_stream


def seconds_by_root(doc: dict[str, Any], function: str) -> dict[str | None, float]:
    """Seconds of stacks that run `function`, by the activity at their root (None: none)."""
    frames = doc["shared"]["frames"]
    out: dict[str | None, float] = {}
    for thread in doc["x-dask-pyspy"]["threads"]:
        profile = doc["profiles"][thread["profile"]]
        for stack, weight in zip(profile["samples"], profile["weights"]):
            if any(frames[i]["name"] == function for i in stack):
                root = frames[stack[0]]
                activity = root["name"] if root.get("file") == ACTIVITY_FILE else None
                out[activity] = out.get(activity, 0.0) + weight
    return out


def activities(profile: Any) -> dict[str, float]:
    return {row["activity"]: row["seconds"] for row in profile.summary()["activities"]}


def test_handlers_added_after_the_plugin_are_named_across_awaits(tmp_path):
    with preloaded(tmp_path, scheduler_preload=True) as cluster:
        client = cluster.client
        client.run_on_scheduler(add_custom_handlers)
        start = time.time()

        async def call() -> list[str]:
            async with rpc(client.scheduler.address) as r:
                return [await r.custom_rpc() for _ in range(3)]

        assert client.sync(call) == ["spun"] * 3
        for _ in range(3):
            client._send_to_scheduler({"op": "custom-stream"})
        deadline = time.time() + 120
        while time.time() < deadline:
            doc = client.pyspy_profile(start=start, by="prefix").speedscope()
            stream = seconds_by_root(doc, "spin_in_stream")
            if sum(stream.values()) >= 0.3:
                break
        before, after = seconds_by_root(doc, "spin_before_await"), seconds_by_root(doc, "spin_after_await")
        for spun in (before, after):
            assert sum(spun.values()) >= 0.2, spun
            # Torn reads (a step starting mid-read) may lose a few samples their name.
            assert spun.get("scheduler: custom_rpc", 0) >= 0.9 * sum(spun.values()), spun
        assert stream.get("scheduler: custom-stream", 0) >= 0.9 * sum(stream.values()), stream


def counted_rpc(comm: Any = None) -> str:
    spin(0.01)  # long enough to be sampled: calls are on rows of sampled time
    return "counted"


def add_counted_handler(dask_scheduler: Any) -> None:
    dask_scheduler.handlers["counted_rpc"] = counted_rpc


def test_a_handlers_calls_are_counted(client):
    client.run_on_scheduler(add_counted_handler)
    start = time.time()

    async def call() -> list[str]:
        async with rpc(client.scheduler.address) as r:
            return [await r.counted_rpc() for _ in range(25)]

    assert client.sync(call) == ["counted"] * 25
    deadline = time.time() + 120
    while time.time() < deadline:
        rows = {r["activity"]: r for r in client.pyspy_profile(start=start).summary()["activities"]}
        calls = rows.get("scheduler: counted_rpc", {}).get("calls", 0)
        if calls >= 25:
            break
    assert calls == 25, rows.get("scheduler: counted_rpc")


def test_the_schedulers_graph_and_task_handlers_are_named(client):
    # The plugin came after the workers connected: their streams' reads and batched
    # sends are named too.
    expected = {
        "scheduler: update-graph",
        "scheduler: task-finished",
        "worker: compute-task",
        "scheduler: receiving",
        "scheduler: sending",
    }
    start = time.time()
    deadline = time.time() + 180
    while time.time() < deadline:
        client.gather(client.map(lambda x: x + 1, range(2000), pure=False))
        names = activities(client.pyspy_profile(start=start))
        if expected <= set(names):
            break
    assert expected <= set(names), names


def hooked(dask_worker: Any) -> list[str]:
    """The activity hooks in place in this worker's process."""
    from distributed.comm.tcp import TCP
    from tornado.iostream import BaseIOStream

    methods = {"TCP.read": vars(TCP)["read"], "TCP.write": vars(TCP)["write"], "BaseIOStream.write": BaseIOStream.write}
    found = [name for name, method in methods.items() if hasattr(method, "__wrapped__")]
    return found + (["handlers"] if type(dask_worker.handlers) is not dict else [])


def test_unregistering_the_plugin_removes_every_hook(fresh):
    _, client = fresh
    assert all(client.run(hooked).values())
    client.unregister_worker_plugin("pyspy")
    assert client.run(hooked) == dict.fromkeys(client.scheduler_info()["workers"], [])


def test_a_large_transfer_is_named_on_both_workers(client):
    sender, receiver = sorted(client.scheduler_info()["workers"])
    start = time.time()
    # A transfer may fall between samples on a loaded machine: repeat until both are seen.
    deadline = time.time() + 180
    for i in range(1000):
        big = client.submit(np.full, 50_000_000 // 8, i, workers=[sender], pure=False)
        total = client.submit(np.sum, big, workers=[receiver], pure=False)
        assert total.result() == i * (50_000_000 // 8)
        del big, total
        prof = client.pyspy_profile(start=start)
        names = [p["name"] for p in prof.processes]
        on = {name: activities(prof.only_process(names.index(name))) for name in (sender, receiver)}
        seen = on[sender].get("worker: get_data", 0) > 0 and on[receiver].get("worker: gather_dep", 0) > 0
        if seen or time.time() > deadline:
            break
    assert on[sender].get("worker: get_data", 0) > 0, on[sender]
    assert on[receiver].get("worker: gather_dep", 0) > 0, on[receiver]
