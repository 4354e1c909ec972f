"""Each server's memory and CPU over time, kept beside the samples, carried by the
profiles a client collects (raw and aggregated) and drawn under the report's timeline."""

from __future__ import annotations

import time

from distributed import wait

from tests.cluster.browser import console_errors, screenshot, start_chromium

MIB = 2**20


def hold_memory(mib: int, seconds: float) -> int:
    """Allocates and touches `mib` MiB for `seconds` in the worker."""
    block = bytearray(mib * MIB)
    for i in range(0, len(block), 4096):
        block[i] = 1
    time.sleep(seconds)
    return len(block)


def test_memory_is_kept_per_server_and_drawn_under_the_timeline(client, tmp_path):
    start = time.time()
    worker = sorted(client.scheduler_info()["workers"])[0]
    wait(client.submit(hold_memory, 300, 3.0, workers=[worker], pure=False))
    stop = time.time()
    for aggregate in (True, False):  # the raw one, in 1 s steps, is drawn
        prof = client.pyspy_profile(start=start - 1, stop=stop + 1, aggregate=aggregate)
        rss = {p["name"]: [v for v in p["rss"] if v is not None] for p in prof.timeline(step=1)["processes"]}
        assert len(rss) == len(prof.processes) == 3, rss  # the scheduler and both workers
        # What each grew by in the window, not its peak: the scheduler runs in the test
        # process, as large as the tests before this one left it.
        grown = {name: max(values) - min(values) for name, values in rss.items()}
        (held,) = [name for name in grown if worker in name]
        others = [growth for name, growth in grown.items() if name != held]
        assert grown[held] > max(others) + 200 * MIB, (aggregate, rss)
        series = next(p for p in prof.processes if worker in p["name"])["stats"]["series"]
        assert series["step"] == 1 and len(series["cpu"]) == len(series["rss"]) >= 3
    driver = start_chromium()
    try:
        driver.get(prof.save(tmp_path / "memory.html").as_uri())
        lines = driver.find_elements("css selector", ".tl-memory path.tl-rss")
        assert {line.get_attribute("data-name") for line in lines} == set(rss), "a line per process"
        chart = driver.find_element("css selector", ".tl-memory")
        driver.execute_script("arguments[0].scrollIntoView();", chart)
        screenshot(driver, "timeline-memory")
        assert console_errors(driver) == []
    finally:
        driver.quit()
