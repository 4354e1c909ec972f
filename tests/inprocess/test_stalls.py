"""Event-loop stalls of an asyncio loop in this process, its selector timed by the
native watch: what each stall reads on this interpreter and reader."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from dask_pyspy import Profile, Sampler
from dask_pyspy.server.stalls import TICK_LOGGER, UNRESPONSIVE, ExplainStalls
from dask_pyspy.stalls import describe
from tests.conftest import most_sampled_state, wait_for

THRESHOLD = 0.2


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def hold_gil() -> int:
    return sum(range(60_000_000))


@contextlib.contextmanager
def watched(sampler: Sampler, threshold: float) -> Iterator[None]:
    """The running loop's selector timed by `sampler`'s watch, for stalls of `threshold` s."""
    selector = asyncio.get_running_loop()._selector  # type: ignore[attr-defined]
    selector.select = watch = sampler.native.watch_loop(selector.select, threshold)
    try:
        yield
    finally:
        del selector.select
        sampler.native.unwatch_loop(watch)


async def stalled_loop(sampler: Sampler) -> list[float]:
    """Stalls the running loop three ways; returns when each began, roughly."""
    with watched(sampler, THRESHOLD):
        began = []
        await asyncio.sleep(0.3)
        began.append(time.time())
        spin(1.0)
        await asyncio.sleep(0.3)
        began.append(time.time())
        time.sleep(1.0)
        await asyncio.sleep(0.3)
        began.append(time.time())
        holder = threading.Thread(target=hold_gil, name="holder")
        holder.start()
        await asyncio.sleep(0.05)  # the loop waits for the GIL to come back from the holder
        holder.join()
        await asyncio.sleep(0.5)
        return began


@pytest.fixture(scope="module")
def stalled():
    sampler = Sampler(rate=200, cpu_budget=0.5)
    sampler.start()
    try:
        began = asyncio.run(stalled_loop(sampler))
        deadline = time.time() + 30
        while len(sampler.stalls()["records"]) < 3 and time.time() < deadline:
            time.sleep(0.05)
        yield sampler, began, sampler.profile()
    finally:
        sampler.stop()


def at(stalls: list[dict[str, Any]], began: float) -> dict[str, Any]:
    """The longest stall that began after `began` and within a second of it."""
    return max((s for s in stalls if began - 0.05 <= s["start"] < began + 1.0), key=lambda s: s["duration"])


def test_a_busy_loop_stalls_for_as_long_as_it_ran(stalled):
    sampler, began, _ = stalled
    stall = at(sampler.stalls()["explained"], began[0])
    assert stall["duration"] >= 0.95
    assert stall["stack"][0].startswith("spin (test_stalls.py")
    assert most_sampled_state(stall) in ("cpu-gil", "cpu", "cpu-wait"), stall["states"]  # "cpu": free-threaded


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


class Late(logging.Filter):
    """distributed's line reaches its handlers late, as on a loaded machine."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg.startswith(UNRESPONSIVE):  # a str method: formats nothing
            time.sleep(0.5)
        return True


def test_our_line_follows_distributed_s_even_when_its_handlers_come_late(stalled):
    sampler, began, _ = stalled
    stall = at(sampler.stalls()["explained"], began[0])
    tick, lines, late = logging.getLogger(TICK_LOGGER), Lines(), Late()
    ExplainStalls.hold(sampler)
    tick.addFilter(late)
    tick.addHandler(lines)
    try:
        message = UNRESPONSIVE + " in %s for %.2fs."
        record = tick.makeRecord(tick.name, logging.WARNING, __file__, 0, message, ("Worker", stall["duration"]), None)
        record.created = stall["start"] + stall["duration"] + 0.05  # when distributed's tick saw it
        tick.handle(record)
        wait_for(lambda: len(lines.lines) >= 2, "both lines")
    finally:
        tick.removeHandler(lines)
        tick.removeFilter(late)
        ExplainStalls.release()
    assert lines.lines[0].startswith(UNRESPONSIVE), lines.lines
    assert lines.lines[1].startswith("dask-pyspy: that") and "stall" in lines.lines[1], lines.lines


def test_a_blocked_loop_names_its_system_call(stalled):
    sampler, began, _ = stalled
    stall = at(sampler.stalls()["explained"], began[1])
    assert stall["duration"] >= 0.95
    assert most_sampled_state(stall) == "blocked", stall["states"]
    assert stall["call"] in ("clock_nanosleep", "nanosleep", "select", "pselect6")


def test_a_loop_waiting_for_the_gil_names_its_holder_where_the_reader_can(stalled):
    sampler, began, _ = stalled
    found = sampler.stalls()
    stall = at(found["explained"], began[2])
    reader = sampler.stats()["reader"]
    if getattr(sys, "_is_gil_enabled", lambda: True)() is False:
        assert found["holders"] == "no GIL: free-threaded"
        return  # nothing to wait for: the holder runs beside the loop
    assert most_sampled_state(stall) == "gil-wait", stall["states"]
    if reader == "pyspy":
        assert found["holders"] == "unknown on py-spy's reader" and not stall["gil_holders"]
        assert "an unknown thread (unknown on py-spy's reader)" in describe({**stall, "holders": found["holders"]})
        return
    assert found["holders"] == "known"
    holder = stall["gil_holders"][0]
    assert holder["function"].startswith("hold_gil (test_stalls.py") and holder["thread"].startswith("holder")
    assert holder["seconds"] >= stall["states"]["gil-wait"] / 2


