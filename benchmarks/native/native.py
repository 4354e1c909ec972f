"""Native frames (native=True): where the time goes by library against `py-spy record
--native`, Python -> C -> Python in order, what a native sample costs, the symbol tables'
memory, fidelity (lost reads, mismatches, the bias runs) and sleeps never interrupted.

The section's run() and its cost, memory, bias, fidelity and EINTR tables; agreement and order
are in native_agreement.py, the child processes in native_runs.py."""

from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from benchmarks.common import Section, interleave, spread, table, verdict
from benchmarks.fidelity import bias
from benchmarks.native.native_agreement import agreement
from benchmarks.native.native_coverage import coverage
from benchmarks.native.native_runs import Fidelity, cost_run, run_child, signals

COST_RATE, COST_CPU = 0.02, 0.015
SYMBOLS_MAX = 64 << 20
LOST_MAX, BIAS_MAX = 0.01, 2.0
CALLS = 10_000


def run(quick: bool) -> Section:
    seconds = 10.0 if quick else 20.0
    section = Section("Native frames", __doc__.split("\n\n")[0].replace("\n", " "))
    before = built()
    fidelity: list[Fidelity] = []
    together = agreement(section, seconds, fidelity)
    coverage(section, together, seconds)
    cost(section, seconds, 2 if quick else 3, fidelity)
    memory(section, 4.0 if quick else 8.0)
    bias_with_native(section, seconds, quick, fidelity)
    eintr(section)
    after = built()
    section.notes.append(
        f"Extension built {before}."
        if after == before
        else f"Extension rebuilt during the run ({before}, then {after}): the figures mix two builds."
    )
    return section


def built() -> str:
    """When the extension the children load was built: each child loads the file anew."""
    from dask_pyspy import _native

    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(os.path.getmtime(_native.__file__ or "")))


#: What native capture did in a cost run, as its table's last column names them.
COST_COUNTS = ("captures", "spared", "merged", "no_capture")


def cost(section: Section, seconds: float, rounds: int, fidelity: list[Fidelity]) -> None:
    contenders: dict[str, Callable[[], dict[str, float]]] = {
        "native=False": lambda: cost_run(False, seconds),
        "native=True": lambda: cost_run(True, seconds),
        # Whether the rate comes back where the budget does not bind.
        "native=True, cpu_budget=0.05": lambda: cost_run(True, seconds, 0.05),
    }
    runs = interleave(contenders, rounds)
    rows: list[list[object]] = []
    for name, m in runs.items():
        native = name.startswith("native=True")
        rows.append(
            [
                name,
                spread(m["rate"], "{:.1f}"),
                spread([100 * c for c in m["cpu"]], "{:.2f}"),
                spread([100 * t for t in m["throttled"]], "{:.0f}"),
                " / ".join(spread(m[k], "{:.1f}") for k in ("unwind", "symbols")) if native else "-",
                " / ".join(f"{sum(m[k]):.0f}" for k in COST_COUNTS) if native else "-",
            ]
        )
        mismatched = sum(m["mismatched"]) if native else None
        fidelity.append(
            Fidelity(
                f"cost, {name}",
                sum(m["lost"]),
                sum(m["reads"]),
                mismatched,
                sum(m.get("merged", [0])),
                spread(m["rate"], "{:.1f}"),
            )
        )
    section.tables.append(
        f"Cost: 4 busy threads (2 numpy matmul, 2 pandas groupby) sampled at 100 Hz with the default CPU budget "
        f"(0.01) unless said, for {seconds:g} s, {rounds} run(s) each, interleaved; median (min-max):\n\n"
        + table(
            [
                "sampler",
                "achieved Hz",
                "sampler CPU, % of a core",
                "ticks throttled by the budget, %",
                "per capture µs: unwind / symbols+merge",
                "captures unwound / left unread / samples merged / samples on a CPU without one",
            ],
            rows,
        )
    )
    nat = runs["native=True"]
    rate_ok = all(abs(r - 100) <= 100 * COST_RATE for r in nat["rate"])
    cpu_ok = all(c <= COST_CPU for c in nat["cpu"])
    section.notes += [
        "A busy thread's timer on its own CPU clock signals it where it runs; the sampler takes its latest capture "
        "at each tick and never waits. Unwind and symbols+merge are the sampler thread's CPU per capture. The "
        "handler's own copy of registers and stack top runs in the sampled thread and is not in the sampler's CPU.",
        f"Target: achieved rate 100 Hz ± {100 * COST_RATE:.0f}% with native=True. Measured "
        f"{spread(nat['rate'], '{:.1f}')}: {verdict(rate_ok)}.",
        f"Target: sampler CPU ≤ {100 * COST_CPU:.1f}% of a core with native=True. Measured "
        f"{spread([100 * c for c in nat['cpu']], '{:.2f}')}%: {verdict(cpu_ok)}.",
    ]


