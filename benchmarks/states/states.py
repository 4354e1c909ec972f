"""Thread states: shapes of work whose states are known, each run idle and beside
`stress-ng --cpu 4`, with the shares of wall time the profile gives each state and
what reading the states cost."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from typing import Any, Callable

from benchmarks.common import Section, table
from benchmarks.states.thread_work import STATES, Accounted, hash_, matmul, nap, parquet, shares, spin, write_parquet

CORES = len(os.sched_getaffinity(0))


def shapes(path: str) -> list[tuple[str, str, Callable[..., int], int, tuple[Any, ...]]]:
    """(name, expected, work, threads, args)"""
    return [
        ("4 pure-Python threads", "on CPU, GIL ~25%, waiting for the GIL ~75%", spin, 4, ()),
        (
            f"sha256 in {2 * CORES} threads (2 x cores)",
            "on CPU, no GIL ~50%, waiting for a CPU ~50%",
            hash_,
            2 * CORES,
            (),
        ),
        ("time.sleep in 2 threads", "blocked 100%", nap, 2, ()),
        ("parquet read, arrow's pool", "native threads, most", parquet, 1, (path,)),
        ("numpy matmul (OpenBLAS)", "on CPU, no GIL (or waiting for a CPU)", matmul, 1, ()),
    ]


def measure(path: str, samples: int) -> list[list[object]]:
    rows = []
    for name, expected, work, threads, args in shapes(path):
        accounted = Accounted(work)
        got, profile = shares(accounted, threads, *args, samples=samples)
        truth = accounted.truth()
        stats = profile.processes[0]["stats"]
        on_cpu = got["gil"] + got["no_gil"]
        rows.append(
            [
                name,
                expected,
                *(f"{100 * got[s]:.0f}%" for s in STATES),
                f"{100 * truth['cpu']:.0f}% / {100 * on_cpu:.0f}%",
                f"{100 * truth['runq']:.0f}% / {100 * got['cpu_wait']:.0f}%",
                f"{stats['states']['syscall_reads'] / max(stats['ticks'], 1):.2f}",
            ]
        )
    return rows


def run(quick: bool) -> Section:
    samples = 300 if quick else 1000
    header = [
        "shape",
        "expected",
        "on CPU, GIL",
        "on CPU, no GIL",
        "waiting for a CPU",
        "waiting for the GIL",
        "native threads",
        "blocked",
        "on CPU: kernel / sampled",
        "run queue: kernel / sampled",
        "syscall reads per tick",
    ]
    section = Section("Thread states", __doc__.split("\n\n")[0].replace("\n", " "))
    with tempfile.TemporaryDirectory() as tmp:
        path = write_parquet(os.path.join(tmp, "t.parquet"))
        section.tables.append("Idle machine (apart from the benchmark):\n\n" + table(header, measure(path, samples)))
        if shutil.which("stress-ng"):
            stress = subprocess.Popen(["stress-ng", "--cpu", "4", "--quiet"])
            try:
                section.tables.append("Beside `stress-ng --cpu 4`:\n\n" + table(header, measure(path, samples)))
            finally:
                stress.kill()
                stress.wait()
        else:
            section.notes.append("stress-ng is not installed: the loaded run was left out.")
    section.notes.append(
        f"{CORES} cores; shares are of each shape's task wall time, from the report's summary; "
        f"at least {samples} samples per shape. Kernel: the tasks' threads' own schedstat (CPU time, "
        "run-queue delay) read at each task's start and end, the truth the sampled shares estimate. "
        "Syscall reads: of /proc/self/task/TID/syscall, per tick of the whole process."
    )
    return section
