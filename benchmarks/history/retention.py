"""Retention (issue 21): a day of samples in each worker's 64 MiB store, time-compressed,
collected from a real 16-worker cluster.

Four threads run the collection benchmark's task stacks (six prefixes, 48 call paths
each) under task tags for a while, sampled at 100 Hz; those real samples are then
replayed into the plugin's store in each of 16 worker processes (`dask scheduler`,
`dask worker --nworkers 16`, samplers paused) as a day at 100 Hz x 4 busy threads
(34.6 million samples per worker, task keys new every minute), through the store's
own recording and folding. Then: what a store holds, whether the day's totals per
prefix survived, how long `client.pyspy_profile(aggregate=True)` of the whole day
takes, and the report with its timeline after.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from distributed import Client

import dask_pyspy
from benchmarks.common import Section, run_for, spread, table, verdict
from benchmarks.process_cluster import cluster
from benchmarks.stacks import PREFIXES, TASKS, VARIANTS
from dask_pyspy import Profile, Sampler, _native
from dask_pyspy.sampler import process_sampler

DAY = 86_400.0
RATE = 100.0
WORKERS = 16
THREADS = 4  # busy task threads per worker
MIB = 2**20


def record_source(seconds: float) -> Profile:
    """Real samples of four task threads, each running random tasks of 50-300 ms."""
    sampler = Sampler(rate=RATE, cpu_budget=0.5)
    stop = threading.Event()

    def work(seed: int) -> None:
        rng, n = random.Random(seed), 0
        while not stop.is_set():
            prefix = rng.choice(PREFIXES)
            sampler.set_thread_tag(threading.get_ident(), f"('{prefix}-{seed}-{n}', 0)", prefix)
            try:
                TASKS[prefix](rng.randrange(VARIANTS), rng.uniform(0.05, 0.3))
            finally:
                sampler.clear_thread_tag(threading.get_ident())
            n += 1

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(THREADS)]
    began = time.time()
    sampler.start()
    run_for(threads, stop, seconds)
    profile = sampler.profile(began, time.time())
    sampler.stop()
    return profile


def distinct_rows_a_minute(source: Profile) -> float:
    """What a one-minute bucket of the replayed day holds: the source's distinct threads,
    stacks, prefixes, activities and states, per minute of it (a minute of the day
    replays about a minute of the source)."""
    entries: int = _native.Profile.wire_head(source.aggregated().to_wire())["entries"]
    return entries / (source.sampled_seconds / THREADS / 60)


def prefix_seconds(profile: Profile) -> dict[str, float]:
    return {p["prefix"]: p["seconds"] for p in profile.summary()["prefixes"]}


def _replay(wire: bytes, start: float) -> dict[str, float]:
    """Replays the source as a day from `start` into this worker's plugin store."""
    sampler = process_sampler.sampler
    assert sampler is not None, "the plugin is registered"
    sampler.stop()  # the replay is the store's only writer; its samples stay
    return _native._testing.replay(sampler.native, Profile.from_wire(wire)._native, start, DAY, RATE)


async def _replay_off_loop(wire: bytes, start: float) -> dict[str, float]:
    return await asyncio.to_thread(_replay, wire, start)


def _store_stats() -> dict[str, Any]:
    sampler = process_sampler.sampler
    assert sampler is not None
    return sampler.stats()["store"]


def _export(start: float, end: float) -> tuple[float, float, bytes]:
    """This worker's day, aggregated, as its part of a collection; the wall and CPU
    seconds it took (the process's: the native core exports in a thread of its own)."""
    sampler = process_sampler.sampler
    assert sampler is not None
    wall, cpu = time.perf_counter(), time.process_time()
    part = sampler.export(start, end, True, "worker", {}, {})
    return time.perf_counter() - wall, time.process_time() - cpu, part


def split(client: Client, start: float, end: float) -> tuple[float, float, float]:
    """Where a collection's time goes: every worker exports at once (the slowest's wall
    seconds, and the CPU seconds of all), then the client merges their parts."""
    workers = client.scheduler_info()["workers"]
    futures = [client.submit(_export, start, end, workers=[w], pure=False) for w in workers]
    results = client.gather(futures)
    began = time.perf_counter()
    Profile.merge_wire({str(i): part for i, (_, _, part) in enumerate(results)})
    merge_s = time.perf_counter() - began
    return max(wall for wall, _, _ in results), sum(cpu for _, cpu, _ in results), merge_s


def fill(client: Client, source: Profile, start: float) -> tuple[float, dict[str, float]]:
    """Replays a day into every worker; the seconds it took, and the prefixes' seconds replayed."""
    began = time.perf_counter()
    recorded: dict[str, dict[str, float]] = client.run(_replay_off_loop, source.to_wire(), start)
    total: dict[str, float] = {}
    for per_worker in recorded.values():
        for prefix, seconds in per_worker.items():
            total[prefix] = total.get(prefix, 0.0) + seconds
    return time.perf_counter() - began, total


def collect(
    client: Client, start: float, end: float, repeats: int, out: Path
) -> tuple[Profile, list[float], list[float]]:
    """The day, aggregated, `repeats` times: the last profile, and the collect and report seconds."""
    collects, reports = [], []
    for i in range(repeats):
        began = time.perf_counter()
        day = client.pyspy_profile(start=start, stop=end, aggregate=True)
        collects.append(time.perf_counter() - began)
        began = time.perf_counter()
        day.save(out / f"day-{i}.html")
        reports.append(time.perf_counter() - began)
    return day, collects, reports


