"""`Profile.timeline()` and the report's timeline chart, on a profile a real sampler took
while this thread ran one task prefix for a known interval, then another; the chart is
read back from a real browser."""

from __future__ import annotations

import gzip
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dask_pyspy import Profile, Sampler

SECONDS = 1.5  # each prefix runs this long: several 0.5 s steps


def busy(until: float) -> None:
    while time.time() < until:
        sum(range(1000))


class Recording:
    """Prefix "load" in `load`, then "total" in `total` (Unix seconds)."""

    def __init__(self) -> None:
        sampler = Sampler(rate=200, idle=True, cpu_budget=0.5)
        sampler.start()
        try:
            self.load = self._run(sampler, "load")
            self.total = self._run(sampler, "total")
            self.profile = sampler.profile(self.load[0] - 0.2, time.time())
        finally:
            sampler.stop()

    @staticmethod
    def _run(sampler: Sampler, prefix: str) -> tuple[float, float]:
        ident = threading.get_ident()
        start = time.time()
        sampler.set_thread_tag(ident, f"('{prefix}-1', 0)", prefix)
        try:
            busy(start + SECONDS)
        finally:
            sampler.clear_thread_tag(ident)
        return start, time.time()


@pytest.fixture(scope="module")
def recording() -> Iterator[Recording]:
    yield Recording()


def steps_with_time(timeline: dict, name: str, kind: str = "worker") -> list[tuple[float, float]]:
    """The (start, stop) of every step where series `name` has wall time."""
    (series,) = [s for s in timeline["series"] if s["name"] == name and s["kind"] == kind]
    t0, step = timeline["start"], timeline["step"]
    return [(t0 + i * step, t0 + (i + 1) * step) for i, v in enumerate(series["wall"]) if v > 0]


def inside(steps: list[tuple[float, float]], interval: tuple[float, float]) -> bool:
    """Every step overlaps the interval (a sample's 5 ms may reach just past its end)."""
    return all(lo < interval[1] + 0.05 and hi > interval[0] for lo, hi in steps)


def test_each_prefix_has_time_only_in_its_interval(recording):
    timeline = recording.profile.timeline(step=0.5)
    assert timeline["step"] == 0.5 and timeline["start"] % 0.5 == 0
    for name, interval in (("load", recording.load), ("total", recording.total)):
        steps = steps_with_time(timeline, name)
        assert len(steps) >= 3 and inside(steps, interval), (name, steps, interval)
    summary = recording.profile.summary()
    by_name = {s["name"]: s for s in timeline["series"]}
    for p in summary["prefixes"]:
        assert by_name[p["prefix"]]["seconds"] == pytest.approx(p["seconds"])
        assert sum(by_name[p["prefix"]]["cpu"]) == pytest.approx(p["cpu"])
    totals = timeline["kinds"]["worker"]
    assert sum(totals["wall"]) == pytest.approx(summary["seconds"]) and totals["processes"] == 1
    assert {s["group"] for s in timeline["series"]} <= {"prefix", "activity"}


def test_default_step_and_bad_arguments(recording):
    timeline = recording.profile.timeline()
    assert timeline["step"] == 1.0 and len(timeline["kinds"]["worker"]["wall"]) == timeline["steps"]
    spans = recording.profile.timeline(by="span")
    assert {s["name"] for s in spans["series"] if s["group"] == "span"} == {"(no span)"}
    for bad in (0, -1.0, "1", float("nan"), True):
        with pytest.raises(ValueError, match="step must be a (positive )?number"):
            recording.profile.timeline(step=bad)
    with pytest.raises(ValueError, match="step must give at most 20000 steps"):
        recording.profile.timeline(step=1e-6)
    with pytest.raises(ValueError, match="by must be one of 'prefix', 'span'"):
        recording.profile.timeline(by="task")


def test_an_aggregated_profile_keeps_its_timeline_in_10_s_cells(recording):
    folded = recording.profile.aggregated()
    assert folded.keeps_times and 'class="timeline"' in folded.to_html()
    timeline = folded.timeline()
    assert timeline["step"] == 10.0
    (load,) = [s for s in timeline["series"] if s["name"] == "load"]
    assert load["seconds"] == pytest.approx(
        next(p["seconds"] for p in folded.summary()["prefixes"] if p["prefix"] == "load")
    )


def test_an_aggregated_profile_without_cells_has_no_timeline(recording):
    """As dask-pyspy aggregated before it kept timeline cells."""
    assert 'class="timeline"' in recording.profile.to_html()
    aggregated = recording.profile.with_metadata(aggregate=True)
    page = aggregated.to_html()
    assert (
        'class="timeline"' not in page
        and "No timeline: the samples were aggregated by a dask-pyspy that kept no sample times" in page
    )
    with pytest.raises(ValueError, match="aggregated by a dask-pyspy that kept no timeline"):
        aggregated.timeline()


