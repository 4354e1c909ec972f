"""Free-threaded CPython (3.13t): the GIL stays off, stacks read as Python reads them,
threads that really run at once are each sampled, and tasks keep their own tags.

Measured in the free-threaded interpreter ci/matrix.sh builds (its venv in the sid
root under $DASK_PYSPY_ROOTS); from another interpreter this section runs itself there
through chroot (as root), so `python -m benchmarks --only free_threaded` works as the
other sections do. In 3.13t itself: `python -m benchmarks.free_threaded.free_threaded`
prints JSON.
"""

from __future__ import annotations

import json
import os
import sys
import sysconfig
import threading
import time
from typing import Any

from benchmarks.common import Section, in_free_threaded_root, run_for, sampler_tid, table, verdict

THREADS = 8
RATE = 100
# Busy share of each thread's 90 ms period: (i + 1) / 9, so the true shares differ.
PERIOD = 0.09


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def duty(i: int, stop: threading.Event, busy: list[float]) -> None:
    """Busy (attached, running Python) for (i + 1)/9 of each period, asleep the rest."""
    on = PERIOD * (i + 1) / 9
    while not stop.is_set():
        began = time.perf_counter()
        spin(on)
        busy[i] += time.perf_counter() - began
        time.sleep(PERIOD - on)


def always(i: int, stop: threading.Event, busy: list[float]) -> None:
    began = time.perf_counter()
    while not stop.is_set():
        spin(0.01)
    busy[i] = time.perf_counter() - began


def sampler_thread_cpu_s() -> float:
    """CPU seconds of the sampling thread so far, from its schedstat: the ticks and
    what the loop does between them (stats count the ticks only)."""
    tid = sampler_tid()
    if tid is None:
        raise RuntimeError("no sampling thread")
    with open(f"/proc/self/task/{tid}/schedstat") as f:
        return int(f.read().split()[0]) / 1e9


def sampled_run(target: Any, seconds: float) -> dict[str, Any]:
    """THREADS threads running `target` for `seconds` under a 100 Hz sampler: per thread
    its busy seconds and sampled seconds, and the sampler's and process's figures."""
    from dask_pyspy import Sampler

    busy = [0.0] * THREADS
    stop = threading.Event()
    threads = [threading.Thread(target=target, args=(i, stop, busy), name=f"t{i}") for i in range(THREADS)]
    s = Sampler(rate=RATE, cpu_budget=0.05)  # the default budget (1%) would throttle 8 threads' reads
    s.start()
    gil_while_sampling = sys._is_gil_enabled()  # type: ignore[attr-defined]
    cpu0, wall0, thread0 = time.process_time(), time.perf_counter(), sampler_thread_cpu_s()
    run_for(threads, stop, seconds)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    thread_cpu = sampler_thread_cpu_s() - thread0
    s.stop()
    stats = s.stats()
    doc = s.profile().speedscope()
    sampled = [sum(sum(p["weights"]) for p in doc["profiles"] if f" t{i} (" in p["name"]) for i in range(THREADS)]
    reads = stats["reader_stats"]
    return {
        "gil_while_sampling": gil_while_sampling,
        "cpu_per_wall": cpu / wall,
        "busy": busy,
        "sampled": sampled,
        # Each sample stands for its tick's interval: sampled seconds per busy second is
        # the share of the ticks while busy that sampled the thread.
        "hz": [stats["achieved_rate"] * s / b for s, b in zip(sampled, busy)],
        "sampler_cpu": stats["cpu_fraction"],
        "sampler_thread_cpu": thread_cpu / wall,
        "achieved_rate": stats["achieved_rate"],
        "lost": reads["lost_reads"] / (reads["thread_reads"] or 1),
    }


def parallel(seconds: float) -> dict[str, Any]:
    """CPU-bound threads (rate, cost, lost reads), then threads busy for different
    shares of the time (each one's sampled share against its true share)."""
    bound, shares = sampled_run(always, seconds), sampled_run(duty, seconds)
    return {
        **bound,
        "gil_while_sampling": bound["gil_while_sampling"] or shares["gil_while_sampling"],
        "duty_sampler_cpu": shares["sampler_cpu"],
        "duty_rate": shares["achieved_rate"],
        "true_share": [b / sum(shares["busy"]) for b in shares["busy"]],
        "sampled_share": [s / (sum(shares["sampled"]) or 1.0) for s in shares["sampled"]],
    }


def oracle(rounds: int) -> dict[str, int]:
    """Parked stacks (depths 1-300, a generator, a coroutine) dumped and compared with Python's."""
    from benchmarks.fidelity.oracle import dumped_stacks, parked
    from dask_pyspy import Sampler

    equal = total = 0
    with parked() as (idents, truth):
        s = Sampler(rate=10, idle=True, cpu_budget=1.0, reader="fast")
        s.start()
        try:
            for _ in range(rounds):
                dumped = dumped_stacks(s, idents)
                total += len(idents)
                equal += sum(dumped.get(i) == truth[i] for i in idents)
        finally:
            s.stop()
    return {"equal": equal, "total": total, "deepest": max(len(v) for v in truth.values())}


def alpha(_: int) -> None:
    spin(0.001)


def beta(_: int) -> None:
    spin(0.001)