def memory(section: Section, seconds: float) -> None:
    print("  memory", flush=True)
    runs = {native: run_child({"mode": "memory", "native": native, "seconds": seconds}) for native in (False, True)}
    rows: list[list[object]] = []
    for native, r in runs.items():
        growth = {k: (r["after"][k] - r["before"][k]) / 1024 for k in ("VmRSS", "RssAnon", "RssFile")}
        mods = (r["stats"].get("native") or {}).get("modules")
        rows.append(
            [
                f"native={native}",
                f"{mods['symbol_bytes'] / 2**20:.1f}" if mods else "-",
                f"{mods['table_bytes'] / 2**20:.1f}" if mods else "-",
                f"{mods['modules']} ({mods['read']}) / {mods['symbols']}" if mods else "-",
                f"{r['before']['VmRSS'] / 1024:.0f}",
                " / ".join(f"{growth[k]:+.1f}" for k in ("VmRSS", "RssAnon", "RssFile")),
            ]
        )
    section.tables.append(
        f"Memory: numpy, pandas, pyarrow imported, a thread in matmul; RSS read before the "
        f"sampler starts and {seconds:g} s after (100 Hz):\n\n"
        + table(
            [
                "sampler",
                "symbol tables MiB",
                "unwind tables MiB",
                "modules (read) / symbols",
                "RSS before MiB",
                "growth MiB: VmRSS / RssAnon / RssFile",
            ],
            rows,
        )
    )
    symbols = runs[True]["stats"]["native"]["modules"]["symbol_bytes"]
    section.notes.append(
        f"Target: symbol tables ≤ {SYMBOLS_MAX >> 20} MiB with numpy, pandas and pyarrow. Measured "
        f"{symbols / 2**20:.1f} MiB: {verdict(symbols <= SYMBOLS_MAX)}. Modules are read (symbols indexed, "
        f"unwind tables copied: RssAnon) the first time a stack meets them; their files are never mapped."
    )


