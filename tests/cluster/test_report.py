"""HTML reports and the dashboard page, opened in a real headless Chromium."""

from __future__ import annotations

import base64
import functools
import http.server
import os
import re
import shutil
import threading
import time
import urllib.request
from html import escape, unescape
from pathlib import Path
from typing import Callable

import pytest
from dask.utils import key_split
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.support.ui import WebDriverWait

import dask_pyspy
from dask_pyspy import Sampler
from dask_pyspy.render.tables import FREE_THREADED_STATES, STATES, budget_needed
from tests.cluster.browser import (
    console_errors,
    cut_from_the_left,
    first_graph_labels,
    screenshot,
    search_first_flame_graph,
    start_chromium,
)
from tests.cluster.workload import alpha, beta, gamma, recurse, spin
from tests.conftest import FAST_WORKS, FREE_THREADED

HOSTILE = "<script>alert(1)</script>"


@pytest.fixture(scope="module")
def chromium():
    driver = start_chromium()
    yield driver
    driver.quit()


def test_report_opens_offline_and_escapes_names(client, chromium, tmp_path):
    path = tmp_path / "report.html"
    with dask_pyspy.pyspy_report(path, client=client):
        futures = client.map(alpha, range(200), [0.01] * 200)
        futures.append(client.submit(gamma, 0, 0.5, key=HOSTILE))
        client.gather(futures)
    html = path.read_text()
    shown = key_split(HOSTILE)  # the report lists task prefixes: 'script>alert(1)</script'
    assert "<script>alert" not in html and shown not in html, "user-supplied names are escaped"
    assert escape(shown) in html
    assert "http://" not in html.replace("http://www.w3.org", "")  # no network resources
    chromium.get(path.as_uri())
    assert chromium.title == "dask-pyspy report"
    body = chromium.find_element("tag name", "body").text
    assert shown in body, "the hostile name shows as text"
    assert "alpha" in body and "Summary" in body
    matched = search_first_flame_graph(chromium, "alpha")
    assert re.fullmatch(r"Matched: [0-9.]+%", matched) and matched != "Matched: 0%", matched
    chromium.find_element("css selector", "details summary").click()
    opened = chromium.find_element("css selector", "details iframe.flame")
    assert opened.get_attribute("src").startswith("data:image/svg+xml"), "a per-prefix graph loads when opened"
    shot = screenshot(chromium, "report")
    assert shot.stat().st_size > 10_000
    assert console_errors(chromium) == []


def flame_graphs(html: str) -> dict[str, str]:
    """Each flame graph's SVG, by the title of its frame."""
    found = re.findall(r'<iframe class="flame" title="([^"]*)"[^>]*?src="data:image/svg\+xml;base64,([^"]+)"', html)
    return {unescape(title): base64.b64decode(data).decode() for title, data in found}


def frame_labels(svg: str) -> list[str]:
    """inferno's tooltip of every frame: 'name (file:line) (N μs, x%)'."""
    return [unescape(t) for t in re.findall(r"<title>([^<]*)</title>", svg)]


def svg_depth(svg: str) -> int:
    """Rows of frames the graph needs (inferno: 16 px each, plus margins)."""
    return int(re.search(r'<svg[^>]*\sheight="(\d+)"', svg).group(1)) // 16


