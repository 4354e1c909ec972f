"""What a profile found, in words: the report opens with it (then the timeline, then the
task flame graph; the sampler's own figures last), the notebook and the CLI print it,
and flame-graph labels keep the function a reader looks for."""

from __future__ import annotations

import pytest

import dask_pyspy
from tests.cluster.browser import (
    console_errors,
    cut_from_the_left,
    first_graph_labels,
    flame_labels,
    screenshot,
    start_chromium,
)
from tests.cluster.workload import a_task_whose_function_name_is_wider_than_its_frame as long_named
from tests.cluster.workload import alpha

LONG = long_named.__name__


@pytest.fixture(scope="module")
def report(client, tmp_path_factory):
    """A report of a short task with a long name beside a busier one, and its profile."""
    path = tmp_path_factory.mktemp("findings") / "report.html"
    with dask_pyspy.pyspy_report(path, client=client) as rec:
        futures = client.map(alpha, range(300), [0.01] * 300)
        futures += client.map(long_named, range(100), [0.004] * 100)
        client.gather(futures)
    return path, rec.profile


@pytest.fixture(scope="module")
def chromium():
    driver = start_chromium()
    yield driver
    driver.quit()


def test_summary_prints_the_findings_and_keeps_the_totals(report):
    _, prof = report
    summary = prof.summary()
    text = str(summary)
    assert text.startswith("Profiled ") and f"{len(prof.processes)} processes" in text.splitlines()[0], text
    busiest = summary["prefixes"][0]
    line = next(line for line in text.splitlines() if line.startswith(f"  {busiest['prefix']}: "))
    assert f"most in {busiest['top'][0]['name']} (" in line, line
    assert "Task threads spent " in text and "on a CPU" in text, text
    assert repr(summary) == text, "a notebook cell shows the words"
    assert summary["samples"] == prof.n_samples and {"prefixes", "processes", "untagged"} <= set(summary)


def test_report_answers_first_and_keeps_the_sampler_for_last(report, chromium):
    path, prof = report
    chromium.set_window_size(1000, 800)
    chromium.get(path.as_uri())
    headings = [h.text for h in chromium.find_elements("css selector", "h2")]
    assert headings[:3] == ["Summary", "Timeline", "Task time across the cluster, by task prefix"], headings
    assert headings[-1] == "About this profile", headings
    findings = chromium.find_element("css selector", ".findings").text
    assert findings.splitlines()[0] == str(prof.summary()).splitlines()[0], findings
    # The summary and the start of the timeline are on the first screen.
    timeline = chromium.find_element("css selector", ".timeline")
    assert timeline.location["y"] < 800, timeline.location
    about = chromium.find_element("id", "about").location["y"]
    sampler = chromium.find_element("xpath", "//th[normalize-space()='achieved Hz']").location["y"]
    assert sampler > about > chromium.find_element("css selector", "iframe.flame").location["y"]
    screenshot(chromium, "report-first-screen")
    assert console_errors(chromium) == []


def test_flame_graph_labels_keep_the_function(report, chromium):
    path, _ = report
    chromium.set_window_size(1400, 1000)
    chromium.get(path.as_uri())
    labels = first_graph_labels(chromium)
    cut = [(text, title) for text, title in labels if text.endswith("..")]
    assert any(title.startswith(LONG) for _, title in cut), "the long name is cut, or the test shows nothing"
    for text, title in cut:
        assert title.startswith(text[:-2]), (text, title)
    # Zoomed in, the graph's own script lays the labels out again.
    chromium.switch_to.frame(chromium.find_element("css selector", "iframe.flame"))
    try:
        chromium.execute_script(
            "zoom(Array.from(frames.querySelectorAll('g')).find("
            "g => g.querySelector('title').textContent.startsWith(arguments[0])));",
            LONG,
        )
        labels += flame_labels(chromium)
    finally:
        chromium.switch_to.default_content()
    assert not cut_from_the_left(labels), labels
