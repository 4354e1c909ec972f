"""The report's per-process tables of a cluster larger than MAX_PROCESS_ROWS: the
busiest processes get a row each, one line sums the rest. The processes are copies of
windows of a real sampler's profile, each window longer than the last."""

from __future__ import annotations

import threading
import time

import pytest

from dask_pyspy import Profile, Sampler, _native
from dask_pyspy.render.tables import MAX_PROCESS_ROWS
from tests.inprocess.test_report_activities import rows, section

N = MAX_PROCESS_ROWS + 5
HIDDEN = N - MAX_PROCESS_ROWS


def busy_body() -> None:
    sum(range(2000))


def windows(timeout: float = 60.0) -> list[Profile]:
    """N windows from one start, the i-th (i + 1) / N of the whole, with a task running throughout."""
    sampler = Sampler(rate=500, cpu_budget=0.5)
    sampler.start()
    ident = threading.get_ident()
    try:
        start, deadline = time.time(), time.monotonic() + timeout
        sampler.set_thread_tag(ident, "('busy-1', 0)", "busy")
        while sampler.profile(start).n_samples < 4 * N:  # so every window holds samples
            assert time.monotonic() < deadline, f"fewer than {4 * N} samples in {timeout} s"
            end = time.perf_counter() + 0.05
            while time.perf_counter() < end:
                busy_body()
        sampler.clear_thread_tag(ident)
        stop = time.time()
        return [sampler.profile(start, start + (stop - start) * (i + 1) / N) for i in range(N)]
    finally:
        sampler.stop()


@pytest.fixture(scope="module")
def processes() -> list[Profile]:
    """Each window as a process of its own, named worker-i."""
    return [Profile(_native._testing.as_process(w._native, f"worker-{i}", f"-{i}")) for i, w in enumerate(windows())]


def tables(profile: Profile) -> tuple[list[list[str]], list[list[str]]]:
    """The rows of the samplers' table (after the window's) and of the states table."""
    page = profile.to_html()
    about, processes = section(page, "About this profile").split("<table>"), section(page, "Processes").split("<table>")
    return rows(about[2]), rows(processes[1])


def number(cell: str) -> float:
    return float(cell.replace(",", ""))


def test_a_large_cluster_lists_its_busiest_processes_and_sums_the_rest(processes):
    cluster = Profile.merge(processes)
    summary = cluster.summary()
    procs, states = tables(cluster)
    assert len(procs) == len(states) == MAX_PROCESS_ROWS + 1
    more = f"+ {HIDDEN} more processes"
    assert procs[-1][0] == states[-1][0] == more
    seconds = {p["name"]: p["seconds"] for p in summary["processes"]}
    shown = [r[0] for r in procs[:-1]]
    assert [r[0] for r in states[:-1]] == shown
    hidden = set(seconds) - set(shown)
    assert len(hidden) == HIDDEN
    assert min(seconds[n] for n in shown) >= max(seconds[n] for n in hidden), "the busiest are shown"
    assert [seconds[n] for n in shown] == sorted((seconds[n] for n in shown), reverse=True), "busiest first"
    # threads, samples and evicted samples add up to the cluster's
    totals = {p["name"]: p for p in summary["processes"]}
    assert sum(number(r[4]) for r in procs) == summary["samples"]
    assert number(procs[-1][4]) == sum(totals[n]["samples"] for n in hidden)
    assert number(procs[-1][3]) == sum(totals[n]["threads"] for n in hidden)
    assert number(procs[-1][10]) == 0
    # sampled and CPU seconds too, each row rounded to the millisecond
    assert sum(number(r[1]) for r in states) == pytest.approx(summary["seconds"], abs=0.001 * len(states))
    assert number(states[-1][1]) == pytest.approx(sum(seconds[n] for n in hidden), abs=0.001)
    assert number(states[-1][2]) == pytest.approx(sum(totals[n]["cpu"] for n in hidden), abs=0.001)


def test_a_small_cluster_lists_every_process_in_its_order(processes):
    procs, states = tables(Profile.merge(processes[:3]))
    assert [r[0] for r in procs] == [r[0] for r in states] == ["worker-0", "worker-1", "worker-2"]
