"""HTML reports and the dashboard page, opened in a real headless Chromium."""

from __future__ import annotations

import re
import urllib.request

from html import escape

import pytest
from dask.utils import key_split

import dask_pyspy
from tests.integration.browser import console_errors, screenshot, search_first_flame_graph, start_chromium
from tests.integration.workload import alpha, gamma

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


def test_download_button_gives_the_speedscope_profile(client, chromium, tmp_path):
    prof = client.pyspy_profile(last=30)
    path = prof.save(tmp_path / "r.html")
    chromium.get(path.as_uri())
    size = chromium.execute_script(
        "return atob(document.getElementById('speedscope-data').textContent.trim()).length;"
    )
    assert size == len(prof.to_bytes(compress=True))
    chromium.find_element("id", "download").click()
    assert console_errors(chromium) == []


def test_dashboard_page(client, chromium):
    client.gather(client.map(alpha, range(100)))
    port = client.scheduler_info()["services"]["dashboard"]
    chromium.get(f"http://127.0.0.1:{port}/pyspy/?last=60")
    assert "last 60 s" in chromium.title
    body = chromium.find_element("tag name", "body").text
    assert "Live stacks" in body and "Whole cluster" in body
    assert search_first_flame_graph(chromium, "alpha") != "Matched: 0%"
    screenshot(chromium, "dashboard")
    assert console_errors(chromium) == []
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/pyspy/dump").read().decode()
    assert "Process scheduler" in text and "Thread 0x" in text
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/pyspy/?last=-3")
    assert err.value.code == 400


def test_notebook_view(client):
    prof = client.pyspy_profile(last=30)
    html = prof._repr_html_()
    assert "<iframe" in html and "sampled thread-seconds" in html


def test_report_filename_must_be_html(client):
    with pytest.raises(ValueError, match=r"filename must end in \.html"):
        dask_pyspy.pyspy_report("report.json", client=client)