def first_hour_share(day: Profile, start: float) -> float:
    """How busy the day's timeline draws the workers' 4 threads over the whole minutes
    of its first hour (1.0: all four, all the time)."""
    timeline = day.timeline(step=60)
    t0, wall = timeline["start"], timeline["kinds"]["worker"]["wall"]
    minutes = [i for i in range(len(wall)) if start <= t0 + 60 * i and t0 + 60 * (i + 1) <= start + 3600]
    return sum(wall[i] for i in minutes) / (len(minutes) * 60 * THREADS * WORKERS)


def run(quick: bool) -> Section:
    source = record_source(20 if quick else 60)
    repeats = 3  # collecting is quick; the replay is what takes minutes
    end = time.time()
    start = end - DAY
    with tempfile.TemporaryDirectory(prefix="pyspy-bench-") as tmp, cluster(tmp) as (address, _):
        client = Client(address)
        client.wait_for_workers(WORKERS, timeout=180)
        client.register_plugin(dask_pyspy.PySpyPlugin(rate=RATE))
        replay_s, recorded = fill(client, source, start)
        stats = max(client.run(_store_stats).values(), key=lambda st: st["bytes"])
        day, collects, reports = collect(client, start, end, repeats, Path(tmp))
        slowest, exports, merge_s = split(client, start, end)
        html = (Path(tmp) / "day-0.html").read_text()
        names = set(client.scheduler_info()["workers"])
        client.close()

    workers = [p for p in day.processes if p["name"] in names]
    if not workers:
        raise RuntimeError(f"no worker's day was collected: {day.metadata.get('missing')}")
    resolution: list[dict[str, Any]] = workers[0]["stats"]["resolution"]
    first_hour = [r for r in resolution if r["from"] < start + 3600]
    raw = [r for r in resolution if r["step"] == 0]
    kept = prefix_seconds(day)
    errors = {p: abs(kept.get(p, 0.0) - s) / s for p, s in recorded.items() if p and s > 0}
    hour_share = first_hour_share(day, start)
    rows_a_minute = distinct_rows_a_minute(source)
    folded_minutes = (DAY - 600) / 60
    rows = [
        ["samples replayed per worker", f"{stats['samples_recorded']:,}"],
        ["the source's distinct rows a minute (a one-minute bucket's)", f"{rows_a_minute:,.0f}"],
        ["store bytes / cap (fullest worker)", f"{stats['bytes'] / MIB:.1f} / {stats['max_bytes'] / MIB:.0f} MiB"],
        ["raw samples held (recent window)", f"{stats['samples_held']:,}"],
        ["folded samples held / standing for", f"{stats['folded_held']:,} / {stats['samples_folded']:,}"],
        ["buckets, merges", f"{stats['buckets']:,}, {stats['bucket_merges']:,}"],
        ["samples dropped", f"{stats['samples_evicted']:,}"],
        ["first hour's steps (s)", ", ".join(sorted({f"{r['step']:g}" for r in first_hour})) or "gone"],
        ["raw stretch (s)", f"{raw[0]['to'] - raw[0]['from']:.0f}" if raw else "none"],
        [f"replay s ({WORKERS} workers, 2 cores)", f"{replay_s:.0f}"],
        [f"pyspy_profile(aggregate=True) of the day, {WORKERS} workers, s", spread(collects, "{:.2f}")],
        [
            f"exports, all {WORKERS} at once: slowest wall s / CPU s of all / then the client's merge s",
            f"{slowest:.2f} / {exports:.2f} / {merge_s:.2f}",
        ],
        ["report of the day with its timeline, s", spread(reports, "{:.2f}")],
        ["samples the collection stands for", f"{day.n_samples:,}"],
        ["workers' threads busy in the timeline's first hour (4 busy: 100%)", f"{100 * hour_share:.1f}%"],
    ]
    worst = max(errors.values(), default=1.0)
    collect_s, report_s = statistics.median(collects), statistics.median(reports)
    drawn = 'class="timeline"' in html and abs(hour_share - 1) < 0.01
    notes = [
        f"Target: a day at 100 Hz x 4 busy threads fits in 64 MiB: "
        f"{verdict(stats['bytes'] <= 64 * MIB and stats['samples_evicted'] == 0)}.",
        f"Target: the first hour is still there at 1-minute resolution: "
        f"{verdict(bool(first_hour) and all(r['step'] == 60 for r in first_hour))}.",
        f"One-minute steps for the whole day need {rows_a_minute * folded_minutes / 1e6:.2f} M folded rows of "
        f"this source; the full store holds {stats['folded_held'] / 1e6:.2f} M beside its raw window, so "
        f"{'they fit' if rows_a_minute * folded_minutes <= stats['folded_held'] else 'its oldest buckets merged'}.",
        f"Target: the last 10 minutes raw: {verdict(bool(raw) and raw[0]['to'] - raw[0]['from'] >= 599)}.",
        f"Target: totals per prefix over the day, {WORKERS} workers, within 1% of the raw samples' totals: worst "
        f"{100 * worst:.4f}%: {verdict(worst <= 0.01)}.",
        f"Target: collecting the day from {WORKERS} workers (aggregated) < 2 s: {collect_s:.2f} s: "
        f"{verdict(collect_s < 2)}.",
        f"Target: the report with its timeline < 4 s: {report_s:.2f} s, the timeline drawn and its first hour "
        f"holding the hour's time: {verdict(report_s < 4 and drawn)}.",
    ]
    header = ["a day in each worker's store", "value"]
    return Section("Retention: a day of history (issue 21)", __doc__ or "", [table(header, rows)], notes)
