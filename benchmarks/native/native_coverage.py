"""Native frames, part 3: how much of each job's time its library's frames reach, in the
shapes dask runs: a worker's 2 busy task threads, and 4 busy threads on 2 cores."""

from __future__ import annotations

from benchmarks.common import Section, table, verdict
from benchmarks.native.native_runs import Doc, Recording, run_child

#: Shares of a job's samples that must show its library (issue 44), %.
CLUSTER_GEMM = 90.0
THREAD_LIBRARY = 85.0
#: The thread of the 4 (native_child.agreement, together) and the frame its library shows.
JOBS = {"matmul (work-0)": ("work-0", "gemm"), "arrow sort and take (work-1)": ("work-1", "arrow::")}


def thread_share(doc: Doc, thread: str, frame: str) -> tuple[float, float]:
    """Seconds of `thread`'s samples, and of those with a frame whose name holds `frame`."""
    frames = doc["shared"]["frames"]
    total = shown = 0.0
    for p in doc["profiles"]:
        if thread not in p["name"]:
            continue
        for stack, weight in zip(p["samples"], p["weights"]):
            total += weight
            shown += weight * any(frame in frames[i]["name"] for i in stack)
    return total, shown


def coverage(section: Section, together: Recording | None, seconds: float) -> None:
    print("  coverage: a 1 x 2 LocalCluster of matmul tasks", flush=True)
    cluster = run_child({"mode": "cluster", "seconds": seconds})
    rows: list[list[object]] = []

    def row(shape: str, what: str, total: float, shown: float, target: float) -> None:
        share = 100 * shown / total if total else 0.0
        rows.append([shape, what, f"{total:.1f}", f"{share:.1f}%", f"≥ {target:g}%: {verdict(share >= target)}"])

    row(
        "LocalCluster, 1 worker x 2 threads",
        "matmul tasks: a gemm frame",
        cluster["task_s"],
        cluster["gemm_s"],
        CLUSTER_GEMM,
    )
    if together is not None:
        for job, (thread, frame) in JOBS.items():
            total, shown = thread_share(together.running, thread, frame)
            row(
                "4 threads on 2 cores, alone, running samples",
                f"{job}: a `{frame}` frame",
                total,
                shown,
                THREAD_LIBRARY,
            )
    section.tables.append(
        f"Coverage: the share of a job's samples that show its library's frames, native=True at 100 Hz (the "
        f"cluster: PySpyPlugin(native=True), default budget, {seconds:g} s of tasks; the threads: the agreement's "
        f"together run, alone):\n\n" + table(["shape", "job: frame shown", "sampled s", "share", "target"], rows)
    )
    section.notes.append(
        "The rest of a matmul task's time is numpy's own: freeing arrays (munmap), the division and maximum "
        "between products, the random fill, and Python-only samples (a capture's halves that disagreed, or none)."
    )
