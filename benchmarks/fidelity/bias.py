"""Sampling bias: threads alternate a churny function (many small calls) and a steady
loop at periods near the sampling interval, keep their own account of the truth, and
are sampled at 100 Hz; this build side by side with a baseline build (`--baseline`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from benchmarks.common import Section, table, verdict

CHILD = os.path.join(os.path.dirname(__file__), "bias_child.py")
RATE = 100.0
PERIODS = (0.5, 1, 2, 10)  # in sampling intervals
SHARES = (0.7, 0.5)
TOLERANCE = 0.02
#: Set by `python -m benchmarks --baseline PYTHON`: an interpreter with another build.
BASELINE: str | None = None


def one_run(
    python: str, periods: float, share: float, threads: int, seconds: float, native: bool = False
) -> dict[str, Any]:
    config = {"rate": RATE, "periods": periods, "share": share, "threads": threads, "seconds": seconds}
    args = json.dumps({**config, **({"native": True} if native else {})})
    # Run from outside the checkout so `python` imports its own installed dask_pyspy.
    done = subprocess.run([python, CHILD, args], capture_output=True, text=True, cwd="/", check=True)
    return json.loads(done.stdout)


def shares(run: dict[str, Any]) -> tuple[float, float]:
    """(true churny share, sampled churny share), pooled over the run's threads."""
    t = [sum(th[kind][fn] for th in run["threads"]) for kind in ("truth", "sampled") for fn in ("churny", "steady")]
    return t[0] / (t[0] + t[1]), t[2] / max(t[2] + t[3], 1e-12)


def lost(run: dict[str, Any]) -> float:
    r = run["reader_stats"]
    reads = r.get("thread_reads", 0)
    gone = r.get("lost_reads", r.get("torn_reads", 0))
    return gone / reads if reads else float("nan")


def run(quick: bool) -> Section:
    seconds, repeats = (20.0, 3) if not quick else (10.0, 3)
    builds = {"this build": sys.executable, **({"baseline": BASELINE} if BASELINE else {})}
    jobs = [
        (build, threads, periods, share, r)
        for build in builds
        for threads in (1, 4)
        for periods in PERIODS
        for share in SHARES
        for r in range(repeats)
    ]
    # Two runs at a time on two cores: each keeps about one core busy.
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda j: one_run(builds[j[0]], j[2], j[3], j[1], seconds), jobs))
    rows, worst = [], {b: (0.0, 0.0) for b in builds}
    by_config: dict[tuple, list] = {}
    for (build, threads, periods, share, _), res in zip(jobs, results):
        by_config.setdefault((build, threads, periods, share), []).append(res)
    for (build, threads, periods, share), runs in by_config.items():
        measured = [shares(r) for r in runs]
        errors = [100 * (s - t) for t, s in measured]
        for (t, s), r in zip(measured, runs):
            # The standard error of a share read from n independent samples.
            se = 100 * (t * (1 - t) / (len(r["threads"]) * r["achieved_rate"] * seconds)) ** 0.5
            worst[build] = max(worst[build], (abs(100 * (s - t)), abs(100 * (s - t)) / se))
        rows.append(
            [
                build,
                threads,
                f"{periods:g} ({periods * 1000 / RATE:g} ms)",
                f"{100 * share:.0f}/{100 - 100 * share:.0f}",
                " / ".join(f"{100 * t:.1f}" for t, _ in measured),
                " / ".join(f"{100 * s:.1f}" for _, s in measured),
                " / ".join(f"{e:+.1f}" for e in errors),
                " / ".join(f"{100 * lost(r):.2f}%" for r in runs),
                " / ".join(f"{r['achieved_rate']:.1f}" for r in runs),
            ]
        )
    notes = [
        f"Target (issue 18): every sampled share within ±{100 * TOLERANCE:.0f} points of the truth in each run. "
        f"{build}: worst {w:.1f} points ({z:.1f} standard errors): {verdict(w <= 100 * TOLERANCE)}."
        for build, (w, z) in worst.items()
    ]
    notes.append(
        f"Statistical floor: with random sample times the phases are independent, so a share read from "
        f"n = {RATE * seconds:.0f} samples of one thread has a standard error of about "
        f"{100 * (0.21 / (RATE * seconds)) ** 0.5:.1f} points (70/30); 4 threads pool 4n samples."
    )
    return Section(
        "Sampling bias",
        f"Each run: 1 or 4 threads, each alternating `churny` (a loop of small calls) for the first share of a "
        f"period and `steady` (one frame, a plain loop) for the rest, keeping its own `perf_counter` account; "
        f"sampled at {RATE:g} Hz (idle=True, budget 1.0) for {seconds:g} s; share = churny's sampled wall time "
        f"over churny + steady, pooled over the run's threads. {repeats} runs per line, two runs at a time.",
        [
            table(
                [
                    "build",
                    "threads",
                    "period (intervals)",
                    "split",
                    "true churny %",
                    "sampled churny %",
                    "error (points)",
                    "reads lost",
                    "achieved Hz",
                ],
                rows,
            )
        ],
        notes,
    )