def stretched(profile: Profile, path: Path, factor: float) -> Profile:
    """`profile` with its sample times and weights `factor` times longer: a day's profile
    from seconds of sampling, saved and edited as its `.pyspy.gz` file."""
    profile.save(path)
    doc = json.loads(gzip.decompress(path.read_bytes()))
    samples = doc["profile"]["samples"]
    first, *rest = samples["time_delta_ns"]
    samples["time_delta_ns"] = [first, *(int(d * factor) for d in rest)]
    samples["weight_us"] = [int(w * factor) for w in samples["weight_us"]]
    samples["cpu_us"] = [int(c * factor) for c in samples["cpu_us"]]
    path.write_bytes(gzip.compress(json.dumps(doc).encode()))
    return Profile.load(path)


def chart_values(driver, weight: str) -> dict[str, list[float]]:
    """Seconds per step of each series of the worker chart, as the page's SVG carries them."""
    found = driver.execute_script(
        "var out = {}; document.querySelectorAll('.tl-kind[data-kind=worker] .tl-chart[data-weight=' + arguments[0]"
        " + '] .tl-series').forEach(function (p) { out[p.dataset.name] = p.dataset.values.split(',').map(Number); });"
        " return out;",
        weight,
    )
    return {name: list(values) for name, values in found.items()}


def test_the_chart_in_a_browser(recording, tmp_path):
    from tests.cluster.browser import console_errors, screenshot, start_chromium

    driver = start_chromium()
    try:
        driver.get(recording.profile.save(tmp_path / "r.html").as_uri())
        chart = driver.find_element("css selector", ".timeline")
        t0, step = float(chart.get_attribute("data-start") or "nan"), float(chart.get_attribute("data-step") or "nan")
        values = chart_values(driver, "wall")
        for name, interval in (("load", recording.load), ("total", recording.total)):
            steps = [(t0 + i * step, t0 + (i + 1) * step) for i, v in enumerate(values[name]) if v > 0]
            assert steps and inside(steps, interval), (name, steps, interval)
        assert sum(chart_values(driver, "cpu")["load"]) > 0
        driver.execute_script("arguments[0].scrollIntoView();", chart)
        screenshot(driver, "timeline-report")
        driver.find_element("css selector", "label[for=tl-cpu]").click()
        assert driver.find_element("css selector", ".tl-cpu").is_displayed()
        assert not driver.find_element("css selector", ".tl-wall").is_displayed()
        screenshot(driver, "timeline-report-cpu")
        span = recording.total[1] - recording.load[0]
        # Ten minutes label every minute, a day every two hours: no label needs seconds.
        for seconds, least_step, name in ((600, 2, "10min"), (86400, 300, "day")):
            long = stretched(recording.profile, tmp_path / f"{name}.pyspy.gz", seconds / span)
            driver.get(long.save(tmp_path / f"{name}.html").as_uri())
            chart = driver.find_element("css selector", ".timeline")
            assert float(chart.get_attribute("data-step") or "nan") >= least_step
            labels = [t.text for t in driver.find_elements("css selector", ".tl-wall text") if ":" in t.text]
            assert 4 <= len(labels) <= 11 and all(label.count(":") == 1 for label in labels), labels
            driver.execute_script("arguments[0].scrollIntoView();", chart)
            screenshot(driver, f"timeline-report-{name}")
        assert console_errors(driver) == []
    finally:
        driver.quit()


def test_steps_cover_the_collection_window_up_to_a_week(recording):
    load = recording.load
    wide = recording.profile.with_metadata(window=[load[0] - 100, load[0] + 100]).timeline(step=1)
    assert wide["start"] <= load[0] - 100 and wide["start"] + wide["steps"] >= load[0] + 100
    endless = recording.profile.with_metadata(window=[0.0, load[1]]).timeline()
    assert endless["step"] == 1.0 and endless["start"] > load[0] - 5, "not steps back to 1970"


def test_many_processes_draw_the_most_median_and_least_memory():
    from dask_pyspy.render.timeline import MOST_LINES, charts

    mib, steps = 2**20, 4
    processes = [
        {"name": f"tcp://w:{i}", "kind": "worker", "cpu": [0.5] * steps, "rss": [i * mib, None, i * mib, 2 * i * mib]}
        for i in range(1, 11)
    ]
    totals = {"processes": len(processes), "wall": [1.0] * steps, "cpu": [0.5] * steps}
    timeline = {"start": 1e9, "step": 1.0, "steps": steps, "kinds": {"worker": totals}, "series": []}
    (kind,) = charts({**timeline, "processes": processes})["kinds"]
    memory = kind["memory"]
    assert [line["name"] for line in memory["lines"]] == ["most", "median", "least"]
    assert [line["peak"] for line in memory["lines"]] == ["20 MiB", "11 MiB", "2 MiB"]
    assert "across 10 processes" in memory["label"]
    assert all(line["path"].count("M") == 2 for line in memory["lines"]), "broken where no process was seen"
    (few,) = charts({**timeline, "processes": processes[:MOST_LINES]})["kinds"]
    assert [line["name"] for line in few["memory"]["lines"]] == [p["name"] for p in processes[:MOST_LINES]]
    (none,) = charts({**timeline, "processes": []})["kinds"]
    assert none["memory"] is None