def test_task_views_lead_with_task_code(client, chromium, tmp_path):
    start = time.time()
    # pure=False: keys of their own, never results an earlier test left in memory.
    futures = client.map(alpha, range(200), [0.01] * 200, pure=False) + client.map(
        beta, range(200), [0.01] * 200, pure=False
    )
    futures += [client.submit(recurse, 300, 0.3, key=f"recurse-{i}") for i in range(4)]
    futures += [client.submit(gamma, i, 0.1, key=f"extra{i}-x") for i in range(9)]
    client.gather(futures)
    by_prefix = client.pyspy_profile(start=start, by="prefix")
    by_task = client.pyspy_profile(start=start, by="task")
    graphs = flame_graphs(by_prefix.to_html())
    lead = frame_labels(graphs["Task time"])
    lead_by_task = frame_labels(flame_graphs(by_task.to_html())["Task time"])
    assert any(t.startswith("alpha (") and "workload.py" not in t for t in lead), "a root per prefix"
    assert any(t.startswith("alpha-") for t in lead_by_task) and not any(t.startswith("alpha-") for t in lead)
    # Task stacks start at the task's own code; the machinery shows only as a leaf, when
    # a sample caught the worker between tasks' calls.
    machinery = ("threading.py", "worker.py", "_task_spec.py", "threadpoolexecutor.py")
    share = sum(float(re.search(r"([0-9.]+)%\)$", t).group(1)) for t in lead if any(m in t for m in machinery))
    # Free-threaded, every thread is runnable at once: on 2 cores a woken task thread waits
    # for a CPU wherever it was preempted, the worker's tagging lines too. With a GIL it
    # waits in the GIL's acquisition, inside the task's own call.
    assert share < (20 if FREE_THREADED else 2), [t for t in lead if any(m in t for m in machinery)]
    assert any(t.startswith("alpha (workload.py") for t in lead)
    raw = frame_labels(graphs[by_prefix.processes[0]["name"]])
    assert any("threading.py" in t for t in raw), "per-process graphs keep the raw stacks"
    assert svg_depth(graphs["Task time"]) < 40, "a 300-deep recursion is folded, not setting the height"
    assert sum(t.startswith("recurse (workload.py") for t in frame_labels(graphs["Task time"])) <= 2
    prefixes = [p["prefix"] for p in by_prefix.summary()["prefixes"]]
    assert len(prefixes) >= 12 and all(p in graphs for p in prefixes), "every prefix has its graph"
    path = by_prefix.save(tmp_path / "tasks.html")
    chromium.get(path.as_uri())
    assert search_first_flame_graph(chromium, "alpha") != "Matched: 0%"
    screenshot(chromium, "report-task-first")
    assert console_errors(chromium) == []


def busy(stop: threading.Event) -> None:
    while not stop.is_set():
        spin(0.01)


def sampled_report(sampler: Sampler, until: Callable[[dict], bool]) -> str:
    """The report of `sampler` once its stats satisfy `until`."""
    stop = threading.Event()
    threads = [threading.Thread(target=busy, args=(stop,)) for _ in range(3)]
    sampler.start()
    for t in threads:
        t.start()
    try:
        deadline = time.time() + 60
        while not (until(sampler.stats()) and sampler.profile().n_samples) and time.time() < deadline:
            time.sleep(0.05)
        return sampler.profile().to_html()
    finally:
        stop.set()
        for t in threads:
            t.join()
        sampler.stop()


def sampler_table(chromium):
    """The table of each process's sampler, under "About this profile"."""
    return chromium.find_element("xpath", "//table[.//th[normalize-space()='achieved Hz']]")


def process_row(chromium, html: str, tmp_path) -> dict[str, str]:
    """The report's first process row as the browser shows it, by column."""
    path = tmp_path / "row.html"
    path.write_text(html)
    chromium.get(path.as_uri())
    table = sampler_table(chromium)
    header = [th.text.replace("\n", " ") for th in table.find_elements("css selector", "th")]
    cells = [td.text for td in table.find_elements("css selector", "tr")[1].find_elements("css selector", "td")]
    return dict(zip(header, cells))


def test_throttling_is_explained_and_lost_samples_are_a_rate(chromium, tmp_path):
    # Throttled, and long enough for the achieved rate to show it (a first tick or two
    # can come at the asked rate).
    html = sampled_report(
        Sampler(rate=2000, cpu_budget=0.001),
        until=lambda st: st["throttled_ticks"] and st["achieved_rate"] < 0.9 * st["requested_rate"],
    )
    row = process_row(chromium, html, tmp_path)
    assert "held to the CPU budget (0.1% of a core)" in row["why lower"] and "cpu_budget" in row["why lower"]
    # What the asked rate would need, from what a tick cost and the rate the budget gave:
    # more than the budget held to, by at least the rate's shortfall.
    needed = re.search(r"2000 Hz needs ([\d.]+)%", row["why lower"])
    shortfall = 2000 / float(row["achieved Hz"])  # shown rounded: a little slack
    assert needed and float(needed.group(1)) >= 0.098 * shortfall, (row["why lower"], row["achieved Hz"])
    # The summary opens with it, in one sentence with the fix, linked to the sampler's figures.
    warning = chromium.find_element("css selector", ".findings .warn")
    assert warning.text.startswith("The CPU budget (0.1% of a core) held "), warning.text
    assert f"needs {needed.group(1)}%; raise it with PySpyPlugin(cpu_budget=...)" in warning.text, warning.text
    assert warning.find_element("tag name", "a").get_attribute("href").endswith("#about")
    assert re.fullmatch(r"\d+\.\d%", row["samples lost"]), row
    assert row["errors"] == "", "lost samples and throttling are not errors"
    assert console_errors(chromium) == []


