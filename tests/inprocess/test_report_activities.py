"""The report's time outside tasks by event-loop activity, and by="activity" views, on
profiles a real sampler took while this thread entered activities and ran a task."""

from __future__ import annotations

import base64
import html
import re
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from click.testing import CliRunner

from dask_pyspy import Profile, Sampler, _native
from dask_pyspy.cli import pyspy
from dask_pyspy.render import report
from tests.conftest import frame_names

SECONDS = 0.1  # sampled per activity and task: enough that each has a graph and a clear row
SCHEDULER = "scheduler tcp://127.0.0.1:8786"  # as the scheduler names its own process


def finish_transitions() -> None:
    sum(range(2000))


def serve_data() -> None:
    sum(range(2000))


def balance_work() -> None:
    sum(range(2000))


def inc_body() -> None:
    sum(range(2000))


def sampled(sampler: Sampler, function: str) -> float:
    """Seconds sampled so far with `function` at the top of the stack."""
    return sum(f["seconds"] for f in sampler.profile().summary()["top"] if f["name"] == function)


def run_until_sampled(sampler: Sampler, work: Callable[[], None], timeout: float = 60.0) -> None:
    """Run `work` in a loop until the sampler has SECONDS of it, or fail at the deadline."""
    deadline = time.monotonic() + timeout
    while sampled(sampler, work.__name__) < SECONDS:
        assert time.monotonic() < deadline, f"{work.__name__} was not sampled in {timeout} s"
        end = time.perf_counter() + 0.05
        while time.perf_counter() < end:
            work()


def in_activity(sampler: Sampler, name: str, work: Callable[[], None], calls: int = 0) -> None:
    activity = _native.Activity(name, "dispatch")
    for _ in range(calls):
        sampler._native.count_call(activity)
    previous = sampler._native.enter_activity(activity)
    try:
        run_until_sampled(sampler, work)
    finally:
        sampler._native.leave_activity(previous)


class Recording:
    """Two scheduler activities, one worker activity and a task, one after the other;
    `worker_only` is the window of the worker activity alone."""

    def __init__(self) -> None:
        sampler = Sampler(rate=500, idle=True, cpu_budget=0.5)
        sampler.start()
        try:
            start = time.time()
            in_activity(sampler, "scheduler: task-finished", finish_transitions, calls=3)
            in_activity(sampler, "scheduler: periodic stealing", balance_work)
            worker_start = time.time()
            in_activity(sampler, "worker: get_data", serve_data)
            worker_stop = time.time()
            sampler.set_thread_tag(threading.get_ident(), "('inc-1', 0)", "inc")
            try:
                run_until_sampled(sampler, inc_body)
            finally:
                sampler.clear_thread_tag(threading.get_ident())
            self.profile = sampler.profile(start, time.time(), name=SCHEDULER)
            self.worker_only = sampler.profile(worker_start, worker_stop, name=SCHEDULER)
        finally:
            sampler.stop()


@pytest.fixture(scope="module")
def recording() -> Iterator[Recording]:
    yield Recording()


def rows(page: str) -> list[list[str]]:
    """Every table row of a page but the headers, as its cells' text."""
    cells = [re.findall(r"<td[^>]*>(.*?)</td>", tr, re.S) for tr in re.findall(r"<tr>(.*?)</tr>", page, re.S)]
    return [[html.unescape(re.sub(r"<[^>]+>", "", c)) for c in row] for row in cells if row]


def section(page: str, heading: str) -> str:
    """The page from an <h2> heading to the next one."""
    return re.split(rf"<h2[^>]*>{re.escape(heading)}</h2>", page, maxsplit=1)[1].split("<h2", 1)[0]


def graph(page: str, title: str) -> str:
    """The SVG of the flame graph frame titled `title`."""
    (src,) = re.findall(rf'<iframe class="flame" title="{re.escape(html.escape(title))}"[^>]*src="([^"]+)"', page)
    return base64.b64decode(src.split(",", 1)[1]).decode()


