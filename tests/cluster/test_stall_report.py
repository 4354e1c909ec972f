"""Event-loop stalls made for real and shown in the HTML report and on the dashboard
page, read back in headless Chromium: a task holding the GIL in one C call stalls its
worker's loop, a handler spinning on the scheduler's loop stalls the scheduler."""

from __future__ import annotations

import time
from typing import Any

import pytest
from distributed import Scheduler
from selenium.webdriver.support.ui import WebDriverWait

from tests.cluster.browser import console_errors, screenshot, start_chromium
from tests.cluster.workload import hold_gil
from tests.conftest import FREE_THREADED

pytestmark = pytest.mark.skipif(FREE_THREADED, reason="without a GIL a task cannot stall its worker's loop")

SPIN_S = 1.0
DEADLINE_S = 60.0


def spin_the_loop(comm: Any = None) -> None:
    """A scheduler handler that keeps its event loop for SPIN_S seconds."""
    end = time.time() + SPIN_S
    while time.time() < end:
        pass


def add_spin_handler(dask_scheduler: Scheduler) -> None:
    dask_scheduler.handlers["pyspy_test_spin"] = spin_the_loop


@pytest.fixture(scope="module")
def chromium():
    driver = start_chromium()
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def stalled(client) -> dict[str, Any]:
    """Stalls in a worker (waiting for a task's GIL) and in the scheduler (running a
    handler), waited for until the cluster reports both explained."""
    start = time.time()
    worker = sorted(client.scheduler_info()["workers"])[0]
    future = client.submit(hold_gil, 60_000_000, workers=[worker], pure=False)
    future.result()
    client.run_on_scheduler(add_spin_handler)
    client.sync(lambda: client.scheduler.pyspy_test_spin())
    deadline = time.monotonic() + DEADLINE_S
    while True:
        found = client.pyspy_stalls(start=start - 1)
        held = [s for s in found if any(h["task_key"] == future.key for h in s["gil_holders"])]
        spun = [s for s in found if s["activity"] == "scheduler: pyspy_test_spin"]
        if held and spun:
            break
        assert time.monotonic() < deadline, f"no stalls explained by the task and the handler in {found}"
        time.sleep(0.2)
    return {"start": start, "stop": time.time(), "key": future.key, "worker": worker, "held": held, "spun": spun}


def stall_rows(driver) -> list[str]:
    return [row.text for row in driver.find_elements("css selector", "#stalls ~ table.stalls tr.stall")]


def marks(driver, kind: str) -> dict[str, list[float]]:
    """The start of each stall mark on the kind's timeline strip, by process row."""
    return driver.execute_script(
        "var out = {}; document.querySelectorAll('.tl-kind[data-kind=' + arguments[0] + '] .tl-stall-row')"
        ".forEach(function (g) { out[g.dataset.process] = Array.from(g.querySelectorAll('rect.tl-stall'))"
        ".map(function (r) { return +r.dataset.start; }); }); return out;",
        kind,
    )


def test_the_report_shows_and_explains_the_stalls(client, stalled, chromium, tmp_path):
    prof = client.pyspy_profile(start=stalled["start"] - 1, stop=stalled["stop"] + 1)
    chromium.get(prof.save(tmp_path / "stalls.html").as_uri())
    section = chromium.find_element("id", "stalls")
    chromium.execute_script("arguments[0].scrollIntoView();", section)
    screenshot(chromium, "stalls-report")
    rows = stall_rows(chromium)
    assert rows and any(stalled["key"] in r and "hold_gil (workload.py" in r for r in rows), rows
    assert any("scheduler: pyspy_test_spin" in r and "spin_the_loop (test_stall_report.py" in r for r in rows), rows
    body = chromium.find_element("tag name", "body").text
    assert "waiting for the GIL held by task " + stalled["key"] in body
    processes = chromium.find_elements("css selector", "#stalls ~ table:not(.stalls)")[0].text
    assert stalled["worker"] in processes and "scheduler " in processes
    graph = chromium.find_element("css selector", "iframe.flame[title='Event-loop stalls']")
    assert graph.get_attribute("src").startswith("data:image/svg+xml")
    chromium.switch_to.frame(graph)
    try:
        labels = [t.get_attribute("textContent") for t in chromium.find_elements("css selector", "g title")]
    finally:
        chromium.switch_to.default_content()
    assert any(label.startswith("hold_gil (workload.py") for label in labels), "the GIL holder's stack"
    assert any(label.startswith("spin_the_loop (test_stall_report.py") for label in labels), "the loop's own"
    worker_marks, scheduler_marks = marks(chromium, "worker"), marks(chromium, "scheduler")
    ours = [s["start"] for s in stalled["held"] if s["address"] == stalled["worker"]]
    assert worker_marks.get(stalled["worker"]) and all(
        any(abs(m - start) < 1e-3 for m in worker_marks[stalled["worker"]]) for start in ours
    ), (worker_marks, ours)
    (scheduler,) = scheduler_marks
    assert scheduler.startswith("scheduler ") and scheduler_marks[scheduler], scheduler_marks
    strip = chromium.find_element("css selector", ".tl-kind[data-kind=worker] .tl-stalls")
    chromium.execute_script("arguments[0].scrollIntoView();", strip)
    screenshot(chromium, "stalls-timeline")
    assert console_errors(chromium) == []


def test_the_dashboard_page_lists_the_stalls(client, stalled, chromium):
    port = client.scheduler_info()["services"]["dashboard"]
    page = f"http://127.0.0.1:{port}/pyspy/?start={stalled['start'] - 1}&stop={stalled['stop'] + 1}"
    chromium.get(page)
    section = chromium.find_element("id", "stalls")
    chromium.execute_script("arguments[0].scrollIntoView();", section)
    screenshot(chromium, "stalls-dashboard")
    rows = stall_rows(chromium)
    assert any(stalled["key"] in r for r in rows) and any("scheduler: pyspy_test_spin" in r for r in rows), rows
    assert marks(chromium, "worker").get(stalled["worker"]), "marked on the timeline"
    assert console_errors(chromium) == []
    # A click on the strip shows its step, as on the charts.
    chromium.find_element("css selector", ".tl-kind[data-kind=worker] .tl-stalls").click()
    WebDriverWait(chromium, 30).until(
        lambda d: "start=" in d.current_url and f"{stalled['start'] - 1}" not in d.current_url
    )