def test_the_budget_a_held_rate_needs_pays_for_the_first_ticks_too():
    """The demo's worker at its defaults: ticks of 99 µs on average need 0.99% of a core
    for 100 Hz, yet 1% held it to 87 Hz, as the first ticks (each code object read once)
    were paid first. The budget named must be more than the one that held it."""
    ticks = 1305
    stats = {"cpu_s": ticks * 99e-6, "ticks": ticks, "requested_rate": 100.0, "achieved_rate": 87.0}
    per_tick, needed = budget_needed({**stats, "config": {"cpu_budget": 0.01}})
    assert round(1e6 * per_tick) == 99
    assert needed == 1.5, "100 / 87 of 1%, rounded up to 0.5"


def test_time_outside_tasks_has_its_split_and_top_functions():
    html = sampled_report(Sampler(rate=200, cpu_budget=0.5), until=lambda st: st["ticks"])  # busy threads, no tasks
    row = re.search(r"<tr><td>\(no task\)</td>(.*?)</tr>", html).group(1)
    cells = re.findall(r"<td[^>]*>(.*?)</td>", row)
    states = FREE_THREADED_STATES if FREE_THREADED else STATES
    cpu, shares, top = cells[2], cells[3 : 3 + len(states)], cells[-1]
    assert float(cpu) >= 0 and sum(float(c.rstrip("%")) for c in shares) == pytest.approx(100, abs=2), cells
    assert "busy" in top or "spin" in top, top
    assert (
        "Time outside tasks (100% of samples: event loops, communication, deserialising and importing, the scheduler)"
        in html
    )


@pytest.mark.skipif(FREE_THREADED, reason="free-threaded builds have no fallback reader (test_reader checks it)")
@pytest.mark.skipif(not FAST_WORKS, reason="before 3.11 py-spy's reader is the only one: no fallback")
def test_a_reader_fallback_is_an_error(chromium, tmp_path, monkeypatch):
    monkeypatch.setenv("DASK_PYSPY_TESTING", "break-self-check")
    html = sampled_report(Sampler(reader="auto"), until=lambda st: st["ticks"])
    row = process_row(chromium, html, tmp_path)
    assert row["reader"] == "pyspy" and row["errors"].startswith("fast reader not used:"), row
    cell = sampler_table(chromium).find_elements("css selector", "tr")[1]
    assert cell.find_elements("css selector", "td .warn"), "real failures are styled as warnings"


def test_empty_window(client, chromium, tmp_path):
    long_ago = time.time() - 3600
    prof = client.pyspy_profile(start=long_ago - 60, stop=long_ago)
    assert prof.n_samples == 0 and prof.sampled_seconds == 0.0
    assert "0 samples, 0.0 thread-s" in repr(prof) and "-0.0" not in repr(prof)
    with pytest.raises(ValueError, match=r"cannot save '.*empty\.json': the profile holds no samples"):
        prof.save(tmp_path / "empty.json")
    assert not (tmp_path / "empty.json").exists()
    chromium.get(prof.save(tmp_path / "empty.html").as_uri())
    assert "No samples in this window" in chromium.find_element("tag name", "body").text
    assert console_errors(chromium) == []