def test_bytes_held_stack_by_prefix_over_processes_under_resident_memory():
    from dask_pyspy.render.timeline import MOST_HELD, OTHER, OTHER_COLOUR, charts

    mib, steps = 2**20, 2
    held = [{"prefix": f"p{i}", "bytes": [i * mib, None]} for i in range(1, MOST_HELD + 3)]
    processes = [
        {"name": f"tcp://w:{i}", "kind": "worker", "cpu": [0.5] * steps, "rss": [60 * mib] * steps, "in_use": held}
        for i in range(2)
    ]
    processes[0]["arrow"] = [30 * mib, None]
    totals = {"processes": 2, "wall": [1.0] * steps, "cpu": [0.5] * steps}
    series = [{"name": "p10", "kind": "worker", "group": "prefix", "seconds": 1.0, "wall": [1.0] * 2, "cpu": [0.5] * 2}]
    timeline = {"start": 1e9, "step": 1.0, "steps": steps, "kinds": {"worker": totals}, "series": series}
    (kind,) = charts({**timeline, "processes": processes})["kinds"]
    areas = kind["memory"]["held"]
    names = [a["name"] for a in areas]
    assert names == [f"p{i}" for i in range(MOST_HELD + 2, 2, -1)] + [OTHER], "largest first, the rest summed"
    assert areas[0]["peak"] == "20 MiB", "summed over the processes"
    assert areas[-1]["peak"] == "6 MiB" and areas[-1]["colour"] == OTHER_COLOUR, "p1 and p2, in both"
    assert areas[names.index("p10")]["colour"] == kind["legend"][0]["colour"], "a prefix keeps its CPU colour"
    assert len({a["colour"] for a in areas}) == len(areas)
    assert kind["memory"]["ticks"][-1]["label"] == "200", "the stack, 110 MiB, and RSS fit the axis"
    assert kind["memory"]["arrow"]["peak"] == "30 MiB" and kind["memory"]["arrow"]["path"].count("M") == 1


def test_a_day_of_stalls_is_marked_a_row_per_process_merged_per_pixel():
    from dask_pyspy.render.timeline import LEFT, MERGE_GAP, STALL_ROWS, WIDTH, charts

    day, steps = 86400.0, 288
    totals = {"processes": 12, "wall": [1.0] * steps, "cpu": [0.5] * steps}
    timeline = {"start": 1e9, "step": day / steps, "steps": steps, "kinds": {"worker": totals}, "series": []}
    every_second = [[1e9 + i, 0.25] for i in range(0, 86400, 2)]  # 43,200 stalls
    stalls = {f"tcp://w:{i}": every_second[:: i + 1] for i in range(12)}
    stalls["tcp://w:0"] = [*stalls["tcp://w:0"], [1e9 - 10.0, 30.0], [1e9 + day + 5, 1.0]]  # across, past the end
    stalls["scheduler tcp://s:1"] = [[1e9 + 3600, 2.0]]
    (kind,) = charts({**timeline, "processes": []}, stalls)["kinds"]
    strip = kind["stalls"]
    rows = strip["rows"]
    assert len(rows) == STALL_ROWS and rows[0]["name"] == "tcp://w:0", "the most stalled first"
    assert rows[-1]["name"] == f"{12 - STALL_ROWS + 1} other processes"
    for row in rows:
        xs = [(float(m["x"]), float(m["x"]) + float(m["width"])) for m in row["marks"]]
        assert len(xs) <= WIDTH / MERGE_GAP, "at most a mark per pixel"
        assert all(LEFT <= a < b <= LEFT + WIDTH for a, b in xs)
        assert all(b + MERGE_GAP < c for (_, b), (c, _) in zip(xs, xs[1:])), "marks apart by more than the gap"
    shown = sum(m["count"] for row in rows for m in row["marks"])
    workers = sum(len(r) for name, r in stalls.items() if name.startswith("tcp://w"))
    assert shown == workers - 1, "every worker's stall in the chart, the one past its end not"
    assert "scheduler tcp://s:1" not in {row["name"] for row in rows}, "the scheduler's is on its own chart"
    assert charts({**timeline, "processes": []})["kinds"][0]["stalls"] is None