def local_threads(tasks: int) -> dict[str, Any]:
    import dask

    from benchmarks.fidelity.attribution import ours, tagged_and_precision
    from dask_pyspy import PySpyProfiler

    work = [dask.delayed(f, pure=False)(i) for i in range(tasks // 2) for f in (alpha, beta)]
    with PySpyProfiler(rate=1000, cpu_budget=0.5) as prof:
        dask.compute(work, scheduler="threads", num_workers=THREADS)
    split = ours(prof.profile.speedscope(by="prefix"), ("alpha", "beta")).values()
    both = {k: sum(r[k] for r in split) for k in ("right", "wrong", "untagged")}
    tagged, precision = tagged_and_precision(both)
    return {"tagged": tagged, "precision": precision, "seconds": sum(both.values())}


def measure(quick: bool) -> dict[str, Any]:
    gil_before = sys._is_gil_enabled()  # type: ignore[attr-defined]
    import dask_pyspy  # noqa: F401

    out: dict[str, Any] = {"version": sys.version.split()[0], "gil_after_import": sys._is_gil_enabled()}  # type: ignore[attr-defined]
    out["gil_before_import"] = gil_before
    out["oracle"] = oracle(20 if quick else 100)
    out["parallel"] = parallel(5.0 if quick else 20.0)
    out["local"] = local_threads(2000)
    out["gil_at_end"] = sys._is_gil_enabled()  # type: ignore[attr-defined]
    return out


def in_root(quick: bool) -> dict[str, Any]:
    """The measurement, run in the free-threaded interpreter of the sid root."""
    out = in_free_threaded_root(["-m", "benchmarks.free_threaded.free_threaded", *(["--quick"] if quick else [])])
    return json.loads(out.splitlines()[-1])


def run(quick: bool) -> Section:
    m = measure(quick) if sysconfig.get_config_var("Py_GIL_DISABLED") else in_root(quick)
    p, o, loc = m["parallel"], m["oracle"], m["local"]
    shares = list(zip(p["hz"], p["true_share"], p["sampled_share"]))
    worst_share = max(abs(t - s) for _, t, s in shares)
    worst_hz = max(abs(h / RATE - 1) for h, _, _ in shares)
    section = Section(
        "Free-threaded CPython (3.13t)",
        f"CPython {m['version']} built with --disable-gil (ci/matrix.sh), in its venv in the sid root. "
        f"Oracle: {THREADS} threads parked at known stacks, dumped and compared with sys._current_frames(). "
        f"Parallel, sampled at {RATE} Hz: first {THREADS} CPU-bound threads (spin loops), where Hz = the "
        "sampler's rate times the share of the thread's run its samples stand for; then thread i busy (a spin "
        f"loop, attached) (i+1)/9 of each {PERIOD * 1000:.0f} ms and asleep the rest: its true share is its "
        "busy wall time over all threads', its sampled share its sampled seconds over all threads'. "
        f"Local: dask.compute of 2000 1-ms tasks of two kinds, scheduler='threads', num_workers={THREADS}, "
        "under PySpyProfiler; tagged = share of samples inside a task function that carry a task tag, "
        "precision = share of those whose tag is that function's.",
    )
    section.tables.append(
        table(
            ["thread", "Hz (CPU-bound)", "true share (duty)", "sampled share (duty)"],
            [[f"t{i}", f"{h:.1f}", f"{t:.1%}", f"{s:.1%}"] for i, (h, t, s) in enumerate(shares)],
        )
    )
    gil_off = not (m["gil_after_import"] or p["gil_while_sampling"] or m["gil_at_end"])
    section.notes += [
        f"Target: the GIL stays off after import and while sampling. sys._is_gil_enabled(): before import "
        f"{m['gil_before_import']}, after {m['gil_after_import']}, while sampling {p['gil_while_sampling']}, "
        f"at the end {m['gil_at_end']}: {verdict(gil_off)}.",
        f"Target: oracle 100%. {o['equal']} of {o['total']} thread-stacks equal to Python's (deepest "
        f"{o['deepest']} frames): {verdict(o['equal'] == o['total'])}.",
        f"The threads ran in parallel: process CPU / wall = {p['cpu_per_wall']:.2f} on {os.cpu_count()} cores.",
        f"Target: each CPU-bound thread sampled at 100 Hz +-2%. Worst {worst_hz:.1%} off: {verdict(worst_hz <= 0.02)}.",
        f"Target: sampler CPU <= 1% of a core per 100 Hz. CPU-bound threads, the ticks' CPU (stats' "
        f"cpu_fraction): {p['sampler_cpu']:.2%} at {p['achieved_rate']:.1f} Hz: "
        f"{verdict(p['sampler_cpu'] * 100 / p['achieved_rate'] <= 0.01)}. The sampling thread's whole CPU "
        f"meanwhile (its schedstat: ticks and the loop between them): {p['sampler_thread_cpu']:.2%}. "
        f"Duty-cycle threads, ticks: {p['duty_sampler_cpu']:.2%} at {p['duty_rate']:.1f} Hz.",
        f"Target: sampled shares within +-3 points of the true ones. Worst {100 * worst_share:.1f} points: "
        f"{verdict(worst_share <= 0.03)}.",
        f"Target: lost reads <= 1% with {THREADS} threads. Measured {p['lost']:.2%}: {verdict(p['lost'] <= 0.01)}.",
        f"Target: local threaded scheduler, >= 98% of task time tagged, precision 100%. Tagged {loc['tagged']:.1%}, "
        f"precision {loc['precision']:.2%} over {loc['seconds']:.2f} sampled s: "
        f"{verdict(loc['tagged'] >= 0.98 and loc['precision'] == 1.0)}.",
    ]
    return section


if __name__ == "__main__":
    print(json.dumps(measure("--quick" in sys.argv)))
