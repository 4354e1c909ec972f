"""How close `Profile.diff` puts a slowed function's gain to the truth, idle and beside
CPU hogs (the figure tests/cluster/test_saved.py no longer asserts)."""

from __future__ import annotations

import os
import shutil
import subprocess
import time

from distributed import Client, LocalCluster

import dask_pyspy
from benchmarks.common import READERS, Section, spread, table
from benchmarks.workload import spin_then_grind

TASKS, SPIN, BASE, NEW = 80, 0.01, 0.01, 0.03


def window(client: Client, grind_seconds: float) -> tuple[dask_pyspy.Profile, float]:
    """The profile of TASKS tasks, and the wall seconds their `grind` took by their own clocks."""
    start = time.time()
    futures = client.map(spin_then_grind, range(TASKS), [SPIN] * TASKS, [grind_seconds] * TASKS, pure=False)
    took = sum(client.gather(futures))
    return client.pyspy_profile(start=start, by="prefix"), took


def measure(reader: str, rounds: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"truth": [], "diff": [], "top": []}
    with (
        LocalCluster(n_workers=2, threads_per_worker=2, processes=True, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        client.register_plugin(dask_pyspy.PySpyPlugin(rate=200, cpu_budget=0.3, reader=reader))
        for _ in range(rounds):
            (base, base_took), (new, new_took) = window(client, BASE), window(client, NEW)
            top = new.diff(base).functions["gained"][0]
            out["truth"].append(new_took - base_took)
            out["diff"].append(top["seconds"])
            out["top"].append(float(top["name"] == "grind"))
    return out


def run(quick: bool) -> Section:
    rounds = 3 if quick else 8
    hogs = 2 * (os.cpu_count() or 1)
    loads = ["idle"] + ([f"stress-ng --cpu {hogs}"] if shutil.which("stress-ng") else [])
    rows = []
    for load in loads:
        for reader in READERS:
            stress = subprocess.Popen(load.split() + ["--quiet"]) if load != "idle" else None
            try:
                m = measure(reader, rounds)
            finally:
                if stress:
                    stress.kill()
                    stress.wait()
            errors = [100 * (d - t) / t for d, t in zip(m["diff"], m["truth"])]
            rows.append(
                [
                    load,
                    reader,
                    f"{TASKS * (NEW - BASE):.2f}",
                    spread(m["truth"], "{:.2f}"),
                    spread(m["diff"], "{:.2f}"),
                    spread(errors, "{:+.0f}%"),
                    f"{sum(m['top']):.0f} of {rounds}",
                ]
            )
    return Section(
        "Diff accuracy",
        f"{TASKS} tasks on 2 workers x 2 threads spin {SPIN * 1000:.0f} ms then `grind` {BASE * 1000:.0f} ms; a "
        f"second run grinds {NEW * 1000:.0f} ms. `new.diff(base)` at 200 Hz against the gain in `grind`'s wall "
        f"time by the tasks' own clocks; {rounds} pairs of runs per row, median (min-max).",
        [
            table(
                [
                    "load",
                    "reader",
                    "injected gain s",
                    "gain by the tasks' clocks s",
                    "gain in the diff s",
                    "diff vs tasks' clocks",
                    "grind on top of the gained",
                ],
                rows,
            )
        ],
        [
            "The tests assert only that grind is on top with a positive gain, equal to what the profiles' own "
            "stacks hold: how much of the truth sampling catches depends on the load, shown here."
        ],
    )
