"""The client's side of a collection at 16 to 1000 workers: merging that many worker
parts, raw and aggregated, in one process. The parts are copies of a real worker's
part, each as its own process with task keys of its own.

Run as `python -m benchmarks.collection.merge_scale PART N [aggregate]`: one merge in a fresh
process, so its peak memory is its own; prints one JSON line. `aggregate`: PART is an
aggregated part, and the merged profile says so as the scheduler's collection does.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

from dask_pyspy import Profile, _native
from dask_pyspy.render.report import render_html

WORKER_COUNTS = (16, 64, 256, 1000)


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith(field))


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _merge_once(part_path: str, n: int, aggregate: bool) -> dict[str, float]:
    part = Profile.from_wire(open(part_path, "rb").read())._native
    parts = {f"w{i}": _native._testing.as_process(part, f"w{i}", f"-w{i}").to_wire() for i in range(n)}
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets the peak, so it is the merge's alone
    before = _status_mib("VmRSS")
    began = time.perf_counter()
    merged = Profile.merge_wire(parts, aggregate=aggregate)
    merge_s = time.perf_counter() - began
    peak = _status_mib("VmHWM") - before
    began, cpu = time.perf_counter(), _cpu_s()
    render_html(merged)
    return {
        # Its threads' CPU too: on a shared machine, the wall time is partly the others'.
        "report_cpu_s": _cpu_s() - cpu,
        "merge_s": merge_s,
        "peak_mib": peak,
        "report_s": time.perf_counter() - began,
        "wire_mib": sum(map(len, parts.values())) / 2**20,
        "samples": merged.n_samples,
    }


def _available_mib() -> float:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("MemAvailable"))


def _needs_mib(part: bytes, n: int) -> float:
    """Decoded copies merged, plus their wire bytes, with room for the tables."""
    head = _native.Profile.wire_head(part)
    return n * (head["memory_bytes"] + len(part)) * 1.5 / 2**20


def scale_rows(parts: dict[str, bytes]) -> tuple[list[list[object]], dict[tuple[str, int], float]]:
    """One row per kind of part (e.g. raw, aggregated) and worker count; and the report
    seconds of each that ran."""
    rows: list[list[object]] = []
    reports: dict[tuple[str, int], float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind, part in parts.items():
            path = os.path.join(tmp, f"{kind}.bin")
            with open(path, "wb") as f:
                f.write(part)
            for n in WORKER_COUNTS:
                needs, free = _needs_mib(part, n), _available_mib()
                if needs > 0.7 * free:
                    rows.append(
                        [
                            kind,
                            n,
                            "-",
                            "-",
                            "-",
                            "-",
                            f"not run: needs ~{needs / 1024:.0f} GiB, {free / 1024:.0f} GiB free",
                        ]
                    )
                    continue
                print(f"  merge {kind} x {n}", flush=True)
                done = subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "benchmarks.collection.merge_scale",
                        path,
                        str(n),
                        *(["aggregate"] if kind == "aggregated" else []),
                    ],
                    capture_output=True,
                    text=True,
                )
                if done.returncode != 0:
                    kept = os.path.join(tempfile.gettempdir(), f"merge-scale-{kind}.bin")
                    shutil.copy(path, kept)
                    raise RuntimeError(f"merging {n} copies of {kept} failed:\n{done.stderr[-3000:]}")
                r = json.loads(done.stdout.strip().splitlines()[-1])
                reports[kind, n] = r["report_s"]
                rows.append(
                    [
                        kind,
                        n,
                        f"{r['samples']:,}",
                        f"{r['wire_mib']:.1f}",
                        f"{r['merge_s']:.2f}",
                        f"{r['peak_mib']:.0f}",
                        f"report {r['report_s']:.1f} s, CPU {r['report_cpu_s']:.1f} s",
                    ]
                )
    return rows, reports


if __name__ == "__main__":
    print(json.dumps(_merge_once(sys.argv[1], int(sys.argv[2]), sys.argv[3:] == ["aggregate"])))
