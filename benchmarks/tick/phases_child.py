"""Sampler figures of every process of a busy LocalCluster, per workload phase, in its
own process (see rate.py): prints JSON. It runs under another build's interpreter too,
so the checkout comes last on its path: that interpreter's own dask_pyspy comes first."""

from __future__ import annotations

import json
import os
import sys
import time

import dask
import dask.datasets
from distributed import Client, LocalCluster

import dask_pyspy

sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks.workload import cpu_task, tiny  # noqa: E402


def stats() -> list[dict]:
    from dask_pyspy import sampler

    return [s.stats() for s in list(sampler._running)]


def snapshot(client: Client) -> dict[str, dict]:
    out = {"scheduler": client.run_on_scheduler(stats)[0]}
    for i, (_, st) in enumerate(sorted(client.run(stats).items())):
        out[f"worker-{i}"] = st[0]
    return out


def delta(before: dict, after: dict) -> dict[str, float]:
    """Rate, CPU per tick and lost reads between two stats snapshots of one sampler."""
    ticks = after["ticks"] - before["ticks"]
    wall = after["duration_s"] - before["duration_s"]
    ra, rb = after["reader_stats"], before["reader_stats"]
    failed = after["failed_ticks"] - before["failed_ticks"]
    if "thread_reads" in ra:
        key = "lost_reads" if "lost_reads" in ra else "torn_reads"
        reads, lost = ra["thread_reads"] - rb["thread_reads"], ra[key] - rb[key] + failed
    else:  # py-spy's reader: a failed read loses the whole tick
        reads, lost = ticks, failed
    return {
        "hz": ticks / wall if wall else 0.0,
        "cpu_share": (after["cpu_s"] - before["cpu_s"]) / wall if wall else 0.0,
        "us_per_tick": 1e6 * (after["cpu_s"] - before["cpu_s"]) / max(ticks, 1),
        "reads": reads,
        "lost": lost,
    }


def main(quick: bool, reader: str) -> dict:
    days = 4 if quick else 10
    phases = {
        "pandas shuffle": lambda c: (
            dask.datasets.timeseries(start="2000-01-01", end=f"2000-01-{1 + days:02d}", freq="1s", partition_freq="1d")
            .set_index("id")[["x", "y"]]
            .mean()
            .compute()
        ),
        "small tasks": lambda c: c.gather(c.map(tiny, range(2000 if quick else 6000))),
        "pure Python": lambda c: c.gather(c.map(cpu_task, range(40 if quick else 120))),
    }
    out = {}
    with (
        LocalCluster(n_workers=2, threads_per_worker=2, processes=True, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        client.gather(client.map(tiny, range(100), key=[f"warm-{i}" for i in range(100)]))
        client.register_plugin(dask_pyspy.PySpyPlugin(reader=reader))
        time.sleep(1)
        for name, phase in phases.items():
            before = snapshot(client)
            phase(client)
            after = snapshot(client)
            out[name] = {p: delta(before[p], after[p]) for p in after}
    return out


if __name__ == "__main__":
    args = json.loads(sys.argv[1])
    print(json.dumps(main(**args)))
