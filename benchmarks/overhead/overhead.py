"""Wall time of real workloads on a saturated LocalCluster, per profiler, interleaved."""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

import dask
from distributed import Client, LocalCluster

import dask_pyspy
from benchmarks.common import Section, interleave, spread, table, verdict
from benchmarks.workload import run_workloads, tiny

PYSPY = os.path.join(os.path.dirname(sys.executable), "py-spy")
# Contenders sampling at 100 Hz per reader, judged against issue 9's target.
AT_100HZ = {
    "fast": "dask-pyspy 100 Hz, fast reader (default budget 1%)",
    "pyspy": "dask-pyspy 100 Hz, pyspy reader (budget 20%)",
}

Setup = Callable[[Client], Callable[[], dict[str, float]]]


def with_plugin(rate: float, cpu_budget: float, reader: str) -> Setup:
    def setup(client: Client) -> Callable[[], dict[str, float]]:
        client.register_plugin(dask_pyspy.PySpyPlugin(rate=rate, cpu_budget=cpu_budget, reader=reader))
        began = time.time()

        def finish() -> dict[str, float]:
            stats = [p["stats"] for p in client.pyspy_profile(start=began, scheduler=False).processes]
            return {
                "sampler CPU %": 100 * statistics.mean(s["cpu_fraction"] for s in stats),
                "achieved Hz": statistics.mean(s["achieved_rate"] for s in stats),
            }

        return finish

    return setup


def with_pyspy_cli(nonblocking: bool) -> Setup:
    def setup(client: Client) -> Callable[[], dict[str, float]]:
        out = tempfile.mkdtemp(prefix="pyspy-cli-")
        procs = [
            subprocess.Popen(
                [
                    PYSPY,
                    "record",
                    "--pid",
                    str(pid),
                    "--rate",
                    "100",
                    "--format",
                    "speedscope",
                    "-o",
                    f"{out}/{pid}.json",
                    *(["--nonblocking"] if nonblocking else []),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for pid in client.run(os.getpid).values()
        ]
        time.sleep(1.0)  # let it attach

        def finish() -> dict[str, float]:
            for p in procs:
                p.send_signal(signal.SIGINT)
            for p in procs:
                p.wait(60)
            return {}

        return finish

    return setup


def contender(config: dict[str, Any], setup: Setup | None, quick: bool) -> Callable[[], dict[str, float]]:
    def run() -> dict[str, float]:
        with (
            dask.config.set(config),
            LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster,
            Client(cluster) as client,
        ):
            client.gather(client.map(tiny, range(100), key=[f"warm-{i}" for i in range(100)]))
            finish = setup(client) if setup else None
            measured = run_workloads(client, quick)
            if finish:
                measured.update(finish())
            return measured

    return run


def run(quick: bool) -> Section:
    off = {"distributed.worker.profile.enabled": False}
    builtin = {"distributed.worker.profile.enabled": True, "distributed.worker.profile.interval": "10ms"}
    contenders = {
        "no profiling": contender(off, None, quick),
        "distributed built-in profiler (10 ms)": contender(builtin, None, quick),
        "py-spy record 100 Hz (blocking)": contender(off, with_pyspy_cli(False), quick),
        "py-spy record 100 Hz --nonblocking": contender(off, with_pyspy_cli(True), quick),
        AT_100HZ["fast"]: contender(off, with_plugin(100, 0.01, "fast"), quick),
        # py-spy's reader needs ~1 ms a tick in a worker: 100 Hz takes ~10% of a core.
        AT_100HZ["pyspy"]: contender(off, with_plugin(100, 0.2, "pyspy"), quick),
        "dask-pyspy 1000 Hz, fast reader (budget 20%)": contender(off, with_plugin(1000, 0.2, "fast"), quick),
    }
    if not os.path.exists(PYSPY):
        for name in [n for n in contenders if n.startswith("py-spy")]:
            del contenders[name]
    results = interleave(contenders, rounds=3 if quick else 5)
    workloads = ["pure Python", "pandas shuffle", "small tasks"]
    base = {w: statistics.median(results["no profiling"][w]) for w in workloads}
    rows = []
    for name, r in results.items():
        row: list[object] = [name]
        for w in workloads:
            row += [spread(r[w], "{:.2f}"), f"{statistics.median(r[w]) / base[w]:.3f}"]
        row += [
            spread(r["sampler CPU %"], "{:.1f}") if "sampler CPU %" in r else "-",
            spread(r["achieved Hz"], "{:.0f}") if "achieved Hz" in r else "-",
        ]
        rows.append(row)
    header = ["contender"]
    for w in workloads:
        header += [f"{w} s, median (min-max)", "ratio"]
    header += ["sampler CPU % (per worker)", "achieved Hz"]
    notes = []
    for reader, name in AT_100HZ.items():
        ratio = statistics.median(results[name]["pure Python"]) / base["pure Python"]
        hz = min(results[name]["achieved Hz"])
        notes.append(
            f"Target (issue 9), {reader} reader: pure-Python ratio <= 1.01 with 100 Hz achieved. "
            f"Measured {ratio:.3f} at {hz:.1f} Hz at least: {verdict(ratio <= 1.01 and hz >= 98)}."
        )
    return Section(
        "Workload overhead",
        "LocalCluster of 2 worker processes x 1 thread (both cores busy); one fresh cluster per "
        "contender per round, contenders interleaved. Ratio = median / median of no profiling.",
        [table(header, rows)],
        notes,
    )
