"""Sampling never waits for an export (issue 34): how late the sampler's ticks begin
(against the times it drew for them, its last 1,024 ticks) while another thread
exports two hours of history over and over (raw and aggregated in turn, through
`Sampler.export` at its lower priority), beside `stress-ng --cpu 4`, and before the
exports for comparison. Each run is a fresh process (export_lateness_child.py), its
store filled by replaying real samples of four threads on many call paths; with
`--baseline PYTHON` another build runs beside this one, alternating."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from benchmarks.common import Section, table, verdict

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "export_lateness_child.py")
#: Set by `python -m benchmarks --baseline PYTHON`: an interpreter with another build.
BASELINE: str | None = None


def one_run(python: str, history_s: float, export_s: float) -> dict[str, Any]:
    args = json.dumps({"history_s": history_s, "export_s": export_s, "stress": 4})
    # Run from outside the checkout so `python` imports its own installed dask_pyspy.
    done = subprocess.run([python, CHILD, args], capture_output=True, text=True, cwd="/", check=True)
    return json.loads(done.stdout)


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1000 * seconds:.1f}"


def run(quick: bool) -> Section:
    builds = {"this build": sys.executable, **({"baseline": BASELINE} if BASELINE else {})}
    rounds = 1 if quick else 2
    results = [(build, one_run(python, 7200, 11)) for _ in range(rounds) for build, python in builds.items()]
    rows = []
    for build, r in results:
        quiet, during = r["quiet"], r["during"]
        rows.append(
            [
                build,
                ms(quiet["p50"]),
                ms(quiet["p99"]),
                ms(quiet["max"]),
                ms(during["p50"]),
                ms(during["p99"]),
                ms(during["max"]),
                r["exports"],
                ms(r["export_s"]),
                f"{r['rate']:.1f}",
            ]
        )
    header = ["build", "quiet p50 ms", "p99", "max", "exporting p50 ms", "p99", "max", "exports", "export ms", "Hz"]
    mine = [r for build, r in results if build == "this build"]
    worst = max(r["during"]["p99"] for r in mine)
    store = mine[0]["store"]
    notes = [
        f"Store replayed: {store['samples_held']:,} raw samples and {store['folded_held']:,} folded rows, "
        f"{store['bytes'] / 2**20:.1f} MiB; the sampler at 100 Hz (interval 10 ms).",
        f"Target: while exporting beside stress-ng --cpu 4, tick lateness at p99 at most one interval. "
        f"This build, worst run: {ms(worst)} ms: {verdict(worst <= mine[0]['interval_s'])}.",
        "stress-ng ran beside every run." if all(r["stress"] for _, r in results) else "stress-ng was NOT found.",
    ]
    return Section("Sampling while exporting (issue 34)", __doc__ or "", [table(header, rows)], notes)
