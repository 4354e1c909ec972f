"""Tick anatomy: what one tick costs and asks the kernel, in the shapes users run, with
this machine's own price of each call, so that figures from two kinds of machine can be
compared. Each shape runs in a process of its own; its sampling thread alone is traced
by `perf stat -t TID` on the kernel's tracepoints, to count its system calls by kind."""

from __future__ import annotations

import contextlib
import csv
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from typing import Any, NamedTuple

from benchmarks import ROOT
from benchmarks.common import Section, cpu_model, in_free_threaded_root, sampler_tid, table, verdict
from benchmarks.tick.rate import busy
from benchmarks.tick.sample_cost import parked
from dask_pyspy import Sampler

RATE = 100
DEFAULT_BUDGET = 0.01


class Shape(NamedTuple):
    threads: int
    spinning: bool  # else parked DEPTH frames deep
    idle: bool
    target_us: float | None  # the tick's, issue 43
    free_threaded: bool = False  # run in the free-threaded 3.13t of ci/matrix.sh's sid root


SHAPES: dict[str, Shape] = {
    "10 parked x 38 frames, idle=True": Shape(10, False, True, 40),
    "10 parked x 38 frames, idle=False": Shape(10, False, False, 15),
    "1 spinning": Shape(1, True, False, None),
    "4 spinning": Shape(4, True, False, 40),
    "32 spinning": Shape(32, True, False, None),
    "8 spinning, free-threaded 3.13t": Shape(8, True, False, 60, free_threaded=True),
}
DEPTH = 38
# Figures are of the ticks after this: the first reads every code object and opens
# every thread's files, once.
WARM_UP_S = 0.5


# The kinds counted one by one; the rest are counted together as "other".
KINDS = ("clock_gettime", "rt_sigaction", "pread64", "read", "openat", "futex", "process_vm_readv")


def syscalls_of(tid: int, seconds: float, hz: float) -> tuple[dict[str, float], float]:
    """System calls of thread `tid` by kind over `seconds`, and the ticks meanwhile
    (`hz` times the span perf counted). Counted from the kernel's tracepoints by
    `perf stat`, which never stops the thread: strace stopped it at each call, and a
    tick's calls, slowed ~100x, made quiet ticks look busy."""
    kind_of = {"raw_syscalls:sys_enter": "total"} | {f"syscalls:sys_enter_{k}": k for k in KINDS}
    # By the second: each line's time stamp is the time counted so far, so the last is
    # the counted span exactly (perf's own start and exit left out).
    events = ",".join(kind_of)
    command = ["perf", "stat", "-x,", "-I", "1000", "-e", events, "-t", str(tid), "--", "sleep", str(seconds)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=seconds + 60)
    counts: dict[str, float] = {}
    span_s = 0.0
    for stamp, count, _, event, *_ in (r for r in csv.reader(done.stderr.splitlines()) if len(r) > 3):
        if event in kind_of and count.isdigit():
            counts[kind_of[event]] = counts.get(kind_of[event], 0) + int(count)
            span_s = max(span_s, float(stamp))
    total = counts.pop("total", 0)
    counts["other"] = total - sum(counts.values())
    return counts, hz * span_s


def clock_reads(stats: dict[str, Any]) -> int:
    return stats["reader_stats"].get("clock_reads", 0)


def measure(shape: str, budget: float, seconds: float, count: bool) -> dict[str, Any]:
    """One shape at `budget`, in this process: us per tick, Hz, phases, calls per tick."""
    form = SHAPES[shape]
    stop = threading.Event()
    spinners = form.threads if form.spinning else 0
    pool = [threading.Thread(target=busy, args=(stop,), daemon=True) for _ in range(spinners)]
    for t in pool:
        t.start()
    with contextlib.nullcontext() if form.spinning else parked(form.threads, DEPTH):
        s = Sampler(rate=RATE, idle=form.idle, cpu_budget=budget)
        s.start()
        time.sleep(WARM_UP_S)
        before = s.stats()
        time.sleep(seconds)
        st = s.stats()
        tid = sampler_tid()
        hz = (st["ticks"] - before["ticks"]) / (st["duration_s"] - before["duration_s"])
        counted = count and shutil.which("perf") is not None and tid is not None
        calls, traced_ticks = syscalls_of(tid, seconds, hz) if counted else ({}, 0.0)
        s.stop()
    stop.set()
    for t in pool:
        t.join()
    ticks = max(st["ticks"] - before["ticks"], 1)
    return {
        "us_per_tick": 1e6 * (st["cpu_s"] - before["cpu_s"]) / ticks,
        "hz": hz,
        "phases": st["phases_us"],
        "calls": {k: v / max(traced_ticks, 1) for k, v in calls.items()},
        "clock_reads": (clock_reads(st) - clock_reads(before)) / ticks,
        "reads_by": st["reader_stats"].get("reads_by"),
    }


def in_child(shape: str, budget: float, seconds: float, count: bool) -> dict[str, Any]:
    """`measure` in a process of its own: this interpreter's, or the free-threaded one."""
    args = json.dumps([shape, budget, seconds, count])
    code = (
        "import json; from benchmarks.tick.tick_anatomy import measure as m; "
        f"print(json.dumps(m(*json.loads({args!r}))))"
    )
    if SHAPES[shape].free_threaded and not sysconfig.get_config_var("Py_GIL_DISABLED"):
        out = in_free_threaded_root(["-c", code], timeout=300)
    else:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(done.stderr[-2000:])
        out = done.stdout
    return json.loads(out.strip().splitlines()[-1])


