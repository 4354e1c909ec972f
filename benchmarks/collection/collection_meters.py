"""What a collection costs, read on the cluster: event-loop stalls on the scheduler and every
worker, the replies' sizes, the scheduler's memory and its CPU off the loop; `collect` measures
one collection with them, `baseline` the same load without one."""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from typing import Any

from distributed import Client

import dask_pyspy
import dask_pyspy.client

# --- event-loop stall monitors on the scheduler and every worker ---


def _waited_s() -> float:
    """Seconds this thread has spent runnable but not running (schedstat's run delay)."""
    with open("/proc/thread-self/schedstat") as f:
        return int(f.read().split()[1]) / 1e9


def _install(server: Any) -> None:
    # The worst stall, and how much of it the loop's thread spent waiting for a CPU:
    # the rest it waited for the GIL or ran something else.
    state = {"max": 0.0, "waiting": 0.0}

    async def watch() -> None:
        while True:
            t, waited = time.perf_counter(), _waited_s()
            await asyncio.sleep(0.005)
            stall = time.perf_counter() - t - 0.005
            if stall > state["max"]:
                state["max"], state["waiting"] = stall, _waited_s() - waited

    server.pyspy_bench_stall = state
    server.pyspy_bench_task = asyncio.ensure_future(watch())  # held: a bare task may be collected


def _take(server: Any) -> tuple[float, float]:
    """The worst stall since the last take and its wait for a CPU; starts a new window."""
    state = server.pyspy_bench_stall
    worst = state["max"], state["waiting"]
    state["max"] = state["waiting"] = 0.0
    return worst


async def _install_worker(dask_worker: Any) -> None:
    _install(dask_worker)


async def _install_scheduler(dask_scheduler: Any) -> None:
    _install(dask_scheduler)


def _take_worker(dask_worker: Any) -> tuple[float, float]:
    return _take(dask_worker)


def _take_scheduler(dask_scheduler: Any) -> tuple[float, float]:
    return _take(dask_scheduler)


def install_stalls(client: Client) -> None:
    """Starts the stall monitor on the scheduler's event loop and every worker's."""
    client.run(_install_worker)
    client.run_on_scheduler(_install_scheduler)


def take_stalls(client: Client) -> dict[str, float]:
    """Worst stall (s) since the last call, the scheduler's and the worst worker's, and
    the part of each its loop waited for a CPU."""
    sched = client.run_on_scheduler(_take_scheduler)
    work = max(client.run(_take_worker).values())
    return {"sched": sched[0], "sched_cpu": sched[1], "work": work[0], "work_cpu": work[1]}


# --- what the scheduler and the client receive ---


def unknown_keyword(error: TypeError, variant: dict[str, Any]) -> None:
    """Returns if `error` is about a keyword of `variant` (which today's code may lack); else raises it."""
    if not any(name in str(error) for name in variant):
        raise error


async def _reply(start: float, stop: float, variant: dict[str, Any], dask_worker: Any) -> bytes:
    reply = await dask_worker.handlers["pyspy_profile"](start=start, stop=stop, **variant)
    return getattr(reply, "data", reply)  # the bytes, sent as a frame in a `Serialize` since issue 21


def worker_replies(client: Client, variant: dict[str, Any]) -> dict[str, bytes] | None:
    """Each worker's reply to the scheduler for the whole window; None if the handler takes no `variant`."""
    stop = time.time()
    try:
        return client.run(_reply, stop - 3600, stop, variant)
    except TypeError as e:
        unknown_keyword(e, variant)
        return None


class ReplyMeter:
    """Size and arrival time of the scheduler's `pyspy_profile` replies to this client, read where the
    client receives them (a wrapper on `dask_pyspy.client._call`; without one, nothing is read)."""

    def __init__(self) -> None:
        self.size: int | None = None
        self.arrived = 0.0
        self._call = getattr(dask_pyspy.client, "_call", None)

    def __enter__(self) -> ReplyMeter:
        if self._call is not None:
            dask_pyspy.client._call = self._metered
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._call is not None:
            dask_pyspy.client._call = self._call

    async def _metered(self, client: Client, op: str, **kwargs: Any) -> Any:
        reply = await self._call(client, op, **kwargs)
        if op == "pyspy_profile" and isinstance(reply, dict) and "parts" in reply:
            self.size, self.arrived = sum(map(len, reply["parts"].values())), time.perf_counter()
        return reply


def distinct_stacks(wire: bytes) -> int:
    """Distinct thread stacks in one worker's reply."""
    doc = dask_pyspy.Profile.from_wire(wire).speedscope(by="thread")
    return len({tuple(s) for p in doc["profiles"] for s in p["samples"]})


# --- the scheduler's memory and CPU ---


def status_kib(pid: int, name: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(name + ":"))


def reset_peak(pid: int) -> int:
    """Resets VmHWM to the current RSS; returns that RSS (KiB)."""
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")
    return status_kib(pid, "VmRSS")


def _cpu(stat: str) -> float:
    with open(stat) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def off_loop_cpu(pid: int) -> float:
    """User + system CPU seconds of the process's threads but its main one (the event loop), ended ones
    included: the collection's export, merge and encoding run there, the task stream's work barely."""
    return _cpu(f"/proc/{pid}/stat") - _cpu(f"/proc/{pid}/task/{pid}/stat")


# --- one collection ---


@dataclass
class Rig:
    client: Client
    pid: int  # the scheduler's
    out: str  # where saves go
    meter: ReplyMeter


def collect(rig: Rig, op: str, variant: dict[str, Any]) -> dict[str, float]:
    """One collection (by=op; the default for the HTML report), then its save."""
    take_stalls(rig.client)
    rss, cpu = reset_peak(rig.pid), off_loop_cpu(rig.pid)
    rig.meter.size = None
    began = time.perf_counter()
    prof = rig.client.pyspy_profile(last=3600, **({} if op == "report" else {"by": op}), **variant)
    collected = time.perf_counter()
    peak, cpu = status_kib(rig.pid, "VmHWM"), off_loop_cpu(rig.pid) - cpu
    stalls = take_stalls(rig.client)
    prof.save(os.path.join(rig.out, "report.html" if op == "report" else f"profile-{op}.json.gz"))
    saved = time.perf_counter()
    size = rig.meter.size
    return {
        "collect": collected - began,
        "save": saved - collected,
        "total": saved - began,
        "decode": collected - rig.meter.arrived if size else float("nan"),
        "reply": size or float("nan"),
        "transient": (peak - rss) * 1024,
        "cpu": cpu,
        **stalls,
    }


def baseline(rig: Rig, seconds: float) -> dict[str, float]:
    """The same load and no collection, for `seconds`: stalls and the scheduler's CPU."""
    take_stalls(rig.client)
    cpu = off_loop_cpu(rig.pid)
    time.sleep(seconds)
    return {"seconds": seconds, "cpu": off_loop_cpu(rig.pid) - cpu, **take_stalls(rig.client)}