def test_time_outside_tasks_is_a_table_by_activity(recording):
    page = recording.profile.to_html()
    table = {r[0]: r for r in rows(section(page, "Time outside tasks, by activity"))}
    assert table["scheduler: task-finished"][1] == "scheduler"
    assert table["scheduler: periodic stealing"][1] == "scheduler"
    assert table["worker: get_data"][1] == "worker"
    activity = next(a for a in recording.profile.summary()["activities"] if a["name"] == "task-finished")
    # sampled s, CPU s, GIL share, calls
    assert table["scheduler: task-finished"][2:] == [
        f"{activity['seconds']:,.3f}",
        f"{activity['cpu']:,.3f}",
        f"{100 * activity['gil'] / activity['seconds']:.0f}%",
        "3",
    ]
    assert table["scheduler: periodic stealing"][5] == report.NO_CALLS, "not counted: no number"
    assert "inc" not in table, "task time is not outside tasks"


def test_each_busy_activity_has_its_own_flame_graph(recording):
    page = recording.profile.to_html()
    finished = graph(page, "scheduler: task-finished")
    assert "finish_transitions" in finished
    assert "serve_data" not in finished and "inc_body" not in finished
    assert "serve_data" in graph(page, "worker: get_data")
    assert "Time outside tasks (" in section(page, "Time outside tasks, by activity"), "the graph of it all stays"


def test_the_scheduler_has_a_section_of_its_own(recording):
    page = recording.profile.to_html()
    scheduler = section(page, "Scheduler")
    names = [r[0] for r in rows(scheduler)]
    assert names[:1] and set(names) == {"scheduler: task-finished", "scheduler: periodic stealing"}
    summary = recording.profile.summary()
    busy = sum(a["seconds"] for a in summary["activities"] if a["kind"] == "scheduler")
    (process,) = summary["processes"]
    assert f"{100 * busy / process['seconds']:.0f}% of the {process['seconds']:.2f} s sampled" in scheduler


def test_no_scheduler_section_without_scheduler_activities(recording):
    page = recording.worker_only.to_html()
    assert "<h2>Scheduler</h2>" not in page
    assert "worker: get_data" in section(page, "Time outside tasks, by activity")


def test_the_smallest_activities_sum_into_one_row(recording, monkeypatch):
    monkeypatch.setattr(report, "MAX_ACTIVITY_ROWS", 2)
    activities = recording.profile.summary()["activities"]
    table = rows(section(recording.profile.to_html(), "Time outside tasks, by activity"))
    assert [r[0] for r in table[:2]] == [a["activity"] for a in activities[:2]]
    (other,) = table[2:]
    assert other[0] == f"other activities ({len(activities) - 2})"
    assert other[2] == f"{sum(a['seconds'] for a in activities[2:]):,.3f}"


def test_by_activity_roots_work_at_its_activity(recording):
    profile = recording.profile
    svg = profile.flamegraph_svg("by activity", by="activity")
    assert svg is not None and all(name in svg for name in ("task-finished", "get_data", "inc"))
    doc = profile.speedscope(by="activity")
    roots = {
        tuple(frame_names(doc, s)[:2])
        for p in doc["profiles"]
        for s in p["samples"]
        if "finish_transitions" in frame_names(doc, s) or "inc_body" in frame_names(doc, s)
    }
    assert ("scheduler", "task-finished") in roots and ("tasks", "inc") in roots
    by_activity = Profile.from_wire(profile.to_wire(), by="activity")
    assert "scheduler: task-finished" in by_activity.to_html()


def test_bogus_by_names_activity_among_the_choices(recording):
    with pytest.raises(ValueError, match="by must be one of .*'activity', got 'bogus'"):
        recording.profile.flamegraph_svg("x", by="bogus")
    result = CliRunner().invoke(pyspy, ["record", "--scheduler", "tcp://127.0.0.1:1", "--by", "bogus"])
    assert result.exit_code == 2 and "'activity'" in result.output