def call_costs() -> list[dict[str, Any]]:
    """benchmarks/tick/tick_calls.c, built with the machine's C compiler and run."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return []
    with tempfile.TemporaryDirectory() as d:
        exe = os.path.join(d, "tick_calls")
        src = os.path.join(os.path.dirname(__file__), "tick_calls.c")
        subprocess.run([cc, "-O2", "-o", exe, src, "-lpthread"], check=True)
        return json.loads(subprocess.run([exe], capture_output=True, text=True, check=True).stdout)


def calls_text(calls: dict[str, float]) -> str:
    kept = sorted(((n, c) for n, c in calls.items() if c >= 0.05), key=lambda nc: -nc[1])
    total = sum(calls.values())
    return f"{total:.1f}: " + ", ".join(f"{n} {c:.1f}" for n, c in kept) if calls else "-"


# The row of tick_calls.c that prices each system call a tick makes; the sleep's futex
# is the wake's, and any other call is priced at the floor.
PRICED_AS = {
    "clock_gettime": "clock_gettime, another thread's CPU clock",
    "rt_sigaction": "sigaction, a query",
    "pread64": "pread /proc/self/task/TID/syscall",
    "process_vm_readv": "process_vm_readv, 16 KiB in one range",
}
FLOOR = "getppid (a system call's floor)"


def calls_target(calls: dict[str, float], form: Shape) -> str:
    """Issue 43's count: the sleep and one clock, and one clock per thread that ran (each
    spinning thread runs or wakes to ask for the GIL between two ticks; parked ones do not)."""
    if not calls:
        return "-"
    ran = form.threads if form.spinning else 0
    return f"<= {2 + ran}: {verdict(sum(calls.values()) <= 2 + ran)}"


def calls_price(calls: dict[str, float], costs: list[dict[str, Any]]) -> str:
    """What a tick's counted system calls cost at this machine's hot and cold prices:
    the cold price is each call's first after a sleep, so the tick's share lies between."""
    price = {c["call"]: (c["hot_us"], c["cold_us"]) for c in costs}
    if not calls or FLOOR not in price:
        return "-"
    asked = [(n, price[PRICED_AS.get(name, FLOOR)]) for name, n in calls.items() if name != "futex"]
    return f"{sum(n * hot for n, (hot, _) in asked):.0f}-{sum(n * cold for n, (_, cold) in asked):.0f}"


def run(quick: bool) -> Section:
    seconds = 2.0 if quick else 4.0
    costs = call_costs()
    rows, phase_rows = [], []
    phase_names: list[str] = []
    for shape, form in SHAPES.items():
        target = form.target_us
        free = in_child(shape, 1.0, seconds, count=True)
        held = in_child(shape, DEFAULT_BUDGET, seconds, count=False)
        tick = free["us_per_tick"] - free["phases"].get("wake", 0.0)
        met = "-" if target is None else f"<= {target:g}: {verdict(tick <= target)}"
        rows.append(
            [
                shape,
                f"{free['us_per_tick']:.0f}",
                f"{tick:.0f}",
                met,
                f"{free['hz']:.0f}",
                f"{held['hz']:.0f}",
                f"{free['clock_reads']:.2f}",
                calls_text(free["calls"]),
                calls_target(free["calls"], form),
                calls_price(free["calls"], costs),
                free["reads_by"],
            ]
        )
        phase_rows.append([shape, *(f"{v:.1f}" for v in free["phases"].values())])
        phase_names = list(free["phases"])
    section = Section(
        "Tick anatomy",
        f"One process per shape, sampled at {RATE} Hz, measured after its first {WARM_UP_S:g} s (the first tick "
        "reads every code object once): the sampling thread's CPU us per tick, the sleep and "
        "wake before it included (what the budget is charged), and the tick alone (less the wake, timed on one "
        "tick in 8), which the targets (issue 43) "
        f"are for; the rate without a budget, the rate at the default budget ({100 * DEFAULT_BUDGET:g}% of a "
        "core), threads' CPU clocks read per tick, and the sampling thread's own system calls per tick, by "
        "kind, counted by `perf stat` from the kernel's tracepoints on that thread alone (never stopping it, "
        "as strace did), and what those calls (the sleep's futex left "
        "out) cost at this machine's prices below, hot and cold: a tick's first calls after the sleep pay the "
        f"cold price, so their share of the tick lies between. CPU: {cpu_model()}.",
    )
    section.tables.append(
        table(
            [
                "shape",
                "us/tick",
                "tick alone",
                "target",
                "Hz, no budget",
                "Hz, 1% budget",
                "clocks read/tick",
                "system calls/tick",
                "target",
                "their price, us hot-cold",
                "reads by",
            ],
            rows,
        )
    )
    section.tables.append(
        "Where a tick's time goes, wall us per tick by phase (timed from the time-stamp counter, "
        "so timing asks the kernel nothing), and the CPU charged for the sleep and wake before it:\n\n"
        + table(["shape", *phase_names], phase_rows)
    )
    if costs:
        section.tables.append(
            "This machine's price of each call, from C: hot (back to back) and cold (after a 10 ms sleep, "
            "as a tick runs), us:\n\n"
            + table(["call", "hot", "cold"], [[c["call"], f"{c['hot_us']:.2f}", f"{c['cold_us']:.2f}"] for c in costs])
        )
    return section


if __name__ == "__main__":
    print(run("--quick" in sys.argv).markdown())