def test_a_saved_profile_keeps_its_stalls(stalled, tmp_path):
    _, began, prof = stalled
    prof.save(tmp_path / "p.pyspy.gz")
    back = Profile.load(tmp_path / "p.pyspy.gz")
    assert [s["start"] for s in back.stalls()] == [s["start"] for s in prof.stalls()]
    assert at(back.stalls(min_duration=0.5), began[0])["duration"] >= 0.95
    assert len(back.stalls(limit=1)) == 1
    (stats,) = (p["stats"]["stalls"] for p in back.processes)
    assert stats["watched"] and stats["threshold"] == pytest.approx(THRESHOLD)
    assert len(stats["records"]) >= 3


def test_the_stall_flame_graph_holds_the_loop_inside_stalls(stalled):
    _, _, prof = stalled
    svg = prof.flamegraph_svg("stalls", stalls=True)
    assert svg is not None and "spin" in svg and "stalled_loop" in svg


def test_bad_arguments_are_named(stalled):
    sampler, _, prof = stalled
    with pytest.raises(ValueError, match="threshold must be a positive number of seconds"):
        sampler.native.watch_loop(lambda timeout=None: [], 0)
    with pytest.raises(ValueError, match="min_duration must be a number of seconds, 0 or more"):
        prof.stalls(min_duration=-1)
    with pytest.raises(ValueError, match="limit must be a positive integer or None"):
        prof.stalls(limit=0)


def test_a_description_says_most_first():
    stall = {
        "duration": 2.0,
        "states": {"gil-wait": 1.5, "cpu-gil": 0.4, "cpu-wait": 0.01},
        "activity": "worker: gather",
        "stack": ["f (a.py:1)"],
        "call": None,
        "gil_holders": [{"task_key": "('slow-1', 3)", "function": "sum (x.py:2)", "thread": "t", "activity": None}],
    }
    assert describe(stall) == (
        "2.0 s stall: 1.5 s waiting for the GIL held by task ('slow-1', 3) in `sum (x.py:2)`; "
        "0.4 s running worker: gather at `f (a.py:1)`"
    )

    unsampled = {**stall, "gil_holders": [], "holders": "known"}
    assert "waiting for the GIL held by a thread not sampled" in describe(unsampled)


def loop_reads(sampler: Sampler) -> int:
    stats = sampler.stats()
    return stats["ticks"] - stats["failed_ticks"]  # a failed tick reads no loop


def drained(sampler: Sampler, timeout: float = 60.0) -> None:
    """Until two ticks have read the loops since the call: the second began after the
    call, so it took every stall finished before it from the loop's ring."""
    first = loop_reads(sampler)
    deadline = time.monotonic() + timeout
    while loop_reads(sampler) < first + 2:
        assert time.monotonic() < deadline, f"the sampler did not tick twice within {timeout:g} s"
        time.sleep(0.01)


async def many_short_stalls(sampler: Sampler, n: int) -> None:
    """`n` loop iterations of 2 ms, stalls at a 1 ms threshold, at most 48 (of a ring's
    64) between two reads of the loop: a slow reader's ticks, spaced out by its CPU budget
    or a loaded machine, would let the ring fill and lose the rest (counted, not kept)."""
    with watched(sampler, 0.001):
        for i in range(n):
            spin(0.002)
            await asyncio.sleep(0)
            if i % 48 == 47:
                # Waited for off the loop, which then polls with no deadline: no stall.
                await asyncio.get_running_loop().run_in_executor(None, drained, sampler)


def test_unwatching_keeps_the_stalls_the_ring_still_holds():
    """A loop unwatched before a tick took its last stalls from the ring (here: a sampler
    that never ticks) keeps them; they were dropped, uncounted."""
    sampler = Sampler(rate=100)

    async def stalls_twice() -> None:
        with watched(sampler, 0.01):
            for _ in range(3):  # the first iteration began before the loop was watched
                spin(0.05)
                await asyncio.sleep(0)

    asyncio.run(stalls_twice())
    found = sampler.stalls()
    assert found["count"] == 2 and found["lost"] == 0, found
    assert all(duration >= 0.05 for _, duration in found["records"]), found["records"]


def test_a_window_carries_the_longest_records_and_counts_them_all():
    sampler = Sampler(rate=100)
    sampler.start()
    try:
        asyncio.run(many_short_stalls(sampler, 2_600))  # the first and last are no stalls
        deadline = time.time() + 30
        while (found := sampler.stalls())["count"] + found["lost"] < 2_500 and time.time() < deadline:
            time.sleep(0.05)
    finally:
        sampler.stop()
    assert found["count"] + found["lost"] >= 2_500
    assert len(found["records"]) == 2_000 and len(found["explained"]) == 100
    starts = [start for start, _ in found["records"]]
    assert starts == sorted(starts)
    shortest_kept = min(d for _, d in found["records"])
    assert found["stalled_s"] >= sum(d for _, d in found["records"]) + 500 * 0.002 * 0.9
    assert all(s["duration"] >= shortest_kept for s in found["explained"])