# speedscope's own app, the npm release that ci/test.sh unpacks.
SPEEDSCOPE_APP = Path(
    os.environ.get("DASK_PYSPY_SPEEDSCOPE")
    or Path(__file__).resolve().parents[2] / ".cache/speedscope/package/dist/release"
)


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def speedscope_site(tmp_path):
    """speedscope's app served over HTTP with room for profiles; yields (directory, base URL)."""
    assert (SPEEDSCOPE_APP / "index.html").exists(), (
        f"speedscope's app is missing from {SPEEDSCOPE_APP}: run ci/test.sh"
    )
    site = shutil.copytree(SPEEDSCOPE_APP, tmp_path / "site")
    handler = functools.partial(QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield site, f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


@pytest.fixture
def webgl_chromium():
    driver = start_chromium(webgl=True)
    yield driver
    driver.quit()


def test_speedscope_app_opens_on_the_profile_with_most_task_time(client, speedscope_site, webgl_chromium):
    site, url = speedscope_site
    driver = webgl_chromium
    start = time.time()
    client.gather(
        client.map(alpha, range(200), [0.01] * 200, pure=False) + client.map(beta, range(50), [0.01] * 50, pure=False)
    )
    for by, merged in (
        ("prefix", "(all threads, task code only)"),
        ("task", "whole cluster by task"),
        ("activity", "whole cluster by activity"),
    ):
        prof = client.pyspy_profile(start=start, by=by)
        doc = prof.speedscope()
        profiles, active = doc["profiles"], doc["activeProfileIndex"]
        tasks = [p for p in profiles if merged in p["name"]]
        assert profiles[active] == max(tasks, key=lambda p: p["endValue"]), "opens on the most task time"
        prof.save(site / f"{by}.json")
        driver.get(f"{url}/index.html?{by}#profileURL=/{by}.json")  # a new page, not a new hash
        title = f"{profiles[active]['name']} ({active + 1}/{len(profiles)})"
        WebDriverWait(driver, 60).until(lambda d, title=title: title in d.find_element("tag name", "body").text)
        assert "went wrong" not in driver.find_element("tag name", "body").text
        screenshot(driver, f"speedscope-by-{by}")
    assert console_errors(driver) == []


def test_download_button_gives_the_speedscope_profile(client, chromium, tmp_path):
    prof = client.pyspy_profile(last=30)
    path = prof.save(tmp_path / "r.html")
    chromium.get(path.as_uri())
    size = chromium.execute_script("return atob(document.getElementById('speedscope-data').textContent.trim()).length;")
    assert size == len(prof.to_bytes(compress=True))
    chromium.find_element("id", "download").click()
    assert console_errors(chromium) == []


def test_dashboard_page(client, chromium):
    client.gather(client.map(alpha, range(100)))
    port = client.scheduler_info()["services"]["dashboard"]
    chromium.get(f"http://127.0.0.1:{port}/pyspy/?last=60")
    assert "last 60 s" in chromium.title
    body = chromium.find_element("tag name", "body").text
    assert "Live stacks" in body and "Task time across the cluster" in body
    assert search_first_flame_graph(chromium, "alpha") != "Matched: 0%"
    assert not cut_from_the_left(first_graph_labels(chromium)), "labels keep their function"
    screenshot(chromium, "dashboard")
    assert console_errors(chromium) == []
    # Auto-refresh: choosing 5 s keeps the window and reloads the page by itself.
    chromium.execute_script(
        "var r = document.getElementById('refresh'); r.value = '5'; r.dispatchEvent(new Event('change'));"
    )
    WebDriverWait(chromium, 30).until(lambda d: "refresh=5" in d.current_url and "last=60" in d.current_url)
    WebDriverWait(chromium, 30).until(lambda d: d.execute_script("return document.readyState") == "complete")
    chromium.execute_script("window.notReloaded = true;")
    WebDriverWait(chromium, 60).until(lambda d: d.execute_script("return window.notReloaded === undefined"))
    chromium.get("about:blank")  # away from the page that reloads itself
    # distributed's own pages list it in their "More..." menu.
    chromium.get(f"http://127.0.0.1:{port}/status")
    WebDriverWait(chromium, 30).until(lambda d: d.find_elements("css selector", ".dropdown-content a"))
    links = chromium.find_elements("css selector", ".dropdown-content a[href='pyspy']")
    assert links and links[0].get_attribute("textContent") == "Py-Spy Profile"
    chromium.get(links[0].get_attribute("href"))
    assert "dask-pyspy: last 30 s" in chromium.title
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/pyspy/dump").read().decode()
    assert "Process scheduler" in text and "Thread 0x" in text
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/pyspy/?last=-3")
    assert err.value.code == 400
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/pyspy/?refresh=7")
    assert err.value.code == 400 and "refresh must be one of 0, 5, 30" in err.value.reason


def _timed(client, work: Callable[..., int], seconds: float) -> tuple[float, float]:
    """Runs `work` tasks for about `seconds`; their (start, stop) in Unix seconds."""
    start = time.time()
    client.gather(client.map(work, range(int(seconds / 0.05) * 4), [0.05] * (int(seconds / 0.05) * 4)))
    return start, time.time()


def _steps_with_time(driver, name: str) -> list[tuple[float, float]]:
    """The (start, stop) of each step where the worker wall chart's series `name` has time."""
    chart = driver.find_element("css selector", ".timeline")
    t0, step = (float(chart.get_attribute(f"data-{k}") or "nan") for k in ("start", "step"))
    values = driver.execute_script(
        "var p = document.querySelector('.tl-kind[data-kind=worker] .tl-wall .tl-series[data-name=\"' + arguments[0]"
        " + '\"]'); return p ? p.dataset.values.split(',').map(Number) : [];",
        name,
    )
    return [(t0 + i * step, t0 + (i + 1) * step) for i, v in enumerate(values) if v > 0]


def test_dashboard_timeline_and_a_chosen_range(client, chromium):
    first, second = _timed(client, alpha, 2.0), _timed(client, beta, 2.0)
    port = client.scheduler_info()["services"]["dashboard"]
    page = f"http://127.0.0.1:{port}/pyspy/"
    chromium.get(f"{page}?start={first[0] - 1}&stop={second[1] + 1}")
    assert " to " in chromium.title and "s). Show the last" in chromium.find_element("tag name", "p").text
    screenshot(chromium, "dashboard-range")
    for name, (lo, hi) in (("alpha", first), ("beta", second)):
        steps = _steps_with_time(chromium, name)
        assert steps and all(a < hi + 0.5 and b > lo - 0.5 for a, b in steps), (name, steps, lo, hi)
    chart = chromium.find_element("css selector", ".tl-kind[data-kind=worker] .tl-wall")
    chromium.execute_script("arguments[0].scrollIntoView();", chart)
    screenshot(chromium, "dashboard-timeline")
    assert console_errors(chromium) == []
    chromium.get(f"{page}?start={first[0]}&stop={first[1]}")
    assert _steps_with_time(chromium, "alpha") and not _steps_with_time(chromium, "beta"), "only the range is shown"
    # Dragging across the chart's left half reloads with that range.
    chart = chromium.find_element("css selector", ".tl-kind[data-kind=worker] .tl-wall")
    width = chart.size["width"]
    ActionChains(chromium).move_to_element_with_offset(chart, -width // 2 + 60, 0).click_and_hold().move_by_offset(
        width // 3, 0
    ).release().perform()
    WebDriverWait(chromium, 30).until(lambda d: "start=" in d.current_url and f"{first[0]}" not in d.current_url)
    query = dict(p.split("=") for p in chromium.current_url.split("?", 1)[1].split("&"))
    # Steps start at whole seconds, so the chart may begin up to one before the range asked for.
    assert first[0] - 1 <= float(query["start"]) < float(query["stop"]) <= first[1] + 1 and query["refresh"] == "0"
    for bad, why in (
        ("start=abc", "start must be a time in Unix seconds"),
        ("stop=5", "stop= needs start="),
        (f"start={first[1]}&stop={first[0]}", "stop must be after start"),
        (f"start=0&stop={first[0]}", "at most 86400 s after it"),
    ):
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"{page}?{bad}")
        assert err.value.code == 400 and why in err.value.reason, (bad, err.value.reason)


