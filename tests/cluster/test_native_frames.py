"""Native frames on a real cluster: PySpyPlugin(native=True), the report, speedscope's app."""

from __future__ import annotations

import re
import time

import pytest
from selenium.webdriver.support.ui import WebDriverWait

import dask_pyspy
from tests.cluster.browser import console_errors, screenshot, search_first_flame_graph, start_chromium
from tests.cluster.conftest import start_cluster
from tests.cluster.test_report import speedscope_site  # noqa: F401  (a fixture)
from tests.cluster.workload import blas_loop


@pytest.fixture(scope="module")
def native_client():
    cluster, client = start_cluster(processes=True)
    client.register_plugin(dask_pyspy.PySpyPlugin(rate=200, cpu_budget=0.3, native=True))
    yield client
    client.close()
    cluster.close()


@pytest.fixture(scope="module")
def chromium():
    driver = start_chromium(webgl=True)
    yield driver
    driver.quit()


def task_stacks(prof: dask_pyspy.Profile, prefix: str) -> list[list[dict]]:
    """The frames (root first) of samples under one task prefix, by="prefix"."""
    doc = prof.speedscope(by="prefix")
    frames = doc["shared"]["frames"]
    out = []
    for p in doc["profiles"]:
        for s in p["samples"]:
            names = [frames[i] for i in s]
            if names and names[0]["name"] == prefix:
                out.append(names)
    return out


def native_names(stack: list[dict]) -> list[str]:
    return [f["name"] for f in stack if "line" not in f and ".so" in f.get("file", "")]


def recorded(client, path=None, **kwargs) -> dask_pyspy.Profile:
    """The profile of matmul tasks, recorded until BLAS frames show in it."""
    deadline = time.monotonic() + 120
    while True:
        with dask_pyspy.profile(path, client=client, **kwargs) as rec:
            client.gather(client.map(blas_loop, range(8), [0.3] * 8, pure=False))
        prof = rec.profile
        gemm = [s for s in task_stacks(prof, "blas_loop") if any("gemm" in n for n in native_names(s))]
        if gemm or not kwargs.get("native", True):
            return prof
        assert time.monotonic() < deadline, "no BLAS frame under the blas_loop tasks"


def test_blas_frames_under_the_task(native_client):
    prof = recorded(native_client)
    for stack in task_stacks(prof, "blas_loop"):
        names = [f["name"] for f in stack]
        natives = native_names(stack)
        if any("gemm" in n for n in natives):
            assert names.index("blas_loop") < names.index(natives[0]), "C under the Python line that called it"
    workers = [p for p in prof.processes if p["name"] in native_client.scheduler_info()["workers"]]
    assert workers and all(p["stats"]["native"]["merged"] > 0 for p in workers)
    plain = recorded(native_client, native=False)
    assert not plain.has_native and not any(native_names(s) for s in task_stacks(plain, "blas_loop"))


def test_report_shows_native_frames(native_client, chromium, tmp_path):
    path = tmp_path / "native.html"
    prof = recorded(native_client, path)
    assert prof.has_native
    chromium.get(path.as_uri())
    body = chromium.find_element("tag name", "body").text
    assert "(native)" in body, "the function table marks C functions with their library"
    matched = search_first_flame_graph(chromium, "gemm")
    assert re.fullmatch(r"Matched: [0-9.]+%", matched) and matched != "Matched: 0%", matched
    shot = screenshot(chromium, "report-native")
    assert shot.stat().st_size > 10_000
    assert console_errors(chromium) == []


def test_speedscope_app_opens_a_native_profile(native_client, speedscope_site, chromium):  # noqa: F811
    site, url = speedscope_site
    prof = recorded(native_client)
    prof.save(site / "native.json")
    doc = prof.speedscope()
    active = doc["activeProfileIndex"]
    title = f"{doc['profiles'][active]['name']} ({active + 1}/{len(doc['profiles'])})"
    chromium.get(f"{url}/index.html#profileURL=/native.json")
    WebDriverWait(chromium, 60).until(lambda d: title in d.find_element("tag name", "body").text)
    assert "went wrong" not in chromium.find_element("tag name", "body").text
    screenshot(chromium, "speedscope-native")
    assert console_errors(chromium) == []


def test_registering_again_turns_native_off(native_client):
    native_client.register_plugin(dask_pyspy.PySpyPlugin(rate=200, cpu_budget=0.3, native=False))
    try:
        start = time.time()
        native_client.gather(native_client.map(blas_loop, range(4), [0.3] * 4, pure=False))
        prof = native_client.pyspy_profile(start=start)
        assert prof.n_samples > 0 and not prof.has_native
        assert all(p["stats"]["native"] is None for p in prof.processes)
    finally:
        native_client.register_plugin(dask_pyspy.PySpyPlugin(rate=200, cpu_budget=0.3, native=True))


def test_cli_record_turns_native_on(native_client, tmp_path):
    from tests.cluster.test_cli import run

    native_client.register_plugin(dask_pyspy.PySpyPlugin(rate=200, cpu_budget=0.3, native=False))
    out = tmp_path / "cli.pyspy.gz"
    futures = native_client.map(blas_loop, range(40), [0.2] * 40, pure=False)
    try:
        done = run(
            "record", "--scheduler", native_client.scheduler.address, "--native", "--duration", "4", "-o", str(out)
        )
        assert done.returncode == 0, done.stderr
        prof = dask_pyspy.Profile.load(out)
        workers = [p for p in prof.processes if p["name"] in native_client.scheduler_info()["workers"]]
        assert workers and all(p["stats"]["config"]["native"] for p in workers)
    finally:
        native_client.gather(futures)
        native_client.register_plugin(dask_pyspy.PySpyPlugin(rate=200, cpu_budget=0.3, native=True))