def bias_with_native(section: Section, seconds: float, quick: bool, fidelity: list[Fidelity]) -> None:
    """The bias benchmark's measurement (bias.py) with native=True, beside the same runs
    with native=False."""
    configs = [
        (threads, periods, share, native)
        for threads in (1, 4)
        for periods in ((1, 10) if quick else bias.PERIODS)
        for share in ((0.7,) if quick else bias.SHARES)
        for native in (False, True)
    ]
    print(f"  bias: {len(configs)} runs", flush=True)
    with ThreadPoolExecutor(2) as pool:  # two at a time, as bias.py runs them
        results = list(pool.map(lambda c: bias.one_run(sys.executable, c[1], c[2], c[0], seconds, c[3]), configs))
    rows: list[list[object]] = []
    worst = (0.0, 0.0)
    for (threads, periods, share, native), r in zip(configs, results):
        truth, sampled = bias.shares(r)
        error = 100 * (sampled - truth)
        # The standard error of a share read from this many independent samples, as bias.py gives it.
        se = 100 * (truth * (1 - truth) / (threads * r["achieved_rate"] * seconds)) ** 0.5
        split = f"{100 * share:.0f}/{100 - 100 * share:.0f}"
        if native:
            worst = max(worst, (abs(error), abs(error) / se))
            fidelity.append(Fidelity.of(f"bias, {threads} thread(s), period {periods:g}, {split}", r))
        n = r.get("native") or {}
        rows.append(
            [
                threads,
                f"{periods:g}",
                split,
                native,
                f"{100 * truth:.1f}",
                f"{100 * sampled:.1f}",
                f"{error:+.1f} ({error / se:+.1f} SE)",
                f"{100 * bias.lost(r):.2f}%",
                f"{n['mismatched']} / {n['merged']}" if n else "-",
                f"{r['achieved_rate']:.1f}",
            ]
        )
    section.tables.append(
        f"Bias: bias.py's alternating churny/steady threads, {seconds:g} s at {bias.RATE:g} Hz (idle=True, budget "
        f"1.0), with native=True and, for comparison, native=False; one run per line, two at a time:\n\n"
        + table(
            [
                "threads",
                "period (intervals)",
                "split",
                "native",
                "true churny %",
                "sampled churny %",
                "error, points (standard errors)",
                "reads lost",
                "mismatched / merged",
                "achieved Hz",
            ],
            rows,
        )
    )
    section.notes.append(
        f"Target: every sampled share within ±{BIAS_MAX:g} points of the truth with native=True. "
        f"Worst {worst[0]:.1f} points ({worst[1]:.1f} standard errors): {verdict(worst[0] <= BIAS_MAX)}."
    )
    fidelity_table(section, fidelity)


def fidelity_table(section: Section, fidelity: list[Fidelity]) -> None:
    section.tables.append(
        "Fidelity with native=True (native=False for comparison): reads the fast reader lost, and native "
        "captures whose Python and native halves disagreed (a Python-only sample kept):\n\n"
        + table(["run", "reads lost", "mismatched / merged", "achieved Hz"], [f.row() for f in fidelity])
    )
    worst = max((f.lost_share for f in fidelity if f.mismatched is not None), default=0.0)
    section.notes.append(
        f"Target: reads lost ≤ {100 * LOST_MAX:.0f}% with native=True. Worst {100 * worst:.2f}%: "
        f"{verdict(worst <= LOST_MAX)}."
    )


def eintr(section: Section) -> None:
    rows = []
    total = 0
    for case, call in (("a", "nanosleep"), ("b", "nanosleep"), ("b", "sem_timedwait"), ("b", "select")):
        what = "back to back" if case == "a" else "each after ~1 ms of numpy/Python work"
        print(f"  EINTR case {case}, {call}", flush=True)
        r = run_child({"mode": "eintr", "case": case, "call": call, "count": CALLS})
        n = r["stats"]["native"]
        total += r["eintr"]
        rows.append(
            [
                f"`{call}`, {what}",
                r["calls"],
                r["eintr"],
                r["other_errors"],
                f"{r['caller_s']:.2f} / {r['caller_native_s']:.2f}",
                signals(n),
                f"{r['stats']['achieved_rate']:.1f}",
            ]
        )
    section.tables.append(
        f"EINTR: a thread making {CALLS:,} libc calls that block ~1 ms (ctypes: `nanosleep`, `sem_timedwait` "
        "with a 1 ms deadline, `select` with a 1 ms timeout) beside 2 busy numpy matmul threads, "
        "sampled at 100 Hz with native=True (budget 0.2):\n\n"
        + table(
            [
                "call",
                "calls",
                "EINTR",
                "other errors",
                "caller sampled s / with native frames",
                "native capture, all threads",
                "achieved Hz",
            ],
            rows,
        )
    )
    section.notes.append(
        f"Target: 0 calls interrupted in {CALLS:,}, in each case. Measured {', '.join(str(r[2]) for r in rows)}: "
        f"{verdict(total == 0)}."
    )