def test_an_aggregated_collection_keeps_its_timeline(client, chromium, tmp_path):
    """aggregate=True keeps when time went in 10 s cells: alpha ran only before a cell
    boundary and beta only after it, and the rendered chart says so."""
    first = _timed(client, alpha, 2.0)
    boundary = (first[1] // 10 + 1) * 10
    while time.time() < boundary:
        time.sleep(0.1)
    second = _timed(client, beta, 2.0)
    prof = client.pyspy_profile(start=first[0] - 1, stop=second[1] + 1, aggregate=True)
    assert prof.metadata["aggregate"] and prof.keeps_times
    chromium.get(prof.save(tmp_path / "aggregated.html").as_uri())
    alpha_steps, beta_steps = _steps_with_time(chromium, "alpha"), _steps_with_time(chromium, "beta")
    assert alpha_steps and all(hi <= boundary for _, hi in alpha_steps), (alpha_steps, boundary)
    assert beta_steps and all(lo >= boundary for lo, _ in beta_steps), (beta_steps, boundary)
    summary = {p["prefix"]: p["seconds"] for p in prof.summary()["prefixes"]}
    series = {s["name"]: s["seconds"] for s in prof.timeline()["series"]}
    assert series["alpha"] == pytest.approx(summary["alpha"]) and series["beta"] == pytest.approx(summary["beta"])
    chromium.execute_script("arguments[0].scrollIntoView();", chromium.find_element("css selector", ".timeline"))
    screenshot(chromium, "aggregated-timeline")
    assert console_errors(chromium) == []


def test_notebook_view(client):
    prof = client.pyspy_profile(last=30)
    html = prof._repr_html_()
    # The findings in words, as Profile.summary() prints them, then the graph.
    assert "<iframe" in html and html.index(prof.summary().findings.window) < html.index("<iframe")


def test_report_filename_must_be_html(client):
    with pytest.raises(ValueError, match=r"filename must end in \.html"):
        dask_pyspy.pyspy_report("report.json", client=client)
