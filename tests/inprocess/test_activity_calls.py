"""Calls per activity: each call of a handler `Named.wrap` wraps counts once, sync or
coroutine (however many steps it takes), in the summaries of windows that hold it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from dask_pyspy import Profile, Sampler
from dask_pyspy.server.activities import Named

BUSY = 0.02  # seconds of work per call step: at 500 Hz, several samples each
SAMPLED = 0.1  # seconds sampled per activity before the calls stop


def busy() -> None:
    end = time.perf_counter() + BUSY
    while time.perf_counter() < end:
        pass


def sync_op() -> None:
    busy()


async def coroutine_op() -> None:
    busy()
    await asyncio.sleep(0)  # a second step: still one call
    busy()


def seconds_in(sampler: Sampler, activity: str) -> float:
    return sum(a["seconds"] for a in sampler.profile().summary()["activities"] if a["activity"] == activity)


def call_until_sampled(sampler: Sampler, activity: str, call: Callable[[], Any], timeout: float = 60.0) -> int:
    """Calls `call` until `activity` has SAMPLED seconds; how many calls that took."""
    deadline = time.monotonic() + timeout
    calls = 0
    while seconds_in(sampler, activity) < SAMPLED:
        assert time.monotonic() < deadline, f"{activity} was not sampled in {timeout} s"
        call()
        calls += 1
    return calls


class Recording:
    """Sync calls, then coroutine calls, through one server's `Named.wrap`."""

    def __init__(self) -> None:
        sampler = Sampler(rate=500, idle=True, cpu_budget=0.5)
        sampler.start()
        try:
            named = Named(sampler._native, "scheduler")
            run_sync = named.wrap(sync_op, named("sync_op"))
            run_coroutine = named.wrap(coroutine_op, named("coroutine_op"))
            self.start = time.time()
            self.sync = call_until_sampled(sampler, "scheduler: sync_op", run_sync)

            def in_a_loop() -> None:
                asyncio.run(run_coroutine())

            self.coroutine = call_until_sampled(sampler, "scheduler: coroutine_op", in_a_loop)
            self.stop = time.time()
            self.profile = sampler.profile(self.start, self.stop)
            self.before = sampler.profile(self.start - 10, self.start - 5)
            self.wire = Profile.from_wire(sampler.export(self.start, self.stop, True, "p", {}, {}))
        finally:
            sampler.stop()


@pytest.fixture(scope="module")
def recording() -> Iterator[Recording]:
    yield Recording()


def calls(profile: Profile) -> dict[str, Any]:
    return {a["activity"]: a.get("calls") for a in profile.summary()["activities"]}


def test_each_wrapped_call_counts_once(recording):
    counted = calls(recording.profile)
    assert counted["scheduler: sync_op"] == recording.sync
    assert counted["scheduler: coroutine_op"] == recording.coroutine, "once per call, not per step"


def test_calls_travel_aggregated_on_the_wire(recording):
    counted = calls(recording.wire)
    assert (counted["scheduler: sync_op"], counted["scheduler: coroutine_op"]) == (recording.sync, recording.coroutine)


def test_rows_of_activities_not_counted_have_no_calls(recording):
    rows = recording.profile.summary()["activities"]
    assert all("calls" not in a for a in rows if not a["activity"].endswith("_op")), rows


def test_a_window_before_the_calls_counts_none(recording):
    assert not any(calls(recording.before).values())
