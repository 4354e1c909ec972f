"""Folded history on a real cluster: samples past the recent window fold into buckets
that keep every prefix's time, merge across workers, and say their resolution."""

from __future__ import annotations

import math
import time
from typing import Any

import dask_pyspy

STEP = 1.0  # seconds per bucket: short, so a test sees samples fold


def early(x: int) -> int:
    end = time.perf_counter() + 0.05
    while time.perf_counter() < end:
        pass
    return x


def prefix_seconds(profile: Any) -> dict[str, float]:
    return {p["prefix"]: p["seconds"] for p in profile.summary()["prefixes"]}


def folded_before(profile: Any, stop: float) -> bool:
    """Whether every process's samples before `stop` are folded (none raw there)."""
    stretches = [r for p in profile.processes for r in p["stats"]["resolution"]]
    return bool(stretches) and all(r["step"] > 0 or r["from"] >= stop for r in stretches)


def test_folded_history_keeps_each_prefixs_time_and_merges_across_workers(fresh):
    _, client = fresh
    client.register_plugin(dask_pyspy.PySpyPlugin(rate=200, cpu_budget=0.3, recent=2, history_step=STEP))
    # A window of whole buckets holds the same samples raw or folded: a bucket counts at
    # its start, a raw sample at its time.
    start = math.ceil(time.time()) + 1
    while time.time() < start:
        time.sleep(0.05)
    client.gather(client.map(early, range(80), pure=False))
    stop = math.ceil(time.time())
    while time.time() < stop:
        time.sleep(0.05)
    window = {"start": start, "stop": stop - 1e-6, "by": "prefix"}
    while_raw = client.pyspy_profile(**window)
    deadline = time.time() + 120
    while not folded_before(later := client.pyspy_profile(**window), stop) and time.time() < deadline:
        time.sleep(0.5)
    assert folded_before(later, stop), [p["stats"]["resolution"] for p in later.processes]
    raw, folded = prefix_seconds(while_raw), prefix_seconds(later)
    assert raw.get("early", 0) > 0.5, raw
    assert abs(folded["early"] - raw["early"]) < 1e-6, (raw, folded)
    names = [p["name"] for p in later.processes]
    for worker in client.scheduler_info()["workers"]:
        i = names.index(worker)
        assert prefix_seconds(later.only_process(i)).get("early", 0) > 0, "each worker's history is in the merge"
        assert {r["step"] for r in later.processes[i]["stats"]["resolution"]} == {STEP}
    assert "early" in later.to_html()
